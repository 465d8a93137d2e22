"""Context parallelism: the sequence split over the "cp" ranks, attention made whole again.

    pos = zigzag_positions(seq_len, cp.size, cp.rank)      # chunks i and 2N-1-i of 2N
    y = ring_attention(q, k, v, pos, cp)                   # K/V blocks go round the ring
    y = ulysses_attention(q, k, v, pos, cp)                # all-to-all: sequence -> heads -> sequence
    y = all_gather_attention(q, k, v, pos, cp)             # Llama 3: K/V all-gathered
    context_parallel(model, cp, method="ring")             # every block's attention, in place

Everything outside attention is per token, so a rank runs it on its own tokens at their
absolute positions (``model.embed(idx, pos)``, ``block(x, pos)``); only attention needs
keys from the other shards. Two ways to get them:

* **Ring attention** (Liu et al. 2023; Megatron's CP): K/V blocks travel round the ring,
  N-1 hops; each rank merges the partial attentions of the blocks with the online-softmax
  rule (running max / log-sum-exp), so the (s, s) scores never exist whole. The exchange of
  the next block is posted before the current block is computed: communication hides behind
  compute. Backward runs the ring again, passing dK/dV along with K/V.
* **Ulysses** (Jacobs et al. 2023): an all-to-all turns the sequence shards of q, k, v into
  head shards over the whole sequence, plain attention runs on a/N heads, an all-to-all
  turns the result back. Needs heads (and K/V heads) divisible by N.
* **All-gathered K/V** (Llama 3, Dubey et al. 2024; ``cp_comm="all_gather"`` on a layout):
  every rank gathers the whole sequence's K and V (small with grouped-query attention) and
  attends each of its query chunks to the keys it sees; backward reduce-scatters dK/dV
  (:mod:`course_lib.parallel.cp_allgather`).

Causal masking makes a contiguous split unfair: rank N-1 sees every key, rank 0 only its
own. The zigzag layout gives rank i chunks i and 2N-1-i, equal work everywhere; packed
documents (``doc_ids``: no attention across documents) need the zigzag of every document
(:mod:`course_lib.parallel.cp_layouts`), and a block then computes only each document's part.
"""
from __future__ import annotations

import contextlib
import math

import torch

from course_lib import fused, trace
from course_lib.attention import (apply_rotary, attention_output, attention_scores, causal_attention,
                                  check_doc_ids, check_positions, document_mask, rotary_rows)
from course_lib.gpt import Attention
from course_lib.layout import CP_COMM
from course_lib.parallel.cp_allgather import all_gather_attention
from course_lib.parallel.cp_layouts import (LAYOUTS, check_documents, check_shard_positions,  # noqa: F401
                                            sequence_chunks, shard_positions, shard_sequence, zigzag_chunks,
                                            zigzag_positions)
from course_lib.parallel.tp_plan import local_heads

# ----------------------------------------------------------------------------- one block
def _span(idx: torch.Tensor):
    """A slice when the indexes are one contiguous run (a view, no copy), else the indexes."""
    if idx.numel() and int(idx[-1]) - int(idx[0]) + 1 == idx.numel():
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def visible_rows_cols(q_pos, k_pos):
    """The query rows that see at least one of these keys, and the keys seen by at least one
    query (causal: q_pos >= k_pos). Everything else of the (s_q, s_k) block is masked: skipped."""
    rows = torch.nonzero(q_pos >= k_pos.min()).flatten()
    cols = torch.nonzero(k_pos <= q_pos.max()).flatten()
    return _span(rows), _span(cols)


