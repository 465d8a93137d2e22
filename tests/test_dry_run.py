"""course_lib.virtual.dry_run: the course's program on the meta device, folded, priced exactly
as a real launch on the virtual clock prices it."""
import pytest

from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run

SPEC = gpt_spec("GPT test", 4, 64, 4, V=256, s=32)     # GeLU, LayerNorm, biases, tied, learned positions
HW = "a100-80gb"


def _real_rank(cfg, layout):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    return train_step(cfg, layout, Mesh.from_layout(layout))


def _real(layout):
    from course_lib.virtual.dry_run import model_config
    res = launch(_real_rank, layout.n_gpus, model_config(SPEC, layout), layout, clock=VirtualCluster(HW))
    return res


def test_dry_run_equals_a_real_launch_and_folds_replicas():
    """dp 2 x tp 2 x pp 2, 1F1B over 6 micro-batches, sequence parallel, selective recompute:
    the dry run (2 ranks running, on meta, the later actions replayed) gives the real 8-rank
    run's step time to 1e-9."""
    layout = Layout(dp=2, tp=2, pp=2, sp=True, micro_batch=1, global_batch=12, recompute="selective")
    real = _real(layout)
    real_step = max(r["t"] for r in real)
    r = dry_run(SPEC, HW, layout)
    assert r.ranks_run == 2 and r.replayed > 0
    assert r.kernels == real[0]["kernels"] + real[2]["kernels"]
    assert abs(r.step_time - real_step) <= 1e-9 * real_step, (r.step_time, real_step)
    # the stages' memory: the real run's states and activations, at the virtual dtype
    for stage in range(2):
        rank = stage * 2                                   # dp = tp = 0 of each stage
        assert r.memory_by_stage[stage]["states"] == real[rank]["states"]
        assert r.memory_by_stage[stage]["activations"] == real[rank]["activations"]
    # folding: dp 1 vs dp 4 of the same per-replica work differ only by DP's collectives
    one = dry_run(SPEC, HW, layout.with_(dp=1, global_batch=6))
    four = dry_run(SPEC, HW, layout.with_(dp=4, global_batch=24))
    dp_spans = [s for s in four.spans if s.dim == "dp"]
    assert dp_spans and not [s for s in one.spans if s.dim == "dp"]
    compute = lambda run: sorted((s.rank, s.name, s.start, s.end) for s in run.spans if s.kind == "compute")
    assert compute(one) == compute(four)                 # every action, to the bit, before the DP sums
    assert four.step_time > one.step_time


def test_bad_layouts_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="tp"):
        dry_run(SPEC, HW, Layout(tp=3, micro_batch=1, global_batch=1))       # 4 heads over 3 ranks
    with pytest.raises(ValueError, match="layers|stages"):
        dry_run(SPEC, HW, Layout(pp=8, micro_batch=1, global_batch=8))       # 4 layers over 8 stages
    with pytest.raises(ValueError, match="unknown model"):
        dry_run("no-such-model", HW, Layout())
    with pytest.raises(ValueError, match="unknown hardware"):
        dry_run(SPEC, "no-such-gpu", Layout())


def test_a_model_too_big_reports_its_peak_and_does_not_fit():
    big = gpt_spec("GPT 15B, 8 layers", 8, 12288, 96, V=51200, s=256)   # 15e9 parameters on one GPU
    r = dry_run(big, HW, Layout(micro_batch=1, global_batch=1))
    assert not r.fits and r.peak_memory > r.hardware.hbm_bytes
    assert r.memory_by_stage[0]["states"] == 16 * big.n_params   # bf16 weights, grads; fp32 master, 2 moments


def test_the_validation_rows_and_random_layouts_are_the_planners():
    """lab.dry_runs runs every published row the planner's validation uses, with the same
    layouts (its runner is benchmarks/dry_run_validation.py, not a timed test)."""
    from course_lib.lab.dry_runs import published_runs, random_layouts
    from course_lib.planner.validation import published_rows
    from course_lib.virtual.dry_run import check_dry_run
    rows = published_runs()
    assert len(rows) == len(published_rows())
    assert {r[0] for r in rows} == {r["source"] for r in published_rows()}
    drawn = random_layouts(6, seed=1)
    assert len(drawn) == 6
    for model, hw, layout in drawn:
        check_dry_run(model, layout)                      # every drawn layout passes the ranks' rules
