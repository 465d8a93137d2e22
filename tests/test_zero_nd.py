"""ZeRO-1 and ZeRO-2 in parallelize_nd (``Layout(zero=1 / 2)``, :mod:`course_lib.parallel.zero_nd`):
equal to one device over several AdamW steps in float64 at dp 2 and dp 3 with pp 2 and tp 2
(+ SP), experts split over ep among them, the owned slices a partition of every parameter;
the dry run of a ZeRO layout is a real launch of it on the clock (step time, kernels, memory per stage); bad input refused by name."""
import dataclasses

import pytest
import torch

from course_lib import launch, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.lab.nd_runs import LR, single_device
from course_lib.layout import FOLDS, Layout
from course_lib.parallel.compose import assemble_nd, check_layout
from course_lib.parallel.mesh import MeshShape, get_reduce_dims
from course_lib.planner import estimate
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run
from course_lib.virtual.dry_run import model_config
from memory_parity import assert_same_memory

CFG = GPTConfig(vocab_size=60, seq_len=12, n_layers=3, hidden=24, n_heads=6, n_kv_heads=2, block="llama")
STEPS = 3
SPEC = gpt_spec("GPT test", 4, 64, 4, V=256, s=32)
HW = "a100-80gb"
# the layout each launch's ranks run first on the virtual clock (its step is the dry run's)
DRY = {2: Layout(dp=2, tp=2, pp=2, sp=True, zero=2, micro_batch=1, global_batch=4),
       3: Layout(dp=3, tp=2, pp=2, sp=True, zero=1, micro_batch=1, global_batch=6)}


def _cases(dp):
    """float64 runs at dp x pp 2 x tp 2 (+ SP): ZeRO-1 with a tied embedding across the two
    stages, ZeRO-2 interleaved (v = 2); 3 layers on 2 stages (uneven), an odd batch split at dp 3;
    at dp 2 also ZeRO-1 over dp x cp (cp 2, tp 2: the ZeRO group is the 4 ranks of dp x cp)."""
    dims = dict(dp=dp, pp=2, tp=2)
    cases = {"zero1-tied": (dataclasses.replace(CFG, tie_embeddings=True), dims,
                            dict(zero=1, sp=True, microbatches=3), 3 * dp),
             "zero2-interleaved": (dataclasses.replace(CFG, n_layers=4), dims,
                                   dict(zero=2, sp=True, schedule="interleaved", v=2, microbatches=2), 2 * dp)}
    if dp == 2:
        cases["zero1-cp2"] = (CFG, dict(dp=2, cp=2, tp=2), dict(zero=1, sp=True, microbatches=2), 4)
    # reduced chunk by chunk in the schedule: per round (m = 4 on pp 2: two rounds of N = 2), a
    # tied embedding reduced after the schedule; per chunk under ZB-H1 (after each W), m = 3
    cases["zero2-round"] = (dataclasses.replace(CFG, n_layers=4, tie_embeddings=True), dims,
                            dict(zero=2, sp=True, schedule="interleaved", v=2, microbatches=4,
                                 grad_reduce="round"), 4 * dp)
    cases["zero2-chunk-zb"] = (CFG, dims, dict(zero=2, sp=True, schedule="zb-h1", microbatches=3,
                                               grad_reduce="chunk"), 3 * dp)
    if dp == 2:     # MoE: each replica and micro-batch a routing group (the reference's groups)
        cases["zero2-round-moe"] = (dataclasses.replace(CFG, n_layers=4, n_experts=8, top_k=1), dict(dp=4, pp=2),
                                    dict(zero=2, schedule="interleaved", v=2, microbatches=4,
                                         grad_reduce="round"), 16)
        # experts split over ep: an expert's ZeRO group is the ranks holding it ("edp"): 2 of the
        # 4 dp ranks here; at ep 4 over dp 2 x tp 2, one rank (its slices the whole expert)
        cases["zero2-ep2"] = (dataclasses.replace(CFG, n_layers=4, n_experts=4, top_k=2), dict(dp=4, pp=2, ep=2),
                              dict(zero=2, microbatches=2), 8)
        cases["zero1-ep4-tp2"] = (dataclasses.replace(CFG, n_experts=4, top_k=2), dict(dp=2, pp=2, tp=2, ep=4),
                                  dict(zero=1, sp=True, microbatches=2), 4)
        # each expert's width split over etp 2 too: its slices over the ranks holding it (edp 1
        # x the tp pair outside the fold), its w2 bias's sum over etp after, on the slice
        cases["zero1-ep2-etp2-tp2"] = (dataclasses.replace(CFG, n_experts=4, top_k=2, ffn_hidden=32),
                                       dict(dp=4, tp=2, ep=2, etp=2), dict(zero=1, sp=True, microbatches=1), 4)
        # Megatron-Core's fold (TP first) in its rank order (PP outermost): the ep pair is the tp
        # pair, an expert's copies lie along dp (outside the fold), its ZeRO group theirs; with
        # dp first, an expert's copies along tp (ep 2 x etp 2 over dp 4) are sharded over tp too
        cases["zero2-ep2-tp2-tpfirst"] = (dataclasses.replace(CFG, n_experts=4, top_k=2),
                                          dict(dp=2, pp=2, tp=2, ep=2, fold_order="tp_first", order=("pp", "dp", "tp")),
                                          dict(zero=2, sp=True, microbatches=2), 4)
    else:           # 3 ranks hold each expert (ep 2 over dp 3 x tp 2): an odd ZeRO group of experts
        cases["zero1-ep2-tp2"] = (dataclasses.replace(CFG, n_experts=4, top_k=1), dict(dp=3, pp=2, tp=2, ep=2),
                                  dict(zero=1, sp=True, microbatches=1), 3)
        # TP first: the ep pair is the tp pair, an expert's copies lie along dp (3 ranks, outside the fold)
        cases["zero1-ep2-tp2-tpfirst"] = (dataclasses.replace(CFG, n_experts=4, top_k=1),
                                          dict(dp=3, pp=2, tp=2, ep=2, fold_order="tp_first"),
                                          dict(zero=1, sp=True, microbatches=1), 3)
    return cases


