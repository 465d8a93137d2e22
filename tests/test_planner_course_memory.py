"""The planner's runtime="course" activations against the dry run's, per layer (issue #36: the
planner was 10-23% low on pipelined layouts without recomputation: it counted FlashAttention's
log-sum-exp where the course's attention keeps its softmax output, the GPT block's dropout
masks where the course runs no dropout, and one dense MLP where an MoE keeps top_k experts'
rows). Small shapes: each dry run takes about a second."""
import pytest

from course_lib.layout import Layout
from course_lib.planner import estimate
from course_lib.planner.activations import course_layer_activation_bytes, layer_activation_bytes, lse_bytes
from course_lib.planner.presets import HARDWARE, ModelSpec, gpt_spec, written_out
from course_lib.virtual import dry_run

GPT = gpt_spec("GPT 4L h512", 4, 512, 8, V=8192, s=512)
LLAMA = ModelSpec("Llama-style 4L h512 GQA", 4, 512, 8, 2, 1408, 8192, 512)
MOE = GPT.with_(name="GPT 4L h512 MoE 4x top-2", n_experts=4, top_k=2)
PIPE = dict(pp=2, schedule="1f1b", micro_batch=1, microbatches=2, seq_len=512)


H100 = HARDWARE["h100-sxm"]                       # states fused attention: FlashAttention runs
WRITTEN_OUT = H100.with_(fused_attention=False)    # the course's attention, written out


def layer_bytes(spec, layout, hw=H100):
    """(planner, dry run) bytes of one layer on stage 0, all its in-flight micro-batches: the
    stage's activations with two layers a stage less with one (the embedding's few saved
    tensors, which the planner leaves out, cancel)."""
    out = []
    for n in (2 * layout.pp, layout.pp):
        small = spec.with_(n_layers=n)
        est = estimate(small, hw, layout, runtime="course")
        r = dry_run(small, hw, layout, progress=None, optimizer="foreach")
        out.append((est.memory_by_stage[0]["activations"], r.memory_by_stage[0]["activations"]))
    return out[0][0] - out[1][0], out[0][1] - out[1][1]


@pytest.mark.parametrize("fused", [False, True], ids=["written-out", "flash"])
@pytest.mark.parametrize("spec,extra", [(GPT, dict(tp=2)), (LLAMA, dict(tp=2, sp=True))],
                         ids=["gpt-tp2", "llama-tp2-sp"])
def test_course_activations_equal_the_dry_runs_per_layer(spec, extra, fused):
    """Both count bytes of saved tensors (integers), so equal up to float rounding; 1F1B's two
    micro-batches in flight on stage 0 included. On a Hardware that states fused attention
    both run FlashAttention: its log-sum-exp kept instead of the softmax output, and K / V at
    their own kv heads (grouped-query attention read in the kernel, not copied out)."""
    layout = Layout(recompute="none", **PIPE, **extra)
    planner, dry = layer_bytes(spec, layout, H100 if fused else WRITTEN_OUT)
    s, t, a = PIPE["seq_len"], extra["tp"], spec.n_heads
    # the planner counts FlashAttention's log-sum-exp in fp32, 4 bytes; the dry run under
    # precision "full" prices every float at the cluster's 2 bytes: 2 bytes a row less, for
    # each of the 2 micro-batches in flight (a "bf16" layout prices it at its fp32: below)
    assert planner - dry == (2 * lse_bytes(s, 1, a, t) / 2 if fused else 0)
    course = course_layer_activation_bytes(spec, s, 1, t, extra.get("sp", False), fused_attention=fused)
    assert planner == 2 * course
    if fused:   # the softmax output (2 bytes a score, a / t heads, causal: every s x s kept) less the lse
        written = course_layer_activation_bytes(spec, s, 1, t, extra.get("sp", False))
        assert written - course == 2 * (a / t) * s * s - lse_bytes(s, 1, a, t)
    if fused and spec is LLAMA:   # each tensor at its own dtype: the fp32 lse counted as the planner does
        assert layer_bytes(spec, layout.with_(precision="bf16"))[1] == planner


def test_moe_activations_equal_the_dry_runs_per_layer():
    """The MoE's expert rows, 22 h bytes per routed (token, expert) pair; the router's few
    bytes (its (T, E) probabilities, the chosen experts' indices) are left out: below 1e-2."""
    planner, dry = layer_bytes(MOE, Layout(dp=2, ep=2, recompute="none", **PIPE), WRITTEN_OUT)
    assert planner == pytest.approx(dry, rel=1e-2)
    assert planner < dry


def test_course_keeps_the_softmax_and_megatron_the_log_sum_exp():
    s, b, a, kv, f = 512, 1, 8, 2, 1408
    course = course_layer_activation_bytes(LLAMA, s, b, t=2, sp=True)
    megatron = layer_activation_bytes(LLAMA, s, b, t=2, sp=True)      # fused attention
    assert course - megatron == 2 * a * s * s * b / 2 - lse_bytes(s, b, a, t=2)
    # ring attention (cp > 1) keeps a log-sum-exp: no scores, as the fused kernel
    assert course_layer_activation_bytes(LLAMA, s, b, cp=2) == layer_activation_bytes(LLAMA, s, b, cp=2)
    # the GPT block: no dropout masks (2 s b h) but LayerNorm's statistics (8 bytes a token)
    h = GPT.hidden
    gap = (layer_activation_bytes(GPT, s, b, recompute="selective")
           - course_layer_activation_bytes(GPT, s, b, recompute="selective"))
    assert gap == 2 * s * b * h - 8 * s * b + lse_bytes(s, b, a)   # (megatron: fused, its lse)
    for rc in ("none", "selective", "full"):
        with pytest.raises(ValueError, match="recompute"):
            course_layer_activation_bytes(GPT, s, b, recompute=rc + "x")


@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
def test_ulysses_keeps_the_softmax_of_its_heads_as_the_dry_run_does(split):
    """Ulysses (cp 2) written out (a Hardware without fused attention: the chapters' program)
    keeps the softmax of a / cp heads over the whole sequence: the planner keeps it, a / cp
    heads x s^2 x 2 bytes a layer, as the dry run does (no recomputation less selective, to the
    byte). With FlashAttention (every preset) its core runs on the sequence put in order and
    keeps no scores: no recomputation and selective keep the same, on both sides."""
    layout = Layout(cp=2, cp_method="ulysses", cp_layout=split, micro_batch=1, global_batch=1, seq_len=512)
    for hw, fusions in ((written_out(HARDWARE["h100-sxm"]), ()), (HARDWARE["h100-sxm"], ("flash_attention",))):
        kept = {}
        for rc in ("none", "selective"):
            lay = layout.with_(recompute=rc)
            est = estimate(LLAMA, hw, lay, runtime="course")
            r = dry_run(LLAMA, hw, lay, progress=None, optimizer="foreach")
            assert r.fusions == fusions
            kept[rc] = est.memory_by_stage[0]["activations"], r.memory_by_stage[0]["activations"]
        scores = LLAMA.n_layers * (LLAMA.n_heads // 2) * 512 ** 2 * 2 if not fusions else 0
        assert kept["none"][0] - kept["selective"][0] == scores
        assert kept["none"][1] - kept["selective"][1] == scores
