"""How close a parallel run must be to one device: bounds derived from the arithmetic.

    from course_lib import tolerance
    tolerance.assert_matches(grads, ref_grads, dtype=torch.float32)             # one step
    tolerance.assert_matches(params, ref_params, dtype=torch.float64,
                             optimizer="adamw", steps=5, lr=1e-2)               # after 5 steps
    ok = tolerance.compare(params, ref_params, ...)   # a Comparison: ok, worst, bound, why

A correct parallel run computes the same sums as one device in another order (a ring adds the
ranks' partial gradients in ring order, tensor parallelism splits a matmul's inner dimension,
every CPU's kernels block a matmul their own way). Rounding is all that may differ, and it is
bounded:

1. **One step** (outputs, losses, the first step's gradients). Adding K terms in another
   order changes the sum by at most 2 K u sum|terms|, u the format's unit roundoff (Higham,
   *Accuracy and Stability of Numerical Algorithms*, sec. 4.2). We bound K by ``TERMS`` (the
   longest chain of additions in the course's test models: depth x widest sum < 2**12) and
   compare norm-wise, against the largest magnitude among everything compared together:
   ``|got - want| <= 2 K u max|want|``. fp32: 4.9e-4 of that scale; fp64: 9.1e-13. Not each
   tensor's own scale: a sum's rounding follows its terms, not its result (a key bias's
   gradient is zero under softmax, yet carries the rounding of the terms that cancel).
   A missing, doubled or mis-scaled reduction is wrong by O(1) of the scale.
2. **After k SGD steps**: each step moves a parameter by lr g, so an error a in g adds lr a:
   ``k lr 2 K u G`` (G: the largest gradient element, ``grad_scale``). With momentum b the
   error of step j is applied again at every later step, shrunk by b each time: step t adds
   lr a (1 - b^t) / (1 - b).
3. **After k AdamW steps**: the update lr m/(sqrt(v) + eps) divides by each element's own
   running RMS. Its derivative in g is at most 1/eps (at g = 0), and the update itself is at
   most B lr (B = 1 at step 1; |m|/sqrt(v) <= (1-b1)/sqrt((1-b2)(1-b1^2/b2)) later, by
   Cauchy-Schwarz). A gradient error a therefore moves a parameter by up to
   ``lr min(2 B, a / eps)`` per step. In fp32, a = 2 K u G is about 1e-5 G: far above
   eps = 1e-8, so a correct fp32 run may differ from one device by ~lr per step in
   parameters whose gradient is near zero (measured: 2.8e-5 after 5 steps at lr 1e-2 on
   AVX-512, 6.8e-6 with the default kernels, on the same machine). No tolerance tighter than
   that follows for fp32 AdamW, whatever one CPU shows. In fp64, a / eps ~ 1e-4 G: the bound
   is ~1e-6 lr k. **Where exactness after optimizer steps is the claim, run in float64**;
   in fp32 check the first step's gradients and losses (bound 1) tightly.

Weight decay contracts a difference by (1 - lr wd) per step, and rounding the parameter
itself adds 2 u |param|: both are included. A later step's gradient also changes with the
parameters' difference (second order: k lr times the Hessian times that difference); the
bounds neglect it, which the fp64 margins allow (measured: 2e-14 against the bound 4.6e-6
after 5 steps at lr 1e-2). AdamW hides a wrongly scaled gradient (it is scale-invariant up
to eps), so a test of parameters after AdamW steps also checks the first step's gradients.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TERMS = 2 ** 12   # longest chain of additions in the course's test models (see the docstring)
UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24,
                 torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
OPTIMIZERS = ("none", "sgd", "adamw")


def unit_roundoff(dtype) -> float:
    """u: half the gap between 1 and the next number of ``dtype``."""
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff for {dtype}; known: {sorted(map(str, UNIT_ROUNDOFF))}")
    return UNIT_ROUNDOFF[dtype]


def reorder_bound(dtype, terms: int = TERMS) -> float:
    """2 K u: how far a reordered sum of K terms may move, relative to the terms' magnitude."""
    return 2 * terms * unit_roundoff(dtype)


def adam_ratio_bound(steps: int, betas=(0.9, 0.999)) -> float:
    """The largest |m_hat| / sqrt(v_hat) Adam can produce after ``steps`` steps (Cauchy-Schwarz):
    1 at step 1, about 7.3 for (0.9, 0.999) in the long run."""
    b1, b2 = betas
    if steps < 1:
        return 0.0
    ratio = (1 - b1) / (1 - b1 ** steps) * math.sqrt((1 - b2 ** steps) / (1 - b2))
    return ratio * math.sqrt(sum((b1 * b1 / b2) ** j for j in range(steps)))


