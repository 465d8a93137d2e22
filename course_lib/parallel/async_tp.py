"""Async tensor parallelism: SP's collectives decomposed into a ring overlapped with the matmuls.

Wang et al. 2022, "Overlap communication with dependent computation via decomposition in
large deep learning models" (ASPLOS '23); torch's micro-pipelined TP, torchtitan's async TP.
With sequence parallelism a column layer needs the all-gathered input and a row layer's
output is reduce-scattered: plain TP waits for the whole collective, then multiplies. Both
decompose into t steps along the sequence, each multiplying one chunk while the next moves:

    all-gather + matmul (column):  step i: Y[:, r-i] = X_{r-i} W^T while passing X_{r-i} on and
                                   receiving X_{r-i-1}            (t matmuls, t-1 hops)
    matmul + reduce-scatter (row): step i: P = X[:, c] W^T for the chunk c = r-i-1, add the
                                   partial sum received for c, send it on; after t steps
                                   chunk r arrives home, summed over every rank

Each of the t - 1 hops runs beside one step's matmul (the first beside the rank's own chunk),
so only each hop's excess over its step is exposed, (t - 1) max(0, hop - step) per op
(:mod:`course_lib.planner.async_tp`); only the adds are left outside. The backward of each is the other one: the input gradient of an all-gather-matmul is a
matmul-reduce-scatter, the input gradient of a matmul-reduce-scatter an all-gather-matmul.
The forward all-gather's chunks are KEPT for the weight gradient (torch's DTensor SP keeps
the gathered input too): re-gathering them in backward (Megatron's choice, t x less memory)
would be another ring of t-1 hops, which could hide under the weight gradient's chunks the
same way; not done here. torch's fused kernels (``torch.ops.symm_mem.fused_all_gather_matmul``
and ``fused_matmul_reduce_scatter``, over symmetric memory) need CUDA GPUs: in the CPU build
(2.13.0+cpu) importing ``torch.distributed._symmetric_memory`` registers them with a CUDA
kernel only, and on CPU tensors they raise NotImplementedError.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib import trace


def _chunks_ring(comm, shard, work):
    """Pass ``shard`` around the ring (t - 1 hops); ``work(c, x_c)`` runs on chunk c (the
    rank it came from) while the next chunk is in flight. Returns the t chunks in rank order."""
    t, r = comm.size, comm.rank
    held, chunks = shard.contiguous(), [None] * t
    for i in range(t):
        c = (r - i) % t                                        # whose chunk I hold now
        works, nxt = [], None
        if i < t - 1:                                          # post the next hop first...
            nxt = torch.empty_like(held)
            works = [comm.irecv(nxt, comm.prev), comm.isend(held, comm.next)]
            start = trace.now()
        with trace.span(f"async TP: all-gather step, chunk {c}", kind="compute"):   # ...compute under it
            work(c, held)
        chunks[c] = held
        if works:
            comm.wait(*works)
            trace.recorder().add(f"async TP: all-gather hop {i + 1}", "comm", start, trace.now(), comm.dim)
            held = nxt
    return chunks


def _accumulate_ring(comm, partial):
    """Reduce-scatter decomposed: ``partial(c)`` is this rank's term of chunk c; at step i the
    term of chunk (r - i - 1) is computed while the running sum of that chunk arrives from the
    previous rank, added and sent on. Returns chunk r summed over every rank."""
    t, r = comm.size, comm.rank
    sending = None
    for i in range(t):
        c = (r - i - 1) % t                                    # chunk destined to rank c
        incoming, works = None, []
        if i > 0:
            start = trace.now()
            incoming = torch.empty_like(acc)
            works = [comm.irecv(incoming, comm.prev)]
        with trace.span(f"async TP: reduce-scatter step, chunk {c}", kind="compute"):
            acc = partial(c).contiguous()                      # (b, s/t, out)
        if works:
            comm.wait(*works)
            trace.recorder().add(f"async TP: reduce-scatter hop {i}", "comm", start, trace.now(), comm.dim)
            acc = acc + incoming                               # order: mine + everything before
        if i < t - 1:
            if sending is not None:
                comm.wait(sending)
            sending = comm.isend(acc, comm.next)
            keep = acc                                         # alive until the send completes
    comm.wait(sending)
    del keep
    return acc


def _chunk(x, t, c):
    """Chunk c of t along the sequence (dim 1): (b, s, ...) -> (b, s/t, ...)."""
    n = x.shape[1] // t
    return x[:, c * n:(c + 1) * n]


class AllGatherMatmul(torch.autograd.Function):
    """Wang et al.'s decomposed all-gather + matmul (SP's ``g`` fused with the column layers
    reading its output): Y_j = AG(X) W_j^T + b_j for every weight j (W_q, W_k, W_v share one
    ring). Backward: dX = RS(sum_j dY_j W_j), decomposed as a matmul-reduce-scatter; dW_j =
    dY_j^T AG(X) from the chunks kept in forward."""

    @staticmethod
    def forward(ctx, shard, comm, n_weights, *params):          # shard (b, s/t, h)
        weights, biases = params[:n_weights], params[n_weights:]
        t = comm.size
        outs = [[None] * t for _ in weights]                   # [j][c]: (b, s/t, out_j)

        def work(c, x):
            for j, (w, b) in enumerate(zip(weights, biases)):
                outs[j][c] = F.linear(x, w, b)
        chunks = _chunks_ring(comm, shard, work)
        ctx.comm, ctx.n_weights, ctx.has_bias = comm, n_weights, [b is not None for b in biases]
        ctx.save_for_backward(*chunks, *weights)               # the gathered input, in t chunks
        return tuple(torch.cat(o, dim=1) for o in outs)        # each (b, s, out_j)

    @staticmethod
    def backward(ctx, *grads):                                 # each (b, s, out_j)
        comm, t = ctx.comm, ctx.comm.size
        saved = ctx.saved_tensors
        chunks, weights = saved[:t], saved[t:]
        x_full = torch.cat(chunks, dim=1)                      # (b, s, h): local copy, no traffic

        def partial(c):                                        # (b, s/t, h): sum_j dY_j[c] W_j
            out = _chunk(grads[0], t, c) @ weights[0]
            for g, w in zip(grads[1:], weights[1:]):
                out = out + _chunk(g, t, c) @ w
            return out
        dx = _accumulate_ring(comm, partial)
        dws, dbs = [], []
        for g, has_bias in zip(grads, ctx.has_bias):
            g2 = g.reshape(-1, g.shape[-1])                    # (b*s, out_j)
            dws.append(g2.t() @ x_full.reshape(-1, x_full.shape[-1]))
            dbs.append(g2.sum(0) if has_bias else None)
        return (dx, None, None, *dws, *dbs)


class MatmulReduceScatter(torch.autograd.Function):
    """Wang et al.'s decomposed matmul + reduce-scatter (a row layer followed by SP's
    ``g-bar``): Y_r = sum over ranks of X[:, r] W^T, chunk by chunk around the ring (no bias:
    the caller adds it once). Backward: dX = AG(dY) W, decomposed as an all-gather-matmul;
    dW = AG(dY)^T X accumulated chunk by chunk as dY's chunks arrive."""

    @staticmethod
    def forward(ctx, x, weight, comm):                         # x (b, s, in_r), weight (out, in_r)
        t = comm.size
        ctx.save_for_backward(x, weight)
        ctx.comm = comm
        return _accumulate_ring(comm, lambda c: F.linear(_chunk(x, t, c), weight))   # (b, s/t, out)

    @staticmethod
    def backward(ctx, grad):                                   # grad (b, s/t, out)
        x, weight = ctx.saved_tensors
        comm, t = ctx.comm, ctx.comm.size
        dx = [None] * t
        dw = torch.zeros_like(weight)                          # (out, in_r)

        def work(c, g):                                        # g (b, s/t, out): chunk c of dY
            dx[c] = g @ weight                                 # (b, s/t, in_r)
            xc = _chunk(x, t, c)
            dw.add_(g.reshape(-1, g.shape[-1]).t() @ xc.reshape(-1, xc.shape[-1]))
        _chunks_ring(comm, grad, work)
        return torch.cat(dx, dim=1), dw, None