def _dry_rank(dp):
    """The dry run's layout's real step (run on the clock)."""
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step

    L = DRY[dp]
    return {"dry": train_step(model_config(SPEC, L), L, Mesh.from_layout(L))}


def _cases_rank(dp):
    """Each case STEPS AdamW steps (float64, on the wall clock: its values are what is checked):
    losses, this rank's parameters, how many elements the optimizer's slices hold."""
    from course_lib import reference
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    out = {}
    for name, (cfg, dims, kw, batch) in _cases(dp).items():
        net = parallelize_nd(TinyGPT(cfg, seed=0).double(), Mesh(**dims), Layout(**dims, global_batch=batch, **kw))
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
        losses = reference.train_parallel(net, reference.gpt_batches(cfg, batch=batch, steps=STEPS), opt)
        owned = sum(q.numel() for q in net.parameters())
        held = sum(q.numel() for q in net.model_parameters())
        experts = sum(q.numel() for q in net.model_parameters() if "edp" in get_reduce_dims(q, ()))
        out[name] = (losses, net.shards(), owned, held, experts)
    return out


@pytest.fixture(scope="module")
def runs():
    """dp 2 (8 ranks) and dp 3 (12 ranks): the dry run's layout on a virtual clock of 4-GPU nodes
    (its real launch; dp crosses the nodes), the cases in a launch of their own on the wall
    clock (the clock prices every op in Python, and their values are what they check: the two
    launches took 62 s of wall and 116 s of CPU with the cases on the clock, 37 s and 67 s so,
    on the 2-core AVX2 machine, 2026-12-01)."""
    out = {}
    for dp in (2, 3):
        dry = launch(_dry_rank, 4 * dp, dp, clock=VirtualCluster(HW, gpus_per_node=4), timeout=300)
        cases = launch(_cases_rank, 4 * dp, dp, timeout=300)
        out[dp] = [{**a, **b} for a, b in zip(dry, cases)]
    return out


