"""Chapter 6's performance question: micro-batches m and chunks v for a bubble below 10%
within a memory budget, graded on the virtual GPU clock (deterministic).

    check_pipeline_plan(choose_m_v)

The learner's (m, v) runs for real: its schedule (1F1B for v = 1, interleaved 1F1B
otherwise) on P = 4 ranks under ``launch(..., clock=VirtualCluster(...))``, every chunk a few
equal Linear layers, on an H100 whose links are free and whose host issues at once (the
question's equal stages and free messages; NCCL's model still charges a message a few
nanoseconds, so 3/30 by the formula idles 10.02% on the clock: the question asks for less
than 10%). The bubble is read from the clock's compute
spans (the rank that idles most), the memory from what the ranks hold (their parameters plus
the activations autograd saved, at the fullest moment: ``ScheduleRunner``'s peak). The
fewest micro-batches that can pass come from one measured step per (layers, v), cached:
its per-action times and message latency (``measured_costs``) replayed by the schedule
simulator for every (m, v), its saved bytes per chunk times the micro-batches each rank
holds. While the learner's function runs, the schedules, their simulation and execution,
``launch`` and the planner are switched off (:mod:`course_lib.grading.guard`).
"""
from __future__ import annotations

import functools
import statistics

import torch

from course_lib.grading import Case, check, learner
from course_lib.launch import launch
from course_lib.planner.presets import HARDWARE
from course_lib.virtual import VirtualCluster

__all__ = ["check_pipeline_plan"]

# what would answer the pipeline question: the schedules, their simulation and the planner,
# or running the schedule on the clock
PIPELINE_LIBRARY = ("course_lib.schedules:*", "course_lib.planner.formulas:*",
                    "course_lib.planner.simulator:*", "course_lib.planner.search:*",
                    "course_lib.parallel.pipeline.runner:*", "course_lib.launch:launch",
                    "course_lib.grading.pipeline_plan:_*")
BUBBLE = 0.10           # the step's idle fraction must stay below it
# the question's premise, on the clock: an H100 whose messages are free and whose host issues at
# once, so a chunk's kernels run back to back (chapter 6's H100_FREE)
FREE_H100 = HARDWARE["h100-sxm"].with_(nvlink_latency=0.0, network_latency=0.0, nvlink_bandwidth=1e30,
                                       network_bandwidth=1e30, launch_overhead=0.0)
ROWS, WIDTH = 8, 32     # one micro-batch's activation between layers: (rows, width), fp32
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


# ----------------------------------------------------------------------------- on the ranks
class _Half(torch.nn.Module):
    """x * 0.5: one elementwise kernel forward and backward, the twin of the last stage's loss."""

    def forward(self, x):
        return x * 0.5


def _stages(p, v, rank, layers):
    """This rank's chunks {stage: module}: layers / (p v) bias-free Linear(WIDTH, WIDTH) each,
    every stage but the last ending in _Half, so every chunk's F and B take the same time."""
    g = torch.Generator().manual_seed(rank)
    stages = {}
    for s in range(rank, p * v, p):
        linears = [torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers // (p * v))]
        for lin in linears:
            with torch.no_grad():
                lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH ** 0.5)
            lin.weight.grad = torch.zeros_like(lin.weight)   # every micro-batch accumulates alike
        stages[s] = torch.nn.Sequential(*linears, *([] if s == p * v - 1 else [_Half()]))
    return stages