def visible_segments(q_pos, k_pos, doc_ids=None):
    """[(rows, cols)]: the parts of a (query block, key block) pair that a kernel computes.
    One document: the rows that see a key and the keys that are seen (causal trim). Packed
    documents (``doc_ids`` (s,) of the whole sequence): that trim inside each document both
    blocks share, nothing across documents (FlashAttention's varlen kernels, cu_seqlens)."""
    if doc_ids is None:
        return [visible_rows_cols(q_pos, k_pos)] if (q_pos >= k_pos.min()).any() else []
    q_doc, k_doc = doc_ids[q_pos], doc_ids[k_pos]
    out = []
    for d in torch.unique(q_doc).tolist():                         # documents in sequence order
        qi, ki = torch.nonzero(q_doc == d).flatten(), torch.nonzero(k_doc == d).flatten()
        if not ki.numel():
            continue
        rows, cols = qi[q_pos[qi] >= k_pos[ki].min()], ki[k_pos[ki] <= q_pos[qi].max()]
        if rows.numel():
            out.append((_span(rows), _span(cols)))
    return out


def block_attention(q, k, v, q_pos, k_pos):
    """Attention of q (b, a, s_q, d) over ONE block of keys k, v (b, kv, s_k, d), unnormalised
    across blocks: returns out (b, a, s_q, d) = softmax within the block @ v, and its
    log-sum-exp lse (b, a, s_q) (-inf for a query that sees none of these keys). For 16-bit
    inputs the softmax and P V run in fp32 (out, lse fp32: FlashAttention accumulates there)."""
    scores = attention_scores(q, k, q_pos, k_pos)                  # (b, a, s_q, s_k)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # softmax in fp32 for 16-bit
    lse = torch.logsumexp(scores, dim=-1)                          # (b, a, s_q)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return attention_output(torch.exp(scores - safe[..., None]), v.to(scores.dtype)), lse


def merge_partial(out1, lse1, out2, lse2):
    """The online-softmax rule: two partial attentions over disjoint key sets -> the attention
    over their union. lse = log(e^lse1 + e^lse2); out = out1 e^(lse1-lse) + out2 e^(lse2-lse).
    A side with lse = -inf (saw no key) gets weight 0."""
    lse = torch.logaddexp(lse1, lse2)                              # (b, a, s)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w1, w2 = torch.exp(lse1 - safe)[..., None], torch.exp(lse2 - safe)[..., None]
    return out1 * w1 + out2 * w2, lse


def running_block_attention(q, k, v, q_pos, k_pos):
    """FlashAttention's running form of one key block, where :func:`block_attention` gives
    (out, lse): m (b, a, s_q) the largest visible score (-inf: none), l = sum exp(s - m) (0:
    none), acc = sum exp(s - m) v (b, a, s_q, d) (0: none); computed in float64, returned in
    q's dtype. Causal by position; out = acc / l and lse = m + log l."""
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])   # (b, a, s_q, s_k)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    m = scores.amax(-1) if scores.shape[-1] else scores.new_full(scores.shape[:-1], float("-inf"))
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(scores - safe[..., None])                                            # 0 where hidden
    return (e @ v.double()).to(q.dtype), m.to(q.dtype), e.sum(-1).to(q.dtype)


def attention_flops(q_pos, k_pos, heads, head_dim, batch=1):
    """FLOPs of the computed (unmasked-trimmed) block: 2 matmuls of 2 * rows * cols * d each."""
    if not (q_pos >= k_pos.min()).any():
        return 0
    rows = int((q_pos >= k_pos.min()).sum())
    cols = int((k_pos <= q_pos.max()).sum())
    return 4 * batch * heads * rows * cols * head_dim


# ----------------------------------------------------------------------------- ring attention
def _flash_mask(flash, q_pos, k_pos, doc_ids):
    """With ``flash``, how one FlashAttention call runs this segment (:func:`course_lib.fused.flash_causal`:
    False, True), else None: the segment runs written out."""
    return fused.flash_causal(q_pos, k_pos) if flash and doc_ids is None else None


