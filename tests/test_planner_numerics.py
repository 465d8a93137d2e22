"""course_lib/planner/numerics.py: the planner prices a layout's precision as the course's program
runs it (gradient sums and DP collectives in the stated dtype, the optimizer step on fp32 masters):

* the bytes follow the dtypes of course_lib.precision.mixed (the planner may not import it);
* the published systems' runtime (default): the DP collective carries the reduce dtype's bytes,
  the step its bytes per parameter, the backward the gradient sums;
* the course's runtime against a small dry run of the same layouts: what each precision adds to
  the step agrees within the sweep's bound (10%), and so do the step times.
"""
import pytest
import torch

from course_lib.lab.dry_run_sweep import BOUND
from course_lib.layout import Layout
from course_lib.planner import estimate
from course_lib.planner import formulas as F
from course_lib.planner.costs import dp_pieces
from course_lib.planner.numerics import NUMERICS, numerics
from course_lib.planner.presets import HARDWARE, ModelSpec
from course_lib.precision.mixed import PRECISIONS, accumulates
from course_lib.virtual import dry_run

LLAMA = ModelSpec("Llama-style 12L h2048 GQA", 12, 2048, 16, 4, 5632, 32000, 1024)


def test_the_bytes_are_the_precisions_dtypes():
    for name, (compute, reduce) in PRECISIONS.items():
        if name == "fp32":                       # fp32 compute: GEMMs the planner does not rate
            with pytest.raises(ValueError, match="the planner prices precision"):
                numerics(name)
            continue
        n = numerics(name)
        assert n.reduce == (reduce or torch.bfloat16).itemsize, name
        assert n.masters == (compute is not None) and n.per_microbatch == accumulates(name), name
        assert n.accumulate == (reduce.itemsize if accumulates(name) else 2), name
        assert n.widen == (n.masters and not accumulates(name)), name
    assert set(NUMERICS) == set(PRECISIONS) - {"fp32"}
    assert [numerics(p).optimizer_bytes for p in ("full", "bf16", "bf16-accumulate-fp32")] == [28, 40, 34]
    assert numerics("bf16-accumulate-fp32").accumulation_bytes(4) == 6 + 3 * 10
    assert numerics("bf16").accumulation_bytes(4) == 3 * 6


def test_the_published_runtime_prices_the_reduce_dtype_and_the_step():
    hw = HARDWARE["h100-sxm"]
    L = Layout(dp=8, tp=1, pp=1, micro_batch=1, microbatches=4, recompute="selective")
    by = {p: estimate(LLAMA, hw, L.with_(precision=p)).stages[0] for p in ("full", "bf16", "bf16-reduce-fp32",
                                                                           "bf16-accumulate-fp32")}
    P = by["full"].params
    assert by["bf16"].grad_sync == by["full"].grad_sync                # 2 bytes a gradient either way
    assert by["bf16-reduce-fp32"].grad_sync == by["bf16-accumulate-fp32"].grad_sync > by["bf16"].grad_sync
    alpha, bw = hw.link(True)                                           # dp 8: one node
    pieces = dp_pieces(L, 0, LLAMA.n_layers)                            # one all-reduce per layer, + ends
    for p, nbytes in (("bf16", 2), ("bf16-accumulate-fp32", 4)):
        want = F.collective_time("all_reduce", P * nbytes, 8, alpha * pieces, bw)
        assert by[p].grad_sync == pytest.approx(want, rel=1e-12), p
    for p, st in by.items():
        assert st.optimizer == pytest.approx(numerics(p).optimizer_bytes * P / hw.hbm_bandwidth, rel=1e-12), p
    extra = by["bf16-accumulate-fp32"].bwd["elementwise"] - by["full"].bwd["elementwise"]
    assert extra == pytest.approx((6 + 3 * 10) * P / 4 / hw.hbm_bandwidth, rel=1e-12)   # per micro-batch
    # ZeRO-2: gradients summed in bf16 are reduce-scattered every micro-batch (in the backward);
    # summed in their own fp32 buffer, once, after the schedule
    z2 = {p: estimate(LLAMA, hw, L.with_(precision=p, zero=2, overlap_dp=False)).stages[0]
          for p in ("bf16", "bf16-accumulate-fp32")}
    assert z2["bf16"].bwd["zero"] > 0 and z2["bf16"].grad_sync == 0
    assert z2["bf16-accumulate-fp32"].bwd["zero"] == 0
    rs = {n: F.collective_time("reduce_scatter", P * n, 8, alpha * pieces, bw) for n in (2, 4)}
    assert z2["bf16"].bwd["zero"] == pytest.approx(rs[2], rel=1e-12)
    assert z2["bf16-accumulate-fp32"].grad_sync == pytest.approx(rs[4], rel=1e-12)


def test_the_course_runtime_prices_what_a_dry_run_adds():
    """What "bf16" and "bf16-accumulate-fp32" add over "full" (the planner's convention of a
    bf16 program): the planner's course runtime against the dry run (each tensor at its own
    dtype), dp 2 x pp 2, 2 micro-batches (measured: +1.0% and -3.3% of the added time)."""
    L = Layout(dp=2, pp=2, micro_batch=1, microbatches=2, recompute="selective")
    est, dry = {}, {}
    for p in ("full", "bf16", "bf16-accumulate-fp32"):
        est[p] = estimate(LLAMA, "h100-sxm", L.with_(precision=p), runtime="course").step_time
        dry[p] = dry_run(LLAMA, "h100-sxm", L.with_(precision=p), progress=None, optimizer="foreach").step_time
        assert abs(est[p] / dry[p] - 1) <= BOUND, (p, est[p], dry[p])
    for p in ("bf16", "bf16-accumulate-fp32"):
        added_est, added_dry = est[p] - est["full"], dry[p] - dry["full"]
        assert added_dry > 0 and abs(added_est / added_dry - 1) <= BOUND, (p, added_est, added_dry)