def _rank_steps(jobs):
    """One step of each (layers, m, v) of ``jobs`` on this pp rank, under the clock: (its compute
    and receive spans, peak saved activation bytes, {(stage, mb): saved bytes}, parameter bytes)."""
    import torch.distributed as dist

    from course_lib import schedules as S
    from course_lib import trace
    from course_lib.collectives.comm import Comm
    from course_lib.parallel.pipeline.runner import ScheduleRunner

    comm = Comm(None, dim="pp")
    p, out = comm.size, []
    for layers, m, v in jobs:
        stages = _stages(p, v, comm.rank, layers)
        # stage 0's input asks for a gradient: its first layer's backward is every layer's
        xs = [torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(m)]
        sched = S.make_schedule("1f1b" if v == 1 else "interleaved", p, m, v)
        dist.barrier()                  # every rank's clock at the same time
        trace.reset()
        res = ScheduleRunner(sched, stages, comm, p=p, m=m, v=v, act_shape=(ROWS, WIDTH)).step(
            xs, [None] * m, lambda y, t: y.sum())
        spans = [s for s in trace.spans() if s.kind == "compute" or s.name.startswith("recv")]
        weights = sum(q.numel() * q.element_size() for mod in stages.values() for q in mod.parameters())
        out.append((spans, res.peak_activation_bytes, res.saved_bytes, weights))
    return out


# ----------------------------------------------------------------------------- the reference
def _schedule(p, m, v):
    from course_lib import schedules as S

    return S.make_schedule("1f1b" if v == 1 else "interleaved", p, m, v)


