"""FlashAttention of a query chunk over the keys it sees: all-gather CP's attention kernel.

    out = flash_attention_prefix(q, k, v)   # q (b, a, c, d): the LAST c positions of k's L

Llama 3's context parallelism (:mod:`course_lib.parallel.cp_allgather`) attends each local
query chunk (positions L - c .. L - 1) to the gathered keys 0 .. L - 1: the past L - c keys in
full and the chunk's own c x c block causal, FlashAttention's causal mask aligned at the
bottom right (flash-attn >= 2.1 for s_q != s_k; Dao 2023). One kernel forward, one backward,
as there. On the CPU the values come from torch's flash kernel with that mask as an additive
bias (:func:`prefix_bias`); the clock prices the op as the GPU's kernel: the FLOPs of the
past keys in full plus the causal half of the diagonal block, torch's SDPA formulas
(:data:`course_lib.planner.kernel_cost.COURSE_ATTENTION`), at the "attention" fraction of
peak. Grouped-query K/V go in as they are (kv heads). It keeps q, k, v, the output and the
log-sum-exp for backward.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def prefix_bias(c: int, length: int, dtype, device) -> torch.Tensor:
    """(c, L) additive mask: 0 where query i (position L - c + i) sees key j (j <= L - c + i),
    -inf above that diagonal (bottom-right causal)."""
    hidden = torch.ones(c, length, dtype=torch.bool, device=device).triu(length - c + 1)
    return torch.zeros(c, length, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))


def _heads(q, t):
    """K or V with one head per query head, for the CPU kernel (a GPU's kernel reads each K/V
    head once for its group of a / kv query heads: grouped-query attention, no copy)."""
    rep = q.shape[1] // t.shape[1]
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _group_sum(g, kv_heads):
    """The gradient of the per-query-head copies summed back onto each K/V head."""
    b, a, length, d = g.shape
    return g if a == kv_heads else g.view(b, kv_heads, a // kv_heads, length, d).sum(2)


@torch.library.custom_op("course::flash_attention_prefix", mutates_args=())
def _prefix_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c, length = q.shape[2], k.shape[2]
    k, v = _heads(q, k), _heads(q, v)
    if c == length:                    # the chunk sees only itself: plain causal
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    bias = prefix_bias(c, length, q.dtype, q.device)
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias)


@_prefix_forward.register_fake
def _prefix_forward_shape(q, k, v):
    lse = torch.empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), lse      # (b, a, c, d), (b, a, c)


@torch.library.custom_op("course::flash_attention_prefix_backward", mutates_args=())
def _prefix_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c, length, kv_heads = q.shape[2], k.shape[2], k.shape[1]
    k, v = _heads(q, k), _heads(q, v)
    if c == length:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, True)
    else:
        bias = prefix_bias(c, length, q.dtype, q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, False,
                                                                               attn_mask=bias)
    return dq, _group_sum(dk, kv_heads), _group_sum(dv, kv_heads)


@_prefix_backward.register_fake
def _prefix_backward_shape(grad, q, k, v, out, lse):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)          # q, k, v, out, lse: FlashAttention's saved set


def _backward(ctx, grad, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    return _prefix_backward(grad.contiguous(), q, k, v, out, lse)


_prefix_forward.register_autograd(_backward, setup_context=_setup)


def flash_attention_prefix(q, k, v):
    """q (b, a, c, d) at the last c positions of k, v (b, kv, L, d) (grouped-query: kv divides
    a) -> (b, a, c, d): causal attention, one fused kernel."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"flash_attention_prefix: query heads ({q.shape[1]}) must be a multiple of key/value "
                         f"heads ({k.shape[1]})")
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"flash_attention_prefix: the {q.shape[2]} queries must be the last of the "
                         f"{k.shape[2]} keys' positions")
    return _prefix_forward(q, k, v)[0]


__all__ = ["flash_attention_prefix", "prefix_bias"]
