"""The schedules that split a backward into B (input gradient) and W (weight gradient) and
run the W passes in the bubbles: ZB-H1 (one stage per rank), and the V schedules ZB-V and
DualPipeV (two chunks per rank in V order, :func:`~course_lib.schedules.actions.stage_rank`)."""
from __future__ import annotations

from course_lib.schedules.actions import Action, check_shape, dependency
from course_lib.schedules.classic import one_f_one_b


def zero_bubble_h1(p: int, m: int):
    """ZB-H1 (Qi et al. 2023): 1F1B's forwards and input-gradient backwards B, in 1F1B
    order; each weight-gradient pass W runs where the rank would otherwise wait for a
    message, or before a forward that would hold more micro-batches than 1F1B does
    (p - r on rank r: the same peak memory), and the rest at the end. Built by running
    that rule on a clock with t_f = t_b = t_w = 1 (F, B, W of equal length)."""
    check_shape(p, m)
    base = one_f_one_b(p, m)
    out = [[] for _ in range(p)]
    pending = [[] for _ in range(p)]       # B done, W not yet
    pc, clock, live, done = [0] * p, [0] * p, [0] * p, {}
    while any(pc[r] < len(base[r]) for r in range(p)):
        best = None                        # (time, rank, what): the earliest next event
        for r in range(p):
            if pc[r] == len(base[r]):
                continue
            a = base[r][pc[r]]
            dep = dependency(a, p, 1)
            ready = 0 if dep is None else done.get(dep)
            allowed = a.op != "F" or live[r] < p
            if ready is not None and ready <= clock[r] and allowed:
                event = (clock[r], r, a)
            elif pending[r]:
                event = (clock[r], r, "W")
            elif ready is not None and allowed:
                event = (ready, r, a)
            else:
                continue                   # blocked on a message not sent yet
            best = min(best, event) if best else event
        t, r, a = best
        if a == "W":
            a = pending[r].pop(0)
        elif a.op == "B":
            pending[r].append(Action("W", a.stage, a.mb))
        live[r] += {"F": 1, "W": -1}.get(a.op, 0)
        clock[r] = done[a] = t + 1
        out[r].append(a)
        pc[r] += a.op != "W"
    for r in range(p):
        out[r] += pending[r]
    return out


def _v_counter(row):
    """(add, counts): add(op, stage) appends ``op`` of the next micro-batch of ``stage`` to ``row``
    and returns that micro-batch (each (op, stage) counts its own: the chunk's next F, B or W)."""
    count = {}

    def add(op, stage):
        mb = count.get((op, stage), 0)
        count[(op, stage)] = mb + 1
        row.append(Action(op, stage, mb))
        return mb
    return add, count


def zero_bubble_v(p: int, m: int):
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 6; torch's
    ``ScheduleZBVZeroBubble``, the same order): two chunks per rank in V order, rank r holds
    stages r and 2p - 1 - r (:func:`stage_rank`). Rank r warms up with 2(p - r) - 1 forwards
    of its first chunk, then r pairs (second chunk, first chunk), then p - r times F B W of its
    second chunk; the steady state runs F B W of the first chunk then of the second; the
    cool-down the input gradients B first and the W passes last. Every backward is split (a W
    per B). Built for max(m, 2p - 1) micro-batches and the ones >= m dropped, as torch does:
    any m >= 1 runs (with m < 2p - 1 the pipeline never fills)."""
    check_shape(p, m)
    n, out = max(2 * p - 1, m), []
    for r in range(p):
        c0, c1, row = r, 2 * p - 1 - r, []
        add, k = _v_counter(row)
        for _ in range(2 * (p - r) - 1):
            add("F", c0)
        for _ in range(r):
            add("F", c1), add("F", c0)
        for _ in range(p - r):
            add("F", c1), add("B", c1), add("W", c1)
        while k.get(("F", c1), 0) < k.get(("F", c0), 0) or k.get(("F", c0), 0) < n:
            if k.get(("F", c0), 0) < n:
                add("F", c0)
            add("B", c0), add("W", c0), add("F", c1), add("B", c1), add("W", c1)
        for _ in range(r):
            add("B", c0), add("B", c1)
        for _ in range(p - r):
            add("B", c0), add("W", c0)
        while k[("W", c1)] < k[("B", c1)]:
            add("W", c1)
        while k[("W", c0)] < k[("B", c0)]:
            add("W", c0)
        out.append([a for a in row if a.mb < m])
    return out


def dualpipe_v(p: int, m: int):
    """DualPipeV (DeepSeek-AI 2024, DeepSeek-V3 technical report Sec. 3.2.1, DualPipe cut in
    half into a V; DeepSeek's ``DualPipeV`` and torch's ``ScheduleDualPipeV``, the same order):
    two chunks per rank in V order. Rank r: 2(p - r - 1) forwards of its first chunk, r + 1
    pairs of forwards, p - r - 1 times (B, W, F) of its second chunk; then the main phase, where
    a forward of one chunk and the full backward of the other (another micro-batch) run as a
    pair: DualPipe overlaps the pair's compute with the other's communication (its MoE
    all-to-all), here they run one after the other (F, then B), as torch's runtime does by
    default (the runner's ``overlap_fb=True`` prices each pair overlapped on the virtual
    clock: ``course_lib.virtual.overlap``); the cool-down splits half of the backwards (B now, W into the bubbles). Needs
    m >= 2p micro-batches (ValueError otherwise, as DeepSeek's and torch's)."""
    check_shape(p, m)
    if m < 2 * p:
        raise ValueError(f"dualpipe-v needs at least 2p = {2 * p} micro-batches (two chunks on each of "
                         f"p={p} ranks, as DeepSeek's DualPipeV and torch's ScheduleDualPipeV): got m={m}")
    out = []
    for r in range(p):
        c0, c1, row, weights = r, 2 * p - 1 - r, [], []
        add, _ = _v_counter(row)

        def split_b(stage):                  # B now, its W queued for a bubble
            weights.append(Action("W", stage, add("B", stage)))

        def w():
            if weights:
                row.append(weights.pop(0))
        for _ in range(2 * (p - r - 1)):
            add("F", c0)
        for _ in range(r + 1):
            add("F", c0), add("F", c1)
        for _ in range(p - r - 1):
            split_b(c1), w(), add("F", c1)
        for _ in range(m - 2 * p + r + 1):    # the overlapped pairs (F of one chunk, B of the other)
            add("F", c0), add("B", c1), add("F", c1), add("B", c0)
        for _ in range(p - r - 1):
            add("B", c1), add("F", c1), add("B", c0)
        zb = False
        for i in range(r + 1):
            zb = zb or (i == (r + 1) // 2 and r % 2 == 1)
            split_b(c1) if zb else add("B", c1)
            zb = zb or (i == (r + 1) // 2 and r % 2 == 0)
            split_b(c0) if zb else add("B", c0)
        for _ in range(p - r - 1):
            w()
            split_b(c0) if zb else add("B", c0)
        while weights:
            w()
        out.append(row)
    return out


__all__ = ["zero_bubble_h1", "zero_bubble_v", "dualpipe_v"]
