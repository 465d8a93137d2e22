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

The schedule families live in their own modules, re-exported here: :mod:`.actions` (what a
schedule is made of), :mod:`.classic` (GPipe, 1F1B, interleaved), :mod:`.zero_bubble` (ZB-H1,
ZB-V, DualPipeV), :mod:`.names` (a schedule by name), :mod:`.bubbles` (idle time and memory).
This module checks an action list (:func:`validate`) and runs it on a unit clock
(:func:`simulate`).
"""
from __future__ import annotations

from course_lib.schedules.actions import (OPS, PLACEMENTS, PLANNED, SCHEDULES, V_SCHEDULES, Action, check_shape,
                                          dependency, format_schedule, positive_int, rank_stage_ids, reduce_points,
                                          stage_rank)
from course_lib.schedules.bubbles import (bubble, bubble_fraction, formula_bubble, formula_idle,
                                          formula_peak_activations, in_flight)
from course_lib.schedules.classic import gpipe, interleaved_1f1b, microbatch_group, one_f_one_b, schedule_order
from course_lib.schedules.names import SCHEDULE_ALIASES, chunks, make_schedule, schedule_name
from course_lib.schedules.zero_bubble import dualpipe_v, zero_bubble_h1, zero_bubble_v
from course_lib.trace import Span


def placement_of(schedule, p: int = 1, v: int = 1) -> str:
    """Where a schedule puts its stages (:data:`PLACEMENTS`): "v" for the V schedules' names and
    for an action list that runs stage p on rank p - 1; "loop" otherwise."""
    if isinstance(schedule, str):
        return "v" if schedule_name(schedule, v) in V_SCHEDULES else "loop"
    if isinstance(schedule, ValidSchedule):
        return schedule.placement
    return _normalise(schedule, p, 1 + max((a[2] for row in schedule for a in row), default=0), v)[1]


def _normalise(schedule, p, m, v):
    check_shape(p, m, v)
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


__all__ = ["Action", "OPS", "SCHEDULES", "V_SCHEDULES", "PLACEMENTS", "stage_rank", "rank_stage_ids", "chunks",
           "placement_of", "zero_bubble_v", "dualpipe_v", "formula_idle", "formula_peak_activations", "schedule_order", "bubble_fraction", "positive_int", "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1",
           "make_schedule", "schedule_name", "SCHEDULE_ALIASES", "validate", "simulate", "bubble", "formula_bubble",
           "in_flight", "microbatch_group", "reduce_points", "format_schedule", "dependency", "ValidSchedule", "PLANNED", "check_shape"]
