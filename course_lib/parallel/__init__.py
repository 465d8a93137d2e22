"""Parallelism from scratch, one file per dimension, each checked against one device.

    data_parallel  DDP: replicate, average gradients (per parameter, bucketed, overlapped)
    zero           ShardedOptimizer: ZeRO-1 (optimizer state) and ZeRO-2 (+ gradients)
    fsdp           FSDP: ZeRO-3 (+ parameters), per-unit all-gather / reduce-scatter
"""
from course_lib.parallel.data_parallel import DDP, Collectives
from course_lib.parallel.fsdp import FSDP
from course_lib.parallel.zero import ShardedOptimizer

__all__ = ["DDP", "Collectives", "ShardedOptimizer", "FSDP"]
