"""Cluster-scale planning: the memory, time and MFU of an N-D parallel layout.

    from course_lib.planner import estimate, simulate, Layout
    est = estimate("llama3-70b", "h100-sxm", Layout(dp=2, tp=8, pp=4, sp=True, global_batch=64))
    print(est.summary())
    viz.timeline(simulate("llama3-70b", "h100-sxm", layout))

Rooms: ``formulas`` (every formula, one small function each; the activation-memory and
communication ones live in ``activations`` and ``communication`` and are re-exported),
``gemm`` (matmul time by the GEMM's shape), ``presets`` (models, GPUs), ``layout`` (a
layout and its constraints), ``costs`` (what one pipeline stage costs), ``estimate``
(the analytic step, its FLOPs in every convention), ``simulator`` (the same step, event
by event, as trace spans), ``search`` (rank valid layouts), ``validation`` (against
published tables), ``calibration`` (a course model's ModelSpec; a Hardware from what
``lab.calibration`` measured on this machine), ``kernels`` (a kernel's roofline and launch,
the course's kernels counted on the meta device) and ``runtime``
(``estimate(..., runtime="course")``: the course's own program, its kernels and every
collective it issues; the default ``"megatron"`` models the published systems validated).
"""
from course_lib.planner.estimate import Estimate, estimate
from course_lib.planner.formulas import (
    activation_bytes_per_layer,
    bubble_fraction,
    collective_bytes_per_rank,
    collective_time,
    flops_per_token,
    in_flight_microbatches,
    model_dims,
    param_breakdown,
    param_count,
    training_flops,
    zero_memory_bytes,
)
from course_lib.planner.layout import Layout, validate
from course_lib.planner.presets import HARDWARE, MODELS, Hardware, ModelSpec, written_out
from course_lib.planner.simulator import simulate

__all__ = [
    "estimate", "Estimate", "simulate", "Layout", "validate", "MODELS", "HARDWARE", "ModelSpec",
    "Hardware", "written_out", "activation_bytes_per_layer", "bubble_fraction", "collective_bytes_per_rank",
    "collective_time", "flops_per_token", "in_flight_microbatches", "model_dims",
    "param_breakdown", "param_count", "training_flops", "zero_memory_bytes",
]
