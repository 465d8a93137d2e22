"""Megatron-Core's overlapped distributed optimizer, as the dry run runs it for a source that
states it (software "overlap_grad_reduce" and "overlap_param_gather",
:func:`course_lib.virtual.software.overlap_distributed_optimizer`; ZeRO-1/2's
:meth:`~course_lib.parallel.zero_nd.ZeroSync.overlap_grad_reduce` and
:meth:`~course_lib.parallel.zero_nd.ZeroSync.overlap_param_gather`): the same training as one
device in float64 over several AdamW steps (the sums and gathers are the same ones, moved);
the first stage's buckets launched by its last backward's hooks, the other stages' when their
schedule ends; the parameters gathered in the first forward, module by module. On the clock:
the dry run is a real launch to the bit, the first stage's reduce-scatters start inside its last
backward, the gathers inside each stage's first forward. Bad layouts refused by name before any
rank runs."""
import dataclasses

import pytest
import torch

from course_lib import launch, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.lab.nd_runs import LR, single_device
from course_lib.layout import Layout
from course_lib.parallel.compose import assemble_nd, check_layout
from course_lib.parallel.mesh import MeshShape
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run
from course_lib.virtual.dry_run import model_config

CFG = GPTConfig(vocab_size=60, seq_len=12, n_layers=4, hidden=24, n_heads=6, n_kv_heads=2, block="llama")
STEPS = 3
BOTH = ("overlap_grad_reduce", "overlap_param_gather")
SPEC, HW = gpt_spec("GPT test", 4, 64, 4, V=256, s=32), "a100-80gb"
# name: (config, mesh dims, layout keywords, global batch); every case at 4 ranks but the odd dp 3
CASES = {4: {"zero1-pp2": (CFG, dict(dp=2, pp=2), dict(zero=1, microbatches=3), 6),
             "zero2-pp2-tied": (dataclasses.replace(CFG, n_layers=3, tie_embeddings=True), dict(dp=2, pp=2),
                                dict(zero=2, microbatches=2), 4),
             "zero1-pp2-moe-ep2": (dataclasses.replace(CFG, n_experts=4, top_k=2), dict(dp=2, pp=2, ep=2),
                                   dict(zero=1, microbatches=2), 4),
             "zero1-tp2-sp-gpipe": (CFG, dict(dp=2, tp=2), dict(zero=1, sp=True, schedule="gpipe", microbatches=2),
                                    4)},
         3: {"zero2-dp3": (CFG, dict(dp=3), dict(zero=2, microbatches=3), 9)}}


def _rank(world):
    """Each case STEPS AdamW steps in float64 (wall clock) with both statements: losses, shards,
    and per step the buckets this rank's hooks launched in its last backward, the buckets
    launched before the schedule's end (finish), and the buckets gathered in the first forward."""
    from course_lib import reference
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.software import overlap_distributed_optimizer

    out = {}
    for name, (cfg, dims, kw, batch) in CASES[world].items():
        net = parallelize_nd(TinyGPT(cfg, seed=0).double(), Mesh(**dims), Layout(**dims, global_batch=batch, **kw))
        overlap_distributed_optimizer(net, BOTH)
        zero, hooked, before_finish, gathered_late = net.zero, [], [], []
        ready = zero._grad_ready

        def counted_ready(i):            # launches made from a gradient's hook
            n = sum(b.launched for b in zero.buckets)
            ready(i)
            hooked[-1] += sum(b.launched for b in zero.buckets) - n
        zero._grad_ready = counted_ready
        finish = zero.finish

        def counted_finish():
            before_finish.append(sum(b.launched for b in zero.buckets))
            gathered_late.append(sum(b.gathered for b in zero.deferred))
            finish()
        net.gradient_sums = [counted_finish if f == finish else f for f in net.gradient_sums]
        begin = zero.begin_step

        def counted_begin():
            hooked.append(0)
            begin()
        zero.begin_step = counted_begin
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
        losses = reference.train_parallel(net, reference.gpt_batches(cfg, batch=batch, steps=STEPS), opt)
        out[name] = dict(losses=losses, shards=net.shards(), hooked=hooked, before_finish=before_finish,
                         gathered=gathered_late, deferred=len(zero.deferred), order=len(zero.order),
                         first=net.runner.me == 0)
    return out


@pytest.fixture(scope="module")
def runs():
    return {world: launch(_rank, world, world, timeout=300) for world in CASES}


