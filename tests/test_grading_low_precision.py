"""Chapter 9c's graders (course_lib/grading/low_precision.py): a right answer written
differently from the solution passes; classic mistakes, hard-coded answers and the library's
(or torch's) own implementation fail with a hint."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib.grading import low_precision as G
from grading_answers import fails_with, graded

F32_MAX = float(torch.finfo(torch.float32).max)


# ----------------------------------------------------------------------------- 1. the scaler's rule
def schedule_by_counting(overflows, init_scale, growth_factor, backoff_factor, growth_interval):
    """Right, written differently: the good steps since the last overflow or growth, by position."""
    scales, stepped, scale, since = [], [], init_scale, 0
    for i, bad in enumerate(overflows):
        scales.append(scale)
        stepped.append(not bad)
        since = 0 if bad else since + 1
        if bad:
            scale *= backoff_factor
        elif since % growth_interval == 0:
            since = 0
            scale = scale * growth_factor if scale * growth_factor <= F32_MAX else scale
    return scales, stepped


def _variant(skip=True, grow_every=False, reset_on_overflow=True, reset_on_growth=True):
    def schedule(overflows, init_scale, growth_factor, backoff_factor, growth_interval):
        scales, stepped, scale, good = [], [], init_scale, 0
        for bad in overflows:
            scales.append(scale)
            stepped.append(not bad or not skip)
            if bad:
                scale *= backoff_factor
                good = 0 if reset_on_overflow else good
            else:
                good += 1
                # without the reset the count stays >= growth_interval: every later good step grows
                if grow_every or good >= growth_interval:
                    if scale * growth_factor <= F32_MAX:
                        scale *= growth_factor
                    good = 0 if reset_on_growth else good
        return scales, stepped
    return schedule


def test_scale_schedule(capsys):
    assert graded(capsys, G.check_scale_schedule, schedule_by_counting)[0]
    assert graded(capsys, G.check_scale_schedule, _variant())[0]              # the variants' base is right
    fails_with(capsys, G.check_scale_schedule, _variant(skip=False), hint="skipped")       # halving, no skip
    fails_with(capsys, G.check_scale_schedule, _variant(grow_every=True), hint="growth_interval")
    fails_with(capsys, G.check_scale_schedule, _variant(reset_on_overflow=False), hint="restart the count")
    fails_with(capsys, G.check_scale_schedule, _variant(reset_on_growth=False), hint="restart the count")

    def no_fp32_cap(overflows, init_scale, growth_factor, backoff_factor, growth_interval):
        scales, stepped, scale, good = [], [], init_scale, 0
        for bad in overflows:
            scales.append(scale)
            stepped.append(not bad)
            good = 0 if bad else good + 1
            scale = scale * backoff_factor if bad else scale
            if good == growth_interval:
                scale, good = scale * growth_factor, 0
        return scales, stepped

    fails_with(capsys, G.check_scale_schedule, no_fp32_cap, hint="scale at step")
    fails_with(capsys, G.check_scale_schedule, lambda *a: ([2.0 ** 16] * 7, [True] * 7), hint=("step", "scales"))

    def with_torch(overflows, init_scale, growth_factor, backoff_factor, growth_interval):
        scale, tracker = torch.tensor(init_scale), torch.tensor(0, dtype=torch.int32)
        out = []
        for bad in overflows:
            out.append(float(scale))
            torch._amp_update_scale_(scale, tracker, torch.tensor(float(bad)), growth_factor, backoff_factor,
                                     growth_interval)
        return out, [not b for b in overflows]

    def with_ours(overflows, init_scale, growth_factor, backoff_factor, growth_interval):
        from course_lib.precision.loss_scale import update_scale

        scale, tracker, out = init_scale, 0, []
        for bad in overflows:
            out.append(scale)
            scale, tracker = update_scale(scale, tracker, bad, growth_factor=growth_factor,
                                          backoff_factor=backoff_factor, growth_interval=growth_interval)
        return out, [not b for b in overflows]

    def with_grad_scaler(overflows, *args):
        torch.amp.GradScaler("cpu")

    for shortcut in (with_torch, with_ours, with_grad_scaler):
        fails_with(capsys, G.check_scale_schedule, shortcut, hint="write this yourself")


# ----------------------------------------------------------------------------- 2. delayed scaling
def delayed_with_deque(amaxes, history_len, fp8_max):
    """Right, written differently: a deque of the recorded amaxes, 1/amax * fp8_max."""
    from collections import deque

    history, out = deque(maxlen=history_len), []
    for amax in amaxes:
        largest = max(history) if history else amax
        out.append(1.0 / largest * fp8_max if largest > 0 else 1.0)
        history.append(amax)
    return out


def test_delayed_scales(capsys):
    assert graded(capsys, G.check_delayed_scales, delayed_with_deque)[0]
    current = lambda amaxes, h, m: [m / a if a > 0 else 1.0 for a in amaxes]
    fails_with(capsys, G.check_delayed_scales, current, hint="previous history_len steps")

    def including_this_step(amaxes, h, m):
        return [m / max(amaxes[max(0, t - h + 1):t + 1]) if max(amaxes[max(0, t - h + 1):t + 1]) > 0 else 1.0
                for t in range(len(amaxes))]

    def whole_history(amaxes, h, m):
        return [m / max(amaxes[:t] or [amaxes[0]]) if max(amaxes[:t] or [amaxes[0]]) > 0 else 1.0
                for t in range(len(amaxes))]

    def mean_of_history(amaxes, h, m):
        out = []
        for t in range(len(amaxes)):
            w = amaxes[max(0, t - h):t] or [amaxes[t]]
            out.append(m / (sum(w) / len(w)) if sum(w) > 0 else 1.0)
        return out

    for wrong in (including_this_step, whole_history, mean_of_history):
        fails_with(capsys, G.check_delayed_scales, wrong, hint="expected")
    fails_with(capsys, G.check_delayed_scales, lambda a, h, m: [448.0, 448.0, 112.0, 112.0, 112.0, 224.0, 896.0,
                                                               896.0], hint=("one scale per step", "expected"))

    def with_library(amaxes, h, m):
        from course_lib.precision.fp8 import E4M3, TensorScaling

        s = TensorScaling(E4M3, "delayed", h)
        return [s.scale_for(torch.tensor([a])) for a in amaxes]

    fails_with(capsys, G.check_delayed_scales, with_library, hint="write this yourself")


# ----------------------------------------------------------------------------- 3. quantise
def quantize_via_where(x, scale, dtype):
    """Right, written differently: saturate with torch.where, scale by division by 1/scale."""
    y = x / (1.0 / scale)
    top = torch.finfo(dtype).max
    y = torch.where(y > top, torch.full_like(y, top), torch.where(y < -top, torch.full_like(y, -top), y))
    return y.to(dtype)


def test_quantize_fp8(capsys):
    assert graded(capsys, G.check_quantize_fp8, quantize_via_where)[0]
    fails_with(capsys, G.check_quantize_fp8, lambda x, s, d: (x * s).to(d), hint="saturate")
    fails_with(capsys, G.check_quantize_fp8, lambda x, s, d: (x / s).clamp(-torch.finfo(d).max,
                                                                            torch.finfo(d).max).to(d),
               hint="8-bit codes")
    fails_with(capsys, G.check_quantize_fp8, lambda x, s, d: (x * s).clamp(-448, 448).to(d), hint="8-bit codes")
    fails_with(capsys, G.check_quantize_fp8, lambda x, s, d: (x * s).clamp(-torch.finfo(d).max,
                                                                            torch.finfo(d).max).to(d).float(),
               hint="dtype")
    fails_with(capsys, G.check_quantize_fp8, lambda x, s, d: torch.tensor([1.0, 3.0, -0.1, 0.0, 288.0]).to(d),
               hint="8-bit codes")

    def with_library(x, s, d):
        from course_lib.precision.fp8 import quantize

        return quantize(x, s, d)

    fails_with(capsys, G.check_quantize_fp8, with_library, hint="write this yourself")


# ----------------------------------------------------------------------------- 4. the flag on ranks
def flag_as_uint8(grads, group):
    """Right, written differently: a uint8 flag, any() over the gradients' isnan | isinf."""
    bad = any(bool((g.isnan() | g.isinf()).any()) for g in grads)
    flag = torch.tensor([int(bad)], dtype=torch.uint8)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def local_only(grads, group):
    return any(not bool(torch.isfinite(g).all()) for g in grads)


