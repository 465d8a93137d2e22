"""All-gather CP (Llama 3's) and Ulysses as one context-parallel rank runs them, written again
on the planner's side: the kernels ``runtime="course"`` traces for a CP rank that does not run
the ring (:func:`course_lib.planner.kernels.trace_step`; the ring is :mod:`.ring_ops`).

The ranks' code (``parallel/cp_allgather.py``: ``all_gather_attention``; ``parallel/
context_parallel.py``: ``ulysses_attention``) is not one attention call cut by ``cp``. Around
its core it moves K and V (or Q, K, V and the output) into another order, with copies a plain
pass cut by ``cp`` would miss:

* all-gather: K and V stacked into one message, the gathered buffer put in sequence order (a
  reshape of a permuted view and an ``index_select``), each local query chunk attended against
  the keys it sees (one FlashAttention kernel per chunk under a Hardware's ``fused_attention``,
  :func:`course_lib.flash_prefix.flash_attention_prefix`), the chunks concatenated; backward
  gathers K and V again (nothing of the gathered K/V is kept between the passes), scatters
  each chunk's dK/dV into the whole sequence and reduce-scatters it;
* Ulysses: Q, K and V each to head shards over the whole sequence (a copy into the message's
  order, one out of it), the core on a/cp heads at the gathered positions, the output back.

The planner sits below ``parallel/`` and imports none of it: the ops below are the ranks',
written again, so traced on the meta device they are the kernels the ranks launch, op for op
(``tests/test_planner_cp_methods.py`` checks it against the code). A message is an empty
buffer here; its time is the runtime's (:mod:`.runtime`: exposed, as the attention waits for it).
"""
from __future__ import annotations

import torch

from course_lib.flash_prefix import flash_attention_prefix
from course_lib.fused import flash_attention
from course_lib.planner.ring_ops import rank_positions


