"""FSDP (ZeRO-3) with the experts split over ep (``compose.expert_units``): each block's experts
one FSDP unit sharded over the ranks holding them ("edp" and the stage dims outside the fold),
the rest of the block over dp x cp. Equal to one device over 3 AdamW steps in float64 at:
dp 4 x pp 2 x ep 2 (full recomputation: the experts' unit gathered by its own hook inside the
region run again, its reduce-scatter from that graph); ep 4 over dp 2 x tp 2 (one rank holds
each expert); etp 2 (each expert's width split too); dp 2 x cp 2 x tp 2 (the experts sharded
over cp x tp); dp 3 x pp 2 x tp 2 (3 ranks hold each expert: an odd group). Every expert's rows
a partition of it over its group; clipping's norm that of one device; the dry run is a real
launch of it (step time to the bit, memory per stage); the planner's course runtime next to the
dry run; bad input refused by name."""
import dataclasses

import pytest
import torch

from course_lib import launch, reference, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.lab.dry_run_sweep import BOUND
from course_lib.lab.nd_runs import LR, single_device
from course_lib.layout import Layout
from course_lib.parallel.compose import assemble_nd, check_layout
from course_lib.parallel.mesh import MeshShape
from course_lib.planner import estimate
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run
from course_lib.virtual.dry_run import model_config
from memory_parity import assert_same_memory

CFG = GPTConfig(vocab_size=60, seq_len=12, n_layers=3, hidden=24, n_heads=6, n_kv_heads=2, block="llama",
                n_experts=4, top_k=2)
STEPS = 3
# name: (config, mesh, layout fields, global batch, the size of an expert's FSDP group)
CASES = {
    "ep2-pp2": (dataclasses.replace(CFG, n_layers=4), dict(dp=4, pp=2, ep=2), dict(microbatches=2, recompute="full"),
                8, 2),
    "ep4-tp2": (CFG, dict(dp=2, pp=2, tp=2, ep=4), dict(sp=True, microbatches=2), 4, 1),
    "ep2-etp2": (dataclasses.replace(CFG, ffn_hidden=32), dict(dp=4, tp=2, ep=2, etp=2), dict(sp=True), 4, 2),
    "ep2-cp2-tp2": (CFG, dict(dp=2, cp=2, tp=2, ep=2), dict(sp=True), 4, 4),
}
ODD = {"ep2-dp3-tp2": (dataclasses.replace(CFG, top_k=1), dict(dp=3, pp=2, tp=2, ep=2), dict(sp=True), 3, 3)}
CLIPPED = ("ep2-etp2", "ep2-cp2-tp2")     # pp 1: one FSDP holds the whole model


def _layout(dims, kw, batch):
    return Layout(**dims, zero=3, global_batch=batch, **kw)


def _rank(cases):
    """Each case STEPS AdamW steps (float64): losses, shards, each expert parameter's (group
    dims, rows); for CLIPPED, the first step's gradient norm as FSDP's clip_grad_norm_ gives it."""
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    out = {}
    for name, (cfg, dims, kw, batch, _) in cases.items():
        net = parallelize_nd(TinyGPT(cfg, seed=0).double(), Mesh(**dims), _layout(dims, kw, batch))
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
        batches = reference.gpt_batches(cfg, batch=batch, steps=STEPS)
        norm = None
        if name in CLIPPED:
            x, y = batches[0]
            net.step(x, y)
            norm = float(next(iter(net.modules.values())).clip_grad_norm_(1e30))   # (no scaling)
            opt.zero_grad()
        losses = reference.train_parallel(net, batches, opt)
        rows = {n: (p.shard, p.rows, p.tp[2] - p.tp[1] if p.tp and p.tp[0] == 0 else p.shape[0])
                for n, p in net.placements.items() if ".moe.experts." in n}   # (an etp slice's rows)
        out[name] = (losses, net.shards(), rows, norm)
    return out


@pytest.fixture(scope="module")
def runs():
    return {"even": launch(_rank, 8, CASES, timeout=300), "odd": launch(_rank, 12, ODD, timeout=300)}


