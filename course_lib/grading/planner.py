"""Graders of the planning chapter. The reference is the planner itself.

    check_memory_per_gpu(memory_per_gpu)          # bytes per GPU of a TP x PP x DP(ZeRO) layout
    check_step_time_1f1b(step_time_1f1b)          # 1F1B with unequal stages, against the simulator
    check_layout(choose_layout)                   # (model, n_gpus, batch, memory limit) -> a layout
    check_min_pipeline_stages(min_pipeline_stages) # the fewest stages that make a layout fit

While the learner's function runs, what would answer for it is switched off (the planner's
formulas, simulators and search, chapter 6's schedules, and this module's references).
"""
from __future__ import annotations

import math

import torch

from course_lib.grading import Case, compare, learner
from course_lib.grading.harness import check_answers, check_in_process, number, table
from course_lib.planner import Layout, estimate
from course_lib.planner import formulas as F
from course_lib.planner.search import search

GiB = 2**30
REFERENCES = ("course_lib.grading.planner:_reference_memory_per_gpu", "course_lib.grading.planner:_simulated_step_time_1f1b",
              "course_lib.grading.planner:_best_layout", "course_lib.grading.planner:_reference_min_pipeline_stages")
FORMULAS = ("course_lib.planner.formulas:*", "course_lib.planner.activations:*", "course_lib.planner.estimate:*",
            "course_lib.planner.costs:*", "course_lib.planner.simulator:*", "course_lib.planner.search:*")
SIMULATORS = ("course_lib.schedules:*", "course_lib.planner.simulator:*", "course_lib.planner.estimate:*",
              *(f"course_lib.schedules.{m}:*" for m in ("actions", "classic", "zero_bubble", "names", "bubbles")),
              "course_lib.planner.search:*")
SEARCH = ("course_lib.planner.search:*",)

# ----------------------------------------------------------------------------- memory per GPU

MEMORY_CASES = [
    # per-layer parameters, layers, (s, b, h, a), t, p, d, ZeRO stage, micro-batches
    dict(layer_params=12 * 4096**2, layers=32, s=2048, b=1, h=4096, a=32, t=1, p=1, d=1, zero=0, m=1),
    dict(layer_params=12 * 4096**2, layers=32, s=2048, b=1, h=4096, a=32, t=8, p=1, d=4, zero=1, m=4),
    dict(layer_params=12 * 8192**2, layers=80, s=4096, b=1, h=8192, a=64, t=8, p=4, d=2, zero=1, m=16),
    dict(layer_params=12 * 8192**2, layers=80, s=4096, b=2, h=8192, a=64, t=4, p=8, d=8, zero=2, m=4),
    dict(layer_params=12 * 12288**2, layers=96, s=2048, b=1, h=12288, a=96, t=8, p=8, d=16, zero=3, m=32),
    dict(layer_params=12 * 2048**2, layers=24, s=8192, b=1, h=2048, a=16, t=2, p=3, d=3, zero=3, m=2),
]


def _reference_memory_per_gpu(layer_params, layers, s, b, h, a, t, p, d, zero, m) -> float:
    """Model states (ZeRO over d ranks of the 1/(t p) slice a GPU holds) plus the
    activations of the first 1F1B stage (TP + SP, selective recomputation)."""
    states = F.zero_memory_bytes(layer_params * layers / (t * p), zero, d)["total"]
    per_layer = F.activation_bytes_per_layer(s, b, h, a, t, sp=True, recompute="selective")
    return states + per_layer * (layers / p) * F.in_flight_microbatches(p, m, "1f1b")


def check_memory_per_gpu(fn) -> bool:
    """fn(layer_params, layers, s, b, h, a, t, p, d, zero, m) -> bytes on the first stage's GPU."""
    cases = [Case(params=dict(args=c), label=", ".join(f"{k}={v}" for k, v in c.items() if k != "layer_params"))
             for c in MEMORY_CASES]
    # the same float64 formula in another order: the one-step rounding bound (course_lib.tolerance)
    return check_answers("memory_per_gpu", fn, cases, _reference_memory_per_gpu, guard=(FORMULAS, REFERENCES),
                         exercise="the memory of a layout", read=number,
                         differ=lambda got, want, **_: compare(float(got), float(want), dtype=torch.float64)
                         and f"got {got / GiB:.3f} GiB, expected {want / GiB:.3f} GiB")


