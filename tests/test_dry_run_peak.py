"""The dry run's peak memory over the whole step (course_lib.virtual.dry_run, ``peak``): the
states as they are at each action (ZeRO-2's fp32 gradient sums under "bf16-accumulate-fp32"
live during the schedule and are gone after it; the owned slices' gradients exist only after)
plus the activations saved then. At a small Llama layout (ZeRO-2, FP32 accumulation, an
interleaved pipeline whose interior rank holds one-layer chunks) the dry run's peak equals the
schedule model (lab.llama3_memory.held_over_step), to the byte, and a real launch of the same
layout reports the same peak on every rank it runs."""
import torch

from course_lib.gpt import TinyGPT
from course_lib.lab import llama3_memory as LM
from course_lib.launch import launch
from course_lib.layout import Layout, split_with_ends
from course_lib.parallel.mesh import MeshShape
from course_lib.planner.presets import ModelSpec, get_hardware
from course_lib.virtual import VirtualCluster, dry_run
from course_lib.virtual.dry_run import model_config
from memory_parity import assert_same_memory

SPEC = ModelSpec("tiny Llama", 4, 64, 4, 2, 176, 128, 32)
HW = "h100-sxm"
FUSIONS = ("flash_attention",)
LAYOUT = Layout(dp=2, pp=3, zero=2, schedule="interleaved", v=2, global_batch=12, seq_len=32,
                precision="bf16-accumulate-fp32", stage_layers=split_with_ends(4, 6))


def _real_rank(cfg, layout, fusions):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    return train_step(cfg, layout, Mesh.from_layout(layout), fusions=fusions)


def test_peak_over_the_step_equals_the_schedule_model_and_a_real_launch():
    r = dry_run(SPEC, HW, LAYOUT, fusions=FUSIONS, progress=None)
    cfg = model_config(SPEC, LAYOUT)
    with torch.device("meta"):
        per_layer = sum(q.numel() for q in TinyGPT(cfg, seed=0).blocks[0].parameters())
    stage_params = 2 * per_layer        # pp rank 1: chunks 1 and 4, one layer each
    assert stage_params % LAYOUT.dp == 0        # ZeRO-2's one bucket, no padding: dp 0 owns half
    layer = LM.one_layer(SPEC, get_hardware(HW), LAYOUT)
    mem = r.memory_by_stage[1]
    model = LM.held_over_step(SPEC, LAYOUT, 1, layer, mem["states"], stage_params,
                              owned=stage_params // LAYOUT.dp)
    assert model["count"] == mem["states"] + mem["activations"]     # the count before: states after + activations
    assert mem["moments"] == model["held"]                          # to the byte
    # the fp32 sums (4 bytes a parameter) are held with the activations; the slices' gradients are not
    assert mem["moments"] - model["count"] == 4 * stage_params - 4 * (stage_params // LAYOUT.dp)
    # between the moments the program holds more for a while (the loss's logits, a gradient
    # on its way into its sum): the peak over the step is above every moment
    assert all(m["peak"] > m["moments"] for m in r.memory_by_stage)
    assert r.peak_memory == max(m["peak"] for m in r.memory_by_stage) > max(m["states"] + m["activations"]
                                                                            for m in r.memory_by_stage)
    real = launch(_real_rank, LAYOUT.n_gpus, cfg, LAYOUT, FUSIONS, clock=VirtualCluster(HW, dtype=None))
    shape = MeshShape(**LAYOUT.sizes)
    for stage in range(LAYOUT.pp):
        got = real[shape.rank_of(pp=stage)]
        assert_same_memory(r.memory_by_stage[stage], got, stage)


def test_the_planner_counts_the_same_moments():
    """The planner's memory (estimate(...).memory) by the same rule: under ZeRO-2 with FP32
    accumulation the schedule holds 4 bytes a parameter of sums beside the activations (where
    m = p, one chunk's: planner.formulas.gradient_moments); under "bf16" without a pipeline
    the masters' fp32 gradients, which appear after the schedule beside DDP's bucket of the
    16-bit ones (held all step), make the step's end the peak (the dry run: its peak is the
    states after the step). Each within the planner-vs-dry-run sweep's bound of the dry run."""
    from course_lib.lab.dry_run_sweep import BOUND
    from course_lib.planner import estimate
    bf16 = LAYOUT.with_(zero=0, precision="bf16", pp=1, schedule="1f1b", v=1, stage_layers=None)
    m_is_p = LAYOUT.with_(global_batch=6)       # m = p = 3: every forward before the first backward
    for layout, at_end in ((LAYOUT, False), (bf16, True), (m_is_p, False)):
        est = estimate(SPEC, HW, layout, runtime="course")
        r = dry_run(SPEC, HW, layout, fusions=FUSIONS, progress=None)
        assert abs(est.memory["total"] / r.moment_memory - 1) <= BOUND, (layout, est.memory, r.moment_memory)
        m = est.memory
        states_after = m["params"] + m["grads_after_step"] + m["optimizer"]
        assert (m["total"] == states_after) is at_end
        assert (r.moment_memory == max(s["states"] for s in r.memory_by_stage)) is at_end
        if at_end:      # during the schedule: the bf16 model's gradients, 2 bytes, and DDP's bucket
            # of them, 2 (held all step); after it: the masters' fp32, 4, beside the bucket
            assert m["grads"] == m["grads_after_step"] == 3 * m["params"]
            assert m["total"] < states_after + m["activations"]
        elif layout is LAYOUT:  # the whole fp32 sums during the schedule; the owned half's after it
            assert m["grads"] == 2 * m["params"] == 2 * m["grads_after_step"]
        else:           # one chunk's sums (of 2) with the most activations: the first backward's end
            assert m["grads"] == m["params"]
            assert m["activations"] == max(s["activations"] for s in est.memory_by_stage)
