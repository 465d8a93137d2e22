"""The planner's price of a fused attention kernel (issue #36): its FLOPs at the Hardware's
"attention" fraction of peak (``gemm.attention_rate``), the rate the virtual clock prices the
same kernel at; unfused attention's batched GEMMs stay on the GEMM model."""
import pytest

from course_lib.planner import HARDWARE, Layout, ModelSpec
from course_lib.planner.gemm import attention_gemms, attention_rate, gemm_time, gemms_flops, gemms_time, layer_gemms
from course_lib.planner.kernel_cost import ATTENTION, KernelModel
from course_lib.planner.validation import MEGATRON_2022

H100 = HARDWARE["h100-sxm"]
# Llama-shaped: head dim 128, grouped K/V heads (8 query heads, 2 K/V), SwiGLU; one layer
LLAMA_LAYER = ModelSpec("Llama-shaped 1L", 1, 1024, 8, 2, 2816, 32000, 2048)


def test_one_rate_for_fused_attention_and_unfused_stays_gemms():
    # the planner's and the clock's rate are one function of the Hardware
    assert attention_rate(H100) == H100.peak_flops * 0.30 == KernelModel(H100).flops_rate[ATTENTION]
    plain = HARDWARE["h100-sxm"].with_(kernel_efficiency=())      # states no attention rate
    assert attention_rate(plain) == plain.peak_flops * plain.matmul_efficiency
    m, s = LLAMA_LAYER, 8192
    # unfused (Megatron 2021-22): the six batched GEMMs on the tile x wave model, unchanged
    f, b = attention_gemms(m, s, 1, 1, 1, fused_attention=False)
    assert {g[6] for g in f + b} == {"gemm"} and len(f + b) == 6
    assert gemms_time(f + b, MEGATRON_2022) == sum(gemm_time(M, N, K, MEGATRON_2022, n, out)
                                                   for M, N, K, n, out, _, _ in f + b)
    # a layer's weight GEMMs are GEMMs whether attention is fused or not
    lf, _ = layer_gemms(m, s, 1, fused_attention=True)
    weights = [g for g in lf if g[6] == "gemm"]
    assert len(weights) == 4 and gemms_time(lf, H100) == pytest.approx(
        gemms_time(weights, H100) + gemms_flops([g for g in lf if g[6] == "attention"]) / attention_rate(H100),
        rel=1e-12)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_planner_attention_time_is_flops_at_the_attention_rate_and_the_dry_run_agrees(recompute, monkeypatch):
    """A Llama-shaped layer, TP 2 with SP, one micro-batch of 2048 tokens. The planner: forward
    2 b (a/t) s^2 d (QK^T and PV, causal half), backward 2.5x (QK^T recomputed, dV, dP, dQ, dK),
    full recomputation one forward more, at peak x 0.30. The dry run (FlashAttention, Llama 3's
    software) runs torch's SDPA kernels, priced by the clock at max(FLOPs / rate, bytes / HBM
    rate, floor): the FLOPs are the same count (torch's SDPA formulas, causal half), so the
    ratio is 1 where every kernel is compute bound (checked per kernel below); float
    summation order aside (rel 1e-12)."""
    from course_lib.virtual import dry_run
    m, t, s = LLAMA_LAYER, 2, LLAMA_LAYER.seq_len
    d = m.hidden // m.n_heads
    fwd = 2 * 1 * (m.n_heads // t) * s * s * d
    flops = fwd + 2.5 * fwd + (fwd if recompute == "full" else 0)
    f, b = layer_gemms(m, s, 1, t, recompute=recompute, fused_attention=True)
    attention = [g for g in f + b if g[6] == "attention"]
    assert gemms_flops(attention) == flops
    planner = gemms_time(attention, H100)
    assert planner == pytest.approx(flops / (H100.peak_flops * 0.30), rel=1e-12)

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
    for (fl, nbytes, _, _), sec in zip(kernels, seconds):      # compute bound: the FLOPs set the time
        assert fl / attention_rate(H100) > max(nbytes / model.bytes_rate[ATTENTION], H100.kernel_floor)
        assert sec == fl / attention_rate(H100)
    assert sum(cost[0] for cost in kernels) == flops
    assert sum(seconds) / planner == pytest.approx(1.0, rel=1e-12)
