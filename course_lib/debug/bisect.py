"""Loss-parity bisection: the first step and parameter whose gradient differs from one device,
and which mesh dimension's reduction is missing, doubled or wrongly scaled.

    # in each rank, after every step's backward and gradient sync:
    steps.append(grads_of(net.named_parameters(), net.placements))   # {name: (grad, its TP slice)}
    # in the caller, with the single-device run's gradients of the same steps:
    found = first_divergence([r["grads"] for r in results], ref_grads, MeshShape(dp=2, cp=2))
    print(found)      # step 0, 'fc1.weight' ... the reduction over cp is missing

A layout whose loss drifts from one device is wrong somewhere in one of a handful of sums.
Comparing every step's gradients with the reference's (through ``course_lib.tolerance``'s
one-step bound) finds the first step and parameter that differ; then the gradients
themselves say which sum is wrong. With ``g_r`` rank r's gradient and ``G`` one device's
(the slice rank r holds):

* **missing over S**: summing ``g`` over each group of dimensions S (the ranks that differ
  only in S) gives ``G`` -- what the missing all-reduce would have done;
* **doubled / scaled by |S|**: ``g = |S| G`` (the reduction over S ran twice, or a loss
  divided by the local instead of the global token count) or ``g = G / |S|`` (a mean where
  a sum belongs: the loss is already divided by the global count);
* **wrongly scaled**: ``g = c G`` for another constant c;
* otherwise: not a reduction's fault (dropout or RNG not synchronised, a wrong slice, ...).

The candidates are tried smallest first (one dimension before two), each through the same
tolerance, so a correct sum never matches a wrong hypothesis by rounding.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from course_lib import tolerance

DIMS = ("dp", "pp", "cp", "tp")


def grads_of(named_parameters, placements=None) -> dict:
    """{name: (gradient clone, where its TP shard sits or None)} of this rank's parameters
    (``where`` = (dim, start, stop, full size), the TP slice of the plan's record
    ``placements``: ``NDParallel.placements``; none given: whole tensors)."""
    items = named_parameters.items() if isinstance(named_parameters, dict) else named_parameters
    where = {n: p.tp for n, p in (placements or {}).items()}
    return {n: (p.grad.detach().clone(), where.get(n)) for n, p in items if p.grad is not None}


def _split(value):
    return value if isinstance(value, tuple) else (value, None)


def _slice(full, where):
    if where is None:
        return full
    dim, start, stop, _ = where
    return full.narrow(dim, start, stop - start)


@dataclass
class Divergence:
    """Where a parallel run first left one device, and why."""
    step: int
    name: str
    ranks: list          # the ranks whose gradient differs
    comparison: object   # tolerance.Comparison of the worst of them
    cause: str           # "missing", "scaled", "update", "other"
    dims: tuple          # the dimensions the cause names
    factor: float        # g = factor * G ("scaled"), else 1.0
    explanation: str

    def __str__(self):
        ranks = ", ".join(map(str, self.ranks))
        return (f"step {self.step}, parameter '{self.name}' differs on rank{'s' if len(self.ranks) > 1 else ''} "
                f"{ranks}: {self.explanation}")


def groups(shape, dims) -> list:
    """The rank sets along ``dims`` (ranks that differ only in those coordinates)."""
    out = {}
    for rank in range(shape.world_size):
        c = shape.coords(rank)
        out.setdefault(tuple(c[d] for d in DIMS if d not in dims), []).append(rank)
    return sorted(out.values())


def _size(shape, dims) -> int:
    n = 1
    for d in dims:
        n *= shape.sizes[d]
    return n


def _matches(got: dict, want: dict, dtype, scale) -> bool:
    return bool(tolerance.compare(got, want, dtype=dtype, scale=scale))


def explain(held: dict, want: dict, shape, dtype=None, scale=None) -> tuple:
    """``held``: {rank: (grad, where)}, ``want``: {rank: one device's slice} -> (cause, dims, factor, text)."""
    dims = [d for d in DIMS if shape.sizes.get(d, 1) > 1]
    subsets = [s for k in range(1, len(dims) + 1) for s in itertools.combinations(dims, k)]
    for S in subsets:   # a missing sum over S: the sum over each S-group is one device's
        sums, valid, differ = {}, True, False
        for members in groups(shape, S):
            here = [r for r in members if r in held]
            if not here:
                continue                          # (a pipeline stage that does not hold it)
            if len({held[r][1] for r in here}) != 1:
                valid = False                     # different TP slices along S: not a sum over S
                break
            total = sum(held[r][0].double() for r in here)
            sums.update({r: total for r in here})
            differ = differ or not _matches({r: held[r][0] for r in here}, {r: held[here[0]][0] for r in here},
                                            dtype, scale)
        # (equal replicas summed once more are a scaling, not a missing sum: tried below)
        if valid and differ and _matches(sums, {r: want[r] for r in sums}, dtype, scale):
            return ("missing", S, 1.0, f"the reduction over {' and '.join(S)} is missing: the sum over each "
                    f"{'+'.join(S)} group of the ranks' gradients matches one device")
    got = {r: held[r][0].double() for r in held}
    sizes = {S: _size(shape, S) for S in subsets}
    for n in sorted(set(sizes.values())):   # the values cannot tell apart dimensions of one size: name all
        names = " or ".join(" and ".join(S) for S in subsets if sizes[S] == n)
        first = next(S for S in subsets if sizes[S] == n)
        if _matches({r: g / n for r, g in got.items()}, want, dtype, scale):
            return ("scaled", first, float(n), f"the gradient is {n} times one device's: the reduction over "
                    f"{names} ran twice, or the loss was divided by a local instead of the global count")
        if _matches({r: g * n for r, g in got.items()}, want, dtype, scale):
            return ("scaled", first, 1.0 / n, f"the gradient is 1/{n} of one device's: averaged over "
                    f"{names} where a sum belongs (the loss is already divided by the global count)")
    num = sum(float((got[r] * want[r].double()).sum()) for r in got)
    den = sum(float((want[r].double() ** 2).sum()) for r in got)
    if den > 0 and _matches({r: g * (den / num) if num else g for r, g in got.items()}, want, dtype, scale):
        return ("scaled", (), num / den, f"the gradient is {num / den:.4g} times one device's: a wrong scale "
                "(a divisor), not a missing sum")
    return ("other", (), 1.0, "no missing, doubled or scaled reduction over any mesh dimension explains it: "
            "the ranks that differ ran another forward (an RNG not synchronised, other data, a wrong slice)")


def _first_difference(per_rank, ref, step, **bounds):
    """The first name in ``ref`` whose value differs on some rank at ``step``:
    (name, held {rank: (value, where)}, want {rank: slice}, bad ranks, worst Comparison) or None."""
    for name, full in ref.items():
        held = {r: _split(steps[step][name]) for r, steps in enumerate(per_rank)
                if step < len(steps) and name in steps[step]}
        want = {r: _slice(full, where) for r, (_, where) in held.items()}
        checks = {r: tolerance.compare(held[r][0], want[r], **bounds) for r in held}
        bad = [r for r, c in checks.items() if not c]
        if bad:
            return name, held, want, bad, checks[bad[0]]
    return None


def first_divergence(per_rank: list, reference: list, shape, *, dtype=None, params=None, ref_params=None,
                     **optimizer):
    """``per_rank[r][step]``: rank r's {name: grad or (grad, where)}; ``reference[step]``: one
    device's {name: grad}. The first (step, parameter in the reference's order) whose gradient
    differs on some rank, with its explanation (a :class:`Divergence`), or None.

    ``params[r][step]`` / ``ref_params[step]`` (optional): the parameters entering each step,
    compared within the optimizer's bound (``optimizer``: tolerance's ``optimizer="sgd", lr=...``).
    Parameters that differ while every earlier gradient matched: the update is at fault."""
    if len(per_rank) != shape.world_size:
        raise ValueError(f"per_rank holds {len(per_rank)} ranks but the mesh has {shape.world_size}")
    for step, ref in enumerate(reference):
        if params is not None and step > 0:
            found = _first_difference(params, ref_params[step], step, dtype=dtype, steps=step, **optimizer)
            if found:
                name, _, _, bad, worst = found
                return Divergence(step, name, bad, worst, "update", (), 1.0,
                                  f"the parameters entering step {step} differ although every gradient of "
                                  f"{'step 0' if step == 1 else f'steps 0..{step - 1}'} matched one device: "
                                  f"the update used other gradients "
                                  f"(an optimizer step before the gradient sync finished?)")
        scale = max(float(t.detach().abs().max()) for t in ref.values() if t.numel())   # the step's scale
        found = _first_difference(per_rank, ref, step, dtype=dtype, scale=scale)
        if found:
            name, held, want, bad, worst = found
            cause, dims, factor, text = explain(held, want, shape, dtype, scale)
            return Divergence(step, name, bad, worst, cause, dims, factor, text)
    return None


__all__ = ["grads_of", "groups", "explain", "first_divergence", "Divergence"]
