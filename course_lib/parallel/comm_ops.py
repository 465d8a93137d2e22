"""The communication operators of tensor and sequence parallelism, as autograd functions.

Each is a pair: what it does to activations in forward, and what that forces on their
gradients in backward (the transpose). Named as in the papers:

    op                            forward          backward         paper
    copy_to_parallel              identity         all-reduce       f      (Shoeybi et al. 2019, Megatron-LM)
    reduce_from_parallel          all-reduce       identity         g      (Shoeybi et al. 2019)
    gather_from_sequence_parallel all-gather       reduce-scatter   g      (Korthikanti et al. 2022, SP)
    scatter_to_sequence_parallel  reduce-scatter   all-gather       g-bar  (Korthikanti et al. 2022, SP)
    split_to_parallel             keep my slice    all-gather       (enter a sharded region, no sum)
    gather_from_parallel          all-gather       keep my slice    (leave it: "concatenate the outputs")
    sum_over_copies               identity         all-reduce of the copies' gradients (a weight several
                                                   ranks hold, e.g. a K/V head shared by their query heads)

``f`` sits where a replicated activation enters a column-parallel layer: every rank uses
the same input, so the input's gradient is the SUM of every rank's partial gradient.
``g`` sits after a row-parallel layer: each rank holds a partial sum of the output.
With sequence parallelism (SP), the activations between the layers are split along the
sequence instead of replicated: ``g`` becomes a reduce-scatter and ``f`` an all-gather; the
bytes are the same, the activation memory is 1/t. The two papers name them differently:
Korthikanti et al. call the TP pair f and f-bar (2019's f and g) and the SP pair g (the
all-gather entering a region) and g-bar (the reduce-scatter leaving it), so "g" is the
exit all-reduce in one paper and the entry all-gather in the other. Spans and docstrings
here say "SP g" and "SP g-bar" for the second pair.

Every op takes the :class:`~course_lib.collectives.comm.Comm` of its group (e.g.
``mesh.comm("tp")``), so the calls are counted, measured and traced like any other.
``dim`` is the tensor dimension that is gathered or scattered (the sequence: 1 for
(batch, seq, hidden)); it must split evenly over the group.
"""
from __future__ import annotations

import contextlib

import torch

from course_lib import trace
from course_lib.collectives.comm import Comm


def _check(comm, x, dim=None):
    if not isinstance(comm, Comm):
        raise TypeError(f"pass the group's Comm (e.g. mesh.comm('tp')), got {type(comm).__name__}")
    if dim is not None and not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is not a dimension of a tensor of shape {tuple(x.shape)}")


def layout_copies(sequence: bool):
    """Where the copies that move a (batch, sequence, hidden) activation's sequence to the front
    and back run: priced as kernels, unless ``sequence`` (the dimension is the sequence of a
    sequence-parallel collective) and this rank's virtual clock runs a program that keeps its
    activations (sequence, batch, hidden), Megatron-LM's, where the sequence is already first
    and no such copy exists (``clock.sequence_first``: the dry run's ``"sequence_first"``
    software item). The copies still run on the CPU: the values are the same."""
    clock = trace.clock() if sequence else None
    return clock.muted() if clock is not None and getattr(clock, "sequence_first", False) \
        else contextlib.nullcontext()


def gather_along(comm, x, dim, name, async_op=False, sequence=False):
    """(.., n, ..) on each rank -> (.., size * n, ..): the pieces in group-rank order along ``dim``.
    ``async_op``: the all-gather is launched and a function returned that waits for it and
    gives the result (the caller computes in between: Megatron-LM 2022's SP backward).
    ``sequence``: ``dim`` is the sequence (:func:`layout_copies`)."""
    with layout_copies(sequence):
        x = x.movedim(dim, 0).contiguous()                           # (n, ...) gathered along dim 0
    out = x.new_empty((comm.size * x.shape[0], *x.shape[1:]))
    work = comm.all_gather_into_tensor(out, x, name=name, async_op=async_op)

    def result():
        if work is not None:
            work.wait()
        with layout_copies(sequence):
            return out.movedim(0, dim).contiguous()  # one copy here, not one per layer that reads it
    return result if async_op else result()


