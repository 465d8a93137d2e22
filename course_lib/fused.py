"""Fused kernels, as autograd and the virtual clock see them: what they keep for backward, and
one kernel each.

A chain of elementwise operations written in plain ops keeps an input for every op that
needs one in backward, and launches a kernel per op. A fused kernel (Megatron-LM's and
Transformer Engine's RMSNorm and SwiGLU on GPUs) runs the chain in one pass and keeps only
the chain's inputs, recomputing the rest in its backward: cheap elementwise work traded for
memory and launches. The two here are ``course::`` operators (``torch.library.custom_op``),
one kernel forward and one backward, which the virtual clock prices as such
(:data:`course_lib.planner.kernel_cost.COURSE_KERNELS`: the norm as a row reduction, like
LayerNorm's kernels, SwiGLU as one streaming pass); autograd keeps exactly what such a kernel
keeps (``models.saved_activations`` counts it), and they give the plain ops' results:

- ``rms_norm(x, weight, eps)``: keeps x and 1/rms per row in fp32 (the input's dtype if
  wider), where the plain ops (``gpt.RMSNorm``) keep x, x / rms and 1/rms; its backward
  gives dx and the weight's gradient in one kernel (a real one finishes the weight's partial
  sums in a second, tiny kernel: left out);
- ``swiglu(a, b) = silu(a) * b``: keeps a and b, where the plain ops also keep silu(a).
  (The product is W_2's input: the matmul after it keeps it in either case.)

And FlashAttention's causal core (``flash_attention``, ``install_flash(model)``): torch's CPU
flash kernel, one kernel forward and one backward, which keeps Q, K, V, the output and the
log-sum-exp, never the s x s scores, and which the clock prices as the GPU's fused kernel
(its FLOPs, causal half, at the preset's "attention" fraction). The dry run runs it for a
Hardware with ``fused_attention`` (the planner's statement that attention is fused), and the
planner's count of the course's program traces it, as for the two kernels above.

``install(model)`` makes one model's RMSNorm and SwiGLU modules run them (the dry run's
``"rmsnorm_swiglu"`` software item and the planner's count of the course's program, both for a
Hardware with ``fused_kernels``); ``kernels()`` does it for every block while inside, so the
planner's ``llama_activation_bytes_per_layer(fused_kernels=True)`` is checked by counting
(tests/test_planner_formulas.py), as the unfused formula is.
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F

from course_lib import gpt, moe, trace


def _wide(dtype):
    """The dtype a fused kernel computes in: fp32 for 16-bit inputs, else the input's."""
    return torch.promote_types(dtype, torch.float32)


