"""Ring attention as one context-parallel rank runs it, written again on the planner's side: the
kernels ``runtime="course"`` traces for a CP rank (:func:`course_lib.planner.kernels.trace_step`).

The course's ring (``parallel/context_parallel.py``: ``ring_attention``, ``RingAttention``) is
not a fused kernel. Per key block it writes the block's scores out, takes their log-sum-exp,
their exponentials and the product with V, and merges the partial result into the running one
(the online-softmax rule: ``logaddexp``, two ``exp``, two products and a sum on the block's
rows); its backward recomputes each block's probabilities and runs FlashAttention's five
products on them. So its cost is its bytes per score element and per row, not a count of
kernels: the same pass cut by ``cp`` would miss both. And each block's trim (the rows that see
a key, the keys that are seen) reads the token positions on the host, which makes the host
wait for the stream (as the virtual clock does: a value read), so the small kernels after each
read run at the host's pace (:mod:`course_lib.planner.issue`).

The planner sits below ``parallel/`` and imports none of it: the ops below are the ring's,
written again (one ``cp`` rank's positions, its c blocks in the ring's order, the merges, the
backward's accumulators), on the model's own attention pieces (:mod:`course_lib.attention`),
so traced on the meta device they are the kernels the ranks launch, op for op. K/V's hops are
the runtime's (:mod:`.runtime`): here a message is an empty buffer.
On a Hardware that states ``fused_attention`` the ranks run each block as one FlashAttention
kernel forward and one backward (``ContextParallelAttention.flash_blocks``, what torch's own CP
runs; :func:`course_lib.fused.flash_block`), merged by the same rule: traced here the same way.
``tests/test_planner_ring.py`` checks the kernels against the code itself and the step against
the dry run.
"""
from __future__ import annotations

import math

import torch

from course_lib import fused
from course_lib.attention import attention_output, attention_scores


def rank_positions(seq_len: int, cp: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """The positions (int64, host) of rank ``rank``'s tokens: chunks i and 2N-1-i of 2N
    ("zigzag"), or the i-th of N ("contiguous"), made as the ranks make them."""
    if layout == "contiguous":
        c = seq_len // cp
        return torch.arange(rank * c, (rank + 1) * c)
    c = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])


def _run(idx):
    """A slice when the indexes are one contiguous run (the ranks take a view), else them."""
    if idx.numel() and int(idx[-1]) - int(idx[0]) + 1 == idx.numel():
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _segments(q_pos, k_pos) -> list:
    """[(rows, cols)] of one (query block, key block) pair the ring computes (causal trim), or []."""
    if not (q_pos >= k_pos.min()).any():
        return []
    rows = torch.nonzero(q_pos >= k_pos.min()).flatten()
    cols = torch.nonzero(k_pos <= q_pos.max()).flatten()
    return [(_run(rows), _run(cols))]


def _block(q, k, v, q_pos, k_pos):
    """One block: its scores, log-sum-exp and P V (unnormalised across blocks)."""
    scores = attention_scores(q, k, q_pos, k_pos)                  # (b, a, s_q, s_k)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    lse = torch.logsumexp(scores, dim=-1)                          # (b, a, s_q)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return attention_output(torch.exp(scores - safe[..., None]), v.to(scores.dtype)), lse


def _merge(out1, lse1, out2, lse2):
    """The online-softmax rule on the block's rows: (b, a, rows, d) and (b, a, rows)."""
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w1, w2 = torch.exp(lse1 - safe)[..., None], torch.exp(lse2 - safe)[..., None]
    return out1 * w1 + out2 * w2, lse