def _block_forward(q, k, v, q_pos, k_pos, out, lse, doc_ids=None, flash=False):
    """Merge block (k, v) into (out, lse), computing only its visible rows and columns
    (``flash``: each segment one FlashAttention kernel where one call computes it)."""
    segments = visible_segments(q_pos, k_pos, doc_ids)
    if segments:                                                   # else fully masked: skipped
        out, lse = out.clone(), lse.clone()
    for rows, cols in segments:                                    # disjoint rows: one per document
        causal = _flash_mask(flash, q_pos[rows], k_pos[cols], doc_ids)
        if causal is None:
            o, l = block_attention(q[:, :, rows], k[:, :, cols], v[:, :, cols], q_pos[rows], k_pos[cols])
        else:
            o, l = fused.flash_block(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal)
        out[:, :, rows], lse[:, :, rows] = merge_partial(out[:, :, rows], lse[:, :, rows], o.to(out.dtype), l)
    return out, lse


def _block_backward(q, k, v, q_pos, k_pos, dout, lse, delta, dq, dk, dv, doc_ids=None, out=None):
    """FlashAttention's backward for one block, with the GLOBAL lse (so P is the final softmax;
    16-bit inputs are computed in lse's fp32, like the forward), on its visible segments:
    dV += P^T dO; dP = dO V^T; dS = P (dP - delta); dQ += dS K / sqrt(d); dK += dS^T Q / sqrt(d).
    Given the whole ``out`` (the ring's blocks as FlashAttention kernels), a segment that one
    call computes runs the kernel's backward with the global out and lse rows instead."""
    for rows, cols in visible_segments(q_pos, k_pos, doc_ids):
        causal = _flash_mask(out is not None, q_pos[rows], k_pos[cols], doc_ids)
        if causal is None:
            _segment_backward(q, k, v, q_pos, k_pos, dout, lse, delta, dq, dk, dv, rows, cols)
            continue
        gq, gk, gv = fused.flash_block_backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                                out[:, :, rows], lse[:, :, rows], causal)
        dq[:, :, rows] += gq
        dk[:, :, cols] += gk
        dv[:, :, cols] += gv


