"""Llama 3's FP32 numerics (Dubey et al. 2024, Sec. 3.3.2), stated and priced by
``lab.llama3_numerics.fp32_numerics`` on the dry run's constants, not run: the arithmetic
checked on the 8k rows."""
from course_lib.lab.llama3_numerics import fp32_numerics
from course_lib.planner import formulas as F
from course_lib.planner.presets import HARDWARE, MODELS
from course_lib.planner.validation import LLAMA3_TABLE4, llama3_layout


def test_fp32_numerics_on_the_8k_rows():
    model, hw = MODELS["llama3-405b"], HARDWARE["h100-sxm"]
    rows = [llama3_layout(tp, cp, pp, dp, s) for _, tp, cp, pp, dp, s, _ in LLAMA3_TABLE4[:2]]
    a, b = (fp32_numerics(model, hw, L) for L in rows)
    h, f, kv = model.hidden, model.ffn, model.n_kv_heads * model.hidden // model.n_heads
    layer = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h      # Q, K, V, O; SwiGLU; two RMSNorms
    assert a["parameters"] == b["parameters"] == 8 * layer / 8      # a middle rank: 8 one-layer chunks, tp 8
    assert [L.microbatches for L in rows] == [32, 16]
    # 4 more bytes per parameter per later micro-batch, 6 for the first one's cast
    assert abs(a["accumulation"] / b["accumulation"] - (31 * 4 + 6) / (15 * 4 + 6)) < 1e-12
    ew = hw.hbm_bandwidth * hw.efficiencies()["elementwise"]
    assert abs(a["accumulation"] - 130 * a["parameters"] / ew) <= 1e-9 * a["accumulation"]
    # FP32 doubles the bytes of the reduce-scatter: the extra is its bf16 bandwidth term
    alpha, bw = hw.link(False)
    bf16 = F.collective_time("reduce_scatter", 2 * a["parameters"], 64, alpha, bw)
    assert 0 < a["reduce_scatter"] < bf16
    # the figures lab.llama3_numerics states
    assert [round(a["accumulation"], 3), round(b["accumulation"], 3), round(a["reduce_scatter"], 3)] == \
        [0.137, 0.069, 0.157]