@torch.library.custom_op("course::rms_norm", mutates_args=())
def _rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rstd = torch.rsqrt(x.to(_wide(x.dtype)).pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return (x * rstd.to(x.dtype)) * weight, rstd


@_rms_norm_kernel.register_fake
def _rms_norm_shape(x, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=_wide(x.dtype))


@torch.library.custom_op("course::rms_norm_backward", mutates_args=())
def _rms_norm_backward_kernel(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                              rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    wide = rstd.dtype
    n = x.to(wide) * rstd                           # x / rms, recomputed
    g = grad.to(wide)
    dn = g * weight.to(wide)
    dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
    dw = (g * n).reshape(-1, n.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@_rms_norm_backward_kernel.register_fake
def _rms_norm_backward_shape(grad, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_backward(ctx, grad, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_backward_kernel(grad, x, weight, rstd)
    return dx, dw, None


_rms_norm_kernel.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


@torch.library.custom_op("course::swiglu", mutates_args=())
def _swiglu_kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


@_swiglu_kernel.register_fake
def _swiglu_shape(a, b):
    return torch.empty_like(a)


@torch.library.custom_op("course::swiglu_backward", mutates_args=())
def _swiglu_backward_kernel(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.sigmoid(a)                            # recomputed
    return grad * b * s * (1 + a * (1 - s)), grad * a * s


@_swiglu_backward_kernel.register_fake
def _swiglu_backward_shape(grad, a, b):
    return torch.empty_like(a), torch.empty_like(b)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, grad):
    a, b = ctx.saved_tensors
    return _swiglu_backward_kernel(grad, a, b)


_swiglu_kernel.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


def rms_norm(x, weight, eps=1e-5):
    """x / rms(x) * weight, keeping x and an fp32 1/rms per row for backward: one kernel."""
    return _rms_norm_kernel(x, weight, eps)[0]


def swiglu(a, b):
    """silu(a) * b, keeping a and b for backward (silu(a) is recomputed): one kernel."""
    return _swiglu_kernel(a, b)


def _norm_forward(self, x):
    return rms_norm(x, self.weight, self.eps)


def _swiglu_forward(self, x):
    return self.w2(swiglu(self.w1(x), self.w3(x)))


_plain_inner = moe.Expert.inner


def _expert_inner(self, x):
    return swiglu(self.w1(x), self.w3(x)) if self.mlp == "swiglu" else _plain_inner(self, x)


def install(model) -> int:
    """Every ``gpt.RMSNorm``, ``gpt.SwiGLU`` and SwiGLU expert (``moe.Expert``) of ``model``
    (this instance only) runs the fused kernels above; returns how many modules were changed."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, gpt.RMSNorm):
            mod.forward = types.MethodType(_norm_forward, mod)
        elif isinstance(mod, gpt.SwiGLU):
            mod.forward = types.MethodType(_swiglu_forward, mod)
        elif isinstance(mod, moe.Expert) and mod.mlp == "swiglu":
            mod.inner = types.MethodType(_expert_inner, mod)
        else:
            continue
        n += 1
    return n


def flash_attention(q, k, v, dropout_p=0.0):
    """FlashAttention's core, causal: q (b, a, s, d), k and v (b, kv, s, d) -> (b, a, s, d), one
    fused kernel. Grouped-query attention runs as FlashAttention-2 runs it: each K/V head read
    by its a / kv query heads inside the kernel, never copied out per query head (torch's CPU
    kernel takes kv < a heads too), so backward keeps K and V at their own kv heads."""
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, True)
    return out


def flash_block(q, k, v, causal: bool):
    """One FlashAttention call over a block of keys: q (b, a, s_q, d), k and v (b, kv, s_k, d)
    -> (out (b, a, s_q, d) in q's dtype, lse (b, a, s_q) in fp32 for 16-bit q): every key
    visible (``causal`` False) or the block's own positions on both sides (True)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)


def flash_block_backward(dout, q, k, v, out, lse, causal: bool):
    """FlashAttention's backward of one block given the WHOLE attention's output and
    log-sum-exp rows (``out``, ``lse``): P = exp(S - lse) is then the final softmax on the
    block and D = rowsum(dO * O) the final one, so (dq, dk, dv) are the block's exact part of
    the gradients (k, v at their own kv heads)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)


def flash_causal(q_pos, k_pos):
    """How one FlashAttention call computes the queries at ``q_pos`` over the keys at ``k_pos``
    (host tensors): False when every key is at or before every query (no mask), True when both
    sides hold the same ascending positions (the kernel's causal mask), None otherwise (another
    mask: not one call). A host check on positions the ranks know, not a kernel: unpriced."""
    clock = trace.clock()
    with clock.muted() if clock is not None else contextlib.nullcontext():
        if not q_pos.numel() or not k_pos.numel():
            return None
        if int(k_pos.max()) <= int(q_pos.min()):
            return False
        if torch.equal(q_pos, k_pos) and bool((q_pos[1:] > q_pos[:-1]).all()):
            return True
        return None


def _plain_causal(attn, q_pos, k_pos, future) -> bool:
    """Whether an attention call of ``attn`` is one whole causal sequence (no positions given,
    the model's own causal mask): what one causal flash kernel computes."""
    return q_pos is None and k_pos is None and (future is None or future is attn.future_mask
                                                or future._base is attn.future_mask)


def attend_flash(self, q, k, v, q_pos=None, k_pos=None, future=None):
    """``Attention.attend`` as :func:`flash_attention` (set per instance by :func:`install_flash`):
    one whole causal sequence, no attention dropout (NotImplementedError naming either)."""
    if not _plain_causal(self, q_pos, k_pos, future):
        raise NotImplementedError("flash_attention: the course's FlashAttention core runs one whole causal "
                                  "sequence (no positions, no packed documents' mask)")
    if self.training and self.attn_dropout.p:
        raise NotImplementedError("flash_attention: attention dropout is not run fused (the course's CPU "
                                  "kernel has no dropout mask the course's Dropout would match)")
    return flash_attention(q, k, v)


def install_flash(model) -> int:
    """Every ``gpt.Attention`` of ``model`` (this instance only) runs its core as
    :func:`flash_attention`; returns how many modules were changed."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, gpt.Attention):
            mod.attend = types.MethodType(attend_flash, mod)
            n += 1
    return n


@contextlib.contextmanager
def kernels():
    """Inside: every ``gpt.RMSNorm``, ``gpt.SwiGLU`` and SwiGLU expert runs the fused kernels
    above."""
    saved = gpt.RMSNorm.forward, gpt.SwiGLU.forward, moe.Expert.inner
    gpt.RMSNorm.forward, gpt.SwiGLU.forward, moe.Expert.inner = _norm_forward, _swiglu_forward, _expert_inner
    try:
        yield
    finally:
        gpt.RMSNorm.forward, gpt.SwiGLU.forward, moe.Expert.inner = saved


__all__ = ["rms_norm", "swiglu", "install", "kernels", "flash_attention",
           "attend_flash", "install_flash", "flash_block", "flash_block_backward", "flash_causal"]
