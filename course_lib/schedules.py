"""A pipeline schedule as data: per rank, the list of actions it runs, in order.

Below both ``parallel/`` (which runs schedules) and ``planner/`` (which prices them): it
imports neither.

    sched = one_f_one_b(p=4, m=8)          # [[Action('F', 0, 0), ...], ...]: one list per rank
    validate(sched, p=4, m=8)              # ValueError naming the first bad action, never a hang
    print(format_schedule(sched))          # rank 0: F0 F1 F2 F3 B0 F4 B1 ...
    spans = simulate(sched, p=4)           # unit-time timeline (t_f=1, t_b=2), as trace Spans

An action is ``(op, stage, mb)``: op ``F`` (forward), ``B`` (backward) or ``W`` (the weight
gradient, split off the backward: Qi et al. 2023's zero-bubble notation; a ``B`` whose
``W`` appears in the schedule computes the input gradient only). ``stage`` is the
*virtual* stage 0 .. p*v - 1: with v chunks per rank, stage s lives on rank s % p
(Megatron-LM's interleaved placement: chunk s // p of rank s % p). ``mb`` is the
micro-batch. Between ranks flow activations (after F of stage s, to F of stage s + 1) and
input gradients (after B of stage s, to B of stage s - 1): a receive blocks, a send does
not (it is posted and waited at the end of the step), so a schedule deadlocks exactly when
the simulation below finds every unfinished rank waiting on a receive.
"""
from __future__ import annotations

from typing import NamedTuple

from course_lib.trace import Span

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


def positive_int(name: str, value) -> int:
    """``value`` if it is an integer >= 1 (not a bool), else a ValueError naming ``name``: the
    one validator of counts (stages, micro-batches, mesh dimensions) in the course."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _check_shape(p, m, v=1):
    for name, val in (("p (pipeline stages)", p), ("m (micro-batches)", m), ("v (chunks per rank)", v)):
        positive_int(name, val)


def _from_order(p, m, name, v=1):
    """The Megatron-LM order of the planner's simulator, per rank, as Actions."""
    return [[Action(ph, ch * p + r, mb) for ph, mb, ch in schedule_order(p, m, name, v, r)] for r in range(p)]


def gpipe(p: int, m: int):
    """GPipe (Huang et al. 2019): all m forwards, then all m backwards (m micro-batches held)."""
    _check_shape(p, m)
    return _from_order(p, m, "gpipe")


