"""course_lib/planner: layouts, estimate(), search, and the published tables."""
import math
import random

import pytest

from course_lib.planner import HARDWARE, MODELS, Layout, ModelSpec, estimate, simulate
from course_lib.planner import formulas as F
from course_lib.planner.search import search
from course_lib.planner.validation import (bloom_row, error_by_source, korthikanti_table5, llama3_table4,
                                          narayanan_table1, published_rows, zero_table1)

GiB = 2**30


@pytest.mark.parametrize("layout,n_gpus,match", [
    (Layout(tp=3, global_batch=8), None, "TP must divide the attention heads"),
    (Layout(dp=2, tp=2, global_batch=8), 8, "DP\\*TP\\*PP\\*CP must equal the GPU count"),
    (Layout(dp=3, micro_batch=2, global_batch=8), None, "micro-batch x DP must divide the global batch"),
    (Layout(pp=33, global_batch=64), None, "more pipeline stages than layers"),
    (Layout(pp=4, schedule="interleaved", v=16, global_batch=64), None, "more pipeline chunks than layers"),
    (Layout(pp=4, schedule="interleaved", v=2, global_batch=9), None, "rounds of equal size"),   # torch's rule
    (Layout(dp=2, zero=1, grad_reduce="round", global_batch=2), None, "that is ZeRO-2"),
    (Layout(dp=2, zero=2, grad_reduce="layer", global_batch=2), None, "grad_reduce must be one of"),
    (Layout(pp=4, schedule="interleaved", v=1, global_batch=8), None, "needs PP >= 2 and v >= 2"),
    (Layout(pp=4, v=2, global_batch=8), None, "needs schedule='interleaved'"),
    (Layout(cp=3, global_batch=8), None, "CP must divide the sequence length"),
    (Layout(ep=2, dp=2, global_batch=8), None, "EP > 1 needs a mixture-of-experts model"),
    (Layout(zero=4, global_batch=8), None, "ZeRO stage"),
    (Layout(schedule="zigzag", global_batch=8), None, "pipeline schedule"),
    (Layout(recompute="most", global_batch=8), None, "recompute"),
    (Layout(dp=0, global_batch=8), None, "layout.dp must be a positive integer"),
])
def test_invalid_layouts_name_the_constraint(layout, n_gpus, match):
    with pytest.raises(ValueError, match=match):
        estimate("llama3-8b", "h100-sxm", layout, n_gpus=n_gpus)


def test_kv_heads_constraint():
    odd = ModelSpec("odd", 4, 768, 12, 4, 3072, 1000, 128)
    with pytest.raises(ValueError, match="TP must divide the KV heads"):
        estimate(odd, "h100-sxm", Layout(tp=6, global_batch=8))
    estimate(odd, "h100-sxm", Layout(tp=4, global_batch=8))       # 4 KV heads, one per rank


def test_moe_constraints():
    with pytest.raises(ValueError, match="EP must divide the experts"):
        estimate("mixtral-8x7b", "h100-sxm", Layout(dp=3, ep=3, global_batch=6))
    with pytest.raises(ValueError, match="expert mesh folds over one stage.s dp x cp x tp"):
        estimate("mixtral-8x7b", "h100-sxm", Layout(dp=2, ep=4, global_batch=8))
    with pytest.raises(ValueError, match="unknown model"):
        estimate("gpt-5", "h100-sxm", Layout())