def query_runs(positions: torch.Tensor, chunk: int | None = None) -> list:
    """[(lo, hi)]: runs of consecutive positions, each cut into chunks of ``chunk`` tokens (the
    zigzag's two chunks are two runs even where they touch, as Llama 3 computes them)."""
    cuts = set((torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist())
    if chunk:
        cuts |= set(range(chunk, positions.numel(), chunk))
    bounds = [0] + sorted(cuts) + [positions.numel()]
    return list(zip(bounds[:-1], bounds[1:]))


class _Gathered(torch.autograd.Function):
    """The K/V all-gather with its message unsent: forward a buffer of every rank's (2, b, kv,
    s/N, d), backward the reduce-scatter's buffer of this rank's piece."""

    @staticmethod
    def forward(ctx, x, n):
        ctx.n = n
        return x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        return grad.new_empty((grad.shape[0] // ctx.n,) + tuple(grad.shape[1:])), None


class _Regathered:
    """Saved-tensor hooks that keep no view of the gathered K/V: the first unpack in backward
    gathers the local K/V again (an empty buffer) and puts it in sequence order; every other
    tensor goes to the hooks outside (the ranks' ``RegatheredKV``)."""

    def __init__(self, kv_all, local, regather):
        self.key, self.regather, self.full = _storage(kv_all), regather, None
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
        self.outer_pack, self.outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)
        self.local = self.outer_pack(local)

    def pack(self, t):
        if t.numel() and _storage(t) == self.key:
            return ("gathered", t.storage_offset(), tuple(t.size()), tuple(t.stride()))
        return self.outer_pack(t)

    def unpack(self, saved):
        if not (isinstance(saved, tuple) and saved and saved[0] == "gathered"):
            return self.outer_unpack(saved)
        if self.full is None:
            self.full = self.regather(self.outer_unpack(self.local))
        _, offset, size, stride = saved
        return self.full.as_strided(size, stride, offset)


def _storage(t):
    storage = t.untyped_storage()
    return t.device, storage._cdata if t.is_meta else storage.data_ptr()


def gather_core(cp: int, rank: int, seq_len: int, layout: str = "zigzag", flash: bool = False, inner=None):
    """An attention core (``Attention.attend``'s signature) that runs all-gather CP on rank
    ``rank`` of ``cp``: ``flash`` each chunk one FlashAttention kernel, else ``inner`` (the
    block's own core, written out). The positions, their order and the runs are the host's
    bookkeeping, made here once (the ranks make them under the clock's mute)."""
    positions = rank_positions(seq_len, cp, rank, layout)
    order = torch.argsort(torch.cat([rank_positions(seq_len, cp, j, layout) for j in range(cp)]))
    chunk = positions.numel() // 2 if layout == "zigzag" else None
    runs = [(lo, hi, int(positions[hi - 1]) + 1) for lo, hi in query_runs(positions, chunk)]
    keys, mine = torch.arange(seq_len), positions.tolist()

    def attend(q, k, v, q_pos=None, k_pos=None, future=None):
        if q_pos.tolist() != mine:                        # (host values: no kernel)
            raise ValueError(f"all-gather attention: positions must be rank {rank}'s {layout} shard")
        b, kvh, s_local, d = k.shape
        # the host's order, which the ranks move to the GPU under the clock's mute: on the meta
        # device an index of its shape (no values there to move, no kernel)
        where = torch.empty(order.shape, dtype=order.dtype, device=q.device) if q.is_meta else order.to(q.device)

        def in_sequence_order(gathered):
            full = gathered.view(cp, 2, b, kvh, s_local, d).permute(1, 2, 3, 0, 4, 5).reshape(2, b, kvh, seq_len, d)
            return full.index_select(3, where)

        def regather(local):
            return in_sequence_order(local.new_empty((cp * 2,) + tuple(local.shape[1:])))

        kv = torch.stack([k, v])
        kv_all = in_sequence_order(_Gathered.apply(kv, cp))
        hooks = _Regathered(kv_all, kv.detach(), regather)
        outs = []
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            for lo, hi, seen in runs:
                qs, ks, vs = q[:, :, lo:hi], kv_all[0, :, :, :seen], kv_all[1, :, :, :seen]
                outs.append(flash_attention_prefix(qs, ks, vs) if flash
                            else inner(qs, ks, vs, positions[lo:hi], keys[:seen], future=None))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return attend


class _AllToAll(torch.autograd.Function):
    """Ulysses' all-to-all, its message unsent: ``to_heads`` (b, heads, s/N, d) -> (b, heads/N,
    s, d), else the inverse; backward the other direction."""

    @staticmethod
    def forward(ctx, x, n, to_heads):
        ctx.n, ctx.to_heads = n, to_heads
        return _seq_to_heads(x, n) if to_heads else _heads_to_seq(x, n)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        return (_heads_to_seq(g, ctx.n) if ctx.to_heads else _seq_to_heads(g, ctx.n)), None, None


def _seq_to_heads(x, n):
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()      # row j: head group j
    recv = torch.empty_like(send)                                          # row j: rank j's tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x, n):
    b, h, s, d = x.shape
    send = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    return recv.transpose(0, 1).reshape(b, n * h, s // n, d)


def ulysses_core(cp: int, rank: int, seq_len: int, layout: str = "zigzag", inner=None, flash: bool = False):
    """An attention core that runs Ulysses on rank ``rank`` of ``cp``: Q, K, V to head shards,
    the core on a/cp heads over the whole sequence, the output back. Written out (``inner``,
    the block's core): the positions gathered first (an empty buffer: on the meta device they
    have no values), the core at the gathered positions. ``flash``: no positions gathered; the
    sequence put in order by the host's order of the shards (the contiguous split's is the
    sequence's: no copies), one FlashAttention kernel over it, the output back in rank order."""
    mine = rank_positions(seq_len, cp, rank, layout).tolist()
    where = torch.cat([rank_positions(seq_len, cp, j, layout) for j in range(cp)])
    plain = bool(torch.equal(where, torch.arange(seq_len)))

    def attend(q, k, v, q_pos=None, k_pos=None, future=None):
        if q_pos.tolist() != mine:
            raise ValueError(f"Ulysses attention: positions must be rank {rank}'s {layout} shard")
        if flash:
            # the host's order and its inverse, moved to the GPU under the ranks' mute: on the
            # meta device indices of their shape
            order = torch.empty(where.shape, dtype=where.dtype, device=q.device) if q.is_meta else \
                torch.argsort(where).to(q.device)
            back = torch.empty(where.shape, dtype=where.dtype, device=q.device) if q.is_meta else where.to(q.device)
            qh, kh, vh = (_AllToAll.apply(t.contiguous(), cp, True) for t in (q, k, v))
            if not plain:
                qh, kh, vh = (t.index_select(2, order) for t in (qh, kh, vh))
            y = flash_attention(qh, kh, vh)
            if not plain:
                y = y.index_select(2, back)
            return _AllToAll.apply(y.contiguous(), cp, False)
        everyone = torch.empty(cp * q_pos.numel(), dtype=q_pos.dtype, device=q.device)
        q_pos.to(q.device).contiguous()                   # the all-gather's input
        qh, kh, vh = (_AllToAll.apply(t.contiguous(), cp, True) for t in (q, k, v))
        y = inner(qh, kh, vh, everyone, everyone, future=None)
        return _AllToAll.apply(y.contiguous(), cp, False)
    return attend


def traced_cp(layout) -> tuple:
    """(method, split) the planner traces a CP rank's program with: ("ring" | "all_gather" |
    "ulysses", "zigzag" | "contiguous"), or (the method, None) where it traces one device's
    attention cut by cp instead (cp = 1; packed documents; another split)."""
    method = "all_gather" if layout.cp_comm == "all_gather" else layout.cp_method
    if layout.cp > 1 and not layout.documents and layout.cp_layout in ("zigzag", "contiguous") \
            and (method != "ring" or layout.cp_comm == "ring"):
        return method, layout.cp_layout
    return method, None


def cp_message_bytes(method: str, b: int, heads: int, kv_heads: int, head_dim: int, seq_len: int, cp: int,
                     itemsize: int = 2) -> dict:
    """{collective: bytes of one call's buffer on a rank} of one layer's forward: all-gather
    CP's K/V (the gathered buffer), Ulysses' all-to-alls (one rank's Q, K, V or output)."""
    local = b * (seq_len // cp) * head_dim * itemsize
    if method == "all_gather":
        return {"all_gather": cp * 2 * kv_heads * local}
    return {"q": heads * local, "kv": kv_heads * local, "out": heads * local}


__all__ = ["query_runs", "gather_core", "ulysses_core", "traced_cp", "cp_message_bytes"]