def all_gather_matmul(shard, comm, weights, biases):
    """[AG(shard) W_j^T + b_j for each j], the all-gather decomposed under the matmuls.
    shard (b, s/t, h) -> [(b, s, out_j)]. ``biases``: one per weight, None where none."""
    if len(weights) != len(biases) or not weights:
        raise ValueError("all_gather_matmul: give one bias (or None) per weight, at least one weight")
    if comm.size == 1:
        return [F.linear(shard, w, b) for w, b in zip(weights, biases)]
    present = [b for b in biases if b is not None]
    if present and len(present) != len(biases):   # autograd Functions take tensors: zeros for a missing bias
        biases = [b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)]
    return list(AllGatherMatmul.apply(shard, comm, len(weights), *weights, *biases))


def matmul_reduce_scatter(x, weight, comm):
    """RS(x W^T) along the sequence, decomposed under the matmuls: (b, s, in_r) -> (b, s/t, out)."""
    if x.shape[1] % comm.size:
        raise ValueError(f"async TP: the sequence {x.shape[1]} does not split evenly over tp={comm.size} "
                         f"(sequence parallelism needs seq % tp == 0)")
    if comm.size == 1:
        return F.linear(x, weight)
    return MatmulReduceScatter.apply(x, weight, comm)


def async_region_entry(comm, columns):
    """A forward pre-hook for a tensor-parallel region (attention, MLP) under async TP: ONE
    decomposed all-gather-matmul for all the region's column layers (``columns``: a function
    of the module returning them), their outputs handed to them; the module is passed the
    gathered input's shape only: one NaN element viewed at (b, s, h) with stride 0 (no
    full-size tensor: the module reads its shape and device; a value read would be NaN)."""
    def enter(module, args):
        x, *rest = args                                        # (b, s/t, h)
        cols = columns(module)
        params = [c.weight_and_bias() for c in cols]
        outs = all_gather_matmul(x, comm, [w for w, _ in params], [b for _, b in params])
        shape = (x.shape[0], x.shape[1] * comm.size, *x.shape[2:])
        full = torch.scalar_tensor(float("nan"), dtype=x.dtype, device=x.device).expand(shape)   # 1 element
        full.async_outputs = dict(zip(cols, outs))
        return (full, *rest)
    return enter


__all__ = ["AllGatherMatmul", "MatmulReduceScatter", "all_gather_matmul", "matmul_reduce_scatter",
           "async_region_entry"]