def test_single_gpu_estimate_is_the_formulas():
    model, hw = MODELS["llama3-8b"], HARDWARE["h100-sxm"]
    est = estimate(model, hw, Layout(global_batch=4, micro_batch=1, recompute="none"))
    P = F.param_count(model)
    assert est.memory["params"] + est.memory["grads"] + est.memory["optimizer"] == pytest.approx(16 * P)
    # a Llama block with fused attention keeps no s x s scores, only a log-sum-exp per row and head
    per_layer = F.llama_activation_bytes_per_layer(8192, 1, 4096, 32, 8, 14336, recompute="selective")
    assert est.memory["activations"] == pytest.approx(32 * (per_layer + 4 * 32 * 8192))
    flops = F.flops_per_token(model, 8192) * 4 * 8192
    assert est.model_flops == pytest.approx(flops)
    assert sum(est.time.values()) == pytest.approx(est.step_time)
    assert est.mfu == pytest.approx(flops / (est.step_time * hw.peak_flops))
    assert not est.fits and "memory" in est.violations[0]
    # unfused attention keeps the scores (the formula as derived), and the flat GEMM model
    # (sm_count = 0) runs every FLOP at matmul_efficiency of peak
    flat = hw.with_(sm_count=0, fused_attention=False)
    est = estimate(model, flat, Layout(global_batch=4, micro_batch=1, recompute="none"))
    per_layer = F.llama_activation_bytes_per_layer(8192, 1, 4096, 32, 8, 14336)
    assert est.memory["activations"] == pytest.approx(32 * per_layer)
    assert est.time["compute"] == pytest.approx(flops / flat.achievable_flops, rel=1e-3)   # + the router: none
    gpt = estimate("gpt3-175b", flat, Layout(global_batch=1, recompute="none"))
    g = MODELS["gpt3-175b"]
    assert gpt.memory["activations"] == pytest.approx(96 * F.activation_bytes_per_layer(2048, 1, g.hidden, g.n_heads))


def test_fused_attention_memory_and_time():
    """Fused attention stores no scores and skips the masked half of causal attention; the
    planner's memory follows it (the scores term is gone at recompute="none")."""
    hw = HARDWARE["h100-sxm"]
    lay = Layout(global_batch=1, recompute="none", seq_len=32768)
    fused, unfused = estimate("llama3-8b", hw, lay), estimate("llama3-8b", hw.with_(fused_attention=False), lay)
    m = MODELS["llama3-8b"]
    scores = m.n_layers * m.n_heads * 32768**2 * 2            # softmax output (a, s, s), bf16, every layer
    lse = m.n_layers * 4 * m.n_heads * 32768
    assert unfused.memory["activations"] - fused.memory["activations"] == pytest.approx(scores - lse)
    sel = estimate("llama3-8b", hw, lay.with_(recompute="selective"))
    assert sel.memory["activations"] == pytest.approx(fused.memory["activations"])
    # faster, though the fused kernel runs at its cited rate (0.30 of peak on half the FLOPs:
    # 0.5 / 0.30 > 1 / 0.70, the unfused GEMMs'; tests/test_planner_attention.py): the s x s
    # scores no longer stream through HBM (at the GEMM rate it was < 0.8x; now 0.89x)
    assert fused.time["compute"] < unfused.time["compute"]


def test_mfu_conventions():
    est = estimate("llama3-70b", "h100-sxm", Layout(tp=8, pp=4, dp=2, sp=True, global_batch=64, recompute="full"))
    u = est.utilization()
    assert u["model"] == pytest.approx(est.mfu) and u["hardware"] == pytest.approx(est.hfu)
    assert u["model_causal"] < u["model"] < u["hardware"] and u["hardware_causal"] < u["hardware"]
    m, s = MODELS["llama3-70b"], 8192
    attn = 12 * m.n_layers * s * m.hidden * 64 * s            # full attention FLOPs of the batch
    assert est.flops["model"] - est.flops["model_causal"] == pytest.approx(attn / 2)
    assert "full attention" in est.conventions() and "causal" in est.conventions()


def test_each_dimension_cuts_what_it_should():
    base = dict(global_batch=64, recompute="selective")
    one = estimate("llama3-70b", "h100-sxm", Layout(**base))
    zero3 = estimate("llama3-70b", "h100-sxm", Layout(dp=8, zero=3, **base))
    assert zero3.memory["optimizer"] == pytest.approx(one.memory["optimizer"] / 8)
    tp = estimate("llama3-70b", "h100-sxm", Layout(tp=8, sp=True, **base))
    assert tp.memory["activations"] == pytest.approx(one.memory["activations"] / 8)
    assert tp.comm_bytes["tp"] > 0 and one.comm_bytes["tp"] == 0        # TP is not free
    cp = estimate("llama3-70b", "h100-sxm", Layout(cp=4, **base))
    assert cp.memory["activations"] == pytest.approx(one.memory["activations"] / 4)
    pp = estimate("llama3-70b", "h100-sxm", Layout(pp=4, **base))
    assert pp.memory["params"] < one.memory["params"] / 3.5
    assert pp.bubble_fraction == pytest.approx(3 / 67)