@pytest.mark.parametrize("dp", [2, 3])
def test_zero_1_and_2_equal_one_device(runs, dp):
    for name, (cfg, dims, kw, batch) in _cases(dp).items():
        shape = check_layout(cfg, Layout(**dims, global_batch=batch, **kw))
        groups = dims["dp"] * kw.get("microbatches", 1) if cfg.n_experts else 1   # MoE: a routing group
        ref = single_device(cfg, batch, STEPS, groups=groups, dtype=torch.float64)   # per replica and micro-batch
        ranks = [r[name] for r in runs[dp]]
        for losses, *_ in ranks:
            tolerance.assert_matches(losses, ref.losses, optimizer="adamw", steps=STEPS, lr=LR, what=f"{name}: losses")
        full = assemble_nd([r[1] for r in ranks], shape)
        assert set(full) == set(ref.state), name
        tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=STEPS, lr=LR, what=name)
        # the optimizer's slices: every element of a dense parameter owned by exactly one rank of
        # dp x cp (per tp rank: its slice); of an expert, by one of the ranks holding it, whichever
        # dims they lie along (tp too): a stage owns its tp slices' dense parts and each (ep, etp)
        # slot's share of the experts once
        n = shape.sizes
        for pp in range(n["pp"]):
            stage = [shape.rank_of(dp=d, cp=c, pp=pp, tp=t) for d in range(n["dp"]) for c in range(n["cp"])
                     for t in range(n["tp"])]
            dense = sum(ranks[k][3] - ranks[k][4] for k in stage if shape.coords(k)["dp"] == shape.coords(k)["cp"] == 0)
            slots = len({(shape.coords(k)["ep"], shape.coords(k)["etp"]) for k in stage})
            experts = {ranks[k][4] for k in stage}
            assert len(experts) == 1, name                       # every slot holds as many expert elements
            assert sum(ranks[k][2] for k in stage) == dense + slots * experts.pop(), (name, pp)
            assert all(ranks[k][2] < ranks[k][3] for k in stage), name   # each holds a part only


@pytest.mark.parametrize("dp", [2, 3])
def test_the_dry_run_of_zero_is_the_real_launch(runs, dp):
    """The dry run (meta device, one rank per stage) gives the real launch's step time, kernels
    and memory per stage to the bit (ZeRO-2 at dp 2, ZeRO-1 at dp 3); ZeRO's collectives were
    priced; the states each GPU holds are below DDP's (and ZeRO-2's below ZeRO-1's)."""
    L = DRY[dp]
    real = [r["dry"] for r in runs[dp]]
    shape = MeshShape(**L.sizes)
    stage_ranks = [shape.rank_of(pp=i) for i in range(2)]
    r = dry_run(SPEC, HW, L, gpus_per_node=4, progress=None)
    assert r.step_time == max(x["t"] for x in real), r.step_time
    assert r.kernels == sum(real[k]["kernels"] for k in stage_ranks)
    for i, k in enumerate(stage_ranks):
        assert_same_memory(r.memory_by_stage[i], real[k], k)
    assert [s for s in r.spans if s.name.startswith("reduce-scatter b")]
    assert [s for s in r.spans if s.name.startswith("all-gather b")]
    other = dry_run(SPEC, HW, L.with_(zero=3 - L.zero), gpus_per_node=4, progress=None)   # 1 <-> 2
    ddp = dry_run(SPEC, HW, L.with_(zero=0), gpus_per_node=4, progress=None)
    z1, z2 = (r, other) if L.zero == 1 else (other, r)
    for i in range(2):
        assert ddp.memory_by_stage[i]["states"] > z1.memory_by_stage[i]["states"] > z2.memory_by_stage[i]["states"]


@pytest.mark.parametrize("spec,layout", [
    (SPEC, Layout(dp=4, pp=2, zero=2, micro_batch=1, global_batch=8)),
    (SPEC, Layout(dp=3, pp=2, zero=1, micro_batch=1, global_batch=6, precision="bf16")),
    (SPEC.with_(name="GPT test MoE", n_experts=4, top_k=2), Layout(dp=4, pp=2, ep=2, zero=1, micro_batch=1,
                                                                   global_batch=8)),
], ids=["zero2-dp4-pp2", "zero1-dp3-pp2-bf16", "moe-zero1-dp4-pp2-ep2"])
def test_the_dry_run_folds_zero_members_that_own_different_pieces(spec, layout):
    """The members of a ZeRO group own slices cut across different numbers of parameters
    (pieces). Each packs its slice with one cat and hands the sums out with one kernel (a cast,
    ZeRO-1's foreach copy), so no member arrives at a collective after the one the dry run runs
    (dp 0: its slice never short). Once packed a copy per piece: the dry run 37 us early here."""
    from course_lib.parallel.zero import ShardedBucket
    real = launch(_real_dry_rank, layout.n_gpus, model_config(spec, layout), layout,
                  clock=VirtualCluster(HW, dtype=None if layout.precision != "full" else torch.bfloat16))
    r = dry_run(spec, HW, layout, progress=None)
    assert r.step_time == max(x["t"] for x in real), (r.step_time, max(x["t"] for x in real))
    with torch.device("meta"):
        params = list(TinyGPT(model_config(spec, layout), seed=0).parameters())
    pieces = {len(ShardedBucket(0, list(range(len(params))), params, k, layout.dp).pieces) for k in range(layout.dp)}
    assert len(pieces) > 1, pieces          # (the model cut in dp slices: the members' piece counts differ)