# ----------------------------------------------------------------------------- 1F1B step, unequal stages

# (per-stage forward times, per-stage backward times, micro-batches, time of one message);
# integer times, so every step time is exact
STEP_CASES = [
    ((2, 2, 2), (4, 4, 4), 4, 0),          # equal stages: (m + p - 1)(t_f + t_b)
    ((1, 3), (2, 6), 4, 0),                # the slow second stage sets the pace
    ((3, 1, 1, 2), (6, 2, 3, 4), 6, 1),    # the first stage is the slowest, messages cost 1
    ((2, 5, 2, 2), (3, 9, 8, 2), 2, 0),    # fewer micro-batches than stages: never steady
    ((1, 5, 3, 5), (3, 5, 2, 2), 3, 2),
    ((5, 1, 3, 4), (6, 4, 9, 8), 8, 1),
    ((2, 3, 2), (5, 4, 6), 1, 3),          # one micro-batch: a forward chain and a backward chain
]


def _simulated_step_time_1f1b(f, b, m, t_comm) -> float:
    """The step time (first forward to last backward) course_lib.schedules.simulate
    measures for 1F1B with stage r's forward taking f[r], its backward b[r], a message t_comm."""
    from course_lib import schedules as S

    p = len(f)
    schedule = S.one_f_one_b(p, m)
    durations = {str(a): (f if a.op == "F" else b)[a.stage] for row in schedule for a in row}
    spans = S.simulate(schedule, p, t_comm=t_comm, durations=durations)
    return max(s.end for s in spans) - min(s.start for s in spans)


def _step_time_harness(step_time_1f1b, f, b, m, t_comm):
    """In a process of its own (a learner's endless loop is stopped by the timeout)."""
    want = _simulated_step_time_1f1b(f, b, m, t_comm)
    got = learner(step_time_1f1b, SIMULATORS, REFERENCES, exercise="playing the 1F1B schedule on a clock")(
        list(f), list(b), m, t_comm)
    if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isfinite(got):
        return f"expected a time (a number), got {got!r}"
    if compare(float(got), float(want), dtype=torch.float64):   # sums of integer times: rounding only
        p = len(f)
        pace = sum(f) + sum(b) + 2 * (p - 1) * t_comm + (m - 1) * max(x + y for x, y in zip(f, b))
        return (f"got {got:g}, the simulated 1F1B step takes {want:g} (fill and drain sum(f) + sum(b) + "
                f"2(p-1) t_comm, plus m-1 times the slowest stage's f+b, gives {pace:g}: not always exact)")
    return None


def check_step_time_1f1b(step_time_1f1b, timeout: float = 20.0) -> bool:
    """step_time_1f1b(f, b, m, t_comm) -> the time of one 1F1B step with per-stage forward
    times f, backward times b (lists of length p), m micro-batches and t_comm per message,
    graded against the discrete-event simulator of chapter 6 (exact: integer times). Each
    case runs in a process of its own, so an endless loop becomes a hint, not a hang."""
    cases = [Case(params=dict(step_time_1f1b=step_time_1f1b, f=f, b=b, m=m, t_comm=t),
                  label=f"f={list(f)}, b={list(b)}, m={m}, t_comm={t}") for f, b, m, t in STEP_CASES]
    return check_in_process("step_time_1f1b", _step_time_harness, cases, timeout, hang="an endless loop? (a rank "
                            "waiting for an action that never runs must not spin forever)")


# ----------------------------------------------------------------------------- choose a layout

LAYOUT_TASKS = [  # model, H100s, global batch (8192-token sequences), memory limit per GPU
    ("llama3-70b", 64, 128, 60 * GiB), ("llama3-8b", 16, 64, 40 * GiB), ("llama3-70b", 32, 64, 70 * GiB),
]
LAYOUT_MIN_SHARE = 0.9      # of the best throughput the planner's search finds


def _best_layout(model, n_gpus, global_batch, memory_limit):
    """The fastest layout the planner's search finds for the task (its tokens/s and layout)."""
    result = search(model, "h100-sxm", n_gpus, global_batch, memory_limit=memory_limit, micro_batches=(1, 2),
                    recomputes=("selective", "full"), zero_stages=(0, 1, 3))
    return result.best.tokens_per_second, result.best.layout


