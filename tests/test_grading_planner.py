"""course_lib/grading/planner.py (chapter 10): each grader fails the classic mistakes of
planning, an answer hard-coded to the lecture's case and a library shortcut, each with a hint
naming the mistake, and passes a right answer written differently from the solution."""
from __future__ import annotations

import itertools

import pytest

from course_lib.grading import planner as G
from course_lib.planner import Layout, estimate
from grading_answers import passed, refused


# ----------------------------------------------------------------------------- memory per GPU
def _mem(zero_grads=True, in_flight=lambda p, m: min(p, m), tp_acts=True):
    def memory(layer_params, layers, s, b, h, a, t, p, d, zero, m):
        P = layer_params * layers / (t * p)
        params = 2 * P / (d if zero >= 3 else 1)
        grads = 2 * P / (d if zero >= (2 if zero_grads else 1) else 1)
        opt = 12 * P / (d if zero >= 1 else 1)
        acts = s * b * h * 34 / (t if tp_acts else 1) * (layers / p) * in_flight(p, m)
        return params + grads + opt + acts
    return memory


def _mem_library(layer_params, layers, s, b, h, a, t, p, d, zero, m):
    from course_lib.planner import formulas as F

    return F.zero_memory_bytes(layer_params * layers / (t * p), zero, d)["total"]


@pytest.mark.parametrize("wrong, hints", [
    (_mem(in_flight=lambda p, m: p), ["case 4/", "p=8", "m=4"]),        # the lecture's m >= p
    (_mem(zero_grads=False), ["case 2/", "zero=1", "GiB"]),
    (_mem(in_flight=lambda p, m: m), ["case 2/", "m=4"]),
    (_mem(tp_acts=False), ["case 2/", "t=8"]),
    (_mem_library, ["write this yourself", "formulas"]),
], ids=["p-in-flight", "zero1-shards-grads", "all-micro-batches-in-flight", "acts-not-split-by-tp", "library"])
def test_memory_per_gpu_refuses(wrong, hints, capsys):
    refused(capsys, "memory_per_gpu", G.check_memory_per_gpu(wrong), *hints)


