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

What backward needs of the gathered K/V is not kept: as Transformer Engine's
``AttnFuncWithCPAndKVAllGather`` (which cites the same section), only the local K/V stay and
backward all-gathers them again (:class:`RegatheredKV`): three collectives per layer, as the
planner prices them (``planner.costs``), and cp times less K/V held between the passes.
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


class RegatheredKV:
    """``saved_tensors_hooks`` that keep no view of the gathered K/V for backward: autograd
    saves a token (offset, size, stride) instead, and the first unpack in backward all-gathers
    the local K/V again and puts them in sequence order (``regather``). Every other saved
    tensor, and the local K/V kept, go to the pair this forward runs inside (the pipeline
    runner's count of saved activations: torch calls only the innermost pair)."""

    def __init__(self, kv_all, local, regather):
        self.key, self.regather, self.full = _storage_key(kv_all), regather, None
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
        self.outer_pack, self.outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)
        self.local = self.outer_pack(local)        # (2, b, kv, s/N, d): what backward gathers again

    def pack(self, t):
        if t.numel() and _storage_key(t) == self.key:
            return ("regathered K/V", t.storage_offset(), tuple(t.size()), tuple(t.stride()))
        return self.outer_pack(t)

    def unpack(self, saved):
        if not (isinstance(saved, tuple) and saved and saved[0] == "regathered K/V"):
            return self.outer_unpack(saved)
        if self.full is None:                      # once per backward of this attention
            self.full = self.regather(self.outer_unpack(self.local))
        _, offset, size, stride = saved
        return self.full.as_strided(size, stride, offset)


def _storage_key(t):
    """The storage ``t`` views (on the meta device, where every data_ptr is 0: its identity)."""
    storage = t.untyped_storage()
    return t.device, storage._cdata if t.is_meta else storage.data_ptr()


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
    def in_sequence_order(gathered):               # (N * 2, b, kv, s/N, d), rank order -> (2, b, kv, s, d)
        full = gathered.view(n, 2, b, kvh, s_local, d).permute(1, 2, 3, 0, 4, 5).reshape(2, b, kvh, seq_len, d)
        return full.index_select(3, order)

    def regather(local):                           # backward: the same K/V, gathered again
        out = local.new_empty((n * 2,) + tuple(local.shape[1:]))
        comm.all_gather_into_tensor(out, local, name="K/V all-gather (backward)")
        return in_sequence_order(out)

    kv = torch.stack([k, v])                                       # (2, b, kv, s/N, d): one message
    kv_all = in_sequence_order(GatherSequence.apply(kv, comm))     # (2, b, kv, s, d): keys 0..s-1
    hooks = RegatheredKV(kv_all, kv.detach(), regather)
    outs = []
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        for lo, hi, seen in runs:                                  # zigzag: chunk i, then chunk 2N-1-i
            mask = None if doc_ids is None else document_mask(positions[lo:hi], keys[:seen], doc_ids)
            outs.append(attention(q[:, :, lo:hi], kv_all[0, :, :, :seen], kv_all[1, :, :, :seen],
                                  positions[lo:hi], keys[:seen], future=mask))   # (b, a, run, d)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (b, a, s/N, d)


__all__ = ["GatherSequence", "RegatheredKV", "query_runs", "all_gather_attention"]