def _block_backward(q, k, v, q_pos, k_pos, dout, lse, delta, dq, dk, dv, out=None):
    """FlashAttention's backward of one block with the global lse, on its computed part (given
    the whole ``out``: the kernel's backward where one call computes the segment)."""
    for rows, cols in _segments(q_pos, k_pos):
        causal = fused.flash_causal(q_pos[rows], k_pos[cols]) if out is not None else None
        if causal is not None:
            gq, gk, gv = fused.flash_block_backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                                    out[:, :, rows], lse[:, :, rows], causal)
            dq[:, :, rows] += gq
            dk[:, :, cols] += gk
            dv[:, :, cols] += gv
            continue
        b, a, _, d = q.shape
        kv = k.shape[1]
        qr, kc, vc, do = (t.to(lse.dtype) for t in (q[:, :, rows], k[:, :, cols], v[:, :, cols], dout[:, :, rows]))
        s_q, s_k = qr.shape[2], kc.shape[2]
        p = torch.exp(attention_scores(qr, kc, q_pos[rows], k_pos[cols]) - lse[:, :, rows, None])
        p_g = p.reshape(b, kv, (a // kv) * s_q, s_k)               # a group's query heads stacked
        do_g = do.reshape(b, kv, (a // kv) * s_q, d)
        dv[:, :, cols] += p_g.transpose(-2, -1) @ do_g
        dp = (do_g @ vc.transpose(-2, -1)).view(b, a, s_q, s_k)
        ds = (p * (dp - delta[:, :, rows, None])).reshape(b, kv, (a // kv) * s_q, s_k) / math.sqrt(d)
        dq[:, :, rows] += (ds @ kc).view(b, a, s_q, d)
        dk[:, :, cols] += ds.transpose(-2, -1) @ qr.reshape(b, kv, (a // kv) * s_q, d)


class RingCore(torch.autograd.Function):
    """The ring's forward (c blocks, each merged) and backward (c blocks, the dK/dV accumulator
    added on arrival) on rank ``rank`` of ``cp``; K/V arrive as empty buffers (meta: shapes)."""

    @staticmethod
    def forward(ctx, q, k, v, positions, cp, rank, seq_len, layout, flash=False):
        pos_of = [rank_positions(seq_len, cp, j, layout) for j in range(cp)]
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)     # (b, a, s/N, d)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack([k, v]).contiguous()                      # (2, b, kv, s/N, d): one message
        for step in range(cp):
            src = (rank - step) % cp
            nxt = torch.empty_like(kv) if step < cp - 1 else None
            segments = _segments(positions, pos_of[src])
            if segments:
                out, lse = out.clone(), lse.clone()
            for rows, cols in segments:
                causal = fused.flash_causal(positions[rows], pos_of[src][cols]) if flash else None
                if causal is None:
                    o, m = _block(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], positions[rows],
                                  pos_of[src][cols])
                else:
                    o, m = fused.flash_block(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal)
                out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], o.to(out.dtype), m)
            if nxt is not None:
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = (pos_of, cp, rank, flash)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        pos_of, cp, rank, flash = ctx.ring
        dout = dout.contiguous()
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)   # (b, a, s/N)
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp):
            src = (rank - step) % cp
            acc_in = torch.empty(kv.shape, dtype=lse.dtype, device=kv.device) if step > 0 else None
            nxt = torch.empty_like(kv) if step < cp - 1 else None
            dkv = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)
            _block_backward(q, kv[0], kv[1], pos_of[rank], pos_of[src], dout, lse, delta, dq, dkv[0], dkv[1],
                            out if flash else None)
            if acc_in is not None:
                dkv += acc_in
            if nxt is not None:
                kv = nxt
        home = torch.empty(kv.shape, dtype=lse.dtype, device=kv.device)
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None, None, None, None, None, None


def ring_core(cp: int, rank: int, seq_len: int, layout: str = "zigzag", flash: bool = False):
    """An attention core (``Attention.attend``'s signature) that runs the ring on rank ``rank``:
    the ranks' ``ring_attention`` (its positions checked against the rank's shard), then
    :class:`RingCore` (``flash``: its blocks as FlashAttention kernels, a Hardware's
    ``fused_attention``, as the dry run runs them)."""
    def attend(q, k, v, q_pos=None, k_pos=None, future=None):
        expected = rank_positions(seq_len, cp, rank, layout)
        if not torch.equal(q_pos, expected):
            raise ValueError(f"ring attention: positions must be rank {rank}'s {layout} shard")
        return RingCore.apply(q, k, v, q_pos, cp, rank, seq_len, layout, flash)
    return attend


def ring_kernels(hw, b: int, heads: int, kv_heads: int, head_dim: int, seq_len: int, cp: int, rank: int,
                 layout: str = "zigzag", itemsize: int = 2) -> tuple:
    """(forward, backward) :class:`~course_lib.planner.kernels.Kernels` of the ring alone
    (:class:`RingCore`) on rank ``rank``: ``heads`` and ``kv_heads`` its own (a TP rank's)."""
    from course_lib.planner.kernels import KernelCounter     # (kernels traces the model with this module)
    n = seq_len // cp
    dtype = torch.bfloat16 if itemsize is None else torch.float32   # None: a mixed precision's own dtypes
    with torch.device("meta"):
        q = torch.empty(b, heads, n, head_dim, requires_grad=True, dtype=dtype)
        k, v = (torch.empty(b, kv_heads, n, head_dim, requires_grad=True, dtype=dtype) for _ in range(2))
    pos = rank_positions(seq_len, cp, rank, layout)
    with KernelCounter(hw, itemsize) as fwd:
        out = RingCore.apply(q, k, v, pos, cp, rank, seq_len, layout, getattr(hw, "fused_attention", False))
    with KernelCounter(hw, itemsize) as bwd:
        out.backward(torch.empty_like(out))
    return fwd.total, bwd.total


def traced_ring(layout) -> str | None:
    """The CP split the planner traces ring attention on (:mod:`.ring_ops`), or None: cp > 1 with
    the ranks' ring (``cp_method`` and ``cp_comm`` "ring"), one document, zigzag or contiguous."""
    if layout.cp > 1 and layout.cp_method == layout.cp_comm == "ring" and not layout.documents \
            and layout.cp_layout in ("zigzag", "contiguous"):
        return layout.cp_layout
    return None


__all__ = ["traced_ring", "rank_positions", "RingCore", "ring_core", "ring_kernels"]