@pytest.mark.parametrize("world", [4, 3])
def test_overlapped_distributed_optimizer_trains_as_one_device(runs, world):
    for name, (cfg, dims, kw, batch) in CASES[world].items():
        layout = Layout(**dims, global_batch=batch, **kw)
        shape = check_layout(cfg, layout)
        groups = dims["dp"] * kw["microbatches"] if cfg.n_experts else 1     # MoE: a routing group per
        ref = single_device(cfg, batch, STEPS, groups=groups, dtype=torch.float64)   # replica and micro-batch
        ranks = [r[name] for r in runs[world]]
        for r in ranks:
            tolerance.assert_matches(r["losses"], ref.losses, optimizer="adamw", steps=STEPS, lr=LR,
                                     what=f"{name}: losses")
        full = assemble_nd([r["shards"] for r in ranks], shape)
        tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=STEPS, lr=LR, what=name)
        for r in ranks:
            # every bucket of a chunk launched in the schedule, before the runtime's finish: by the
            # first stage's hooks (every one, but on a tied stage whose one bucket holds the tied
            # embedding, summed after the schedule), by the end of the schedule on the others
            assert r["before_finish"] == [r["order"]] * STEPS, (name, r)
            hooks = r["order"] if r["first"] else 0
            assert r["hooked"] == [hooks] * STEPS, (name, r)
            # the buckets of the blocks gathered by the first forward, before the step's end
            assert r["deferred"] > 0 or cfg.tie_embeddings, (name, r)
            assert r["gathered"] == [r["deferred"]] * STEPS, (name, r)
        assert any(r["hooked"][0] > 0 for r in ranks) or cfg.tie_embeddings, name


def _real_rank(cfg, layout, software):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    return train_step(cfg, layout, Mesh.from_layout(layout), fusions=software)


def test_overlapped_distributed_optimizer_prices_as_a_real_launch():
    """dp 2 x pp 2, ZeRO-1, eight micro-batches: the dry run with both statements is the real
    4-rank launch to the bit (the first stage's last backward runs, its hooks with it, where the
    dry run replays the price of the backwards before it). On a
    model wide enough for many buckets, across nodes: the first stage's reduce-scatters start
    inside its last backward (after it without the statement), the last stage's after its own;
    each stage's gathers start inside its first forward (before it, at the step's start,
    without the statement)."""
    layout = Layout(dp=2, pp=2, zero=1, micro_batch=1, global_batch=16)
    untied = dataclasses.replace(SPEC, tied=False)      # (a tied embedding's bucket waits for the schedule's end)
    real = launch(_real_rank, layout.n_gpus, model_config(untied, layout), layout, BOTH, clock=VirtualCluster(HW))
    r = dry_run(untied, HW, layout, fusions=BOTH, progress=None)
    stage_ranks = [MeshShape(**layout.sizes).rank_of(pp=i) for i in range(2)]     # (the dry run's running ranks)
    assert r.kernels == sum(real[k]["kernels"] for k in stage_ranks)
    assert r.step_time == max(x["t"] for x in real), (r.step_time, max(x["t"] for x in real))
    assert r.replayed > 0
    wide = gpt_spec("GPT wide", 4, 2048, 16, V=256, s=1024)
    for software, under in ((BOTH, True), ((), False)):
        run = dry_run(wide, HW, layout, fusions=software, progress=None, gpus_per_node=2)
        for rank in sorted({s.rank for s in run.spans}):
            mine = [s for s in run.spans if s.rank == rank]
            computes = sorted((s for s in mine if s.kind == "compute" and s.name[0] in "FB"), key=lambda s: s.start)
            first_f = next(s for s in computes if s.name.startswith("F"))
            last_b = [s for s in computes if s.name.startswith("B")][-1]
            sums = [s for s in mine if s.kind == "comm" and s.name.startswith("reduce-scatter")]
            gathers = [s for s in mine if s.kind == "comm" and s.name.startswith("all-gather")]
            first_stage = min(s.start for s in computes) == min(s.start for s in run.spans if s.kind == "compute")
            assert (min(s.start for s in sums) < last_b.end) == (under and first_stage), (software, rank)
            assert (max(s.start for s in gathers) > first_f.start) == under, (software, rank)


def test_overlapped_distributed_optimizer_refuses_by_name_before_any_rank():
    lay = Layout(dp=2, pp=2, micro_batch=1, global_batch=4)
    for bad, match in ((lay, "ZeRO-1 or ZeRO-2.*zero=0"),
                       (lay.with_(zero=2, grad_reduce="chunk"), "grad_reduce='step', got 'chunk'"),
                       (lay.with_(zero=1, schedule="interleaved", v=2, global_batch=8, micro_batch=1),
                        "non-interleaved schedule.*'interleaved', v=2"),
                       (lay.with_(zero=1, schedule="zb-h1"), "non-interleaved schedule.*'zb-h1'")):
        with pytest.raises(ValueError, match=match):
            dry_run(SPEC, HW, bad, fusions=BOTH, progress=None)
    with pytest.raises(ValueError, match="ZeRO-1 or ZeRO-2"):     # the param gather alone too
        dry_run(SPEC, HW, lay, fusions=("overlap_param_gather",), progress=None)
