"""The classic schedules, built from Megatron-LM's per-stage order (:func:`schedule_order`):
GPipe, 1F1B (PipeDream-Flush) and interleaved 1F1B (v chunks per rank)."""
from __future__ import annotations

from course_lib.schedules.actions import V_SCHEDULES, Action, check_shape


def schedule_order(p: int, m: int, schedule: str, v: int, stage: int) -> list[tuple[str, int, int]]:
    """The (phase, micro-batch, chunk) order one stage runs: Megatron-LM's schedules.

    GPipe: all forwards, then all backwards. 1F1B: p - stage - 1 warm-up forwards,
    then one forward / one backward, then the remaining backwards (Narayanan et al.
    2021). Interleaved: the same with (p - stage - 1) * 2 + (v - 1) * p warm-up
    forwards over m * v chunk-micro-batches, taken p micro-batches per chunk.
    """
    if schedule in V_SCHEDULES:
        raise ValueError(f"schedule_order gives Megatron-LM's orders; {schedule!r} is an action list: "
                         f"make_schedule({schedule!r}, p, m)")
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    total = m * v
    if schedule == "interleaved" and v > 1:
        warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)

        def fwd(k):
            return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

        def bwd(k):
            return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)
    else:
        warmup = min(p - stage - 1, total)

        def fwd(k):
            return ("F", k, 0)

        def bwd(k):
            return ("B", k, 0)
    order = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [fwd(warmup + i), bwd(i)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


def _from_order(p, m, name, v=1):
    """The Megatron-LM order of the planner's simulator, per rank, as Actions."""
    return [[Action(ph, ch * p + r, mb) for ph, mb, ch in schedule_order(p, m, name, v, r)] for r in range(p)]


def gpipe(p: int, m: int):
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards (m micro-batches held)."""
    check_shape(p, m)
    return _from_order(p, m, "gpipe")


def one_f_one_b(p: int, m: int):
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): rank r warms up with min(p - r - 1, m)
    forwards, then alternates one forward and one backward, then cools down with the
    remaining backwards; it never holds more than p - r micro-batches."""
    check_shape(p, m)
    return _from_order(p, m, "1f1b")


def interleaved_1f1b(p: int, m: int, v: int = 2):
    """Interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2): v chunks per rank, micro-batches
    taken p at a time per chunk; needs m to be a multiple of p (as Megatron-LM)."""
    check_shape(p, m, v)
    if v > 1 and m % p:
        raise ValueError(f"interleaved 1F1B takes micro-batches p={p} at a time: m={m} must be a multiple of p")
    return _from_order(p, m, "interleaved", v)


__all__ = ["schedule_order", "gpipe", "one_f_one_b", "interleaved_1f1b"]