def _real_dry_rank(cfg, layout):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    from course_lib.virtual.priced import BalancedRouting
    with BalancedRouting():            # (an MoE: the routing the dry run assumes)
        return train_step(cfg, layout, Mesh.from_layout(layout))


@pytest.mark.parametrize("changes,match", [
    (dict(zero=4), "ZeRO stage"),
    (dict(zero=1, grad_reduce="round"), "that is ZeRO-2"),
    (dict(zero=2, grad_reduce="layer"), "grad_reduce must be one of"),
])
def test_bad_zero_layouts_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        check_layout(CFG, Layout(dp=2, global_batch=2, **changes))



# ---------------------------------------------------------------- reduced chunk by chunk

ROUNDS = gpt_spec("GPT rounds", 16, 2048, 16, V=50304, s=2048)


def _reductions(r, rank=0):
    """(the rank's reduce-scatter spans, how many start before its last forward or backward)."""
    rs = [s for s in r.spans if s.rank == rank and s.name.startswith("reduce-scatter b")]
    last = max(s.end for s in r.spans if s.rank == rank and s.kind == "compute" and s.name[0] in "FB")
    return rs, sum(s.start < last for s in rs)


def test_grad_reduce_moves_the_reductions_into_the_schedule():
    """ZeRO-2 with 4 chunks a stage, m = 16 on pp 4 (torch's rounds: 4 of N = 4): "step" sends
    every bucket after the schedule; "chunk" each chunk's once its last backward ran (all but
    the last chunk's inside the schedule), the step shorter by what they hid; "round" each
    chunk's after each of its 4 rounds (4x their reduce-scatters), the sums of at most two
    chunks held whole: the peak below "step"'s. The planner (course runtime) prices all three
    within 5% of the dry run, memory within 3%."""
    layout = Layout(dp=4, pp=4, zero=2, schedule="interleaved", v=4, global_batch=64,
                    precision="bf16-accumulate-fp32")
    runs = {mode: dry_run(ROUNDS, "h100-sxm", layout.with_(grad_reduce=mode), progress=None)
            for mode in ("step", "chunk", "round")}
    (step, n_step), (chunk, n_chunk), (rounds, n_round) = (_reductions(runs[m]) for m in ("step", "chunk", "round"))
    assert n_step == 0 and len(step) > 0
    after = len(chunk) - n_chunk                       # the last chunk's buckets (+ any of no chunk)
    assert 0 < after < len(chunk) / 2 and len(rounds) - n_round == after
    assert len(rounds) > 3 * len(chunk)
    assert runs["chunk"].step_time < runs["step"].step_time
    assert runs["round"].peak_memory < runs["step"].peak_memory
    for mode, r in runs.items():
        est = estimate(ROUNDS, "h100-sxm", layout.with_(grad_reduce=mode), runtime="course")
        assert est.step_time == pytest.approx(r.step_time, rel=0.05), mode
        assert est.memory["total"] == pytest.approx(r.moment_memory, rel=0.03), mode


def test_the_planner_shards_an_expert_over_the_group_the_ranks_use():
    """planner.layout.expert_zero_group (the course runtime's ZeRO group of an expert, and the
    dims its slice is summed over after) is the ranks' rule read off the mesh: an expert's
    reduce dims (MeshShape.expert_replicas) split by zero_nd.shard_dims, sized by the expert
    mesh: every rank holding it. Every fold of both fold orders: over dp, dp x cp, dp x cp x tp;
    tp, tp x cp, tp x cp x dp (Megatron-Core's)."""
    import itertools
    import math

    from course_lib.parallel.zero_nd import shard_dims
    from course_lib.planner.layout import expert_holders, expert_zero_group
    seen = set()
    for dp, cp, tp, ep, order in itertools.product((1, 2, 3, 4), (1, 2), (1, 2, 4), (2, 4, 8), FOLDS):
        if (dp * cp * tp) % ep:
            continue
        shape = MeshShape(dp=dp, cp=cp, tp=tp, ep=ep, fold_order=order)
        sizes = {**shape.sizes, **shape.expert_sizes}
        shard, after = shard_dims(shape.expert_replicas())
        expected = (math.prod(sizes[d] for d in shard), after)
        layout = Layout(dp=dp, cp=cp, tp=tp, ep=ep, global_batch=dp, fold_order=order)
        assert expert_zero_group(layout) == expected == (expert_holders(layout), ()), (dp, cp, tp, ep, order)
        seen.add(shape.fold)
    assert seen == {("dp",), ("dp", "cp"), ("dp", "cp", "tp"), ("tp",), ("tp", "cp"), ("tp", "cp", "dp")}
