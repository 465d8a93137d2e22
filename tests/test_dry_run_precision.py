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
from memory_parity import assert_same_memory

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
        assert_same_memory(r.memory_by_stage[stage], real[2 * stage], stage)
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


def _zero_sums(all_reduce):
    """dp 2, ZeRO-1 in float64: each owned slice's gradient after one step."""
    import torch
    from course_lib.gpt import GPTConfig, TinyGPT
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    from course_lib.reference import gpt_batches
    from course_lib.virtual.software import install_runtime
    cfg = GPTConfig(vocab_size=64, seq_len=8, n_layers=2, hidden=16, n_heads=2, n_kv_heads=1, block="llama")
    net = parallelize_nd(TinyGPT(cfg, seed=0).double(), Mesh(dp=2), zero=1, microbatches=2)
    install_runtime(net, ("zero_all_reduce",) if all_reduce else ())
    x, y = gpt_batches(cfg, batch=4, steps=1)[0]
    net.step(x, y)
    return [q.grad.clone() for q in net.parameters()], [s.name for s in __import__("course_lib").trace.spans()]


def _both():
    return _zero_sums(False), _zero_sums(True)


def test_deepspeeds_all_reduce_sums_what_zero_reduce_scatters_and_prices_as_a_real_launch():
    """BLOOM's BF16_Optimizer ("zero_all_reduce"): the same owned slices' sums as ZeRO-1's
    reduce-scatter (two ranks: a + b either way, bit for bit), its buckets all-reduced; the dry
    run of a ZeRO-1 layout with it equals a real launch, and its DP sums take longer."""
    import torch
    (rs, rs_spans), (ar, ar_spans) = launch(_both, 2)[0]
    assert len(rs) == len(ar) and all(torch.equal(a, b) for a, b in zip(rs, ar))
    assert any(n.startswith("reduce-scatter b") for n in rs_spans) and not any(n.startswith("all-reduce b")
                                                                               for n in rs_spans)
    assert any(n.startswith("all-reduce b") for n in ar_spans)
    L = LLAMA.with_(zero=1, schedule="1f1b", v=1)
    software = FUSIONS + ("zero_all_reduce",)
    from course_lib.virtual.dry_run import model_config
    real = launch(_real_rank, L.n_gpus, model_config(SPEC, L), L, software, clock=VirtualCluster(HW, dtype=None))
    r = dry_run(SPEC, HW, L, fusions=software, progress=None)
    assert r.step_time == max(x["t"] for x in real) and r.kernels == real[0]["kernels"] + real[2]["kernels"]
    plain = dry_run(SPEC, HW, L, fusions=FUSIONS, progress=None)
    sums = lambda run, kind: [s.end - s.start for s in run.spans if s.name.startswith(kind + " b")]
    assert sums(r, "all-reduce") and not sums(r, "reduce-scatter")
    assert sum(sums(r, "all-reduce")) > sum(sums(plain, "reduce-scatter"))