def parameter_bound(dtype, *, optimizer="none", steps=0, lr=0.0, grad_scale=1.0, eps=1e-8,
                    betas=(0.9, 0.999), momentum=0.0, terms: int = TERMS) -> float:
    """The absolute difference a correct run may show in a parameter after ``steps`` optimizer
    steps (the docstring's bounds 2 and 3); 0 for ``optimizer="none"``."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if steps < 0 or lr < 0 or grad_scale < 0:
        raise ValueError(f"steps, lr and grad_scale must be >= 0, got {steps}, {lr}, {grad_scale}")
    a = reorder_bound(dtype, terms) * grad_scale            # error in one gradient element
    if optimizer == "sgd":
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        return sum(lr * a * (1 - momentum ** t) / (1 - momentum) if momentum else lr * a
                   for t in range(1, steps + 1))
    if optimizer == "adamw":
        return sum(lr * min(2 * adam_ratio_bound(t, betas), a / eps) for t in range(1, steps + 1))
    return 0.0


@dataclass
class Comparison:
    """The outcome of ``compare``: ``worst`` is the tensor closest to (or past) its bound."""
    ok: bool
    worst: str
    diff: float
    bound: float
    why: str

    def __bool__(self):
        return self.ok

    def __str__(self):
        verdict = "within" if self.ok else "OUTSIDE"
        return f"{self.worst}: |diff| {self.diff:.3g} {verdict} the bound {self.bound:.3g} ({self.why})"


def _as_dict(x):
    if isinstance(x, torch.Tensor):
        return {"tensor": x}
    if isinstance(x, dict):
        return x
    if isinstance(x, (list, tuple)):   # e.g. one loss per step
        return {f"[{i}]": torch.as_tensor(v) for i, v in enumerate(x)}
    raise TypeError(f"compare takes a tensor, a dict of tensors or a list of numbers, got {type(x).__name__}")


def compare(got, want, *, dtype=None, optimizer="none", steps=0, lr=0.0, grad_scale=1.0,
            eps=1e-8, betas=(0.9, 0.999), momentum=0.0, terms: int = TERMS, scale=None) -> Comparison:
    """Compare ``got`` (a parallel run) with ``want`` (one device), tensor by tensor, with the
    bound the arithmetic allows (module docstring). ``dtype``: the precision both ran in
    (default: ``want``'s). ``optimizer``/``steps``/``lr``: the steps taken since the values
    were last equal; "none" compares one step's outputs, losses or gradients. ``scale``: the
    magnitude of the summed terms where the caller knows it (sum |x_i|), else the largest
    value compared."""
    got, want = _as_dict(got), _as_dict(want)
    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        return Comparison(False, "keys", math.inf, 0.0, f"missing {missing}, unexpected {extra}")
    worst = Comparison(True, "", 0.0, 0.0, "nothing compared")
    worst_ratio = -1.0
    overall = float(scale) if scale is not None else max(
        [float(torch.as_tensor(w).detach().abs().max()) for w in want.values()
         if torch.as_tensor(w).numel()] or [0.0])   # the one-step bound's scale
    for name, w in want.items():
        g = torch.as_tensor(got[name])
        w = torch.as_tensor(w)
        if g.shape != w.shape:
            return Comparison(False, name, math.inf, 0.0, f"shape {tuple(g.shape)} != {tuple(w.shape)}")
        kind = dtype or (w.dtype if w.is_floating_point() else torch.float64)
        w64, g64 = w.detach().double().cpu(), g.detach().double().cpu()
        scale = float(w64.abs().max()) if w64.numel() else 0.0
        if not torch.isfinite(g64).all() and not torch.equal(g64.isnan(), w64.isnan()):
            return Comparison(False, name, math.nan, 0.0, "non-finite values where one device has none")
        if optimizer == "none":
            bound = reorder_bound(kind, terms) * overall
            why = f"one step: 2 K u max|want|, K={terms}, u={unit_roundoff(kind):.3g}"
        else:
            bound = parameter_bound(kind, optimizer=optimizer, steps=steps, lr=lr, grad_scale=grad_scale,
                                    eps=eps, betas=betas, momentum=momentum, terms=terms) \
                + 2 * unit_roundoff(kind) * scale
            why = f"{steps} {optimizer} steps at lr {lr:g}, {kind}: lr min(2B, 2KuG/eps) per step + 2u|param|"
        finite = torch.isfinite(w64)
        diff = float((g64 - w64)[finite].abs().max()) if finite.any() else 0.0
        ratio = diff / bound if bound > 0 else (math.inf if diff > 0 else 0.0)
        if ratio > worst_ratio:
            worst_ratio = ratio
            worst = Comparison(diff <= bound, name, diff, bound, why)
    return worst


def assert_matches(got, want, *, what: str = "", **bounds) -> Comparison:
    """``compare`` that raises an AssertionError naming the tensor outside its bound."""
    result = compare(got, want, **bounds)
    if not result.ok:
        raise AssertionError(f"{what + ': ' if what else ''}{result}")
    return result


__all__ = ["TERMS", "unit_roundoff", "reorder_bound", "adam_ratio_bound", "parameter_bound",
           "Comparison", "compare", "assert_matches"]