@pytest.mark.parametrize("name", list(CASES) + list(ODD))
def test_fsdp_with_experts_split_equals_one_device(runs, name):
    cfg, dims, kw, batch, group = {**CASES, **ODD}[name]
    L = _layout(dims, kw, batch)
    shape = check_layout(cfg, L)                       # (refused before this change: FSDP with ep > 1)
    ref = single_device(cfg, batch, STEPS, groups=dims["dp"] * L.microbatches, dtype=torch.float64)   # MoE:
    # one routing group per replica and micro-batch (the reference's groups)
    ranks = [r[name] for r in runs["odd" if name in ODD else "even"]]
    for losses, *_ in ranks:
        tolerance.assert_matches(losses, ref.losses, optimizer="adamw", steps=STEPS, lr=LR, what=f"{name}: losses")
    full = assemble_nd([r[1] for r in ranks], shape)
    assert set(full) == set(ref.state), name
    tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=STEPS, lr=LR, what=name)
    # each expert parameter: its rows cut over a group of `group` ranks (the ranks holding it),
    # the pieces tiling its dim 0, each piece held equally often (its copies outside the group)
    for pname in ranks[0][2]:
        held = [r[2][pname] for r in ranks if pname in r[2]]
        assert {x[0] for x in held} == {held[0][0]} and "edp" in held[0][0], (name, pname, held[0])
        pieces = {}
        for _, rows, _ in held:
            pieces[rows] = pieces.get(rows, 0) + 1
        assert len(pieces) == group and len(set(pieces.values())) == 1, (name, pname, pieces)
        starts, d0 = sorted(pieces), held[0][2]
        assert starts[0][0] == 0 and min(d0, starts[-1][0] + starts[-1][1]) == d0, (name, pname, starts)
        assert all(a[0] + a[1] == b[0] or a[1] == 0 or b[1] == 0 for a, b in zip(starts, starts[1:])), starts
    if name in CLIPPED:     # the norm over the stage: every expert row counted once, TP slices each;
        # a sum of squares over every element, in another order: one step's reordering bound
        expected = torch.stack([g.double().pow(2).sum() for g in ref.grads.values()]).sum().sqrt()
        terms = sum(g.numel() for g in ref.grads.values())
        for r in ranks:
            tolerance.assert_matches(torch.tensor(r[3], dtype=torch.float64), expected, terms=terms,
                                     what=f"{name}: clipping's norm")


SPEC = gpt_spec("GPT test MoE", 4, 64, 4, V=256, s=32).with_(n_experts=4, top_k=2, tied=False)
HW = "a100-80gb"
DRY = [Layout(dp=4, pp=2, ep=2, zero=3, micro_batch=1, global_batch=8, recompute="full"),
       Layout(dp=2, cp=2, tp=2, ep=2, zero=3, sp=True, micro_batch=1, global_batch=4)]


def _real_dry_rank(cfg, layout):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    from course_lib.virtual.priced import BalancedRouting
    with BalancedRouting():            # (the routing the dry run assumes)
        return train_step(cfg, layout, Mesh.from_layout(layout))


@pytest.mark.parametrize("layout", DRY, ids=["dp4-pp2-ep2", "dp2-cp2-tp2-ep2"])
def test_the_dry_run_of_fsdp_with_experts_is_the_real_launch(layout):
    """One running rank per stage on the meta device gives the real launch's step time to the
    bit and its memory per stage (states, activations, moments to the byte); the experts'
    all-gathers and reduce-scatters ran in their own group."""
    real = launch(_real_dry_rank, layout.n_gpus, model_config(SPEC, layout), layout, clock=VirtualCluster(HW))
    r = dry_run(SPEC, HW, layout, progress=None)
    assert r.step_time == max(x["t"] for x in real), (r.step_time, max(x["t"] for x in real))
    shape = MeshShape(**layout.sizes)
    for i in range(layout.pp):
        k = shape.rank_of(pp=i)
        assert_same_memory(r.memory_by_stage[i], real[k], k)
    experts = [s for s in r.spans if ".moe.experts" in s.name and s.name.startswith(("all-gather", "reduce-scatter"))]
    assert experts and all("edp" in s.dim for s in experts), {s.dim for s in experts}


def test_the_planner_prices_the_experts_units_in_their_group():
    """The planner's course runtime against the dry run (GPT 12L MoE on H100s, dp 4 x ep 2):
    each block's experts gathered and reduce-scattered over the 2 ranks holding them (all 8
    experts over dp 4 before, as one unit with the block: +44.5%; now -2.4%), their optimizer
    step on 1/2 of them: within half the sweep's bound in time, the bound in memory."""
    moe = gpt_spec("GPT 12L h2048", 12, 2048, 16, V=51200, s=1024).with_(n_experts=8, top_k=2, tied=False)
    layout = Layout(dp=4, ep=2, zero=3, micro_batch=1, microbatches=2)
    est = estimate(moe, "h100-sxm", layout, runtime="course")
    r = dry_run(moe, "h100-sxm", layout, progress=None, optimizer="foreach")
    assert abs(est.step_time / r.step_time - 1) <= BOUND / 2, (est.step_time, r.step_time)
    assert abs(est.memory["total"] / r.moment_memory - 1) <= BOUND, (est.memory["total"], r.moment_memory)


@pytest.mark.parametrize("changes,match", [
    (dict(dp=4, ep=2, zero=3, shard_size=2), "under HSDP"),
    (dict(dp=4, ep=2, zero=3, zeropp=("hpz",), gpus_per_node=2), "zeropp"),
])
def test_experts_under_hsdp_or_zeropp_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        check_layout(CFG, Layout(global_batch=4, **changes))
