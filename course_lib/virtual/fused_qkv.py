"""Megatron-LM's fused QKV projection, run as the course's program: the ``"fused_qkv"`` item of
the dry run's per-source software (:mod:`course_lib.virtual.software`).

The course's :class:`~course_lib.gpt.Attention` projects its input with three Linears, W_q,
W_k and W_v: three GEMMs of width h/t and kv/t (t: the tensor-parallel size). Megatron-LM
runs one: its ``ParallelAttention`` holds a single ``ColumnParallelLinear``
``query_key_value`` of width 3h/t (megatron/model/transformer.py, 2021-22; BLOOM's
Megatron-DeepSpeed keeps it), so forward is one GEMM, backward one GEMM for dX and one for dW
(and, with biases, one reduction for the three biases).

Here the weights stay the course's ``wq``, ``wk``, ``wv`` parameters (this rank's
column-parallel slices under TP, a copied K/V head's summed in backward as the course does):
:func:`fused_qkv` takes them and computes what the three Linears compute, to the bit on the
CPU (the same GEMMs, the same sums in the same order). Each step is one ``course::`` op that
the virtual clock prices as Megatron's kernel (:data:`course_lib.planner.kernel_cost.COURSE_KERNELS`):
a GEMM of x against the three weights as one [(h + 2 kv)/t, h] operand. Megatron stores that
operand as one tensor; the pricing models that storage, so no concatenation copy is priced
(none runs: the CPU runs the three GEMMs inside the one op).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from course_lib.parallel.tensor_parallel import ColumnParallelLinear, column_backward
from course_lib.parallel.tp_backward_overlap import all_reduced_column_backward


@torch.library.custom_op("course::fused_qkv", mutates_args=())
def _qkv(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, bq: Optional[torch.Tensor],
         bk: Optional[torch.Tensor], bv: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    f = torch.nn.functional.linear                 # the three Linears' own kernels: the same bits
    return f(x, wq, bq), f(x, wk, bk), f(x, wv, bv)


@_qkv.register_fake
def _qkv_shape(x, wq, wk, wv, bq, bk, bv):
    return tuple(x.new_empty(*x.shape[:-1], w.shape[0]) for w in (wq, wk, wv))


@torch.library.custom_op("course::fused_qkv_input_grad", mutates_args=())
def _input_grad(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                wv: torch.Tensor) -> torch.Tensor:
    # autograd's sum of the three Linears' dX: V's arrives first, then K's, then Q's
    # (the last add writes the (.., in) result: a fresh tensor, not a view, as the fake's, so f
    # sums it in place on the CPU as in the dry run, as Megatron-LM does)
    mm = [g.reshape(-1, g.shape[-1]).mm(w).view(*dq.shape[:-1], wq.shape[1]) for g, w in ((dv, wv), (dk, wk), (dq, wq))]
    return (mm[0] + mm[1]) + mm[2]


@_input_grad.register_fake
def _input_grad_shape(dq, dk, dv, wq, wk, wv):
    return dq.new_empty(*dq.shape[:-1], wq.shape[1])


@torch.library.custom_op("course::fused_qkv_weight_grad", mutates_args=())
def _weight_grad(x: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
                 dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # dY^T x, each in the weight's layout: the GEMM nn.Linear's autograd runs (torch's
    # mm_mat2_backward for x W^T: grad.t().mm(mat1)) and the sequence-parallel Linear's, so the
    # same bits on every BLAS (the transposed (x^T dY)^T gives others on some: AMD's MKL path)
    x2 = x.reshape(-1, x.shape[-1])
    return tuple(g.reshape(-1, g.shape[-1]).t().mm(x2) for g in (dq, dk, dv))


@_weight_grad.register_fake
def _weight_grad_shape(x, dq, dk, dv):
    return tuple(x.new_empty(g.shape[-1], x.shape[-1]) for g in (dq, dk, dv))


@torch.library.custom_op("course::fused_qkv_bias_grad", mutates_args=())
def _bias_grad(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    return tuple(g.reshape(-1, g.shape[-1]).sum(0) for g in (dq, dk, dv))


@_bias_grad.register_fake
def _bias_grad_shape(dq, dk, dv):
    return tuple(g.new_empty(g.shape[-1]) for g in (dq, dk, dv))


class FusedQKV(torch.autograd.Function):
    """(x W_q^T + b_q, x W_k^T + b_k, x W_v^T + b_v) as one op forward, one dX and one dW op
    backward. ``shard``/``source``: under sequence parallelism, x's s/t tokens are kept for
    backward and x re-gathered there (the course's SP Linear, Korthikanti et al. 2022).
    ``region``: without SP, the tensor-parallel region whose dX the GEMM all-reduces under dW
    (``"tp_backward_overlap"``, :mod:`course_lib.parallel.tp_backward_overlap`)."""

    @staticmethod
    def forward(ctx, x, shard, source, wq, wk, wv, bq, bk, bv, overlap=False, region=None):
        ctx.source, ctx.has_bias, ctx.overlap, ctx.region = source, bq is not None, overlap, region
        if region is not None:
            region.add_reader()
        if source is not None:
            source.add_reader()
            ctx.save_for_backward(shard, wq, wk, wv)
        else:
            ctx.save_for_backward(x, wq, wk, wv)
        return torch.ops.course.fused_qkv(x, wq, wk, wv, bq, bk, bv)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, wq, wk, wv = ctx.saved_tensors
        source = ctx.source

        def input_grad():
            return torch.ops.course.fused_qkv_input_grad(dq, dk, dv, wq, wk, wv)

        def weight_grads(x):
            dw = torch.ops.course.fused_qkv_weight_grad(x, dq, dk, dv)
            return dw, (torch.ops.course.fused_qkv_bias_grad(dq, dk, dv) if ctx.has_bias else (None,) * 3)
        if source is None and ctx.region is not None:    # dX all-reduced under dW, as Megatron-LM 2022's
            dx, (dw, db) = all_reduced_column_backward(ctx.region, input_grad, lambda: weight_grads(x))
        elif source is None:
            dx, (dw, db) = input_grad(), weight_grads(x)
        else:       # x all-gathered again (once per region); overlapped as Megatron-LM 2022's, or not
            dx, (dw, db) = column_backward(source, x, ctx.overlap, input_grad, weight_grads)
            source.release()
        return (dx, None, None, *dw, *db, None, None)


def _weights(linear):
    """(weight, bias) a projection multiplies by: an nn.Linear's, or a column-parallel slice's
    (a copied K/V head's summed over its copies in backward)."""
    if isinstance(linear, ColumnParallelLinear):
        if linear.input != "entered" or linear.gather_output:
            raise NotImplementedError(f"fused_qkv: a column layer with input={linear.input!r} applies its own "
                                      f"collective; the fused GEMM reads the region's entered input")
        return linear.weight_and_bias()
    if type(linear) is not nn.Linear:
        raise NotImplementedError(f"fused_qkv: fuses nn.Linear or ColumnParallelLinear projections, not "
                                  f"{type(linear).__name__}")
    return linear.weight, linear.bias


def fused_qkv(x, wq, wk, wv):
    """The projections of ``x`` (.., h) by the Linears ``wq``, ``wk``, ``wv`` (nn.Linear, or
    the column-parallel slices :func:`~course_lib.parallel.tp_plan.parallelize` made), as one
    fused GEMM: (Q, K, V), what ``wq(x), wk(x), wv(x)`` give, to the bit."""
    if getattr(x, "async_outputs", None) is not None:
        raise NotImplementedError("fused_qkv: async TP computes the projections in its decomposed "
                                  "all-gather matmul (give async_tp=False)")
    (w_q, b_q), (w_k, b_k), (w_v, b_v) = (_weights(m) for m in (wq, wk, wv))
    if (b_q is None) != (b_k is None) or (b_q is None) != (b_v is None):
        raise ValueError("fused_qkv: W_q, W_k and W_v must all have a bias or none")
    source = getattr(x, "sequence_shard", None)
    shard = source.shard if source is not None else None
    overlap = getattr(wq, "overlap_backward", False)      # (a column-parallel W_q: the region's)
    region = getattr(x, "replicated_region", None) if getattr(wq, "overlap_all_reduce", False) else None
    return FusedQKV.apply(x, shard, source, w_q, w_k, w_v, b_q, b_k, b_v, overlap, region)


def project_fused(self, x):
    """:meth:`course_lib.gpt.Attention.project` as one fused QKV GEMM (installed per instance)."""
    return fused_qkv(x, self.wq, self.wk, self.wv)


__all__ = ["fused_qkv", "project_fused", "FusedQKV"]
