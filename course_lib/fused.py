"""Fused kernels, as autograd sees them: what they keep for backward.

A chain of elementwise operations written in plain ops keeps an input for every op that
needs one in backward. A fused kernel (Megatron-LM's and Transformer Engine's RMSNorm and
SwiGLU on GPUs) runs the chain in one pass and keeps only the chain's inputs, recomputing
the rest in its backward: cheap elementwise work traded for memory. The two here are
written as ``torch.autograd.Function`` so that autograd keeps exactly what such a kernel
keeps (``models.saved_activations`` counts it), and they give the plain ops' results:

- ``rms_norm(x, weight, eps)``: keeps x and 1/rms per row in fp32 (the input's dtype if
  wider), where the plain ops (``gpt.RMSNorm``) keep x, x / rms and 1/rms;
- ``swiglu(a, b) = silu(a) * b``: keeps a and b, where the plain ops also keep silu(a).
  (The product is W_2's input: the matmul after it keeps it in either case.)

``kernels()`` runs the course's Llama blocks with both, so the planner's
``llama_activation_bytes_per_layer(fused_kernels=True)`` is checked by counting
(tests/test_planner_formulas.py), as the unfused formula is.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from course_lib import gpt


def _wide(dtype):
    """The dtype a fused kernel computes in: fp32 for 16-bit inputs, else the input's."""
    return torch.promote_types(dtype, torch.float32)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.to(_wide(x.dtype)).pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return (x * rstd.to(x.dtype)) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        wide = rstd.dtype
        n = x.to(wide) * rstd                           # x / rms, recomputed
        g = grad.to(wide)
        dn = g * weight.to(wide)
        dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
        dw = (g * n).reshape(-1, n.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        s = torch.sigmoid(a)                            # recomputed
        return grad * b * s * (1 + a * (1 - s)), grad * a * s


def rms_norm(x, weight, eps=1e-5):
    """x / rms(x) * weight, keeping x and an fp32 1/rms per row for backward."""
    return _RMSNorm.apply(x, weight, eps)


def swiglu(a, b):
    """silu(a) * b, keeping a and b for backward (silu(a) is recomputed)."""
    return _SwiGLU.apply(a, b)


@contextlib.contextmanager
def kernels():
    """Inside: every ``gpt.RMSNorm`` and ``gpt.SwiGLU`` runs the fused functions above."""
    saved = gpt.RMSNorm.forward, gpt.SwiGLU.forward
    gpt.RMSNorm.forward = lambda self, x: rms_norm(x, self.weight, self.eps)
    gpt.SwiGLU.forward = lambda self, x: self.w2(swiglu(self.w1(x), self.w3(x)))
    try:
        yield
    finally:
        gpt.RMSNorm.forward, gpt.SwiGLU.forward = saved