def fitting_estimate(layout, model, hardware, n_gpus, global_batch, memory_limit):
    """The planner's estimate of a learner's ``layout``, or the hint when it is no Layout, has
    another global batch, is not valid on ``n_gpus`` (estimate's ValueError) or does not fit."""
    if not isinstance(layout, Layout):
        return f"expected a planner Layout, got {type(layout).__name__}"
    if layout.global_batch != global_batch:
        return f"the global batch is {global_batch} sequences, not {layout.global_batch}"
    est = estimate(model, hardware, layout, n_gpus=n_gpus)
    if est.memory["total"] > memory_limit:
        return (f"{layout.describe()} needs {est.memory['total'] / GiB:.1f} GiB per GPU, "
                f"over the {memory_limit / GiB:.0f} GiB limit")
    return est


def check_layout(choose_layout) -> bool:
    """choose_layout(model, n_gpus, global_batch, memory_limit) -> a planner Layout for H100s
    ("h100-sxm"), sequences of 8192 tokens: valid on n_gpus, under memory_limit bytes per GPU,
    and at least 90% of the throughput of the best layout the planner's search finds."""
    def differ(layout, want, model, n, batch, limit):
        best = want[0]
        est = fitting_estimate(layout, model, "h100-sxm", n, batch, limit)
        if isinstance(est, str):
            return est
        share = est.tokens_per_second / best
        if share < LAYOUT_MIN_SHARE:
            return (f"{layout.describe()} fits but runs {est.tokens_per_second:.4g} tokens/s, "
                    f"{share:.0%} of the best layout found ({best:.4g}); aim for {LAYOUT_MIN_SHARE:.0%}")
        return None
    return check_answers("choose_layout", choose_layout, table(LAYOUT_TASKS, lambda m, n, g, lim: f"{m}, {n} x H100, "
                         f"{g} sequences, <= {lim / GiB:.0f} GiB"), _best_layout, guard=(SEARCH, REFERENCES),
                         exercise="the search for a layout", seconds=60, differ=differ)


# ----------------------------------------------------------------------------- fewest pipeline stages

PP_CHOICES = (1, 2, 4, 8, 16, 32)
PP_CASES = [  # model, tp, dp, global batch (8192-token sequences), H100s
    ("llama3-8b", 1, 8, 64), ("llama3-8b", 2, 1, 16), ("llama3-70b", 8, 2, 128), ("llama3-70b", 4, 4, 128),
    ("llama3-70b", 2, 8, 64), ("llama3-405b", 8, 16, 1024), ("llama3-405b", 1, 1, 8),
    ("llama3-70b", 4, 16, 8),   # 8 sequences on 16 DP ranks: no candidate is valid (estimate raises)
]


def _reference_min_pipeline_stages(model, tp, dp, global_batch, hardware="h100-sxm"):
    """The smallest PP in PP_CHOICES whose 1F1B layout (ZeRO-1, TP + SP, selective
    recomputation, micro-batch 1) is valid and fits in HBM; None if none does."""
    for pp in PP_CHOICES:
        layout = Layout(dp=dp, tp=tp, pp=pp, sp=tp > 1, zero=1, recompute="selective", global_batch=global_batch)
        try:
            if estimate(model, hardware, layout).fits:
                return pp
        except ValueError:          # e.g. more stages than layers
            continue
    return None


def check_min_pipeline_stages(fn) -> bool:
    """fn(model, tp, dp, global_batch) -> the fewest pipeline stages (from 1, 2, 4, ..., 32) that
    make the layout fit on H100s, or None."""
    cases = [Case(params=dict(args=dict(model=m, tp=t, dp=d, global_batch=g)), label=f"{m}, TP {t}, DP {d}, {g} "
                  f"sequences") for m, t, d, g in PP_CASES]
    return check_answers("min_pipeline_stages", fn, cases, _reference_min_pipeline_stages, guard=(SEARCH, REFERENCES),
                         exercise="the search for the fewest stages", seconds=20,
                         hint=lambda got, want, **_: ": no PP in 1..32 fits" if want is None
                         else f" (PP {want} is the first that fits in 80 GB)")


__all__ = ["check_memory_per_gpu", "check_step_time_1f1b", "check_layout", "check_min_pipeline_stages"]