def test_memory_per_gpu_accepts_per_category_sums(capsys):
    def by_category(layer_params, layers, s, b, h, a, t, p, d, zero, m):
        held = layer_params * layers / (t * p)
        shard = [d if zero >= k else 1 for k in (3, 2, 1)]            # params, grads, optimizer
        states = sum(bytes_ * held / div for bytes_, div in zip((2, 2, 12), shard))
        return states + (layers // p if layers % p == 0 else layers / p) * s * b * h * 34 / t * min(m, p)
    passed(capsys, G.check_memory_per_gpu(by_category), "memory_per_gpu: 6/6 cases passed")


# ----------------------------------------------------------------------------- 1F1B step time
def _step_formula(f, b, m, t):                         # the textbook "slowest stage sets the pace"
    p = len(f)
    return sum(f) + sum(b) + 2 * (p - 1) * t + (m - 1) * max(x + y for x, y in zip(f, b))


def _step_equal_stages(f, b, m, t):                    # the lecture's formula: equal stages
    p = len(f)
    return (m + p - 1) * (f[0] + b[0])


def _step_simulator(f, b, m, t):
    from course_lib import schedules as S

    sched = S.one_f_one_b(len(f), m)
    spans = S.simulate(sched, len(f), t_comm=t)
    return max(s.end for s in spans)


@pytest.mark.parametrize("wrong, hints", [
    (_step_formula, ["not always exact"]),
    (_step_equal_stages, ["case 2/"]),
    (_step_simulator, ["write this yourself", "schedules"]),
], ids=["pace-formula", "equal-stages", "simulator"])
def test_step_time_1f1b_refuses(wrong, hints, capsys):
    refused(capsys, "step_time_1f1b", G.check_step_time_1f1b(wrong), *hints)


def test_step_time_1f1b_accepts_an_event_loop_by_readiness(capsys):
    def by_readiness(f, b, m, t):
        p = len(f)
        queue = []
        for r in range(p):
            w = min(p - r - 1, m)
            order = [("F", i) for i in range(w)]
            for i in range(m - w):
                order += [("F", w + i), ("B", i)]
            queue.append(order + [("B", i) for i in range(m - w, m)])
        end, free = {}, [0.0] * p
        progress = True
        while progress:
            progress = False
            for r in range(p):
                if not queue[r]:
                    continue
                op, i = queue[r][0]
                need = (("F", r - 1, i) if r else None) if op == "F" else (("B", r + 1, i) if r < p - 1 else None)
                if need and need not in end:
                    continue
                start = max(free[r], end[need] + t if need else 0)
                free[r] = end[(op, r, i)] = start + (f[r] if op == "F" else b[r])
                queue[r].pop(0)
                progress = True
        return max(free)
    passed(capsys, G.check_step_time_1f1b(by_readiness), "step_time_1f1b: 7/7 cases passed")


# ----------------------------------------------------------------------------- choose a layout
def _layout_lecture(model, n, batch, limit):           # the chapter's answer for 70B on 64 GPUs
    return Layout(dp=2, tp=4, pp=4, cp=2, sp=True, zero=1, recompute="selective", global_batch=batch)


def _layout_max_tp(model, n, batch, limit):            # "TP 8 and enough PP": valid, not fast
    return Layout(dp=n // 64 if n >= 64 else 1, tp=8, pp=max(1, min(8, n // 8)), sp=True, zero=1,
                  recompute="full", global_batch=batch)


def _layout_search(model, n, batch, limit):
    from course_lib.planner.search import search

    return search(model, "h100-sxm", n, batch, memory_limit=limit).best.layout


def _layout_ignores_limit(model, n, batch, limit):     # the fastest layout by estimate, memory unchecked
    best, speed = None, 0.0
    for tp, cp in itertools.product((1, 2, 4, 8), (1, 2, 4)):
        for pp in (1, 2, 4, 8):
            if n % (tp * cp * pp):
                continue
            layout = Layout(dp=n // (tp * cp * pp), tp=tp, pp=pp, cp=cp, sp=tp > 1, zero=1, recompute="selective",
                            global_batch=batch)
            try:
                est = estimate(model, "h100-sxm", layout, n_gpus=n)
            except ValueError:
                continue
            if est.tokens_per_second > speed:
                best, speed = layout, est.tokens_per_second
    return best


@pytest.mark.parametrize("wrong, hints", [
    (_layout_lecture, ["case 2/", "llama3-8b"]),
    (_layout_max_tp, ["case 1/"]),
    (_layout_search, ["write this yourself", "search"]),
    (_layout_ignores_limit, ["over the", "GiB limit"]),
], ids=["lecture-layout", "max-tp", "planner-search", "ignores-limit"])
def test_choose_layout_refuses(wrong, hints, capsys):
    refused(capsys, "choose_layout", G.check_layout(wrong), *hints)


def test_choose_layout_accepts_a_search_that_prunes_by_memory(capsys):
    def pruned(model, n, batch, limit):
        best, speed = None, 0.0
        for tp, cp, zero, rec, mb in itertools.product((2, 4, 8), (1, 2, 4), (1, 3), ("selective", "full"), (1, 2)):
            for pp in (1, 2, 4, 8, 16):
                if n % (tp * cp * pp):
                    continue
                layout = Layout(dp=n // (tp * cp * pp), tp=tp, pp=pp, cp=cp, sp=True, zero=zero, recompute=rec,
                                micro_batch=mb, global_batch=batch)
                try:
                    est = estimate(model, "h100-sxm", layout, n_gpus=n)
                except ValueError:
                    continue
                if est.memory["total"] <= limit and est.tokens_per_second > speed:
                    best, speed = layout, est.tokens_per_second
        return best
    passed(capsys, G.check_layout(pruned), "choose_layout: 3/3 cases passed")


# ----------------------------------------------------------------------------- fewest pipeline stages
def _pp_division(model, tp, dp, global_batch):                # weights only: ignores optimizer state and activations
    params = {"llama3-8b": 8e9, "llama3-70b": 70.6e9, "llama3-405b": 405e9}[model]
    for pp in (1, 2, 4, 8, 16, 32):
        if 2 * params / (tp * pp) < 80e9:
            return pp
    return None


def _pp_no_skip(model, tp, dp, global_batch):                 # an invalid candidate is not skipped
    for pp in (1, 2, 4, 8, 16, 32):
        layout = Layout(dp=dp, tp=tp, pp=pp, sp=tp > 1, zero=1, recompute="selective", global_batch=global_batch)
        if estimate(model, "h100-sxm", layout).fits:
            return pp
    return None


def _pp_reference(model, tp, dp, global_batch):
    return G._reference_min_pipeline_stages(model, tp, dp, global_batch)


@pytest.mark.parametrize("wrong, hints", [
    (_pp_division, ["case 1/", "expected"]),
    (_pp_no_skip, ["case 8/", "ValueError"]),
    (_pp_reference, ["write this yourself", "fewest stages"]),
], ids=["weights-only", "no-skip", "grader-reference"])
def test_min_pipeline_stages_refuses(wrong, hints, capsys):
    refused(capsys, "min_pipeline_stages", G.check_min_pipeline_stages(wrong), *hints)


def test_min_pipeline_stages_accepts_checking_memory_directly(capsys):
    def by_memory(model, tp, dp, global_batch):
        from course_lib.planner import HARDWARE

        for pp in (1, 2, 4, 8, 16, 32):
            try:
                est = estimate(model, "h100-sxm", Layout(dp=dp, tp=tp, pp=pp, sp=tp > 1, zero=1,
                                                          recompute="selective", global_batch=global_batch))
            except ValueError:
                continue
            if est.memory["total"] <= HARDWARE["h100-sxm"].hbm_bytes:
                return pp
        return None
    passed(capsys, G.check_min_pipeline_stages(by_memory), "min_pipeline_stages: 8/8 cases passed")