def one_f_one_b(p: int, m: int):
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): rank r warms up with min(p - r - 1, m)
    forwards, then alternates one forward and one backward, then cools down with the
    remaining backwards; it never holds more than p - r micro-batches."""
    _check_shape(p, m)
    return _from_order(p, m, "1f1b")


def interleaved_1f1b(p: int, m: int, v: int = 2):
    """Interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2): v chunks per rank, micro-batches
    taken p at a time per chunk; needs m to be a multiple of p (as Megatron-LM)."""
    _check_shape(p, m, v)
    if v > 1 and m % p:
        raise ValueError(f"interleaved 1F1B takes micro-batches p={p} at a time: m={m} must be a multiple of p")
    return _from_order(p, m, "interleaved", v)


def zero_bubble_h1(p: int, m: int):
    """ZB-H1 (Qi et al. 2023): 1F1B's forwards and input-gradient backwards B, in 1F1B
    order; each weight-gradient pass W runs where the rank would otherwise wait for a
    message, or before a forward that would hold more micro-batches than 1F1B does
    (p - r on rank r: the same peak memory), and the rest at the end. Built by running
    that rule on a clock with t_f = t_b = t_w = 1 (F, B, W of equal length)."""
    _check_shape(p, m)
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
    _check_shape(p, m)
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
    _check_shape(p, m)
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


# Other spellings of the same schedules, compared case-insensitively: torch.distributed.pipelining's
# names (``get_schedule_class`` and the class names). Not torch's "InterleavedZeroBubble": with one
# stage per rank it places the W passes differently when m < p, and with v > 1 it is another schedule.
SCHEDULE_ALIASES = {"gpipe": "gpipe", "schedulegpipe": "gpipe", "1f1b": "1f1b", "schedule1f1b": "1f1b",
                    "interleaved": "interleaved", "interleaved1f1b": "interleaved",
                    "scheduleinterleaved1f1b": "interleaved", "zb-h1": "zb-h1", "zero-bubble": "zb-h1",
                    "zb-v": "zb-v", "zbvzerobubble": "zb-v", "schedulezbvzerobubble": "zb-v",
                    "dualpipe-v": "dualpipe-v", "dualpipev": "dualpipe-v", "scheduledualpipev": "dualpipe-v"}


def schedule_name(name, v: int = 1) -> str:
    """The course's name (one of SCHEDULES) for ``name``, in any case or in torch's spelling
    ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"). ValueError for an unknown
    name, and for v > 1 chunks per rank with a schedule that runs one (only "interleaved" takes
    v; the V schedules run two, v = 1 or 2 both meaning their own two)."""
    canon = SCHEDULE_ALIASES.get(name.lower()) if isinstance(name, str) else None
    if canon is None:
        raise ValueError(f"schedule must be one of {SCHEDULES} (or torch's GPipe, 1F1B, Interleaved1F1B, "
                         f"ZBVZeroBubble, DualPipeV), got {name!r}")
    if canon in V_SCHEDULES and v not in (1, 2):
        raise ValueError(f"{name!r} runs two chunks per rank in V order: v must be 2 (or 1, its default), got {v!r}")
    if canon not in V_SCHEDULES and canon != "interleaved" and v != 1:
        raise ValueError(f"v={v!r} chunks per rank needs the interleaved schedule; {name!r} runs one stage per rank")
    return canon


def chunks(schedule, v: int = 1) -> int:
    """Model chunks per rank the schedule runs: 2 for the V schedules, ``v`` otherwise."""
    return 2 if isinstance(schedule, str) and schedule_name(schedule, v) in V_SCHEDULES else v


def placement_of(schedule, p: int = 1, v: int = 1) -> str:
    """Where a schedule puts its stages (:data:`PLACEMENTS`): "v" for the V schedules' names and
    for an action list that runs stage p on rank p - 1; "loop" otherwise."""
    if isinstance(schedule, str):
        return "v" if schedule_name(schedule, v) in V_SCHEDULES else "loop"
    if isinstance(schedule, ValidSchedule):
        return schedule.placement
    return _normalise(schedule, p, 1 + max((a[2] for row in schedule for a in row), default=0), v)[1]


def make_schedule(name: str, p: int, m: int, v: int = 1):
    """One of SCHEDULES by name (:func:`schedule_name`; ``v`` > 1 only for "interleaved")."""
    name = schedule_name(name, v)
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1, "zb-v": zero_bubble_v,
                "dualpipe-v": dualpipe_v}
    return interleaved_1f1b(p, m, v) if name == "interleaved" else builders[name](p, m)


def dependency(a: Action, p: int, v: int):
    """The remote action whose message ``a`` receives first (None: nothing to receive)."""
    if a.op == "F" and a.stage > 0:
        return Action("F", a.stage - 1, a.mb)
    if a.op == "B" and a.stage < p * v - 1:
        return Action("B", a.stage + 1, a.mb)
    return None


def _normalise(schedule, p, m, v):
    _check_shape(p, m, v)
    if not isinstance(schedule, (list, tuple)) or len(schedule) != p:
        n = len(schedule) if isinstance(schedule, (list, tuple)) else type(schedule).__name__
        raise ValueError(f"a schedule is one list of actions per rank: expected {p} lists, got {n}")
    out = []
    for r, actions in enumerate(schedule):
        if not isinstance(actions, (list, tuple)):
            raise ValueError(f"rank {r}: expected a list of (op, stage, mb) actions, got {type(actions).__name__}")
        row = []
        for i, a in enumerate(actions):
            try:
                op, stage, mb = a
            except (TypeError, ValueError):
                raise ValueError(f"rank {r}, action {i}: {a!r} is not an (op, stage, mb) triple") from None
            if op not in OPS:
                raise ValueError(f"rank {r}, action {i}: op {op!r} is not one of {OPS}")
            for what, val, n in (("stage", stage, p * v), ("micro-batch", mb, m)):
                if isinstance(val, bool) or not isinstance(val, int) or not 0 <= val < n:
                    raise ValueError(f"rank {r}, action {i} {a!r}: {what} {val!r} is outside 0..{n - 1}")
            row.append(Action(op, stage, mb))
        out.append(row)
    return out, _placement(out, p, v)


def _placement(rows, p, v):
    """The placement every action agrees with: "loop", else "v" (v = 2); a ValueError naming the
    first action on a rank that does not hold its stage."""
    for placement in PLACEMENTS if v == 2 else ("loop",):
        if all(stage_rank(a.stage, p, placement) == r for r, row in enumerate(rows) for a in row):
            return placement
    for r, row in enumerate(rows):
        for i, a in enumerate(row):
            if a.stage % p != r:
                v_rank = f" (V order, v=2: {stage_rank(a.stage, p, 'v')})" if v == 2 else ""
                raise ValueError(f"rank {r}, action {i} {a}: stage {a.stage} lives on rank {a.stage % p}"
                                 f"{v_rank}, not {r}")


class ValidSchedule(list):
    """What :func:`validate` returns: the lists of :class:`Action`, checked for (p, m, v)."""

    def __init__(self, rows, p, m, v, placement="loop"):
        super().__init__(rows)
        self.placement = placement            # where its stages live (:func:`stage_rank`)
        self.checked = (p, m, v), tuple(map(tuple, rows))

    def checked_for(self, p, m, v) -> bool:
        """Checked for (p, m, v), and not changed since."""
        return self.checked == ((p, m, v), tuple(map(tuple, self)))


def validate(schedule, p: int, m: int, v: int = 1):
    """Check a schedule before anything runs; return it as lists of :class:`Action`.

    Every (stage, mb) has one F and one B, at most one W; on its rank F comes before B and
    B before W; every receive has its send (they are implied by the data flow); and the
    ranks, each running its list in order with blocking receives, all finish (a simulation
    of the point-to-point dependency graph). Each rank runs only the stages it holds: "loop"
    placement, or (v = 2) "v" placement (:func:`stage_rank`), read from the lists themselves and
    kept as ``.placement``. Raises ValueError naming the first bad action.
    What it returns is checked once: validated again for the same (p, m, v), unchanged, it
    is returned as is (``check_layout`` checks a list before any rank starts, the ranks run it).
    """
    if isinstance(schedule, ValidSchedule) and schedule.checked_for(p, m, v):
        return schedule
    sched, placement = _normalise(schedule, p, m, v)
    for r, actions in enumerate(sched):
        seen = {}
        for i, a in enumerate(actions):
            if a in seen:
                raise ValueError(f"rank {r}, action {i} {a}: runs twice (first at action {seen[a]})")
            seen[a] = i
            before = {"B": "F", "W": "B"}.get(a.op)
            if before and Action(before, a.stage, a.mb) not in seen:
                raise ValueError(f"rank {r}, action {i} {a}: {a.op} of stage {a.stage}, micro-batch {a.mb} "
                                 f"comes before its {before}")
        for s in rank_stage_ids(r, p, v, placement):
            for mb in range(m):
                for op in ("F", "B"):
                    if Action(op, s, mb) not in seen:
                        raise ValueError(f"rank {r}: {op} of stage {s}, micro-batch {mb} is missing")
    sched = ValidSchedule(sched, p, m, v, placement)
    simulate(sched, p, v)
    return sched


def simulate(schedule, p: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0, t_w: float = 1.0,
             t_comm: float = 0.0, durations: dict | None = None, t_overhead: float = 0.0) -> list[Span]:
    """Run the action lists on a virtual clock: F takes t_f, a full backward t_b, a split
    one t_b - t_w (its W t_w), a message t_comm (from the end of the sender's action to the
    start of the receiver's), and every action costs its rank t_overhead more after it
    (posting its send, Python: time that is neither compute nor waiting); ``durations``
    {action name ("F3@1"): time} overrides the compute times action by action (a measured
    trace replayed; with t_comm = t_overhead = 0, on free messages).
    Returns compute Spans (name "F3@1"...) and ``idle`` spans, rank by rank. Raises
    ValueError when the ranks deadlock."""
    schedule = validate(schedule, p, 1 + max((a[2] for row in schedule for a in row), default=0), v)
    split = {(a.stage, a.mb) for row in schedule for a in row if a.op == "W"}
    pc, clock, done, spans = [0] * p, [0.0] * p, {}, []
    while True:
        progressed = False
        for r in range(p):
            while pc[r] < len(schedule[r]):
                a = schedule[r][pc[r]]
                dep = dependency(a, p, v)
                if dep is not None and dep not in done:
                    break
                remote = dep is not None and stage_rank(dep.stage, p, schedule.placement) != r
                start = max(clock[r], done[dep] + t_comm * remote if dep is not None else 0.0)
                if start > clock[r]:
                    spans.append(Span(r, "idle", "idle", clock[r], start, "pp"))
                dur = t_f if a.op == "F" else t_w if a.op == "W" else t_b - t_w if (a.stage, a.mb) in split else t_b
                dur = durations.get(str(a), dur) if durations else dur
                done[a] = start + dur
                spans.append(Span(r, str(a), "compute", start, done[a], "pp"))
                clock[r] = done[a] + t_overhead
                if t_overhead:
                    spans.append(Span(r, "overhead", "other", done[a], clock[r], "pp"))
                pc[r] += 1
                progressed = True
        if all(pc[r] == len(schedule[r]) for r in range(p)):
            return spans
        if not progressed:
            stuck = [(r, schedule[r][pc[r]]) for r in range(p) if pc[r] < len(schedule[r])]
            r, a = stuck[0]
            dep = dependency(a, p, v)
            waits = "; ".join(f"rank {q} at {b}" for q, b in stuck)
            raise ValueError(f"deadlock: rank {r}, action {pc[r]} {a} waits for {dep} from rank "
                             f"{stage_rank(dep.stage, p, schedule.placement)}, "
                             f"which never runs it (stuck: {waits})")


def bubble(spans, rank=None):
    """Idle fraction of the step (first start to last end over all ranks) of ``rank``'s
    compute spans; the mean over ranks if ``rank`` is None. (Narayanan's (p-1)/m is idle
    time relative to the IDEAL compute time instead: (p-1)/(m+p-1) = x / (1 + x).)"""
    spans = [s for s in spans if s.kind == "compute"]
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    ranks = sorted({s.rank for s in spans}) if rank is None else [rank]
    fr = [1.0 - sum(s.end - s.start for s in spans if s.rank == r) / (t1 - t0) for r in ranks]
    return sum(fr) / len(fr)


def bubble_fraction(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> float:
    """Fraction of a pipeline step that a stage sits idle (equal stages, free p2p).

    GPipe and 1F1B: the first micro-batch needs p - 1 stage-times to reach the last
    stage and the last backward p - 1 to come back, so a step lasts (m + p - 1)
    (t_f + t_b) of which m (t_f + t_b) is work: bubble = (p-1)/(m+p-1) (Huang et al.
    2019; Narayanan et al. 2021). Interleaved with v chunks per stage: each chunk
    takes (t_f + t_b)/v, the fill and drain shrink to (p-1)(t_f + t_b)/v, the work
    stays m (t_f + t_b): bubble = (p-1)/(v m + p - 1) (Narayanan et al. 2021, Sec. 2.2.2).
    The simulator reproduces both (tests/test_planner_simulator.py). ZB-V and DualPipeV:
    :func:`formula_bubble` with a chunk's F : B : W = 1 : 2 : 1 (the weight-gradient GEMMs are
    half of a backward's), (p-1)/(6m + p-1) and (p-1)/(3m + p-1).
    """
    if schedule not in PLANNED:
        raise ValueError(f"schedule must be one of {PLANNED}, got {schedule!r}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be >= 1, got p={p}, m={m}, v={v}")
    if schedule in V_SCHEDULES or schedule == "zb-h1":
        return formula_bubble(schedule, p, m)
    vv = v if schedule == "interleaved" else 1
    return (p - 1) / (vv * m + p - 1)


def formula_bubble(name: str, p: int, m: int, v: int = 1, t_f=1.0, t_b=2.0, t_w=1.0) -> float:
    """The textbook bubble as a fraction of the step: :func:`bubble_fraction`
    for GPipe / 1F1B / interleaved. ZB-H1 (t_b: the whole backward, B + W) idles

        (p - 1)(t_f + t_b - t_w) - (min(m, p) - 1) t_w     per rank per step:

    1F1B's fill and drain with a split backward, (p - 1)(t_f + t_b - t_w), less the W passes
    that fill it: p - 1 of them once m >= p (Qi et al. 2023, Sec. 3.1: (p - 1)(t_f + t_b - 2 t_w)),
    only m - 1 when m < p, where the step is (p - 1 + m)(t_f + t_b - t_w) + t_w: the F and B
    passes through every stage, then rank 0's last W. No less than 0, where a W outlasts a
    forward and an input-gradient pass together. Exact for the timeline of :func:`zero_bubble_h1`
    on the clock it is built on (t_f = t_b - t_w = t_w, any scale); tested for p 2..4, m 1..8."""
    if name == "zb-h1":
        idle = max(0.0, (p - 1) * (t_f + t_b - t_w) - (min(m, p) - 1) * t_w)
        return idle / (m * (t_f + t_b) + idle)
    if name in V_SCHEDULES:             # t_f, t_b, t_w: a chunk's; each rank runs two per micro-batch
        idle = formula_idle(name, p, t_f=t_f, t_b=t_b, t_w=t_w)
        return idle / (2 * m * (t_f + t_b) + idle)
    return bubble_fraction(p, m, name, v)


def formula_idle(name: str, p: int, t_f=1.0, t_b=2.0, t_w=1.0, t_fb=None) -> float:
    """Idle time per rank per step, the formulas of DeepSeek-V3's technical report (DeepSeek-AI
    2024, Table 2; the DualPipe repository's README): with F a forward, B a full backward, W its
    weight part, F&B (``t_fb``, default F + B: not overlapped) a forward and a backward of two
    micro-batches run as one overlapped pair, on PP stages,

        1F1B  (PP - 1)(F + B)     ZB1P (= zb-h1)  (PP - 1)(F + B - 2W)     DualPipe  (PP/2 - 1)(F&B + B - 3W)

    F, B, W are a stage's for 1F1B and ZB1P (p = PP ranks), a chunk's for the V schedules.
    DualPipeV is DualPipe cut in half: its 2p chunks on p ranks are DualPipe's PP = 2p stages,
    so (p - 1)(F&B + B - 3W). ZB-V (Qi et al. 2024, Sec. 6) runs ZB1P's idea over the V's 2p
    chunks, each rank's two chunks filling each other's bubbles: (p - 1)(F + B - 2W) with a
    chunk's times, zero-bubble's "zero" being this (p - 1) chunk-forwards at F = B - W = W.
    Steady-state formulas (m >= 2p); :func:`simulate` gives the exact timeline of any order."""
    t_fb = t_f + t_b if t_fb is None else t_fb
    if name in ("gpipe", "1f1b"):
        return (p - 1) * (t_f + t_b)
    if name in ("zb-h1", "zb-v"):
        return (p - 1) * (t_f + t_b - 2 * t_w)
    if name == "dualpipe-v":
        return (p - 1) * (t_fb + t_b - 3 * t_w)
    raise ValueError(f"formula_idle knows gpipe, 1f1b, zb-h1, zb-v and dualpipe-v, got {name!r}")


def formula_peak_activations(name: str, p: int, m: int) -> int:
    """The most micro-batches' activations a rank holds at once (:func:`in_flight` of its
    busiest rank), counted in its own chunks: 1F1B and ZB1P min(p, m) stages' worth (DeepSeek-V3
    Table 2: PP); ZB-V min(2p, 2m) chunks, half a stage each: 1F1B's memory (Qi et al. 2024);
    DualPipeV 2p + 1 chunks (Table 2's PP + 1, with PP = 2p chunks). Parameters per rank: a
    V rank's two chunks are 1/p of the model, as a 1F1B stage (DualPipe's 2x is the bidirectional
    version's two copies of every stage)."""
    if name == "gpipe":
        return m
    if name in ("1f1b", "zb-h1"):
        return min(p, m)
    if name == "zb-v":
        return min(2 * p, 2 * m)
    if name == "dualpipe-v":
        return 2 * p + 1
    raise ValueError(f"formula_peak_activations knows gpipe, 1f1b, zb-h1, zb-v and dualpipe-v, got {name!r}")


def in_flight(actions) -> int:
    """Peak number of micro-batches (per chunk) whose forward ran and whose last backward
    part (B, or W where split) has not: the activations a rank holds at once."""
    split = {(a.stage, a.mb) for a in actions if a.op == "W"}
    live = peak = 0
    for a in actions:
        if a.op == "F":
            live += 1
            peak = max(peak, live)
        elif a.op == "W" or (a.op == "B" and (a.stage, a.mb) not in split):
            live -= 1
    return peak


def format_schedule(schedule, width: int = 0) -> str:
    """One line per rank: ``rank 0: F0 F1 B0 ...`` (``@s``: virtual stage s > 0)."""
    rows = [f"rank {r}: " + " ".join(str(Action(*a)) for a in row) for r, row in enumerate(schedule)]
    return "\n".join(rows)


__all__ = ["Action", "OPS", "SCHEDULES", "V_SCHEDULES", "PLACEMENTS", "stage_rank", "rank_stage_ids", "chunks",
           "placement_of", "zero_bubble_v", "dualpipe_v", "formula_idle", "formula_peak_activations", "schedule_order", "bubble_fraction", "positive_int", "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1",
           "make_schedule", "schedule_name", "SCHEDULE_ALIASES", "validate", "simulate", "bubble", "formula_bubble",
           "in_flight", "format_schedule", "dependency", "ValidSchedule"]