def test_dp_bytes_are_ring_volumes():
    est = estimate("llama3-8b", "h100-sxm", Layout(dp=8, global_batch=8))
    P = F.param_count(MODELS["llama3-8b"])
    assert est.comm_bytes["dp"] == pytest.approx(2 * 7 / 8 * 2 * P)     # all-reduce of bf16 grads


def _random_layout(rng, model, n_gpus_max=512):
    for _ in range(200):
        tp = rng.choice([1, 2, 4, 8])
        pp = rng.choice([1, 1, 2, 4, 8])
        cp = rng.choice([1, 1, 2, 4])
        dp = rng.choice([1, 2, 4, 8, 16])
        ep = rng.choice([1, 2, 4, 8]) if model.n_experts > 1 else 1
        sched = rng.choice(["gpipe", "1f1b", "interleaved"]) if pp > 1 else "1f1b"
        v = rng.choice([2, 3, 4]) if sched == "interleaved" else 1
        mbs = rng.choice([1, 2, 4])
        m = rng.choice([1, 2, 4, 8, 16, 32])
        layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=rng.choice([0, 1, 2, 3]), sp=rng.random() < 0.5,
                        schedule=sched, v=v, micro_batch=mbs, global_batch=dp * mbs * m,
                        recompute=rng.choice(["none", "selective", "full"]),
                        overlap_dp=rng.random() < 0.7, seq_len=rng.choice([None, 1024, 32768]))
        if layout.n_gpus > n_gpus_max:
            continue
        try:
            estimate(model, "h100-sxm", layout)
        except ValueError:
            continue
        return layout
    raise AssertionError("no valid layout drawn")


def _finite_nonneg(x, what):
    assert isinstance(x, (int, float)) and math.isfinite(x) and x >= 0, (what, x)


def test_property_random_valid_configurations_are_finite_and_nonnegative():
    rng = random.Random(1234)
    models = list(MODELS.values()) + [ModelSpec("tiny", 2, 64, 4, 2, 128, 100, 64)]
    hws = list(HARDWARE.values())
    for i in range(300):
        model = rng.choice(models)
        hw = rng.choice(hws)
        layout = _random_layout(rng, model)
        est = estimate(model, hw, layout)
        for k, val in est.memory.items():
            _finite_nonneg(val, f"memory {k} {layout}")
        for stage in est.memory_by_stage:
            for k, val in stage.items():
                _finite_nonneg(val, f"stage memory {k} {layout}")
        for k, val in est.time.items():
            _finite_nonneg(val, f"time {k} {layout}")
        for k, val in est.comm_bytes.items():
            _finite_nonneg(val, f"comm {k} {layout}")
        for val in (est.step_time, est.tflops_per_gpu, est.mfu, est.hfu, est.bubble_fraction):
            _finite_nonneg(val, layout)
        assert est.step_time > 0
        assert sum(est.time.values()) == pytest.approx(est.step_time, rel=1e-9)
        # the GPU cannot beat its achievable rate on the FLOPs it runs
        assert est.utilization()["executed"] <= hw.matmul_efficiency * (1 + 1e-9)
        assert 0 <= est.bubble_fraction < 1
        if i % 10 == 0 and layout.n_gpus <= 64 and layout.microbatches * layout.chunks <= 64:
            sim = simulate(model, hw, layout)
            assert all(math.isfinite(s.start) and s.end >= s.start >= 0 for s in sim)
            assert sim.step_time == pytest.approx(est.step_time, rel=0.03)


def test_zero_table1_within_one_percent():
    rows = zero_table1()
    assert len(rows) == 18 and all(r["ok"] for r in rows)
    assert sum(abs(r["rel_err"]) > 0.01 for r in rows) == 1     # only 0.1172 printed as 0.12


