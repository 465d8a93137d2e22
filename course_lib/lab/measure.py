"""Timing gloo's collectives over sizes and world sizes: the ranks started from outside.

    rows = sweep_builtin([4 << 10, 1 << 20], [2, 4], rounds=3)   # [costmodel.Measurement]

What runs inside each rank (``measure_builtin``, ``time_ops``, ``realtime_priority``) is the
library's, in ``course_lib.collectives.measure``; this module only launches it.
"""
from __future__ import annotations

from course_lib.collectives.measure import fastest, measure_builtin, realtime_priority, stat_of
from course_lib.launch import launch


def _sweep_rank(sizes, collectives, reps, warmup, stat, realtime):
    with realtime_priority(realtime):
        return measure_builtin(sizes, collectives, reps, warmup, stat=stat)


def sweep_builtin(sizes, world_sizes, collectives=("all_reduce",), rounds: int = 3, reps: int = 5,
                  warmup: int = 2, stat: str = "min", realtime: bool = False, timeout: float = 900.0):
    """Outside ranks: Measurement rows of gloo's collectives for every size and world size.

    Each round launches every world size once (one thread per rank); a point's time is
    ``stat`` ("min" or "median") of its ``reps``, then the fastest of the ``rounds``
    (:func:`fastest`). ``realtime``: the ranks run under :func:`realtime_priority`, where
    the OS permits it (check first with ``with realtime_priority() as permitted``).
    """
    stat_of(stat)
    if rounds < 1 or reps < 1:
        raise ValueError(f"rounds and reps must be >= 1, got rounds={rounds}, reps={reps}")
    rows = []
    for _ in range(rounds):
        for N in world_sizes:
            rows += launch(_sweep_rank, N, list(sizes), tuple(collectives), reps, warmup, stat, realtime,
                           threads=1, quiet=True, timeout=timeout)[0]
    return fastest(rows)


__all__ = ["sweep_builtin"]