def _chunk_counts(p, layers):
    return [v for v in range(1, layers // p + 1) if layers % (p * v) == 0]


def _bubble(spans, p):
    """The idle fraction of the step of the rank that idles most (compute spans of every rank)."""
    from course_lib import schedules as S

    compute = [s for s in spans if s.kind == "compute"]
    return max(S.bubble(compute, r) for r in range(p))


@functools.lru_cache(maxsize=None)
def _measured(p, layers_all, prices):
    """{(layers, v): (per-action time {(op, stage): s}, t_comm, t_overhead, saved bytes of one
    chunk's micro-batch {stage: bytes}, parameter bytes of a rank)} from one step of m = p per
    (layers, v) on the clock, cached per price list (``prices``: the clock's describe())."""
    from course_lib.parallel.pipeline.runner import measured_costs

    jobs = [(layers, p, v) for layers in layers_all for v in _chunk_counts(p, layers)]
    res = launch(_rank_steps, p, jobs, clock=VirtualCluster(FREE_H100, gpus_per_node=8), threads=1,
                 timeout=300, quiet=True)
    out = {}
    for j, (layers, m, v) in enumerate(jobs):
        spans = [s for rank in res for s in rank[j][0]]
        costs = measured_costs(spans, _schedule(p, m, v), p, v)
        times = {}
        for name, t in costs["durations"].items():   # "F3@1": op F, stage 1
            times.setdefault((name[0], int(name.partition("@")[2] or 0)), []).append(t)
        saved = {}                                    # stage -> bytes one micro-batch leaves there
        for rank in res:
            for (stage, _), nbytes in rank[j][2].items():
                saved[stage] = max(saved.get(stage, 0), nbytes)
        out[(layers, v)] = ({k: statistics.fmean(t) for k, t in times.items()}, costs["t_comm"],
                            costs["t_overhead"], saved, res[0][j][3])
    return out


def _replay(p, layers, m, v, measured):
    """(bubble, peak bytes of the fullest rank) of (m, v) replayed from the measured step."""
    from course_lib import schedules as S

    times, t_comm, t_overhead, saved, weights = measured[(layers, v)]
    sched = _schedule(p, m, v)
    durations = {str(a): times[(a.op, a.stage)] for row in sched for a in row}
    spans = S.simulate(sched, p, v, durations=durations, t_comm=t_comm, t_overhead=t_overhead)
    held = max(S.in_flight(row) * max(saved[a.stage] for a in row) for row in sched)
    return _bubble(spans, p), weights + held


def _problem(p, layers, m, v):
    """Why (m, v) cannot run as the course's schedule, or None."""
    if layers % (p * v):
        return f"{layers} layers do not split into {p} x {v} equal stages (v must divide layers / p = {layers // p})"
    if v > 1 and m % p:
        return f"interleaved 1F1B needs m to be a multiple of p = {p} (Megatron-LM's order), got m = {m}"
    return None


def _fewest(p, layers, budget, max_m, measured):
    """The smallest m of any (m, v) whose replayed step idles below 10% within the budget, or None."""
    for m in range(1, max_m + 1):
        for v in _chunk_counts(p, layers):
            if _problem(p, layers, m, v) is None:
                bubble, peak = _replay(p, layers, m, v, measured)
                if bubble < BUBBLE and peak <= budget:
                    return m
    return None


# ----------------------------------------------------------------------------- the check
def check_pipeline_plan(choose_m_v):
    """choose_m_v(p, layers, act_bytes, weight_bytes, budget_bytes, max_m) -> (m, v) or None:
    the fewest micro-batches (the smallest global batch) whose 1F1B (v = 1) or interleaved
    1F1B (v chunks per rank) schedule idles less than 10% of the step, with the activations the
    fullest rank holds at its peak plus its weights within the budget; None if none does.
    Graded on the virtual clock: the learner's (m, v) runs on p ranks, its bubble read from the
    clock's spans and its memory from what the ranks hold."""
    answer = learner(choose_m_v, PIPELINE_LIBRARY, exercise="choosing m and v", seconds=10)
    clock = VirtualCluster(FREE_H100, gpus_per_node=8)
    p = P
    measured = _measured(p, tuple(sorted({c[0] for c in PIPELINE_CASES})), clock.describe())
    cases = []
    for layers, budget_mbs, max_m in PIPELINE_CASES:
        _, _, saved, weights = measured[(layers, 1)][1:]
        act = saved[0]                                   # one micro-batch in all of a rank's layers
        budget = weights + int(budget_mbs * act)
        cases.append(Case(dict(p=p, layers=layers, act=act, weights=weights, budget=budget, max_m=max_m),
                          label=f"p={p}, {layers} layers, activations {act} B, weights {weights} B, "
                                f"budget {budget} B, m <= {max_m}"))
    answers, runs = {}, {}
    for i, case in enumerate(cases):     # the learner's answers first, out of the timed runs
        k = case.params
        try:
            answers[i] = (answer(k["p"], k["layers"], k["act"], k["weights"], k["budget"], k["max_m"]), None)
        except BaseException as exc:     # noqa: BLE001 - raised again in its case: a hint there
            if isinstance(exc, KeyboardInterrupt):
                raise
            answers[i] = (None, exc)

    def valid(i):
        got, exc = answers[i]
        k = cases[i].params
        return (exc is None and isinstance(got, (tuple, list)) and len(got) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in got)
                and got[0] <= k["max_m"] and _problem(k["p"], k["layers"], *got) is None)

    def clock_run(i):
        """The learner's (m, v) of case i on the clock: the first case alone (an answer that fails
        there pays one short run), then every answer from case i on in one launch."""
        if i not in runs:
            todo = [i] if not runs else [j for j in range(i, len(cases)) if valid(j)]
            jobs = [(cases[j].params["layers"], *answers[j][0]) for j in todo]
            res = launch(_rank_steps, p, jobs, clock=clock, threads=1, timeout=300, quiet=True)
            for n, j in enumerate(todo):
                runs[j] = (_bubble([s for rank in res for s in rank[n][0]], p),
                           cases[j].params["weights"] + max(rank[n][1] for rank in res))
        return runs[i]

    def run(case):
        i, k = next(j for j, c in enumerate(cases) if c is case), case.params
        got, exc = answers[i]
        if exc is not None:
            raise exc
        best = _fewest(k["p"], k["layers"], k["budget"], k["max_m"], measured)
        if got is None:
            return None if best is None else f"returned None, but an (m, v) with m = {best} fits the budget"
        if not (isinstance(got, (tuple, list)) and len(got) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in got)):
            return f"expected (m, v), two integers >= 1, or None; got {got!r}"
        m, v = got
        if m > k["max_m"]:
            return f"m = {m} is more than max_m = {k['max_m']}"
        problem = _problem(k["p"], k["layers"], m, v)
        if problem:
            return problem
        bubble, peak = clock_run(i)
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
