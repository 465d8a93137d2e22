"""course_lib.virtual.dry_run under a layout's precision: the course's mixed precision run for
real (a bf16 model, fp32 master weights and moments, gradients accumulated and reduced in fp32),
each tensor priced at its own dtype (``VirtualCluster(dtype=None)``), equal to a real launch of
the same layout and precision on the CPU in bf16 under the same clock mode: step time, kernels
and memory per stage, to the bit. Llama 3's stated numerics (lab.dry_runs.PRECISION): ZeRO-2,
"bf16-accumulate-fp32", FlashAttention, an interleaved pipeline."""
import pytest

from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.planner.presets import ModelSpec
from course_lib.virtual import VirtualCluster, dry_run

SPEC = ModelSpec("Llama test", 4, 64, 4, 2, 172, 256, 32)      # SwiGLU, RMSNorm, GQA
HW = "h100-sxm"
FUSIONS = ("flash_attention",)
LLAMA = Layout(dp=2, tp=2, pp=2, sp=True, zero=2, schedule="interleaved", v=2, micro_batch=1, global_batch=8,
               recompute="selective", precision="bf16-accumulate-fp32")


def _real_rank(cfg, layout, fusions):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    return train_step(cfg, layout, Mesh.from_layout(layout), fusions=fusions)


@pytest.fixture(scope="module")
def real():
    from course_lib.virtual.dry_run import model_config
    return launch(_real_rank, LLAMA.n_gpus, model_config(SPEC, LLAMA), LLAMA, FUSIONS,
                  clock=VirtualCluster(HW, dtype=None))


def test_a_precise_dry_run_equals_a_real_bf16_launch_and_folds_replicas(real):
    r = dry_run(SPEC, HW, LLAMA, fusions=FUSIONS, progress=None)
    assert r.ranks_run == 2
    assert r.step_time == max(x["t"] for x in real)
    assert r.kernels == real[0]["kernels"] + real[2]["kernels"]
    for stage in range(2):
        for part in ("states", "activations"):
            assert r.memory_by_stage[stage][part] == real[2 * stage][part], (stage, part)
    # the fp32 numerics cost time: accumulation adds, fp32 reduce-scatters, the masters' copies
    plain = dry_run(SPEC, HW, LLAMA.with_(precision="full"), fusions=FUSIONS, progress=None)
    bf16 = dry_run(SPEC, HW, LLAMA.with_(precision="bf16"), fusions=FUSIONS, progress=None)
    assert r.step_time > bf16.step_time and r.kernels > bf16.kernels
    rs = lambda run: sorted(s.end - s.start for s in run.spans if s.name.startswith("reduce-scatter b"))
    assert rs(r) and all(a > b for a, b in zip(rs(r), rs(bf16)))        # 4 bytes a gradient, not 2
    assert r.memory_by_stage[0]["states"] != plain.memory_by_stage[0]["states"]
    # folding (DDP, the masters' gradients all-reduced in fp32): dp 1 vs dp 4 of the same
    # per-replica work differ only by the DP collectives after the schedule
    one = dry_run(SPEC, HW, LLAMA.with_(dp=1, zero=0, global_batch=4), fusions=FUSIONS, progress=None)
    four = dry_run(SPEC, HW, LLAMA.with_(dp=4, zero=0, global_batch=16), fusions=FUSIONS, progress=None)
    assert [s for s in four.spans if s.dim == "dp"] and not [s for s in one.spans if s.dim == "dp"]
    compute = lambda run: sorted((s.rank, s.name, s.start, s.end) for s in run.spans if s.kind == "compute")
    assert compute(one) == compute(four)                 # every action, to the bit, before the DP sums
    assert four.step_time > one.step_time