def test_korthikanti_table5_mfu_within_15_percent():
    rows = korthikanti_table5()
    for r in rows:
        assert abs(r["rel_err"]) <= 0.15, r
        # our FLOP count turns the paper's time into the paper's MFU
        assert r["MFU_from_paper_time"] == pytest.approx(r["paper_MFU"], abs=0.002)


def test_narayanan_table1_hfu_within_15_percent_and_fits():
    rows = narayanan_table1()
    assert len(rows) == 10
    for r in rows:
        assert abs(r["rel_err"]) <= 0.15 and r["fits"], r
    # the count is the paper's: 96 B s l h^2 (1 + s/6h + V/16lh) with full recomputation
    m = MODELS["megatron-175b"]
    s, L, h, V_ = 2048, m.n_layers, m.hidden, m.vocab
    assert F.flops_per_token(m, s, "full") == pytest.approx(96 * s * L * h**2 * (1 + s / (6 * h) + V_ / (16 * h * L)) / s,
                                                            rel=2e-3)   # + biases' and LayerNorm's nothing


def test_llama3_table4_rows_and_memory():
    rows = llama3_table4()
    assert [r["GPUs"] for r in rows] == [8192, 16384, 16384]
    for r in rows:
        assert r["ours_causal"] < r["ours"]
    # with no recomputation beyond the fused kernel, the derived Llama-block memory exceeds
    # 80 GB on these layouts (the notebook says so); full recomputation fits
    assert not any(r["fits"] for r in rows)
    assert all(r["fits"] for r in llama3_table4(recompute="full"))


def test_llama3_papers_pipeline_explains_the_drop_from_8k_to_16k_gpus():
    """The 8k-token rows: 16M tokens a step on 8,192 then 16,384 GPUs, DP 64 -> 128, so each
    replica's micro-batches halve (32 -> 16) and the bubble (p - 1) / (v m) doubles. Table 4's
    throughput drops 430 -> 400 TFLOP/s (7.0%). With the paper's v = 8 (and its embedding and
    head chunks) the planner's drop (6.6%; 8.8% before FlashAttention was priced at its own
    rate, which lengthens the compute beside the bubble) is nearer that than at v = 2 (16.7%:
    a bubble 4x as large), the rule the course ran before it could cut the paper's chunks."""
    from course_lib.planner.validation import LLAMA3_TABLE4, LLAMA3_V_PAPER, llama3_layout

    def drop(v):
        tflops = []
        for gpus, tp, cp, pp, dp, s, _ in LLAMA3_TABLE4[:2]:
            est = estimate("llama3-405b", "h100-sxm", llama3_layout(tp, cp, pp, dp, s, v=v))
            tflops.append(est.model_flops / (est.step_time * gpus))
        return 1 - tflops[1] / tflops[0]

    paper, stated, former = 1 - LLAMA3_TABLE4[1][-1] / LLAMA3_TABLE4[0][-1], drop(LLAMA3_V_PAPER), drop(2)
    assert stated < former, (paper, stated, former)              # the bubble's growth, smaller at v = 8
    assert abs(stated - paper) < (former - paper) / 4, (paper, stated, former)


def test_bloom_row_takes_the_least_recomputation_that_fits():
    from course_lib.planner.validation import BLOOM, JEAN_ZAY
    assert F.param_count(BLOOM) == pytest.approx(176.2e9, rel=1e-3)          # "176B"
    (row,) = bloom_row()
    assert row["fits"] and "(full)" in row["model"] and abs(row["rel_err"]) <= 0.15
    none = estimate(BLOOM, JEAN_ZAY, Layout(dp=8, tp=4, pp=12, zero=1, micro_batch=2, global_batch=2048))
    assert not none.fits


def test_error_by_source():
    rows = published_rows()
    stats = {r["source"]: r for r in error_by_source(rows)}
    assert set(stats) == {"Korthikanti 2022 T5", "Narayanan 2021 T1", "BLOOM 2022", "Llama 3 T4"}
    for st in stats.values():
        errs = [abs(r["rel_err"]) for r in rows if r["source"] == st["source"]]
        assert st["worst_abs_err"] == max(errs) and st["mean_abs_err"] == pytest.approx(sum(errs) / len(errs))
    # the validation's 15% goal: met by every row but Llama 3's 128k (test below)
    missed = [(r["source"], r["model"]) for r in rows if abs(r["rel_err"]) > 0.15]
    assert missed == [("Llama 3 T4", "Llama 3 405B, 128k")]


