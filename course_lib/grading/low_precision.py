"""Graders of chapter 9c (fp16 loss scaling, FP8).

    check_scale_schedule(scale_schedule)     # the loss scaler's rule over a run's overflow flags
    check_delayed_scales(delayed_scales)     # FP8 delayed scaling: the scale from an amax history
    check_quantize_fp8(quantize_fp8)         # quantise to e4m3 / e5m2 with a scale, saturating
    check_overflow_flag(overflow_anywhere)   # on ranks: one verdict for the mesh, one tiny all-reduce

Each prints one line and returns True/False. While the learner's function runs,
course_lib.precision, torch's GradScaler and its kernels, and this module's references are off.
"""
from __future__ import annotations

import math
import random

import torch

from course_lib.grading import Case, Mismatch, check_distributed, compare, learner
from course_lib.grading.harness import check_answers
from course_lib.precision.fp8 import TensorScaling, quantize
from course_lib.precision.loss_scale import update_scale

REFERENCES = ("course_lib.grading.low_precision:_schedule", "course_lib.grading.low_precision:_delayed_scales")
LIBRARY = ("course_lib.precision.loss_scale:*", "course_lib.precision.fp8:*",
           "torch:_amp_update_scale_", "torch:_amp_foreach_non_finite_check_and_unscale_",
           "torch.amp.grad_scaler:GradScaler", "torch.amp:GradScaler", "torch.cpu.amp:GradScaler",
           "torch.cuda.amp:GradScaler")
FP8_BY_MAX = {torch.finfo(d).max: d for d in (torch.float8_e4m3fn, torch.float8_e5m2)}


# ----------------------------------------------------------------------------- 1. the scaler's rule
def _schedule(overflows, init_scale, growth_factor, backoff_factor, growth_interval):
    """The library's one-step rule (torch's ``_amp_update_scale_``) over a run's flags."""
    scale, tracker, scales = init_scale, 0, []
    for overflow in overflows:
        scales.append(scale)
        scale, tracker = update_scale(scale, tracker, overflow, growth_factor=growth_factor,
                                      backoff_factor=backoff_factor, growth_interval=growth_interval)
    return scales, [not overflow for overflow in overflows]


def _flags(pattern: str):
    return [c == "X" for c in pattern]


def _schedule_cases():
    rng = random.Random(2026)
    long_run = [rng.random() < 0.0004 for _ in range(6000)]   # rare overflows, default interval
    cases = [
        (_flags("......."), 2.0 ** 16, 2.0, 0.5, 3, "no overflow, growth_interval 3"),
        (_flags("XXX...."), 2.0 ** 24, 2.0, 0.5, 2, "three overflows first"),
        (_flags("..X..X...X.."), 1024.0, 2.0, 0.5, 3, "an overflow resets the good-step count"),
        (_flags("X.X.XX....."), 2.0 ** 10, 2.0, 0.5, 1, "growth_interval 1"),
        (_flags("....X......"), 2.0 ** 16, 4.0, 0.25, 2, "growth 4, backoff 0.25"),
        (_flags("......"), 2.0 ** 126, 2.0, 0.5, 2, "the scale never grows past float32's max"),
        (long_run, 2.0 ** 16, 2.0, 0.5, 2000, "6000 steps with torch's defaults"),
    ]
    return [Case(params=dict(args=(f, s, g, b, n)), label=label) for f, s, g, b, n, label in cases]


def _as_schedule(got, *args):
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise Mismatch("return a pair (scales, stepped): two lists with one entry per step")
    return list(got[0]), [bool(s) for s in got[1]]


def _schedule_differ(got, want, *args):
    (scales, stepped), (want_scales, want_stepped) = got, want
    if len(scales) != len(want_scales) or len(stepped) != len(want_stepped):
        return f"{len(scales)} scales and {len(stepped)} flags for {len(want_scales)} steps: one of each per step"
    for i, (a, b) in enumerate(zip(stepped, want_stepped)):
        if a != b:
            return (f"step {i}: stepped={a}, expected {b} (a step whose gradients overflowed is skipped, every "
                    f"other one is taken)")
    for i, (a, b) in enumerate(zip(scales, want_scales)):
        if compare(float(a), b, exact=True):
            return (f"the scale at step {i} is {a}, expected {b} (overflow: multiply by the backoff factor "
                    f"and restart the count of good steps; the growth_interval-th good step in a row "
                    f"multiplies by the growth factor and restarts the count)")


def check_scale_schedule(fn) -> bool:
    """fn(overflows, init_scale, growth_factor, backoff_factor, growth_interval) ->
    (scales, stepped): the scale step i's loss is multiplied by, and whether step i stepped."""
    return check_answers("scale_schedule", fn, _schedule_cases(), _schedule, guard=(LIBRARY, REFERENCES),
                         exercise="the loss scaler's update rule", read=_as_schedule, differ=_schedule_differ)


# ----------------------------------------------------------------------------- 2. delayed scaling
def _delayed_scales(amaxes, history_len, fp8_max):
    """The library's delayed scaling (an amax history of ``history_len`` steps) over a run."""
    scaling = TensorScaling(FP8_BY_MAX[fp8_max], "delayed", history_len)
    return [scaling.scale_for(torch.tensor([amax], dtype=torch.float64)) for amax in amaxes]


def _delayed_cases():
    rng = random.Random(9)
    noisy = [round(rng.uniform(0.5, 3.0), 3) for _ in range(40)]
    cases = [
        ([1.0, 4.0, 2.0, 2.0, 0.5, 0.5, 0.5, 0.5], 3, 448.0, "a spike that leaves a 3-step window"),
        ([2.0, 1.0, 1.0, 1.0, 8.0, 1.0], 2, 57344.0, "e5m2's max, a late spike"),
        ([0.0, 0.0, 3.0, 1.0], 2, 448.0, "amax 0: scale 1"),
        ([5.0, 1.0, 1.0, 1.0, 1.0], 1, 448.0, "history of one step"),
        (noisy, 16, 448.0, "40 steps, history 16"),
    ]
    return [Case(params=dict(args=(a, h, m)), label=label) for a, h, m, label in cases]


