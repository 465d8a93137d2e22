"""Causal attention at explicit token positions: the arithmetic every parallel dimension reuses.

    q, k = apply_rotary(q, *rotary_rows(cos, sin, q_pos, s_q)), ...   # rotary at the tokens' positions
    y = causal_attention(q, k, v, q_pos, k_pos)    # (b, a, s_q, d): q_pos >= k_pos is visible
    mask = document_mask(q_pos, k_pos, doc_ids)    # packed documents: none attends across

Positions are absolute (int64, one per token; None = 0..s-1), so a context-parallel shard
(the second half of a sequence, or two chunks for load balance) attends to keys from
another shard. Packed documents: ``doc_ids`` gives every token of the WHOLE sequence a
document id (one contiguous run per document, like the cu_seqlens of FlashAttention's
varlen kernels), and a query sees a key only if both are in the same document.
Head counts come from the tensors' shapes (grouped-query: a multiple of
the key/value heads), so a tensor-parallel rank runs the heads it holds.
``course_lib.gpt.Attention`` is the module around these functions.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------- positions


def check_positions(positions, s, seq_len):
    """None, or ``positions`` checked: an int64 tensor of shape (s,) with values in [0, seq_len)."""
    if positions is None:
        if s > seq_len:
            raise ValueError(f"sequence length {s} exceeds config.seq_len={seq_len}")
        return None
    if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be an int64 tensor, got {getattr(positions, 'dtype', type(positions))}")
    if positions.shape != (s,):
        raise ValueError(f"positions must have shape (s,) = ({s},), one per token, got {tuple(positions.shape)}")
    if s and (positions.min() < 0 or positions.max() >= seq_len):
        raise ValueError(f"positions must lie in [0, seq_len={seq_len}), got "
                         f"[{positions.min().item()}, {positions.max().item()}]")
    return positions


def check_doc_ids(doc_ids, seq_len):
    """None, or ``doc_ids`` checked: int64 of shape (S,) or (b, S), S >= 1 the whole sequence's
    length (at most ``seq_len``), each document one contiguous run of tokens (a packing)."""
    if doc_ids is None:
        return None
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dtype != torch.int64 or doc_ids.dim() not in (1, 2):
        raise ValueError(f"doc_ids must be an int64 tensor of shape (s,) or (batch, s), one document id per "
                         f"token, got {getattr(doc_ids, 'dtype', type(doc_ids))} "
                         f"{tuple(getattr(doc_ids, 'shape', ()))}")
    if not 1 <= doc_ids.shape[-1] <= seq_len:
        raise ValueError(f"doc_ids covers {doc_ids.shape[-1]} tokens: a packed sequence holds 1..seq_len="
                         f"{seq_len}")
    for row in doc_ids.reshape(-1, doc_ids.shape[-1]):
        if int((row[1:] != row[:-1]).sum()) + 1 != torch.unique(row).numel():    # runs vs documents
            raise ValueError("doc_ids: each document must be one contiguous run of tokens (a packed "
                             "sequence); an id that comes back after another document's tokens is not a packing")
    return doc_ids


def document_mask(q_positions, k_positions, doc_ids=None):
    """True where a query may NOT see a key: the key comes later (q_pos < k_pos) or, with
    ``doc_ids`` (the whole sequence's, (S,) or (b, S)), sits in another document.
    (s_q, s_k), or (b, 1, s_q, s_k) for one packing per batch row: the scores' mask."""
    future = q_positions[:, None] < k_positions[None, :]                     # (s_q, s_k)
    if doc_ids is None:
        return future
    q_doc, k_doc = doc_ids[..., q_positions], doc_ids[..., k_positions]      # (..., s_q), (..., s_k)
    other = q_doc[..., :, None] != k_doc[..., None, :]                       # (..., s_q, s_k)
    return (future | other) if doc_ids.dim() == 1 else (future | other)[:, None]


def rotary_tables(seq_len, head_dim, theta=10000.0):
    """cos, sin of shape (seq_len, head_dim): position t rotates pair (i, i + d/2) by t * theta^(-2i/d)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (d/2,)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)           # (s, d/2)
    angles = torch.cat([angles, angles], dim=-1)                                          # (s, d)
    return angles.cos().float(), angles.sin().float()


def rotary_rows(cos, sin, positions, s):
    """The (s, d) rows of the tables for the tokens at ``positions`` (None = 0..s-1).

    Contiguous positions take a slice, a view of the tables, so autograd saves nothing new
    (the tables are buffers); other positions (a load-balanced context-parallel shard) gather."""
    if positions is None:
        return cos[:s], sin[:s]
    start = int(positions[0]) if s else 0
    if torch.equal(positions, torch.arange(start, start + s, device=positions.device)):
        return cos[start:start + s], sin[start:start + s]
    return cos[positions], sin[positions]


def apply_rotary(x, cos, sin):  # x (b, heads, s, d); cos, sin (s, d)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # the pair (x1, x2) turned by 90 degrees
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------- attention


def attention_scores(q, k, q_positions=None, k_positions=None, future=None):
    """Scaled causal scores: q (b, a, s_q, d), k (b, kv, s_k, d) -> (b, a, s_q, s_k).

    Grouped-query: the a / kv query heads of a group are stacked along the sequence axis,
    so K is used (and saved for backward) at its own small size. A query sees the keys
    with ``q_pos >= k_pos`` (absolute positions, None = 0..s-1); ``future`` (s_q, s_k) bool,
    True where the key is hidden, may be passed precomputed (:func:`document_mask`; (b, 1,
    s_q, s_k) for a packing per batch row). The mask is added as a
    0 / -inf bias: an addition saves nothing for backward (a masked_fill would save it).
    """
    b, a, s_q, d = q.shape
    kv, s_k = k.shape[1], k.shape[2]
    if a % kv:
        raise ValueError(f"query heads ({a}) must be a multiple of key/value heads ({kv})")
    dev = q.device
    q_pos = torch.arange(s_q, device=dev) if q_positions is None else q_positions
    k_pos = torch.arange(s_k, device=dev) if k_positions is None else k_positions
    if future is None and (q_pos.shape != (s_q,) or k_pos.shape != (s_k,)):
        raise ValueError(f"need one position per query ({s_q}) and per key ({s_k}), got "
                         f"{tuple(q_pos.shape)} and {tuple(k_pos.shape)}")
    if future is None:
        future = q_pos[:, None] < k_pos[None, :]                        # (s_q, s_k)
    bias = torch.zeros(future.shape, dtype=q.dtype, device=dev).masked_fill(future, float("-inf"))
    scores = (q.reshape(b, kv, (a // kv) * s_q, d) @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    return scores.view(b, a, s_q, s_k) + bias                           # (b, a, s_q, s_k)


def attention_output(probs, v):  # probs (b, a, s_q, s_k), v (b, kv, s_k, d) -> (b, a, s_q, d)
    b, a, s_q, s_k = probs.shape
    kv, d = v.shape[1], v.shape[3]
    return (probs.reshape(b, kv, (a // kv) * s_q, s_k) @ v).view(b, a, s_q, d)


def causal_attention(q, k, v, q_positions=None, k_positions=None, dropout=None, future=None):
    """softmax(q k^T / sqrt(d) + causal bias) v, grouped-query, at explicit positions.

    q (b, a, s_q, d); k, v (b, kv, s_k, d) -> (b, a, s_q, d). Keys may come from another
    context-parallel shard (their own ``k_positions``); every query must see at least one
    key, else its softmax has nothing to normalise (ring attention merges blocks itself,
    from :func:`attention_scores` and :func:`attention_output`)."""
    if (q_positions is not None or k_positions is not None) and q.shape[2] and k.shape[2]:
        first_q = 0 if q_positions is None else int(q_positions.min())
        first_k = 0 if k_positions is None else int(k_positions.min())
        if first_q < first_k:
            raise ValueError(f"every query needs a key at or before its position: query position "
                             f"{first_q} < first key position {first_k}")
    probs = F.softmax(attention_scores(q, k, q_positions, k_positions, future), dim=-1)
    if dropout is not None:
        probs = dropout(probs)
    return attention_output(probs, v)


# ----------------------------------------------------------------------------- memory-efficient


class BlockwiseCausalAttention(torch.autograd.Function):
    """Causal attention over key blocks of ``block`` tokens, FlashAttention's way, on one device.

    Forward keeps a running output and log-sum-exp per query and merges one key block at a
    time (online softmax), so the largest score tensor is (b, a, s, block), never (s, s).
    Saved for backward: q, k, v, the output and the log-sum-exp, linear in s; backward
    recomputes each block's probabilities from them. The FLOPs stay quadratic in s: every
    query still meets every earlier key. Positions 0..s-1 (one whole sequence).
    """

    @staticmethod
    def forward(ctx, q, k, v, block):                     # q (b, a, s, d); k, v (b, kv, s, d)
        s = q.shape[2]
        out, lse = None, None
        for start in range(0, s, block):
            k_pos = torch.arange(start, min(start + block, s), device=q.device)
            scores = attention_scores(q, k[:, :, k_pos], None, k_pos)     # (b, a, s, block)
            blk_lse = torch.logsumexp(scores, dim=-1)                      # -inf: sees no key here
            probs = torch.exp(scores - blk_lse.masked_fill(blk_lse.isinf(), 0.0)[..., None])
            blk_out = attention_output(probs, v[:, :, k_pos])              # (b, a, s, d)
            if out is None:                                                # block 0: every query sees key 0
                out, lse = blk_out, blk_lse
                continue
            new_lse = torch.logaddexp(lse, blk_lse)
            out = out * torch.exp(lse - new_lse)[..., None] + blk_out * torch.exp(blk_lse - new_lse)[..., None]
            lse = new_lse
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block = block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        b, a, s, d = q.shape
        kv = k.shape[1]
        delta = (grad_out * out).sum(-1)                                   # (b, a, s): rowsum(dO o O)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        scale = 1.0 / math.sqrt(d)
        for start in range(0, s, ctx.block):
            k_pos = torch.arange(start, min(start + ctx.block, s), device=q.device)
            probs = torch.exp(attention_scores(q, k[:, :, k_pos], None, k_pos) - lse[..., None])  # true softmax
            grouped = probs.reshape(b, kv, s * (a // kv), len(k_pos))      # query heads of a K/V head stacked
            dv[:, :, k_pos] = grouped.transpose(-2, -1) @ grad_out.reshape(b, kv, -1, d)
            dprobs = (grad_out.reshape(b, kv, -1, d) @ v[:, :, k_pos].transpose(-2, -1)).view_as(probs)
            dscores = probs * (dprobs - delta[..., None])                 # (b, a, s, block)
            dq += (dscores.reshape(b, kv, -1, len(k_pos)) @ k[:, :, k_pos]).view_as(q) * scale
            dk[:, :, k_pos] = dscores.reshape(b, kv, -1, len(k_pos)).transpose(-2, -1) @ q.reshape(b, kv, -1, d) * scale
        return dq, dk, dv, None


def blockwise_causal_attention(q, k, v, block: int = 64):
    """The same result as :func:`causal_attention` (positions 0..s-1), computed with O(s) saved
    memory instead of the (s, s) probabilities: see :class:`BlockwiseCausalAttention`."""
    if block < 1:
        raise ValueError(f"block must be a positive number of keys, got {block}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    return BlockwiseCausalAttention.apply(q, k, v, block)


__all__ = ["check_positions", "check_doc_ids", "document_mask", "rotary_tables", "rotary_rows", "apply_rotary", "attention_scores",
           "attention_output", "causal_attention", "blockwise_causal_attention"]
