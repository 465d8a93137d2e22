"""Megatron-LM's fused bias + dropout + residual add, run as the course's program: the
``"bias_dropout_add"`` item of the dry run's per-source software (:mod:`course_lib.virtual.software`).

After each row-parallel output layer (the attention's W_o, the MLP's down projection) Megatron
adds the layer's bias, applies dropout and adds the residual in one kernel
(``bias_dropout_add_fused_train``, Narayanan et al. 2021, Sec. 4.2), the layer itself leaving
its bias out (``skip_bias_add``). Here the block's ``layer`` does the same with the course's
modules: each output layer runs without its bias, then one ``course::`` op computes
``residual + dropout(y + bias)`` in the course's order (to the bit on the CPU) and the virtual
clock prices it as the bytes that kernel reads and writes once
(:mod:`course_lib.planner.kernel_cost`).
"""
from __future__ import annotations

import contextlib

import torch

from course_lib import trace


@torch.library.custom_op("course::bias_dropout_add", mutates_args=())
def _bias_dropout_add_kernel(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return residual + (x + bias)       # the course's order: the row layer's y + b, then x + that


@_bias_dropout_add_kernel.register_fake
def _bias_dropout_add_shape(x, bias, residual):
    return torch.empty_like(residual)


def _bias_dropout_add_backward(ctx, grad):
    # what autograd does for the two adds: the gradient passes to x and the residual, and is
    # summed over the tokens for the bias (one reduction kernel, as unfused)
    return grad, grad.sum(tuple(range(grad.dim() - 1))), grad


_bias_dropout_add_kernel.register_autograd(_bias_dropout_add_backward)


@torch.library.custom_op("course::bias_dropout_add_masked", mutates_args=())
def _bias_dropout_add_masked_kernel(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                                    keep: torch.Tensor, scale: float) -> torch.Tensor:
    # the unfused order: the row layer's y + b, dropout's (y + b) * keep * scale, then x + that
    return residual + torch.ops.aten.native_dropout_backward(x + bias, keep, scale)


@_bias_dropout_add_masked_kernel.register_fake
def _bias_dropout_add_masked_shape(x, bias, residual, keep, scale):
    return torch.empty_like(residual)


def _bias_dropout_add_masked_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[3])          # the mask, 1 byte per element (Korthikanti's 2sbh)
    ctx.scale = inputs[4]


def _bias_dropout_add_masked_backward(ctx, grad):
    (keep,) = ctx.saved_tensors
    gx = torch.ops.aten.native_dropout_backward(grad, keep, ctx.scale)     # one kernel
    return gx, gx.sum(tuple(range(gx.dim() - 1))), grad, None, None


_bias_dropout_add_masked_kernel.register_autograd(_bias_dropout_add_masked_backward,
                                                  setup_context=_bias_dropout_add_masked_setup)


def _keep_mask(dropout, x):
    """The keep mask ``dropout`` draws for ``x``, as its unfused forward draws it (a
    tensor-parallel dropout's generator, its replayed masks, else torch's default stream;
    recorded where it records). On a GPU the draw is inside the fused kernel: not a kernel of
    its own here (muted on the clock)."""
    masks = getattr(dropout, "masks", None)
    if masks is not None:
        keep = masks.pop(0)
    else:
        clock = trace.clock()
        with clock.muted() if clock is not None else contextlib.nullcontext():
            keep = torch.rand(x.shape, generator=getattr(dropout, "generator", None), device=x.device) >= dropout.p
    if getattr(dropout, "record", None) is not None:
        dropout.record.append(keep)
    return keep


def bias_dropout_add(x, bias, residual, dropout=None):
    """Megatron-LM's fused ``residual + dropout(x + bias)``: (.., h), (h,), (.., h) -> (.., h),
    one kernel (priced by :mod:`course_lib.planner.kernel_cost` as the bytes it reads and
    writes once). With ``dropout`` training at p > 0 the kernel also reads the keep mask (on a
    GPU it draws and writes it: the same bytes) and keeps it for backward, 1 byte per element
    (one ``native_dropout_backward`` kernel there), as Megatron's jit-fused
    ``bias_dropout_add_fused_train``."""
    if bias is None:                   # no bias (Llama blocks): the residual add alone, as unfused
        return residual + (x if dropout is None else dropout(x))
    if dropout is not None and dropout.training and dropout.p > 0:
        scale = 0.0 if dropout.p >= 1.0 else 1.0 / (1.0 - dropout.p)
        return _bias_dropout_add_masked_kernel(x, bias, residual, _keep_mask(dropout, x), scale)
    return _bias_dropout_add_kernel(x, bias, residual)


class _BiasSkipped:
    """Inside the block, ``linear``'s forward leaves out its bias (Megatron's ``skip_bias_add``);
    ``as`` gives the bias (None if it has none)."""

    def __init__(self, linear):
        # the slot itself: recompute and FSDP put plain tensors there, which setattr refuses
        self.slots, self.bias = linear._parameters, linear._parameters.get("bias")

    def __enter__(self):
        if self.bias is not None:
            self.slots["bias"] = None
        return self.bias

    def __exit__(self, *exc):
        if self.bias is not None:
            self.slots["bias"] = self.bias


def output_layer(module, name):
    out = getattr(module, name, None)
    if out is None:
        raise NotImplementedError(f"bias_dropout_add: {type(module).__name__} has no {name!r} output layer "
                                  f"(the fusion runs dense GPT-2 and Llama blocks)")
    return out


def layer_bias_dropout_add(self, x, positions=None, doc_ids=None):
    """:meth:`course_lib.gpt.Block.layer` with each output layer's bias, dropout and the
    residual add in one kernel."""
    with _BiasSkipped(output_layer(self.attn, "wo")) as bias:
        y = self.attn(self.attn_norm(x), positions, doc_ids=doc_ids)
    x = bias_dropout_add(y, bias, x, self.attn_out_dropout)
    with _BiasSkipped(output_layer(self.mlp, "proj" if hasattr(self.mlp, "proj") else "w2")) as bias:
        y = self.mlp(self.mlp_norm(x))
    return bias_dropout_add(y, bias, x, self.mlp_out_dropout)


__all__ = ["bias_dropout_add", "layer_bias_dropout_add", "output_layer"]