def reduce_scatter_along(comm, x, dim, name, async_op=False, sequence=False):
    """(.., size * n, ..) on each rank -> (.., n, ..): the sum over ranks of this rank's piece.
    ``async_op``: as :func:`gather_along`'s, a function that waits and gives the result;
    ``sequence``: as :func:`gather_along`'s."""
    if x.shape[dim] % comm.size:
        raise ValueError(f"{name}: dimension {dim} of size {x.shape[dim]} does not split evenly over the "
                         f"{comm.size} ranks of the group (sequence parallelism needs seq % tp == 0)")
    with layout_copies(sequence):
        x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // comm.size, *x.shape[1:]))
    work = comm.reduce_scatter_tensor(out, x, name=name, async_op=async_op)

    def result():
        if work is not None:
            work.wait()
        return out.movedim(0, dim)
    return result if async_op else result()


def _split(comm, x, dim):
    if x.shape[dim] % comm.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split evenly over the "
                         f"{comm.size} ranks of the group")
    return x.chunk(comm.size, dim)[comm.rank].contiguous()


def reduces_in_place(x, in_place) -> bool:
    """May the all-reduce write into ``x`` itself? Only where the caller said it owns ``x``
    (``in_place``), and ``x`` is a whole contiguous tensor: not a view (an in-place write
    through a view makes autograd copy the base in backward) nor a leaf that requires grad."""
    return in_place and x.is_contiguous() and x._base is None and not (x.is_leaf and x.requires_grad)


def _all_reduce(comm, x, name, in_place=False):
    if not reduces_in_place(x, in_place):
        x = x.contiguous().clone()  # someone else may read x (autograd saved it, or another branch)
    comm.all_reduce(x, name=name)
    return x


class CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce backward (the input was used by every rank).

    ``in_place``: the gradient that arrives is this Function's alone (the output is read by
    matmuls only, whose backward hands it a fresh tensor), so it is summed where it lies, as
    Megatron-LM's ``_reduce`` does; otherwise it is copied first: torch's autograd may hand the
    same tensor to another Function too (an add's backward passes one gradient to both inputs)."""

    @staticmethod
    def forward(ctx, x, comm, in_place=False):
        ctx.comm, ctx.in_place = comm, in_place
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(ctx.comm, grad, "f: all-reduce (backward)", ctx.in_place), None, None


class ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs), identity backward.

    ``in_place``: ``x`` is the caller's fresh partial sum (a row-parallel matmul's output, which
    autograd did not save), summed where it lies (``mark_dirty``), as Megatron-LM does."""

    @staticmethod
    def forward(ctx, x, comm, in_place=False):
        if reduces_in_place(x, in_place):
            comm.all_reduce(x, name="g: all-reduce")
            ctx.mark_dirty(x)
            return x
        return _all_reduce(comm, x, "g: all-reduce")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class GatherFromSequenceParallel(torch.autograd.Function):
    """SP g: all-gather along ``dim`` forward, reduce-scatter backward. ``region``: the region's
    :class:`~course_lib.parallel.tensor_parallel.SequenceShardInput`, whose single column layer
    may have reduce-scattered the gradient itself, under its weight gradient (``region.reduced``,
    Megatron-LM 2022's overlap): then that is the result, not a second reduce-scatter."""

    @staticmethod
    def forward(ctx, x, comm, dim, region=None):
        ctx.comm, ctx.dim, ctx.region = comm, dim, region
        return gather_along(comm, x, dim, "SP g: all-gather", sequence=True)

    @staticmethod
    def backward(ctx, grad):
        region = ctx.region
        if region is not None and region.reduced is not None:
            (source, reduced), region.reduced = region.reduced, None
            if grad is source:        # the column layer's dX is the whole gradient: no other reader
                return reduced, None, None, None
        return (reduce_scatter_along(ctx.comm, grad, ctx.dim, "SP g: reduce-scatter (backward)", sequence=True),
                None, None, None)


class ScatterToSequenceParallel(torch.autograd.Function):
    """SP g-bar: reduce-scatter along ``dim`` forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return reduce_scatter_along(comm, x, dim, "SP g-bar: reduce-scatter", sequence=True)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(ctx.comm, grad, ctx.dim, "SP g-bar: all-gather (backward)", sequence=True), None, None


class GatherFromParallel(torch.autograd.Function):
    """All-gather along ``dim`` forward (every rank's slice, concatenated), keep my slice backward."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return gather_along(comm, x, dim, "gather: all-gather")

    @staticmethod
    def backward(ctx, grad):
        return _split(ctx.comm, grad, ctx.dim), None, None


class SumOverCopies(torch.autograd.Function):
    """Identity forward; backward: the sum of the gradients of every rank holding the same copy.

    ``slot`` (0..n_slots-1) names the copy this rank holds: copies with the same slot are one
    tensor of the single-device model, so its gradient is the sum of theirs. One all-reduce of
    ``n_slots`` gradient-sized pieces, each rank writing its own piece (zeros elsewhere)."""

    @staticmethod
    def forward(ctx, x, comm, slot, n_slots):
        ctx.comm, ctx.slot, ctx.n_slots = comm, slot, n_slots
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        pieces = grad.new_zeros((ctx.n_slots, *grad.shape))              # (copies, *grad.shape)
        pieces[ctx.slot] = grad
        ctx.comm.all_reduce(pieces, name="copies: all-reduce (backward)")
        return pieces[ctx.slot], None, None, None


class SplitToParallel(torch.autograd.Function):
    """Keep this rank's slice along ``dim`` forward (no communication), all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _split(comm, x, dim)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(ctx.comm, grad, ctx.dim, "split: all-gather (backward)"), None, None


def copy_to_parallel(x, comm, in_place=False):
    """f (Megatron): identity forward, all-reduce of the gradient backward. ``in_place=True``
    only where the output is read by matmuls alone (the gradient is then summed without a copy)."""
    _check(comm, x)
    return CopyToParallel.apply(x, comm, bool(in_place)) if comm.size > 1 else x


def reduce_from_parallel(x, comm, in_place=False):
    """g (Megatron): all-reduce forward, identity backward. ``in_place=True`` only for a fresh
    partial sum nobody else reads (summed without a copy; ``x`` becomes the sum)."""
    _check(comm, x)
    return ReduceFromParallel.apply(x, comm, bool(in_place)) if comm.size > 1 else x


def gather_from_sequence_parallel(x, comm, dim=1, region=None):
    """SP g (sequence parallelism): all-gather along ``dim`` forward, reduce-scatter backward
    (``region``: see :class:`GatherFromSequenceParallel`)."""
    _check(comm, x, dim)
    return GatherFromSequenceParallel.apply(x, comm, dim % x.dim(), region) if comm.size > 1 else x


def scatter_to_sequence_parallel(x, comm, dim=1):
    """SP g-bar: reduce-scatter along ``dim`` forward, all-gather backward."""
    _check(comm, x, dim)
    return ScatterToSequenceParallel.apply(x, comm, dim % x.dim()) if comm.size > 1 else x


def split_to_parallel(x, comm, dim=1):
    """This rank's even slice along ``dim`` (forward: no communication; backward: all-gather)."""
    _check(comm, x, dim)
    return SplitToParallel.apply(x, comm, dim % x.dim()) if comm.size > 1 else x


def gather_from_parallel(x, comm, dim=-1):
    """Every rank's slice along ``dim``, concatenated in group-rank order (forward: all-gather;
    backward: keep my slice). Concatenating column-parallel outputs IS communication."""
    _check(comm, x, dim)
    return GatherFromParallel.apply(x, comm, dim % x.dim()) if comm.size > 1 else x


def sum_over_copies(x, comm, slot, n_slots):
    """Identity forward; backward: the gradient summed over the ranks whose ``slot`` is the same."""
    _check(comm, x)
    if not (isinstance(slot, int) and isinstance(n_slots, int) and 0 <= slot < n_slots):
        raise ValueError(f"slot must be an int in [0, n_slots={n_slots}), got {slot!r}")
    return SumOverCopies.apply(x, comm, slot, n_slots) if comm.size > 1 and n_slots < comm.size else x


__all__ = ["copy_to_parallel", "reduce_from_parallel", "gather_from_sequence_parallel",
           "scatter_to_sequence_parallel", "split_to_parallel", "gather_from_parallel", "sum_over_copies",
           "gather_along", "reduce_scatter_along", "reduces_in_place", "CopyToParallel", "ReduceFromParallel",
           "GatherFromSequenceParallel", "ScatterToSequenceParallel", "SplitToParallel", "layout_copies",
           "GatherFromParallel", "SumOverCopies"]