def _segment_backward(q, k, v, q_pos, k_pos, dout, lse, delta, dq, dk, dv, rows, cols):
    b, a, _, d = q.shape
    kv = k.shape[1]
    qr, kc, vc, do = (t.to(lse.dtype) for t in (q[:, :, rows], k[:, :, cols], v[:, :, cols], dout[:, :, rows]))
    s_q, s_k = qr.shape[2], kc.shape[2]
    p = torch.exp(attention_scores(qr, kc, q_pos[rows], k_pos[cols]) - lse[:, :, rows, None])  # (b, a, s_q, s_k)
    p_g = p.reshape(b, kv, (a // kv) * s_q, s_k)                   # query heads of a group stacked
    do_g = do.reshape(b, kv, (a // kv) * s_q, d)
    dv[:, :, cols] += p_g.transpose(-2, -1) @ do_g
    dp = (do_g @ vc.transpose(-2, -1)).view(b, a, s_q, s_k)
    ds = (p * (dp - delta[:, :, rows, None])).reshape(b, kv, (a // kv) * s_q, s_k) / math.sqrt(d)
    dq[:, :, rows] += (ds @ kc).view(b, a, s_q, d)
    dk[:, :, cols] += ds.transpose(-2, -1) @ qr.reshape(b, kv, (a // kv) * s_q, d)


class RingAttention(torch.autograd.Function):
    """Ring attention, forward and backward (one ring each), on a Comm of the "cp" ranks.

    forward: post (send my K/V block right, receive the next from the left), attend to the
    current block, merge, wait; N blocks, N-1 hops. backward: the same ring for K/V, plus an
    accumulator dK/dV that travels WITH each block and arrives home after N hops.
    ``layout`` (and ``doc_ids``, the whole sequence's documents) tells every rank which positions
    another rank's block holds (nothing extra sent).
    16-bit inputs: the block softmax, P V, the merges (out, lse) and the gradients (dQ, and dK/dV,
    which then travel in fp32) are computed in fp32, where FlashAttention accumulates;
    K/V travel in their own dtype; fp32 and fp64 are unchanged. ``flash``: each block a
    FlashAttention kernel forward and backward (16-bit products on tensor cores, fp32
    accumulation, no block's scores in memory), merged the same way: what torch's own CP runs.
    """

    @staticmethod
    def forward(ctx, q, k, v, positions, comm, seq_len, layout, doc_ids=None, flash=False):
        n, r = comm.size, comm.rank
        pos_of = [shard_positions(seq_len, n, j, layout, positions.device, doc_ids) for j in range(n)]
        acc = torch.promote_types(q.dtype, torch.float32)          # bf16 blocks merge in fp32 (flash-attn's rule)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)     # (b, a, s/N, d)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)  # (b, a, s/N)
        kv = torch.stack([k, v]).contiguous()                      # (2, b, kv, s/N, d): one message
        for step in range(n):
            src = (r - step) % n                                   # whose block I hold now
            works, nxt = [], None
            if step < n - 1:                                       # post the next hop first...
                nxt = torch.empty_like(kv)
                works = [comm.irecv(nxt, comm.prev), comm.isend(kv, comm.next)]
                start = trace.now()
            with trace.span(f"attend block {src}", kind="compute"):  # ...then compute under it
                out, lse = _block_forward(q, kv[0], kv[1], positions, pos_of[src], out, lse, doc_ids, flash)
            if works:
                comm.wait(*works)
                trace.recorder().add(f"K/V hop {step + 1}", "comm", start, trace.now(), comm.dim)
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.pos_of, ctx.doc_ids, ctx.flash = comm, pos_of, doc_ids, flash
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, pos_of = ctx.comm, ctx.pos_of
        n, r = comm.size, comm.rank
        dout = dout.contiguous()
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)   # (b, a, s/N): rowsum(dO * O)
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)  # accumulated in fp32 for bf16
        kv = torch.stack([k, v]).contiguous()
        dkv_send = None
        for step in range(n):
            src = (r - step) % n
            works, nxt, acc_in = [], None, None
            if step > 0:   # the dK/dV accumulator of block src, from the left (posted before K/V:
                acc_in = torch.empty(kv.shape, dtype=lse.dtype, device=kv.device)  # (the left neighbour
                # sent it before its next K/V)
                works.append(comm.irecv(acc_in, comm.prev))
            if step < n - 1:
                nxt = torch.empty_like(kv)
                works += [comm.irecv(nxt, comm.prev), comm.isend(kv, comm.next)]
            dkv = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)
            with trace.span(f"attend block {src} (backward)", kind="compute"):
                _block_backward(q, kv[0], kv[1], pos_of[r], pos_of[src], dout, lse, delta, dq, dkv[0], dkv[1],
                                ctx.doc_ids, out if ctx.flash else None)
            comm.wait(*works)
            if dkv_send is not None:
                comm.wait(dkv_send)
            if acc_in is not None:
                dkv += acc_in
            dkv_send = comm.isend(dkv, comm.next)                  # on to the next rank (home after N)
            ctx.keep = dkv                                         # alive until the send completes
            if nxt is not None:
                kv = nxt
        home = torch.empty(kv.shape, dtype=lse.dtype, device=kv.device)
        comm.wait(comm.irecv(home, comm.prev), dkv_send)
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None, None, None, None, None, None


def ring_attention(q, k, v, positions, comm, seq_len=None, layout="zigzag", doc_ids=None, flash=False):
    """Causal attention of this rank's queries over the WHOLE sequence's keys.

    q (b, a, s/N, d); k, v (b, kv, s/N, d): this rank's tokens at ``positions`` (those of
    ``shard_positions(seq_len, N, rank, layout, doc_ids=doc_ids)``) -> (b, a, s/N, d).
    ``doc_ids`` (s,): the whole packed sequence's documents; none attends across them.
    ``flash``: the blocks as FlashAttention kernels (:class:`RingAttention`)."""
    n = comm.size
    seq_len = positions.numel() * n if seq_len is None else seq_len
    check_shard_positions(positions, seq_len, n, comm.rank, layout, doc_ids, "ring attention")
    if n == 1:
        mask = None if doc_ids is None else document_mask(positions, positions, doc_ids)
        return causal_attention(q, k, v, positions, positions, future=mask)
    return RingAttention.apply(q, k, v, positions, comm, seq_len, layout, doc_ids, flash)


# ----------------------------------------------------------------------------- Ulysses
class SeqToHeads(torch.autograd.Function):
    """All-to-all (b, heads, s/N, d) -> (b, heads/N, s, d): send head group j to rank j,
    receive every rank's sequence shard of my heads. Backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _seq_to_heads(x, comm)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g.contiguous(), ctx.comm), None


class HeadsToSeq(torch.autograd.Function):
    """The inverse: (b, heads/N, s, d) -> (b, heads, s/N, d). Backward: SeqToHeads."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _heads_to_seq(x, comm)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g.contiguous(), ctx.comm), None


def _seq_to_heads(x, comm):
    n = comm.size
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()   # (N, b, h/N, s/N, d): row j -> rank j
    recv = torch.empty_like(send)                                       # row j: rank j's tokens
    comm.all_to_all_single(recv, send, name="ulysses seq->heads")
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)     # (b, h/N, s, d)


def _heads_to_seq(x, comm):
    n = comm.size
    b, h, s, d = x.shape
    send = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()  # (N, b, h/N, s/N, d)
    recv = torch.empty_like(send)                                       # row j: head group j
    comm.all_to_all_single(recv, send, name="ulysses heads->seq")
    return recv.transpose(0, 1).reshape(b, n * h, s // n, d)           # (b, h, s/N, d)


def ulysses_attention(q, k, v, positions, comm, attention=causal_attention, doc_ids=None, seq_len=None,
                      layout=None, in_order=False):
    """DeepSpeed-Ulysses: all-to-all to head shards, full-sequence attention, all-to-all back.
    Any layout works: the gathered positions say where every token sits. ``attention``: the
    core on a/N heads (``Attention.attend``: recomputed there under selective recomputation).
    ``doc_ids``: the whole sequence's documents ((s,) or (b, s)); none attends across them.

    ``in_order`` (a core that runs one whole causal sequence, FlashAttention's): the gathered
    tokens are put in sequence order by the host's order of ``layout``'s shards (no positions
    gathered), the core runs on positions 0..s-1, its output goes back to the ranks' order;
    the contiguous layout's order is the sequence's already (no copies)."""
    n = comm.size
    a, kv = q.shape[1], k.shape[1]
    ulysses_heads(a, kv, n)                     # the rule check_layout applies before any rank starts
    if n == 1:
        mask = None if doc_ids is None else document_mask(positions, positions, doc_ids)
        return attention(q, k, v, positions, positions, future=mask)
    if in_order:
        return _ulysses_in_order(q, k, v, positions, comm, attention, doc_ids, seq_len, layout)
    everyone = torch.empty(n * positions.numel(), dtype=positions.dtype, device=q.device)
    comm.all_gather_into_tensor(everyone, positions.to(q.device).contiguous(), name="ulysses positions")
    qh, kh, vh = (SeqToHeads.apply(t.contiguous(), comm) for t in (q, k, v))  # (b, heads/N, s, d)
    mask = None if doc_ids is None else document_mask(everyone, everyone, doc_ids)   # (s, s)
    with trace.span("attention on a/N heads", kind="compute"):
        y = attention(qh, kh, vh, everyone, everyone, future=mask)
    return HeadsToSeq.apply(y.contiguous(), comm)                      # (b, a, s/N, d)


def _ulysses_in_order(q, k, v, positions, comm, attention, doc_ids, seq_len, layout):
    """:func:`ulysses_attention` with its core on the sequence in order (``in_order``)."""
    if doc_ids is not None:
        raise NotImplementedError("Ulysses with a core that runs one whole causal sequence (FlashAttention): "
                                  "packed documents need their mask, which that core does not take")
    n = comm.size
    seq_len = positions.numel() * n if seq_len is None else seq_len
    clock = trace.clock()
    with clock.muted() if clock is not None else contextlib.nullcontext():   # bookkeeping: host ints
        check_shard_positions(positions, seq_len, n, comm.rank, layout, None, "Ulysses attention")
        where = torch.cat([shard_positions(seq_len, n, j, layout, positions.device) for j in range(n)])
        plain = bool(torch.equal(where, torch.arange(seq_len, device=where.device)))
        order, back = torch.argsort(where).to(q.device), where.to(q.device)   # rank order <-> sequence order
    qh, kh, vh = (SeqToHeads.apply(t.contiguous(), comm) for t in (q, k, v))  # (b, heads/N, s, d)
    if not plain:
        qh, kh, vh = (t.index_select(2, order) for t in (qh, kh, vh))
    with trace.span("attention on a/N heads", kind="compute"):
        y = attention(qh, kh, vh)                                         # positions 0..s-1
    if not plain:
        y = y.index_select(2, back)
    return HeadsToSeq.apply(y.contiguous(), comm)                        # (b, a, s/N, d)


# ----------------------------------------------------------------------------- in a model
class ContextParallelAttention(Attention):
    """``course_lib.gpt.Attention`` with its core replaced: same weights, same names; only the
    attention over the sequence talks to the other CP ranks. ``flash_blocks``: the ring's
    blocks as FlashAttention kernels, Ulysses' core on the sequence in order (set with the dry
    run's ``"flash_attention"``)."""

    flash_blocks = False

    def forward(self, x, positions=None, doc_ids=None):            # (b, s/N, h), positions (s/N,)
        b, s, _ = x.shape
        if positions is None:
            raise ValueError("context-parallel attention needs the positions of this rank's tokens "
                             "(shard_positions(seq_len, cp, rank, layout)): its s/N tokens are not 0..s/N-1")
        check_positions(positions, s, s * self.cp_comm.size)
        d = self.head_dim
        q, k, v = self.project(x)
        q = q.view(b, s, -1, d).transpose(1, 2)                    # (b, a, s/N, d)
        k = k.view(b, s, -1, d).transpose(1, 2)                    # (b, kv, s/N, d)
        v = v.view(b, s, -1, d).transpose(1, 2)
        if self.rotary:
            cos, sin = rotary_rows(self.cos, self.sin, positions, s)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.cp_method == "ring":   # keeps q, k, v, out, lse: no (s, s) scores for selective to drop
            y = ring_attention(q, k, v, positions, self.cp_comm, s * self.cp_comm.size, self.cp_layout, doc_ids,
                               self.flash_blocks)
        elif self.cp_method == "all_gather":   # Llama 3's: each query chunk against the gathered keys
            y = all_gather_attention(q, k, v, positions, self.cp_comm, s * self.cp_comm.size, self.cp_layout,
                                     doc_ids, self.attend)
        else:
            y = ulysses_attention(q, k, v, positions, self.cp_comm, self.attend, doc_ids, s * self.cp_comm.size,
                                  self.cp_layout, self.flash_blocks)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


METHODS = ("ring", "ulysses", "all_gather")


def cp_method_of(layout) -> str:
    """What the ranks run for a layout: ``cp_comm="all_gather"`` is Llama 3's all-gathered K/V
    (it names no other method: ``cp_method`` stays at its default "ring"), else ``cp_method``."""
    if layout.cp_comm not in CP_COMM:
        raise ValueError(f"cp_comm must be one of {CP_COMM}, got {layout.cp_comm!r}")
    if layout.cp_comm == "all_gather":
        if layout.cp_method != "ring":
            raise ValueError(f"cp_comm='all_gather' (Llama 3's all-gathered K/V) is the CP method itself: "
                             f"cp_method={layout.cp_method!r} cannot run with it (leave cp_method at 'ring')")
        return "all_gather"
    return layout.cp_method


def check_cp_names(method: str, layout: str):
    if method not in METHODS:
        raise ValueError(f"cp_method must be one of {METHODS}, got {method!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"cp_layout must be one of {LAYOUTS}, got {layout!r}")


def ulysses_heads(q_heads: int, kv_heads: int, cp: int):
    """Ulysses hands each CP rank heads / cp of the local query and K/V heads."""
    if q_heads % cp or kv_heads % cp:
        raise ValueError(f"Ulysses needs the local query heads ({q_heads}) and key/value heads ({kv_heads}) "
                         f"divisible by cp={cp}; use ring attention instead")


def no_dropout(p: float):
    if p:
        raise ValueError("context parallelism here has no attention dropout (Llama trains without)")


def rule_context(cfg, layout):
    """CP's rules for a TinyGPT config: the method (:func:`cp_method_of`), the sequence cuts
    into its chunks (2 * cp for the zigzag), Ulysses' heads, no dropout."""
    check_cp_names(cp_method_of(layout), layout.cp_layout)
    documents = getattr(layout, "documents", ())
    if documents and (any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in documents)
                      or sum(documents) != cfg.seq_len):
        raise ValueError(f"documents={documents}: the lengths of the documents packed in one sequence, positive "
                         f"ints summing to the sequence length {cfg.seq_len}")
    if documents and layout.cp_layout == "documents" and layout.cp > 1 and any(n % (2 * layout.cp) for n in documents):
        raise ValueError(f"cp_layout='documents' cuts every document in 2 * cp = {2 * layout.cp} chunks: "
                         f"documents={documents} are not all multiples of it (pad them)")
    if layout.cp == 1:
        return
    sequence_chunks(cfg.seq_len, layout.cp, layout.cp_layout)
    if layout.cp_method == "ulysses":
        ulysses_heads(*local_heads(cfg.n_heads, cfg.n_kv_heads, layout.tp), layout.cp)
    no_dropout(cfg.dropout)


def rule_doc_ids(doc_ids, seq: int, seq_len: int, layout: str = "zigzag", cp: int = 1):
    """Packed documents in a parallel step: one packing that every row shares, ``doc_ids``
    (seq,) (a rank's micro-batches and its CP shard are cut from the same sequence); the
    "documents" layout needs them, and each document a multiple of 2*cp tokens."""
    if doc_ids is None:
        if layout == "documents" and cp > 1:
            raise ValueError("cp_layout='documents' splits each packed document: pass step(x, y, doc_ids=...)")
        return None
    check_doc_ids(doc_ids, seq_len)
    if doc_ids.shape != (seq,):
        raise ValueError(f"doc_ids: a parallel step takes one packing for every row, shape ({seq},), got "
                         f"{tuple(doc_ids.shape)}")
    if layout == "documents" and cp > 1:
        check_documents(doc_ids, cp)
    return doc_ids


def context_parallel(model, comm, method: str = "ring", layout: str = "zigzag"):
    """Make every ``block.attn`` of ``model`` context-parallel over ``comm`` (in place; the
    module keeps its parameters and their names). Returns ``model``."""
    check_cp_names(method, layout)
    for m in model.modules():
        if isinstance(m, Attention) and not isinstance(m, ContextParallelAttention):
            no_dropout(getattr(getattr(m, "attn_dropout", None), "p", 0.0))
            m.__class__ = ContextParallelAttention                 # same parameters, new forward
            m.cp_comm, m.cp_method, m.cp_layout = comm, method, layout
    return model


__all__ = ["LAYOUTS", "zigzag_chunks", "shard_positions", "zigzag_positions", "shard_sequence",
           "visible_rows_cols", "visible_segments", "block_attention", "running_block_attention", "merge_partial",
           "attention_flops", "RingAttention",
           "ring_attention", "SeqToHeads", "HeadsToSeq", "ulysses_attention", "ContextParallelAttention",
           "context_parallel", "METHODS",
           "cp_method_of", "all_gather_attention", "check_cp_names", "sequence_chunks", "ulysses_heads",
           "no_dropout", "rule_context", "rule_doc_ids"]
