"""Chapter 6's performance question: micro-batches m and chunks v for a bubble below 10%
within a memory budget, graded on the virtual GPU clock (deterministic).

    check_pipeline_plan(choose_m_v)

The learner's (m, v) runs for real on P = 4 ranks under the clock, and the fewest
micro-batches that can pass come from one measured step per (layers, v) replayed by the
schedule simulator: both in :mod:`course_lib.lab.pipeline_runs`. While the learner's function
runs, the schedules, their simulation and execution, ``launch`` and the planner are switched
off (:mod:`course_lib.grading.guard`).
"""
from __future__ import annotations

from course_lib.grading import Case, check, learner
from course_lib.lab import pipeline_runs as runs

__all__ = ["check_pipeline_plan"]

# what would answer the pipeline question: the schedules, their simulation and the planner,
# running the schedule on the clock, or the grader's own reference
PIPELINE_LIBRARY = ("course_lib.schedules:*", "course_lib.planner.formulas:*",
                    *(f"course_lib.schedules.{m}:*" for m in ("actions", "classic", "zero_bubble", "names", "bubbles")),
                    "course_lib.planner.simulator:*", "course_lib.planner.search:*",
                    "course_lib.parallel.pipeline.runner:*", "course_lib.launch:launch",
                    "course_lib.lab.pipeline_runs:*")
BUBBLE = 0.10           # the step's idle fraction must stay below it
P = 4                   # pipeline ranks of every case
PIPELINE_CASES = [  # (layers, budget: weights + this many micro-batches' activations of a rank, max m)
    (16, 6.0, 64),      # room for interleaving: 4 chunks per rank (4.75 held), m = 8
    (16, 4.5, 64),      # interleaving does not fit: 1F1B (4 held), m = 28
    (8, 6.0, 64),       # 2 layers per rank: v <= 2 (5.5 held), m = 16
    (12, 5.2, 64),      # v = 3 fits (5 held), v = 2 does not (5.5): m = 12
    (24, 5.2, 64),      # v = 6 (4.5 held): m = 8
    (16, 4.5, 24),      # 1F1B needs m = 28 > 24 and interleaving does not fit: None
    (16, 3.5, 64),      # not even 1F1B's 4 micro-batches fit: None
]


def _problem(p, layers, m, v):
    """Why (m, v) cannot run as the course's schedule, or None."""
    if layers % (p * v):
        return f"{layers} layers do not split into {p} x {v} equal stages (v must divide layers / p = {layers // p})"
    if v > 1 and m % p:
        return f"interleaved 1F1B needs m to be a multiple of p = {p} (Megatron-LM's order), got m = {m}"
    return None


def _shape_error(got, max_m, p, layers):
    """Why ``got`` is no (m, v) the schedules run, or None."""
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in got)):
        return f"expected (m, v), two integers >= 1, or None; got {got!r}"
    if got[0] > max_m:
        return f"m = {got[0]} is more than max_m = {max_m}"
    return _problem(p, layers, *got)


def check_pipeline_plan(choose_m_v):
    """choose_m_v(p, layers, act_bytes, weight_bytes, budget_bytes, max_m) -> (m, v) or None:
    the fewest micro-batches (the smallest global batch) whose 1F1B (v = 1) or interleaved
    1F1B (v chunks per rank) schedule idles less than 10% of the step, with the activations the
    fullest rank holds at its peak plus its weights within the budget; None if none does.
    Graded on the virtual clock: the learner's (m, v) runs on p ranks, its bubble read from the
    clock's spans and its memory from what the ranks hold."""
    answer = learner(choose_m_v, PIPELINE_LIBRARY, exercise="choosing m and v", seconds=10)
    layers_all = tuple(sorted({c[0] for c in PIPELINE_CASES}))
    measured = runs.measured_steps(P, layers_all)
    cases = []
    for layers, budget_mbs, max_m in PIPELINE_CASES:
        _, _, saved, weights = measured[(layers, 1)][1:]
        act = saved[0]                                   # one micro-batch in all of a rank's layers
        budget = weights + int(budget_mbs * act)
        cases.append(Case(dict(p=P, layers=layers, act=act, weights=weights, budget=budget, max_m=max_m),
                          label=f"p={P}, {layers} layers, activations {act} B, weights {weights} B, "
                                f"budget {budget} B, m <= {max_m}"))
    answers, runs_of = [], {}
    for case in cases:                   # the learner's answers first, out of the timed runs
        k = case.params
        try:
            answers.append((answer(k["p"], k["layers"], k["act"], k["weights"], k["budget"], k["max_m"]), None))
        except BaseException as exc:     # noqa: BLE001 - raised again in its case: a hint there
            if isinstance(exc, KeyboardInterrupt):
                raise
            answers.append((None, exc))

    def clock_run(i):
        """The learner's (m, v) of case i on the clock: the first case alone (an answer that fails
        there pays one short run), then every valid answer from case i on in one launch."""
        if i not in runs_of:
            todo = [i] if not runs_of else [j for j in range(i, len(cases)) if answers[j][1] is None and
                                             answers[j][0] is not None and not _shape_error(
                                                 answers[j][0], cases[j].params["max_m"], P, cases[j].params["layers"])]
            results = runs.clock_steps(P, [(cases[j].params["layers"], *answers[j][0]) for j in todo])
            runs_of.update(zip(todo, results))
        return runs_of[i]

    def run(case):
        i, k = cases.index(case), case.params
        got, exc = answers[i]
        if exc is not None:
            raise exc
        best = runs.fewest_microbatches(k["p"], k["layers"], k["budget"], k["max_m"], BUBBLE, layers_all)
        if got is None:
            return None if best is None else f"returned None, but an (m, v) with m = {best} fits the budget"
        problem = _shape_error(got, k["max_m"], k["p"], k["layers"])
        if problem:
            return problem
        (m, v), (bubble, peak) = got, clock_run(i)
        if bubble >= BUBBLE:
            return (f"(m={m}, v={v}): the step idles {bubble:.2%} >= 10% on the clock (the bubble as a "
                    f"fraction of the step is (p-1)/(v m + p - 1), not (p-1)/m)")
        if peak > k["budget"]:
            held = (peak - k["weights"]) / k["act"]
            return (f"(m={m}, v={v}): the fullest rank holds {held:g} micro-batches' activations at its "
                    f"peak, {peak} B > budget {k['budget']} B (interleaving warms up with "
                    f"2(p-1) + (v-1)p + 1 chunk forwards, each 1/v of the layers)")
        if best is not None and m > best:
            return (f"(m={m}, v={v}) fits, but m = {best} micro-batches are enough (a smaller global batch; "
                    f"the bubble as a fraction of the step is (p-1)/(v m + p - 1), (p-1)/(v m) is relative to "
                    f"the ideal time)")
        return None

    return check("pipeline_plan", cases, run)