def sum_of_gradients(grads, group):
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    return not bool(torch.isfinite(flat).all())


def one_call_per_gradient(grads, group):
    bad = False
    for g in grads:
        flag = torch.tensor([float(not torch.isfinite(g).all())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        bad = bad or bool(flag.item())
    return bad


def min_instead_of_max(grads, group):
    flag = torch.tensor([float(any(not torch.isfinite(g).all() for g in grads))])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def isinf_only(grads, group):
    flag = torch.tensor([float(any(bool(g.isinf().any()) for g in grads))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def with_library(grads, group):
    from course_lib.precision.loss_scale import overflow_on_any_rank

    return overflow_on_any_rank(grads, None)


def test_overflow_flag(capsys):
    assert graded(capsys, G.check_overflow_flag, flag_as_uint8)[0]
    fails_with(capsys, G.check_overflow_flag, local_only, hint="same verdict")
    fails_with(capsys, G.check_overflow_flag, sum_of_gradients, hint="ONE all_reduce")
    fails_with(capsys, G.check_overflow_flag, one_call_per_gradient, hint="ONE all_reduce")
    fails_with(capsys, G.check_overflow_flag, min_instead_of_max, hint="expected True")
    fails_with(capsys, G.check_overflow_flag, isinf_only, hint="nan")
    fails_with(capsys, G.check_overflow_flag, lambda grads, group: False, hint="expected True")
    fails_with(capsys, G.check_overflow_flag, with_library, hint="write this yourself")
    assert math.isnan(float("nan"))
