"""Megatron-LM 2022's tensor-parallel backward overlap: a column layer's dX all-reduced under its
weight gradient's GEMM (the stated software item ``"tp_backward_overlap"`` of
:mod:`course_lib.virtual.software`).

Without sequence parallelism a tensor-parallel region starts with ``f``: identity forward,
all-reduce of dX backward. The plain backward computes the column layer's dX and dW, then ``f``
all-reduces dX, although the all-reduce needs only dX. Megatron-LM at 55ba1f7b
(``--async-tensor-model-parallel-allreduce``, on by default; megatron/mpu/layers.py L239-309,
``LinearWithGradAccumulationAndAsyncCommunication.backward``) launches dX's all-reduce on the
tp group's stream as soon as dX is computed, computes dW (and the bias's sum) under it, then
waits; that all-reduce replaces ``f``'s.

Here ``f`` stays, the region's entry (:func:`enter_tensor_parallel`), and carries the region
(:class:`ReplicatedInput`), which counts the overlapping column layers reading it. The region's
only column layer (GPT-2's W_1, the fused QKV GEMM, the LM head) all-reduces its dX itself under
dW (:func:`all_reduced_column_backward`), where ``f`` would have (a copy, or dX itself), and
``f`` returns that sum when the gradient it receives is what the layer handed autograd
(nothing else read the region's input), else it all-reduces what it got (a second reader).
With several column layers (W_q, W_k, W_v unfused; Llama's W_1 and W_3) autograd sums their
dX first: ``f`` all-reduces the sum, as without the overlap. The same kernels, the same
collective on the same tensor: the same values, to the bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib.collectives.comm import Comm
from course_lib.parallel.comm_ops import CopyToParallel, reduces_in_place

NAME = "f: all-reduce (backward)"       # the span f's own all-reduce has: the same collective


class ReplicatedInput:
    """The input of a tensor-parallel region after ``f``, shared by its column layers.

    ``readers``: the overlapping column layers that read it (counted in forward); ``reduced``:
    (what the region's one column layer handed autograd, its dX's all-reduce, a function
    computing that dX again) for ``f``'s backward (:func:`all_reduced_column_backward`)."""

    def __init__(self, comm):
        self.comm, self.readers, self.reduced = comm, 0, None

    def add_reader(self):
        self.readers += 1


class CopyToRegion(CopyToParallel):
    """``f`` (:class:`~course_lib.parallel.comm_ops.CopyToParallel`, its gradient summed in
    place) for a region: its backward returns the dX the region's one column layer all-reduced
    under its weight gradient (``region.reduced``) when the gradient it receives is that dX;
    else (another reader added to it) it all-reduces what it got, as ``f`` does."""

    @staticmethod
    def forward(ctx, x, comm, region):
        ctx.region = region
        ctx.set_materialize_grads(False)   # the column layer may hand autograd no dX (summed in place)
        return CopyToParallel.forward(ctx, x, comm, True)

    @staticmethod
    def backward(ctx, grad):
        region = ctx.region
        if region.reduced is not None:
            (handed, reduced, again), region.reduced = region.reduced, None
            if grad is handed:        # the column layer's dX is the whole gradient: no other reader
                return reduced, None, None
            if handed is None:        # another reader's gradient: the layer's dX again, added
                grad = grad + again()
        if grad is None:
            return None, None, None
        return CopyToParallel.backward(ctx, grad)


def enter_tensor_parallel(x, comm):
    """f (Megatron): identity forward, all-reduce of the gradient backward, for a region whose
    input is read by matmuls only; the result carries the region (``replicated_region``) for
    its column layers. One rank: ``x`` itself (nothing to sum)."""
    if not isinstance(comm, Comm):
        raise TypeError(f"pass the group's Comm (e.g. mesh.comm('tp')), got {type(comm).__name__}")
    if comm.size == 1:
        return x
    region = ReplicatedInput(comm)
    y = CopyToRegion.apply(x, comm, region)
    y.replicated_region = region
    return y


def all_reduced_column_backward(region, input_grad, weight_grads):
    """The backward of a column layer reading ``region``: (dX for autograd, what
    ``weight_grads()`` returns). Where it is the region's only column layer, dX's all-reduce is
    launched (async, on the tp group's stream) before the weight gradient's GEMM and waited
    after it, as Megatron-LM 2022's; else dX then dW, and ``f`` all-reduces the layers' sum.

    The all-reduce runs where ``f``'s would (the same kernels): into a copy where ``f`` would copy
    (dX a view), and autograd gets dX itself; in dX itself where ``f`` would sum it in place (a
    fresh tensor, as Megatron-LM does), and autograd gets nothing (None) from this layer. ``f``
    returns the sum if it receives exactly that; else another reader added to the gradient, and
    ``f`` all-reduces it itself, this layer's dX added again where autograd did not (one more
    GEMM: ``input_grad`` again; the same bits with one other reader, autograd's order with more
    than one may round otherwise)."""
    grad_x = input_grad()                                         # (.., in)
    if region.readers != 1:
        return grad_x, weight_grads()
    if reduces_in_place(grad_x, True):
        summed, handed = grad_x, None
    else:
        summed, handed = grad_x.contiguous().clone(), grad_x
    work = region.comm.all_reduce(summed, name=NAME, async_op=True)
    grads = weight_grads()                                        # under the all-reduce
    if work is not None:
        work.wait()
    region.reduced = (handed, summed, input_grad)  # f checks it got what this layer handed
    return handed, grads


class LinearAllReducingInput(torch.autograd.Function):
    """y = x W^T + b (``F.linear``) for a column layer reading ``region``'s input; backward:
    :func:`all_reduced_column_backward` with the GEMMs ``F.linear``'s autograd runs (dX = dY W,
    dW = dY^T x, db = sum of dY): the same kernels, the same values."""

    @staticmethod
    def forward(ctx, x, weight, bias, region):
        ctx.save_for_backward(x, weight)
        ctx.region, ctx.has_bias = region, bias is not None
        region.add_reader()
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):                                      # grad (.., out_r)
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])                     # (b s, out_r)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]

        def weight_grads():
            grad_w = g2.t().mm(x.reshape(-1, x.shape[-1])) if need_w else None     # (out_r, in)
            return grad_w, (g2.sum(0) if ctx.has_bias and need_b else None)
        if not need_x:
            return (None, *weight_grads(), None)
        grad_x, (grad_w, grad_b) = all_reduced_column_backward(
            ctx.region, lambda: g2.mm(weight).view(*grad.shape[:-1], weight.shape[1]), weight_grads)
        return grad_x, grad_w, grad_b, None


__all__ = ["ReplicatedInput", "CopyToRegion", "enter_tensor_parallel", "all_reduced_column_backward",
           "LinearAllReducingInput"]
