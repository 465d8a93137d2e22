"""Llama 3's rows taken apart (course_lib/lab/llama3_memory.py), checked at a small shape of the
same layout (ZeRO-2, FP32 accumulation, TP + SP, interleaved, one layer a chunk, the embedding
and the head alone in their chunks, FlashAttention): every interior stage's activation peak
is its layers in flight times one layer's saved bytes, exactly, and the chunks in flight are
the planner's formula; so the stage outputs the runner hands on are not in the count."""
import pytest

from course_lib.lab import llama3_memory as LM
from course_lib.layout import Layout, split_with_ends
from course_lib.planner.presets import ModelSpec, get_hardware

TINY = ModelSpec("tiny Llama", 6, 64, 4, 2, 176, 128, 32)
LAYOUT = Layout(dp=2, tp=2, pp=4, zero=2, sp=True, schedule="interleaved", v=2, global_batch=16, seq_len=32,
                precision="bf16-accumulate-fp32", stage_layers=split_with_ends(6, 8))


@pytest.fixture(scope="module")
def tiny():
    return LM.breakdown((LM.SOURCE, TINY.name, TINY, get_hardware("h100-sxm"), LAYOUT))


def test_interior_peak_is_layers_in_flight_times_one_layer(tiny):
    stages = tiny["stages"]
    assert [s["in_flight_chunks"] for s in stages] == [s["formula_chunks"] for s in stages] == [11, 9, 7, 5]
    for s in stages[1:-1]:
        assert s["no_layer_chunks"] == 0 and s["rest"] == 0
        assert s["activations"] == s["layers_in_flight"] * tiny["layer"]
    # the ends: stage 0 holds 7 embedding-only chunks (their token ids), stage 3 one head-only chunk
    assert stages[0]["no_layer_chunks"] == 7 and 0 < stages[0]["rest"] < tiny["layer"]
    assert stages[-1]["no_layer_chunks"] == 1 and stages[-1]["rest"] > 0
    assert tiny["peak_stage"] == 1 and tiny["peak"] == stages[1]["peak"] > stages[1]["total"]


def test_boundary_and_uncounted():
    # a boundary activation (b, s / tp, h) in bf16; the sends kept to the step's end: 2 m v of them
    assert LM.boundary_bytes(LAYOUT, TINY) == 1 * 16 * 64 * 2
    assert LM.unit_bytes(LAYOUT, TINY) == 32 * 64 * 2 // 2
    u = LM.uncounted(TINY, "h100-sxm", LAYOUT, 1)
    assert u["sent_kept_at_end"] == 2 * LAYOUT.microbatches * 2 * 2048
    assert u["outputs_kept"] == 9 * 2048


def test_paper_quotes_name_what_the_rows_follow():
    # the statements the layout's balance and numerics follow, quoted as printed
    assert "only the embedding" in LM.PAPER["balance"]
    assert "without activation checkpointing" in LM.PAPER["deallocate"]
    assert [r[4].n_gpus for r in LM.llama_rows()] == [8192, 16384, 16384]


def test_held_over_step_model(tiny):
    # the walk's saved-activation peak is the dry run's own count on the peak stage, to the byte
    k = tiny["peak_stage"]
    assert tiny["held"]["count"] == tiny["held_deallocated"]["count"] == tiny["stages"][k]["total"]
    # the states at each moment (the fp32 sums during the schedule): the dry run's peak, but for the
    # planner's parameter count the breakdown sizes the sums with (to the byte: test_dry_run_peak.py)
    assert tiny["held"]["held"] == tiny["held_deallocated"]["held"]
    assert abs(tiny["held"]["held"] - tiny["peak"]) < 1e-3 * tiny["peak"]
    # the course's runner holds more (fp32 sums, every sent tensor to the step's end); freeing a sent
    # tensor once delivered holds less than that, and never less than the count
    assert tiny["held"]["program"] > tiny["held_deallocated"]["program"] > tiny["held"]["count"]
    with pytest.raises(ValueError, match="layer chunks"):
        LM.held_over_step(TINY, LAYOUT, 0, tiny["layer"], 0, 0)       # stage 0: the embedding's chunk


def test_the_8192_row_with_fused_kernels_and_the_sums_sent_each_round():
    """The recorded what-if (``FUSED_ROUND_RECORDED``: the dry run) under 80 GiB at moments,
    over it with the temporaries between them, and the planner's course runtime on the same row
    and Hardware (instant; chapter 10 prints both): the same count at moments (to 0.1%: one
    count of the same tensors), and the step to 0.5%. The two compose a step apart: the ZeRO
    kernels a round runs in the schedule are the program's to rounding
    (tests/test_planner_zero_rounds.py) and the step-start gather is the dry run's to 0.1 ms
    (188.7 against 188.8 ms on stage 0), but the planner's schedule (``pipeline_time`` over a
    chunk-op's priced parts, its sends in series) is 37 ms longer than the clock's, op by op
    (10.670 against 10.633 s from stage 0's first forward to its last backward, 2026-12-01):
    0.26% on the step (10.893 against 10.865 s). Until the program packed a bucket with one
    foreach copy the step agreed to 0.006%, by chance: the program's copy per rank's row, which
    the planner never counted, filled that gap."""
    from course_lib.planner import estimate
    step, peak, gpu_peak = LM.FUSED_ROUND_RECORDED
    (_, _, model, hw, layout, *_), = LM.llama_rows([("Llama 3 405B, 8k", 8192)])
    hw = hw.with_(fused_kernels=True)
    est = estimate(model, hw, layout.with_(grad_reduce="round"), runtime="course")
    assert peak < hw.hbm_bytes / 2**30 < gpu_peak and est.fits
    assert est.step_time == pytest.approx(step, rel=5e-3)
    assert est.memory["total"] / 2**30 == pytest.approx(peak, rel=1e-3)


def test_the_16384_rows_with_fused_kernels_fit_with_every_tensor():
    """The recorded what-ifs (``FUSED_RECORDED``: the dry run) fit in 80 GiB with the temporaries
    between the moments counted, each peak above its moments' count; the 8k row's count at moments
    is the planner's course runtime on the same row and Hardware (to 0.1%, instant)."""
    from course_lib.planner import estimate
    for (name, gpus), (step, moments, peak) in LM.FUSED_RECORDED.items():
        (_, _, model, hw, layout, *_), = LM.llama_rows([(name, gpus)])
        assert moments < peak < hw.hbm_bytes / 2**30, name
        if name.endswith(", 8k"):
            est = estimate(model, hw.with_(fused_kernels=True), layout, runtime="course")
            assert est.memory["total"] / 2**30 == pytest.approx(moments, rel=1e-3)
