"""Llama 3's context parallelism: K and V all-gathered, each local query chunk attended locally.

    pos = shard_positions(seq_len, cp.size, cp.rank)          # chunks i and 2N-1-i of 2N
    y = all_gather_attention(q, k, v, pos, cp)                # one all-gather forward,
                                                              # one reduce-scatter backward

Dubey et al. 2024 (Sec. 3.3.2): the sequence is cut into 2N chunks and rank i holds chunks i
and 2N-1-i (the zigzag of :mod:`course_lib.parallel.cp_layouts`: equal work under the causal
mask). Before attention every CP rank all-gathers K and V, then computes the attention of each
of its local query chunks against the gathered keys that chunk sees: chunk j (positions
j c .. (j+1) c - 1, c = s / 2N) sees the first (j+1) c keys, its own c x c block causal
(FlashAttention's causal mask aligned at the bottom right). Backward: every rank holds dK/dV
of the whole sequence, and a reduce-scatter sums them back to the ranks that own the tokens.

Against the ring (:func:`~course_lib.parallel.context_parallel.ring_attention`): the
all-gather is exposed (attention waits for it) where the ring hides its hops under compute,
but with grouped-query attention K and V are small (kv heads against a query heads: Llama 3
405B has 8 against 128), any mask works on the gathered keys (packed documents), and the
attention kernel is one call per chunk, no merges.

Here autograd keeps the gathered K/V for backward. Transformer Engine's
``AttnFuncWithCPAndKVAllGather`` (which cites the same section) keeps only the local K/V and
all-gathers them again in backward: one collective more per layer, cp times less K/V held
(the planner prices that one: ``planner.costs``, three collectives per layer).
"""
from __future__ import annotations

import contextlib

import torch

from course_lib import trace
from course_lib.attention import causal_attention, document_mask
from course_lib.parallel.cp_layouts import check_shard_positions, shard_positions


class GatherSequence(torch.autograd.Function):
    """``f`` of all-gather CP: all-gather forward (N, ...) from every rank's (...) along dim 0,
    reduce-scatter backward (each rank gets the sum of every rank's gradient of its own piece)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        out = x.new_empty((comm.size * x.shape[0],) + tuple(x.shape[1:]))   # (N * 2, b, kv, s/N, d)
        comm.all_gather_into_tensor(out, x.contiguous(), name="K/V all-gather")
        return out

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        mine = grad.new_empty((grad.shape[0] // comm.size,) + tuple(grad.shape[1:]))   # (2, b, kv, s/N, d)
        comm.reduce_scatter_tensor(mine, grad.contiguous(), name="dK/dV reduce-scatter")
        return mine, None


def query_runs(positions: torch.Tensor, chunk: int | None = None) -> list[tuple[int, int]]:
    """[(lo, hi)]: the runs of consecutive positions in this rank's tokens, each cut into the
    layout's chunks of ``chunk`` tokens (zigzag: s/2N, so its two chunks are two runs even where
    they touch, as Llama 3 computes them). Each run sees a prefix of the sequence's keys."""
    cuts = set((torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist())
    if chunk:
        cuts |= set(range(chunk, positions.numel(), chunk))
    bounds = [0] + sorted(cuts) + [positions.numel()]
    return list(zip(bounds[:-1], bounds[1:]))


def all_gather_attention(q, k, v, positions, comm, seq_len=None, layout="zigzag", doc_ids=None,
                         attention=causal_attention):
    """Causal attention of this rank's queries over the WHOLE sequence's keys, Llama 3's way.

    q (b, a, s/N, d); k, v (b, kv, s/N, d): this rank's tokens at ``positions`` (its
    ``shard_positions(seq_len, N, rank, layout)``) -> (b, a, s/N, d). ``attention``: the core
    run on each query run against the keys it sees (``Attention.attend``: recomputed under
    selective recomputation; a fused kernel in a dry run). ``doc_ids`` (s,): the packing."""
    n = comm.size
    seq_len = positions.numel() * n if seq_len is None else seq_len
    b, kvh, s_local, d = k.shape
    chunk = s_local // 2 if layout == "zigzag" else None          # the zigzag's two chunks, s/2N each
    clock = trace.clock()
    with clock.muted() if clock is not None else contextlib.nullcontext():   # bookkeeping: on a GPU, host ints
        check_shard_positions(positions, seq_len, n, comm.rank, layout, doc_ids, "all-gather attention")
        where = torch.cat([shard_positions(seq_len, n, j, layout, positions.device, doc_ids) for j in range(n)])
        order = torch.argsort(where).to(q.device)                  # rank order -> sequence order
        runs = [(lo, hi, int(positions[hi - 1]) + 1) for lo, hi in query_runs(positions, chunk)]   # + keys seen
        keys = torch.arange(seq_len, device=positions.device)
    if n == 1:
        mask = None if doc_ids is None else document_mask(positions, positions, doc_ids)
        return attention(q, k, v, positions, positions, future=mask)
    kv = torch.stack([k, v])                                       # (2, b, kv, s/N, d): one message
    gathered = GatherSequence.apply(kv, comm)                      # (N * 2, b, kv, s/N, d), rank order
    kv_all = gathered.view(n, 2, b, kvh, s_local, d).permute(1, 2, 3, 0, 4, 5).reshape(2, b, kvh, seq_len, d)
    kv_all = kv_all.index_select(3, order)                         # (2, b, kv, s, d): keys 0..s-1
    outs = []
    for lo, hi, seen in runs:                                      # zigzag: chunk i, then chunk 2N-1-i
        mask = None if doc_ids is None else document_mask(positions[lo:hi], keys[:seen], doc_ids)
        outs.append(attention(q[:, :, lo:hi], kv_all[0, :, :, :seen], kv_all[1, :, :, :seen],
                              positions[lo:hi], keys[:seen], future=mask))   # (b, a, run, d)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (b, a, s/N, d)


__all__ = ["GatherSequence", "query_runs", "all_gather_attention"]
