"""What a schedule is made of: an :class:`Action` (op, virtual stage, micro-batch), the
rank that holds each virtual stage (:func:`stage_rank`), the remote action an action waits
for (:func:`dependency`), the one validator of counts (:func:`positive_int`), and a schedule
printed one line per rank (:func:`format_schedule`)."""
from __future__ import annotations

from typing import NamedTuple

OPS = ("F", "B", "W")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v")
V_SCHEDULES = ("zb-v", "dualpipe-v")         # two chunks per rank in V order (:func:`stage_rank`)
PLANNED = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v")   # the planner prices (formulas.SCHEDULES)
PLACEMENTS = ("loop", "v")


def stage_rank(stage: int, p: int, placement: str = "loop") -> int:
    """The pp rank that runs virtual stage ``stage`` of p * v. "loop" (Megatron-LM's interleaved:
    chunk stage // p of rank stage % p); "v" (ZB-V, DualPipeV: two chunks per rank, rank r holds
    stages r and 2p - 1 - r, so the first and the last stage sit on rank 0 and the turn of the V,
    stages p - 1 and p, on rank p - 1: that hand-over is no message)."""
    if placement == "v":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


def rank_stage_ids(rank: int, p: int, v: int = 1, placement: str = "loop") -> list[int]:
    """The virtual stages of pp rank ``rank``, in order (:func:`stage_rank`)."""
    return [s for s in range(p * v) if stage_rank(s, p, placement) == rank]


class Action(NamedTuple):
    op: str      # "F", "B" or "W"
    stage: int   # virtual stage: rank stage % p, chunk stage // p
    mb: int      # micro-batch

    def __str__(self):
        return f"{self.op}{self.mb}" + (f"@{self.stage}" if self.stage else "")


def positive_int(name: str, value) -> int:
    """``value`` if it is an integer >= 1 (not a bool), else a ValueError naming ``name``: the
    one validator of counts (stages, micro-batches, mesh dimensions) in the course."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_shape(p, m, v=1):
    """p stages, m micro-batches and v chunks per rank: each an integer >= 1 (ValueError)."""
    for name, val in (("p (pipeline stages)", p), ("m (micro-batches)", m), ("v (chunks per rank)", v)):
        positive_int(name, val)


def dependency(a: Action, p: int, v: int):
    """The remote action whose message ``a`` receives first (None: nothing to receive)."""
    if a.op == "F" and a.stage > 0:
        return Action("F", a.stage - 1, a.mb)
    if a.op == "B" and a.stage < p * v - 1:
        return Action("B", a.stage + 1, a.mb)
    return None


def reduce_points(actions) -> dict:
    """Where one rank's gradient sums are complete, for sharded data parallelism to reduce
    them: {action: (round_end, last)} over the actions that complete a micro-batch's weight
    gradients (a B, or its W where the list splits one off), in the rank's order. ``last``:
    its stage's last (torch's pipelining schedules its REDUCE_GRAD there: ``grad_reduce=
    "chunk"``); ``round_end``: the next such action is another stage's, the end of a round of
    backwards through the stage (N of them in the interleaved order: ``grad_reduce="round"``)."""
    split = {(s, mb) for op, s, mb in actions if op == "W"}
    done = [Action(op, s, mb) for op, s, mb in actions if op == "W" or (op == "B" and (s, mb) not in split)]
    last = {a.stage: k for k, a in enumerate(done)}
    return {a: (k == len(done) - 1 or done[k + 1].stage != a.stage, last[a.stage] == k)
            for k, a in enumerate(done)}


def format_schedule(schedule, width: int = 0) -> str:
    """One line per rank: ``rank 0: F0 F1 B0 ...`` (``@s``: virtual stage s > 0)."""
    rows = [f"rank {r}: " + " ".join(str(Action(*a)) for a in row) for r, row in enumerate(schedule)]
    return "\n".join(rows)


__all__ = ["OPS", "SCHEDULES", "V_SCHEDULES", "PLANNED", "PLACEMENTS", "stage_rank", "rank_stage_ids", "Action",
           "positive_int", "check_shape", "dependency", "format_schedule"]
