"""Cluster-scale planning: the memory, time and MFU of an N-D parallel layout.

``formulas`` holds every formula as one small function (parameter count, FLOPs,
activation memory, ZeRO, bubble, communication); the rest of the package builds
on it.
"""
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

__all__ = [
    "activation_bytes_per_layer", "bubble_fraction", "collective_bytes_per_rank",
    "collective_time", "flops_per_token", "in_flight_microbatches", "model_dims",
    "param_breakdown", "param_count", "training_flops", "zero_memory_bytes",
]
