"""Where one rank's step goes, read from a dry run's spans (:func:`course_lib.virtual.dry_run`).

    parts = step_breakdown(r.spans, rank=0)    # {"compute": s, "exposed TP": s, ...}

Virtual seconds of the step [first span start, last span end] on ``rank``, cut into parts
that sum to the step: time under a TP collective ("exposed TP": Megatron's SP collectives sit on
the compute path), the rest of the compute spans ("compute"), DP collectives outside the
compute spans ("DP all-reduce"), the time before the last compute span in none of these
("pipeline bubble": idle, or waiting on a pipeline message), and the rest after the last
compute span of any rank ("optimizer and syncs": the optimizer step and the small syncs after the
schedule, which the dry run does not mark as compute).
"""
from __future__ import annotations

LOSSES = ("compute", "exposed TP", "pipeline bubble", "DP all-reduce", "optimizer and syncs")


def _union(intervals) -> list:
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _minus(intervals, cut) -> list:
    """``intervals`` (a union) less the union ``cut``."""
    out = []
    for a, b in intervals:
        pieces = [[a, b]]
        for c, d in cut:
            nxt = []
            for x, y in pieces:
                if d <= x or c >= y:
                    nxt.append([x, y])
                    continue
                if c > x:
                    nxt.append([x, c])
                if d < y:
                    nxt.append([d, y])
            pieces = nxt
        out += pieces
    return out


def step_breakdown(spans, rank: int, step_end: float | None = None) -> dict:
    """{part: virtual seconds} of ``rank``'s step (parts in :data:`LOSSES`), summing to it
    (``tests/test_viz_dry_run.py``). ``step_end``: where the step ends if later than the last
    span (a dry run's ``step_time``: its optimizer kernels carry no span)."""
    mine = [s for s in spans if s.rank == rank]
    if not mine:
        raise ValueError(f"no span of rank {rank} (ranks: {sorted({s.rank for s in spans})})")
    t0, t1 = min(s.start for s in mine), max(s.end for s in mine)
    t1 = t1 if step_end is None else max(t1, step_end)
    # a gradient sum is data parallelism's whatever else its group spans (the SP norms' over dp x
    # tp, the experts' over their replicas, "edp" across tp): TP's are the collectives over tp alone
    sums = [s for s in mine if s.kind == "comm" and {"dp", "edp"} & set(s.dim.split("+"))]
    tp = _union((s.start, s.end) for s in mine if s.kind == "comm" and "tp" in s.dim.split("+")
                and not {"dp", "edp"} & set(s.dim.split("+")))
    compute = _minus(_union((s.start, s.end) for s in mine if s.kind == "compute"), tp)
    dp = _minus(_union((s.start, s.end) for s in sums), _union([*tp, *compute]))
    # the schedule's last op on any rank: a stage done early waits for the drain (the bubble)
    end = min(t1, max((s.end for s in spans if s.kind == "compute"), default=t0))
    before = [[a, min(b, end)] for a, b in _union([*tp, *compute, *dp]) if a < end]
    after = _minus([[end, t1]], _union([*tp, *dp]))
    return {"compute": _length(compute), "exposed TP": _length(tp), "pipeline bubble": (end - t0) - _length(before),
            "DP all-reduce": _length(dp), "optimizer and syncs": _length(after)}


def largest_loss(parts: dict) -> str:
    """The part other than compute that takes the most time."""
    return max((k for k in parts if k != "compute"), key=lambda k: parts[k])


__all__ = ["step_breakdown", "largest_loss", "LOSSES"]