def test_llama3_rows_within_tolerance():
    # #36: the paper's pipeline (v = 8) and FlashAttention on its tile x wave model fitted on an
    # H200 (gemm.ATTENTION_MODEL): +12.0%, +12.6%, +15.3% model TFLOP/s. At a flat 0.30 of peak
    # they were +12.9%, +13.3%, +12.3%; at the GEMM model +16.7%, +14.4%, +44.9%. The 128k row's
    # calls (8,192 queries over up to 131,072 gathered keys) run near the kernel's best rate; the
    # planner's CP leaves out per-hop launches and synchronisation (chapter 10), and is fast there.
    errs = [r["rel_err"] for r in llama3_table4()]
    assert all(0 < e <= 0.15 for e in errs[:2]) and 0.15 < errs[2] < 0.16


def test_cp_ring_hides_behind_attention_and_all_gather_does_not():
    hw = HARDWARE["h100-sxm"]
    base = Layout(tp=2, cp=4, sp=True, global_batch=1, recompute="selective")     # 8 GPUs: NVLink
    ring = estimate("llama3-70b", hw, base)
    ag = estimate("llama3-70b", hw, base.with_(cp_comm="all_gather"))
    # the ring's hops hide under a block's attention, all but the accumulator's last hop home
    m = MODELS["llama3-70b"]
    kv = 2 * 8192 * (m.n_kv_heads // 2) * m.head_dim * 2   # K and V of the sequence, this TP rank's heads
    alpha, bw = hw.link(True)
    assert ring.time["cp"] == pytest.approx(m.n_layers * (alpha + kv / 4 / bw))
    assert ring.time["cp"] < ag.time["cp"]
    assert ring.comm_bytes["cp"] == pytest.approx(m.n_layers * 10 / 4 * kv)      # (3N-2)/N KV per layer
    assert ag.comm_bytes["cp"] == pytest.approx(m.n_layers * 9 / 4 * kv)         # 3(N-1)/N KV
    # a slow link exposes the ring hop by hop: (cp - 1) x (hop - block attention)
    slow = hw.with_(nvlink_bandwidth=1e9)
    assert estimate("llama3-70b", slow, base).time["cp"] > 0
    with pytest.raises(ValueError, match="cp_comm"):
        estimate("llama3-70b", hw, base.with_(cp_comm="tree"))


def test_search_ranks_valid_fitting_layouts():
    result = search("llama3-70b", "h100-sxm", 64, 128, micro_batches=(1,), recomputes=("selective",),
                    zero_stages=(1,), cp_sizes=(1, 2))
    assert result.ranked
    speeds = [e.tokens_per_second for e in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert all(e.layout.n_gpus == 64 and e.memory["total"] <= 80 * GiB for e in result.ranked)
    assert any(e.layout.pp > 1 for e in result.ranked) and any(e.layout.cp > 1 for e in result.ranked)


def test_calibration_predicts_a_real_run():
    """A 2-rank gloo DDP run of a tiny GPT, predicted from measured matmul rate, memory
    bandwidth and alpha-beta fit. Timing on a shared machine is noisy: only sanity here;
    the notebook prints predicted next to measured."""
    models = pytest.importorskip("course_lib.models")
    from course_lib.lab.calibration import calibrate
    from course_lib.planner import calibration
    cfg = models.GPTConfig(n_layers=1, hidden=64, n_heads=4, seq_len=32)
    assert F.param_count(calibration.model_spec(cfg)) == F.param_count(cfg)
    cal = calibrate(cfg, world_size=2, batch=4, steps=2, repeats=2, timeout=120)
    assert cal["measured"]["fit"].alpha >= 0 and cal["measured"]["matmul_flops"] > 0
    assert 0 < cal["predicted"] < 60 and 0 < cal["measured_step"] < 60
    assert 0.1 < cal["predicted"] / cal["measured_step"] < 10
