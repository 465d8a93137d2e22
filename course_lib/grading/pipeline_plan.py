"""Chapter 6's performance question: micro-batches m and chunks v for a bubble of at most
10% within a memory budget, graded on the schedule itself (deterministic).

    check_pipeline_plan(choose_m_v)

Each case runs the schedule the learner's (m, v) names (its simulated step on equal stages
and the micro-batches it holds), on several pipelines and budgets, so one hard-coded answer
fails; while the learner's function runs, the schedules, their simulation and the planner
are switched off (:mod:`course_lib.grading.guard`).
"""
from __future__ import annotations

from course_lib.grading import Case, check, learner

__all__ = ["check_pipeline_plan"]

# ----------------------------------------------------------------------------- 2. pipeline m, v
# what would answer the pipeline question: the schedules, their simulation and the planner
PIPELINE_LIBRARY = ("course_lib.schedules:*", "course_lib.planner.formulas:*",
                    "course_lib.planner.simulator:*", "course_lib.planner.search:*",
                    "course_lib.grading.pipeline_plan:_*")
BUBBLE = 0.10
GIB = 2**30
PIPELINE_CASES = [  # (p, layers, activation GiB of one micro-batch in one rank's layers, weights GiB, budget GiB, max m)
    (4, 16, 2.0, 30.0, 42.0, 64),     # room for interleaving: 4 chunks per rank, m = 8
    (4, 16, 2.0, 30.0, 39.0, 64),     # interleaving does not fit: 1F1B, m = 27
    (4, 8, 2.0, 30.0, 42.0, 64),      # 2 layers per rank: v <= 2, m = 16
    (4, 12, 2.0, 30.0, 40.4, 64),     # v = 3 fits, v = 2 does not (5.5 micro-batches' worth)
    (4, 24, 2.0, 30.0, 40.4, 64),     # v = 6: 4.5 micro-batches' worth, m = 8
    (4, 16, 2.0, 30.0, 39.0, 24),     # 1F1B needs m = 27 > 24 and interleaving does not fit: None
    (4, 16, 2.0, 30.0, 37.0, 64),     # not even 1F1B's 4 micro-batches fit: None
]


def _schedule_of(p, m, v):
    """(bubble of the step on equal stages, peak bytes-per-activation units on the fullest rank)
    of the schedule the course runs for (m, v): 1F1B for v = 1, interleaved 1F1B otherwise."""
    from course_lib import schedules as S

    sched = S.make_schedule("1f1b" if v == 1 else "interleaved", p, m, v)
    spans = S.simulate(sched, p, v, t_f=1.0 / v, t_b=2.0 / v)
    return max(S.bubble(spans, r) for r in range(p)), max(S.in_flight(row) for row in sched) / v


def _pipeline_problem(p, layers, m, v):
    """Why (m, v) cannot run as an interleaved schedule, or None."""
    if layers % (p * v):
        return f"{layers} layers do not split into {p} x {v} equal stages (v must divide layers / p = {layers // p})"
    if v > 1 and m % p:
        return f"interleaved 1F1B needs m to be a multiple of p = {p} (Megatron-LM's order), got m = {m}"
    return None


def _best_m(p, layers, act, weights, budget, max_m):
    """The smallest m of any (m, v) that keeps the bubble <= 10% within the budget, or None."""
    for m in range(1, max_m + 1):
        for v in range(1, layers // p + 1):
            if _pipeline_problem(p, layers, m, v) is None:
                bubble, held = _schedule_of(p, m, v)
                if bubble <= BUBBLE + 1e-9 and weights + held * act <= budget:
                    return m
    return None


def check_pipeline_plan(choose_m_v):
    """choose_m_v(p, layers, act_bytes, weight_bytes, budget_bytes, max_m) -> (m, v) or None:
    the fewest micro-batches (the smallest global batch) whose 1F1B (v = 1) or interleaved
    1F1B (v chunks per rank) schedule idles at most 10% of the step, with the activations the
    fullest rank holds at its peak plus its weights within the budget; None if none does.
    Graded on the schedule itself: simulated step (equal stages) and held micro-batches."""
    cases = [Case(dict(zip(("p", "layers", "act", "weights", "budget", "max_m"), c)),
                  label=f"p={c[0]}, {c[1]} layers, activations {c[2]:g} GiB, weights {c[3]:g} GiB, "
                        f"budget {c[4]:g} GiB, m <= {c[5]}") for c in PIPELINE_CASES]
    answer = learner(choose_m_v, PIPELINE_LIBRARY, exercise="choosing m and v", seconds=10)

    def run(case):
        k = case.params
        best = _best_m(k["p"], k["layers"], k["act"], k["weights"], k["budget"], k["max_m"])
        got = answer(k["p"], k["layers"], k["act"] * GIB, k["weights"] * GIB, k["budget"] * GIB, k["max_m"])
        if got is None:
            return None if best is None else f"returned None, but an (m, v) with m = {best} fits the budget"
        if not (isinstance(got, (tuple, list)) and len(got) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in got)):
            return f"expected (m, v), two integers >= 1, or None; got {got!r}"
        m, v = got
        if m > k["max_m"]:
            return f"m = {m} is more than max_m = {k['max_m']}"
        problem = _pipeline_problem(k["p"], k["layers"], m, v)
        if problem:
            return problem
        bubble, held = _schedule_of(k["p"], m, v)
        peak = k["weights"] + held * k["act"]
        if bubble > BUBBLE + 1e-9:
            return (f"(m={m}, v={v}): the simulated step idles {bubble:.1%} > 10% (the bubble as a fraction "
                    f"of the step is (p-1)/(v m + p - 1), not (p-1)/m)")
        if peak > k["budget"] + 1e-9:
            return (f"(m={m}, v={v}): rank 0 holds {held:g} micro-batches' activations at its peak, "
                    f"{peak:g} GiB > budget {k['budget']:g} GiB (interleaving warms up with "
                    f"2(p-1) + (v-1)p + 1 chunk forwards, each 1/v of the layers)")
        if best is None or m > best:
            return (f"(m={m}, v={v}) fits, but m = {best} micro-batches are enough (a smaller global batch; "
                    f"the bubble as a fraction of the step is (p-1)/(v m + p - 1), (p-1)/(v m) is relative to "
                    f"the ideal time)")
        return None

    return check("pipeline_plan", cases, run)
