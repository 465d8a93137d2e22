"""The classic schedules, built from Megatron-LM's per-stage order (:func:`schedule_order`):
GPipe, 1F1B (PipeDream-Flush) and interleaved 1F1B (v chunks per rank)."""
from __future__ import annotations

from course_lib.schedules.actions import V_SCHEDULES, Action, check_shape, positive_int


def microbatch_group(p: int, m: int, group: int | None = None) -> int:
    """How many micro-batches interleaved 1F1B runs through one chunk before the next chunk:
    N, Megatron-LM's ``microbatch_group_size_per_vp_stage``, Llama 3's "N" (Dubey et al. 2024,
    Sec. 3.3.2, Fig. 6). Default: torch's rule (``ScheduleInterleaved1F1B`` since torch 2.6; 2.5's
    ``ScheduleFlexibleInterleaved1F1B``, pytorch#129597): the
    micro-batches cut into max(1, m // p) rounds of N = m / rounds each, so N = p when m is a
    multiple of p (Narayanan et al. 2021's order) and m need not be. ``group``: N chosen, a
    divisor of m of at least min(p, m) (N = m: breadth-first, every micro-batch through a chunk
    before the next chunk). A ValueError names the rule broken."""
    positive_int("m", m)
    if group is None:
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(f"interleaved 1F1B runs m micro-batches in max(1, m // p) = {rounds} rounds of "
                             f"equal size (torch's ScheduleInterleaved1F1B): m = {m} is not a multiple of "
                             f"{rounds} (p = {p}): take m < 2p or a multiple of {rounds}")
        return m // rounds
    group = positive_int("group", group)
    if m % group:
        raise ValueError(f"the micro-batch group N = {group} must divide m = {m}: every round runs N "
                         f"micro-batches through each chunk")
    if group < min(p, m):
        raise ValueError(f"the micro-batch group N = {group} is below min(p, m) = {min(p, m)}: rank 0 would "
                         f"wait p - N = {p - group} steps for its own micro-batch to come round the ring")
    return group


def schedule_order(p: int, m: int, schedule: str, v: int, stage: int,
                   group: int | None = None) -> list[tuple[str, int, int]]:
    """The (phase, micro-batch, chunk) order one stage runs: Megatron-LM's schedules, and
    torch's for interleaving (the same orders where m is a multiple of p).

    GPipe: all forwards, then all backwards. 1F1B: p - stage - 1 warm-up forwards,
    then one forward / one backward, then the remaining backwards (Narayanan et al.
    2021). Interleaved: the same with (p - stage - 1) * 2 + (v - 1) * N warm-up
    forwards over m * v chunk-micro-batches, taken N micro-batches per chunk
    (:func:`microbatch_group`: N = p where p divides m).
    """
    if schedule in V_SCHEDULES:
        raise ValueError(f"schedule_order gives Megatron-LM's orders; {schedule!r} is an action list: "
                         f"make_schedule({schedule!r}, p, m)")
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    total = m * v
    if schedule == "interleaved" and v > 1:
        n = microbatch_group(p, m, group)
        warmup = min((p - stage - 1) * 2 + (v - 1) * n, total)

        def fwd(k):
            return ("F", (k // (n * v)) * n + k % n, (k // n) % v)

        def bwd(k):
            return ("B", (k // (n * v)) * n + k % n, v - 1 - (k // n) % v)
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


def _from_order(p, m, name, v=1, group=None):
    """The Megatron-LM order of the planner's simulator, per rank, as Actions."""
    return [[Action(ph, ch * p + r, mb) for ph, mb, ch in schedule_order(p, m, name, v, r, group)]
            for r in range(p)]


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


def interleaved_1f1b(p: int, m: int, v: int = 2, group: int | None = None):
    """Interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2): v chunks per rank, micro-batches
    taken N at a time per chunk (:func:`microbatch_group`: p where p divides m, as Megatron-LM;
    otherwise torch's rounds, so m = 10 on p = 4 runs N = 5, Llama 3's Figure 6). Rank 0 holds
    2 (p - 1) + (v - 1) N chunk forwards before its first backward: a larger N holds more."""
    check_shape(p, m, v)
    if v > 1:
        microbatch_group(p, m, group)
    return _from_order(p, m, "interleaved", v, group)


__all__ = ["microbatch_group", "schedule_order", "gpipe", "one_f_one_b", "interleaved_1f1b"]
