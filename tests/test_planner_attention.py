"""The planner's price of a fused attention kernel (issue #36): FlashAttention's tile x wave
model (``gemm.attention_kernel_time``), the model the virtual clock prices the same kernel by;
unfused attention's batched GEMMs stay on the GEMM model."""
import pytest

from course_lib.planner import HARDWARE, Layout, ModelSpec
from course_lib.planner.gemm import (attention_gemms, attention_kernel_time, attention_rate, gemm_time, gemms_flops,
                                     gemms_time, layer_gemms)
from course_lib.planner.kernel_cost import ATTENTION, KernelModel
from course_lib.planner.validation import MEGATRON_2022

H100 = HARDWARE["h100-sxm"]
# Llama-shaped: head dim 128, grouped K/V heads (8 query heads, 2 K/V), SwiGLU; one layer
LLAMA_LAYER = ModelSpec("Llama-shaped 1L", 1, 1024, 8, 2, 2816, 32000, 2048)


def test_one_model_for_fused_attention_and_unfused_stays_gemms():
    # the planner's and the clock's price are one function of the Hardware and the kernel's shape
    shape = (8, 8192, 8192, 128, True, False)
    flops = 2 * 8 * 8192 * 8192 * 128
    assert KernelModel(H100).compute(flops, ATTENTION, shape) == attention_kernel_time(H100, *shape)
    plain = HARDWARE["h100-sxm"].with_(kernel_efficiency=(), sm_count=0)   # states no attention model
    assert attention_rate(plain) == plain.peak_flops * plain.matmul_efficiency
    assert attention_kernel_time(plain, *shape) == pytest.approx(flops / attention_rate(plain), rel=1e-12)
    m, s = LLAMA_LAYER, 8192
    # unfused (Megatron 2021-22): the six batched GEMMs on the tile x wave model, unchanged
    f, b = attention_gemms(m, s, 1, 1, 1, fused_attention=False)
    assert {g[6] for g in f + b} == {"gemm"} and len(f + b) == 6
    assert gemms_time(f + b, MEGATRON_2022) == sum(gemm_time(M, N, K, MEGATRON_2022, n, out)
                                                   for M, N, K, n, out, _, _ in f + b)
    # a layer's weight GEMMs are GEMMs whether attention is fused or not; its attention is one
    # forward kernel over its 8 heads
    lf, lb = layer_gemms(m, s, 1, fused_attention=True)
    weights = [g for g in lf if g[6] == "gemm"]
    assert len(weights) == 4 and gemms_time(lf, H100) == pytest.approx(
        gemms_time(weights, H100) + attention_kernel_time(H100, 8, s, s, 128, True, False), rel=1e-12)
    assert {g[6] for g in lb if g[6] != "gemm"} == {"attention_backward"}


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_planner_attention_time_is_the_kernel_model_and_the_dry_run_agrees(recompute, monkeypatch):
    """A Llama-shaped layer, TP 2 with SP, one micro-batch of 2048 tokens. The planner: forward
    2 b (a/t) s^2 d (QK^T and PV, causal half), backward 2.5x (QK^T recomputed, dV, dP, dQ, dK),
    full recomputation one forward more, each kernel on FlashAttention's tile x wave model. The
    dry run (FlashAttention, Llama 3's software) runs torch's SDPA kernels, priced by the clock
    at max(the same model, bytes / HBM rate, floor): the FLOPs are the same count (torch's SDPA
    formulas, causal half), so the ratio is 1 where every kernel is compute bound (checked per
    kernel below); float summation order aside (rel 1e-12)."""
    from course_lib.virtual import dry_run
    m, t, s = LLAMA_LAYER, 2, LLAMA_LAYER.seq_len
    d = m.hidden // m.n_heads
    fwd = 2 * 1 * (m.n_heads // t) * s * s * d
    flops = fwd + 2.5 * fwd + (fwd if recompute == "full" else 0)
    f, b = layer_gemms(m, s, 1, t, recompute=recompute, fused_attention=True)
    attention = [g for g in f + b if g[6] in ("attention", "attention_backward")]
    assert gemms_flops(attention) == flops
    planner = gemms_time(attention, H100)
    heads = m.n_heads // t
    one = attention_kernel_time(H100, heads, s, s, d, True, False)
    assert planner == pytest.approx(one * (2 if recompute == "full" else 1)
                                    + attention_kernel_time(H100, heads, s, s, d, True, True), rel=1e-12)

    from course_lib.virtual import compute
    kernels, cost_of = [], compute.kind_cost               # the clock's stream prices what this returns

    def record(*args):
        cost = cost_of(*args)
        if cost is not None and cost[2] == ATTENTION:
            kernels.append(cost)
        return cost
    monkeypatch.setattr(compute, "kind_cost", record)
    layout = Layout(tp=t, sp=True, micro_batch=1, global_batch=1, recompute=recompute)
    r = dry_run(m, H100, layout, fusions=("flash_attention",), progress=None, replay=False)
    assert r.ranks_run == 1                                    # the tp twin folded
    assert len(kernels) == (3 if recompute == "full" else 2)   # forward, (again,) backward
    model = KernelModel(H100)                                  # the clock's kernel model
    seconds = [model.seconds(*cost) for cost in kernels]
    for (fl, nbytes, _, shape), sec in zip(kernels, seconds):  # compute bound: the model sets the time
        assert shape[:5] == (heads, s, s, d, True)
        assert attention_kernel_time(H100, *shape) > max(nbytes / model.bytes_rate[ATTENTION], H100.kernel_floor)
        assert sec == attention_kernel_time(H100, *shape)
    assert sum(cost[0] for cost in kernels) == flops
    assert sum(seconds) / planner == pytest.approx(1.0, rel=1e-12)
