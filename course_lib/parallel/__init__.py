"""Parallelism from scratch, one file per dimension, each checked against one device.

    mesh           Mesh: named dimensions (dp, pp, cp, tp, ep), one Comm per group
    grad_sync      GradSync: gradients summed over their reduce dims, in buckets (start / finish, hooks)
    data_parallel  DDP: replicate, average gradients (textbook loop, bucketed, overlapped)
    zero           ShardedOptimizer: ZeRO-1 (optimizer state) and ZeRO-2 (+ gradients)
    fsdp           FSDP: ZeRO-3 (+ parameters), per-unit all-gather / reduce-scatter
"""
from course_lib.parallel.data_parallel import DDP, average_gradients
from course_lib.parallel.fsdp import FSDP
from course_lib.parallel.grad_sync import GradSync, OverlappedGradSync
from course_lib.parallel.zero import ShardedOptimizer

__all__ = ["DDP", "average_gradients", "GradSync", "OverlappedGradSync", "ShardedOptimizer", "FSDP"]
