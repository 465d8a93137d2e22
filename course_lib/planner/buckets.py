"""The gradient buckets of the course's ``GradSync``, as the planner counts them (``runtime="course"``).

``GradSync`` (``course_lib.parallel.grad_sync``) walks a stage's parameters in reverse order and
fills one bucket per set of reduce dims until the next parameter would overflow its 25 MiB (a
larger parameter gets a bucket of its own); each bucket is one all-reduce. The planner sits
below ``parallel/`` and imports none of it: it walks the same parameters, those the planner's own
trace of a rank's model holds (:func:`course_lib.planner.kernels.trace_step`, ``"params"``), with
the same rule; ``tests/test_planner_course_tp.py`` checks the buckets against ``GradSync``'s own.
"""
from __future__ import annotations

import re

import torch

from course_lib.planner.kernel_cost import FOREACH, KernelModel, foreach_launches, op_cost
from course_lib.planner.kernels import Kernels

BUCKET_CAP_BYTES = 25 * 2**20     # GradSync's bucket_cap_mb = 25, on the CPU run's fp32 gradients
_EXPERT = re.compile(r"\.moe\.experts\.(\d+)\.")
DTYPES = {2: torch.bfloat16, 4: torch.float32}   # a floating tensor's dtype by its bytes


def stage_params(model, layout, params, n_layers: int, first: bool, last: bool, names: bool = False) -> list:
    """[(reduce dims, elements)] of one rank's parameters on a stage of ``n_layers`` blocks, in
    registration order. ``params``: (name, elements) of the one-block model on a TP rank. The
    norms' with SP are summed over (dp, cp, tp), an expert's over the ranks holding the same
    expert ("edp"; E / ep of them here, each 1 / etp of its width: w2's bias whole, summed over
    etp too, ("edp", "etp")), the rest over (dp, cp). ``names``: [(name, reduce dims, elements)]."""
    experts = model.n_experts // layout.ep if model.n_experts > 1 else 0
    out = []

    def add(name, n):
        found = _EXPERT.search(name)
        if found:
            if int(found.group(1)) < experts:
                whole = layout.etp > 1 and name.endswith("w2.bias")     # (added on etp rank 0)
                out.append((name, ("edp", "etp"), n) if whole else (name, ("edp",), n // layout.etp))
            return
        norm = "norm" in name.rsplit(".", 2)[-2]
        out.append((name, ("dp", "cp", "tp") if norm and layout.sp and layout.tp > 1 else ("dp", "cp"), n))
    block = [(name.split(".", 2)[2], n) for name, n in params if name.startswith("blocks.0.")]
    before = [(name, n) for name, n in params if name.endswith("_emb.weight")]
    after = [(name, n) for name, n in params if not name.startswith("blocks.") and (name, n) not in before]
    if first:
        for name, n in before:
            add(name, n)
    for _ in range(n_layers):
        for name, n in block:
            add("blocks.0." + name, n)
    if last:
        for name, n in after:
            add(name, n)
        if model.tied and not first:           # the tied head's own copy of the embedding
            add("lm_head.weight", dict(params)["tok_emb.weight"])
    return out if names else [(dims, n) for _, dims, n in out]


def assign_buckets(params, cap: float = BUCKET_CAP_BYTES, itemsize: int = 4) -> list:
    """[(reduce dims, elements, [elements of each member])] of each bucket, in the order they
    close: GradSync's rule on ``params`` [(reduce dims, elements)] (reverse order, one open
    bucket per dims)."""
    closed, open_ = [], {}
    for dims, n in reversed(params):
        if dims in open_ and (open_[dims][1] + n) * itemsize > cap:
            closed.append(tuple(open_.pop(dims)))
        entry = open_.setdefault(dims, [dims, 0, []])
        entry[1] += n
        entry[2].append(n)
    return closed + [tuple(v) for v in open_.values()]


def bucket_copy(hw, elements: int, itemsize: int = 2) -> Kernels:
    """GradSync's fill of one gradient into its bucket, ``view.copy_(p.grad)``, priced as the clock
    prices that op (:func:`~course_lib.planner.kernel_cost.op_cost`): ``copy_`` reads its source
    and names its destination twice (argument and result), 3 x the gradient's bytes, not a
    clone's 2 (the sweep's dp rows: the dry run's 1.05 GB embedding fill 3.66 ms, not 2.44)."""
    with torch.device("meta"):
        dst = torch.empty(elements)
        return priced(hw, torch.ops.aten.copy_.default, (dst, torch.empty(elements)), dst, itemsize)


def foreach_copy(hw, elements: int, itemsize: int = 2) -> Kernels:
    """ZeRO-1's sums written into the owned slices of the full gradients, one
    ``torch._foreach_copy_`` over the pieces, priced as the clock prices it (one launch of
    CUDA's multi-tensor apply on ``elements``)."""
    with torch.device("meta"):
        dst, src = torch.empty(elements), torch.empty(elements)
        return priced(hw, torch.ops.aten._foreach_copy_.default, ([dst], [src]), None, itemsize)


def row_pieces(sizes, group: int) -> list[int]:
    """Elements of each piece ZeRO-1/2 packs a bucket in: the gradients ``sizes`` end to end,
    cut where a rank's row of the reduce-scatter's buffer ends (rows of ceil(sum / group)
    elements, each followed by that rank's flags: :mod:`course_lib.parallel.zero_nd`)."""
    shard = -(-sum(sizes) // group)
    out, at = [], 0
    for n in sizes:
        while n:
            k = min(shard - at % shard, n)
            out.append(k)
            at, n = at + k, n - k
    return out


def bucket_fill(hw, sizes, group: int, itemsize: int = 2, source_itemsize: int | None = None) -> Kernels:
    """ZeRO-1/2's pack of one bucket's gradients into its buffer: one ``torch._foreach_copy_``
    over the pieces (:func:`row_pieces`), as the clock prices that op (each piece read, at
    ``source_itemsize`` bytes an element (the gradients' sums; default ``itemsize``), and its
    destination written, not read, at ``itemsize`` (the buffer's, the reduce dtype's); CUDA's
    multi-tensor apply's launches for two lists of them, at the foreach rate)."""
    pieces = row_pieces(sizes, group)
    n = sum(pieces)
    launches = foreach_launches(pieces, 2)
    cost = (n, n * (itemsize + (source_itemsize or itemsize)), FOREACH, launches)
    seconds = KernelModel(hw).roofline(*cost)
    return Kernels(launches, cost[0], cost[1], seconds, max(seconds, hw.kernel_floor * launches))


def priced(hw, func, args, out=None, itemsize: int | None = None) -> Kernels:
    """One aten op on meta tensors (``args``, ``out``) as the clock prices it: its
    :func:`~course_lib.planner.kernel_cost.op_cost` (``itemsize``: every floating tensor's
    bytes; None: each tensor's own dtype's) at :class:`KernelModel`'s seconds, floor included."""
    flops, nbytes, cls, detail = op_cost(func, args, {}, out, itemsize)
    model = KernelModel(hw)
    seconds = model.roofline(flops, nbytes, cls, detail)
    return Kernels(detail if cls is FOREACH else 1, flops, nbytes, seconds, model.seconds(flops, nbytes, cls, detail))


def zeros_write(hw, elements: int, itemsize: int) -> Kernels:
    """``torch.zeros`` of ``elements`` at ``itemsize`` bytes, as the clock prices it (written)."""
    with torch.device("meta"):
        out = torch.empty(elements, dtype=DTYPES[itemsize])
        return priced(hw, torch.ops.aten.zeros.default, ([elements],), out)


def add_into(hw, elements: int, itemsize: int) -> Kernels:
    """``a.add_(b)`` of ``elements`` at ``itemsize`` bytes (two read, one written), as the clock
    prices it."""
    with torch.device("meta"):
        a, b = (torch.empty(elements, dtype=DTYPES[itemsize]) for _ in range(2))
        return priced(hw, torch.ops.aten.add_.Tensor, (a, b), a)


__all__ = ["bucket_copy", "foreach_copy", "bucket_fill", "priced", "zeros_write", "add_into", "DTYPES", "row_pieces",
           "BUCKET_CAP_BYTES", "stage_params", "assign_buckets"]