def check_delayed_scales(fn) -> bool:
    """fn(amaxes, history_len, fp8_max) -> the scale each step quantises with (delayed scaling)."""
    def differ(got, want, *args):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return f"return one scale per step ({len(want)} of them)"
        for t, (g, w) in enumerate(zip(got, want)):
            # fp8_max / amax computed another way (1 / amax * fp8_max) differs by 2 roundings
            if compare(float(g), w, dtype=torch.float64, terms=2, scale=w):
                return (f"step {t}: scale {float(g):.6g}, expected {w:.6g} (fp8_max / the largest amax of the "
                        f"previous history_len steps, this step's not included yet)")
    return check_answers("delayed_scales", fn, _delayed_cases(), _delayed_scales, guard=(LIBRARY, REFERENCES),
                         exercise="delayed scaling's amax history", differ=differ)


# ----------------------------------------------------------------------------- 3. quantise
def _quantize_cases():
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(64, generator=gen) * torch.logspace(-6, 3, 64)   # 9 decades
    cases = [
        (torch.tensor([1.0, 3.0, -0.1, 0.004, 300.0]), 1.0, torch.float8_e4m3fn, "e4m3, scale 1"),
        (torch.tensor([1000.0, -5000.0, 447.0, 2.0]), 1.0, torch.float8_e4m3fn, "e4m3 saturates at 448"),
        (torch.tensor([1e6, -1e5, 6e4, 3.0]), 1.0, torch.float8_e5m2, "e5m2 saturates at 57344, no inf"),
        (torch.tensor([1e-5, 3e-6, -2e-7, 1e-3]), 2.0 ** 16, torch.float8_e5m2, "small gradients, scale 2**16"),
        (wide, 2.0 ** -3, torch.float8_e4m3fn, "9 decades, scale 2**-3"),
        (wide, 2.0 ** 4, torch.float8_e5m2, "9 decades, scale 2**4"),
    ]
    return [Case(params=dict(args=(x, s, d)), label=label) for x, s, d, label in cases]


def check_quantize_fp8(fn) -> bool:
    """fn(x, scale, dtype) -> x * scale rounded to ``dtype`` (a float8 tensor), saturated."""
    def differ(got, want, x, scale, dtype):
        if not isinstance(got, torch.Tensor) or got.dtype != dtype:
            kind = got.dtype if isinstance(got, torch.Tensor) else type(got).__name__
            return f"return a tensor of dtype {dtype} (the 8-bit codes), got {kind}"
        if not torch.isfinite(got.float()).all():
            return ("an inf or NaN in the result: saturate first (clamp x * scale to +-the format's max, "
                    "torch.finfo(dtype).max)")
        return compare(got.view(torch.uint8), want.view(torch.uint8), exact=True, what="8-bit codes")
    return check_answers("quantize_fp8", fn, _quantize_cases(), quantize, guard=(LIBRARY, REFERENCES),
                         exercise="FP8 quantisation with a scale", differ=differ)


# ----------------------------------------------------------------------------- 4. the flag over ranks
def _flag_harness(fn, bad_rank, bad_value, n_grads):
    """On each rank: a few gradients, one poisoned on ``bad_rank`` (None: nowhere, -1: every rank)."""
    import torch.distributed as dist

    from course_lib.grading.training import CollectiveWatch

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(5, 3, generator=gen) * 1e3 for _ in range(n_grads)]
    if grads and bad_rank is not None and (bad_rank == rank or bad_rank == -1):
        grads[-1][2, 1] = bad_value
    want = bad_rank is not None and bool(n_grads)
    with CollectiveWatch() as watch:
        got = fn(grads, None)
    if not isinstance(got, (bool, int)) and not (isinstance(got, torch.Tensor) and got.numel() == 1):
        return f"return True or False, got {type(got).__name__}"
    if bool(got) != want:
        where = {None: "no rank", -1: "every rank"}.get(bad_rank, f"rank {bad_rank} only")
        return (f"returned {bool(got)}, expected {want}: {bad_value} in a gradient on {where} of {world} "
                f"(every rank must return the same verdict: some rank overflowed)")
    calls = watch.calls
    if len(calls) != 1 or calls[0][0] != "all_reduce" or calls[0][1] > 8:
        return (f"collectives called: {calls}; expected ONE all_reduce of a single number (a flag, "
                f"reduced with MAX), whatever the number and size of the gradients")
    return None


def check_overflow_flag(fn) -> bool:
    """fn(grads, group) -> True if any gradient on any rank of ``group`` is inf or NaN (on ranks)."""
    wrapped = learner(fn, "course_lib.precision.loss_scale:*", exercise="the overflow flag over the mesh")
    cases = [Case(params=dict(fn=wrapped, bad_rank=b, bad_value=v, n_grads=n), world_size=w, label=label)
             for b, v, n, w, label in (
                 (1, math.inf, 3, 3, "inf on rank 1 only"),
                 (3, math.nan, 3, 4, "NaN on rank 3 only"),
                 (None, 0.0, 4, 3, "no overflow anywhere"),
                 (-1, -math.inf, 2, 2, "-inf on every rank"))]
    return check_distributed("overflow_flag", _flag_harness, cases, timeout=60)


__all__ = ["check_scale_schedule", "check_delayed_scales", "check_quantize_fp8", "check_overflow_flag"]
