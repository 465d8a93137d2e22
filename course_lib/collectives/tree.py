"""Logarithmic collectives: binomial-tree broadcast and reduce, recursive-doubling
all-reduce, dissemination barrier.

They finish in ceil(log2 N) rounds instead of N-1, but every message carries the
whole buffer: they win when latency (alpha) dominates, i.e. for small buffers,
and lose to the ring for large ones (``costmodel.crossover_bytes``).

Ranks are renumbered relative to the root (``v = (rank - root) % N``) so the
root is always 0 in the tree's own numbering.
"""
from __future__ import annotations

import torch

from course_lib.collectives.checks import check_all_reduce, check_broadcast, check_reduce
from course_lib.collectives.core import Comm, ReduceOp, collective, contiguous_flat, finish_avg, reduce_


@collective("tree broadcast")
def broadcast(tensor, src, group=None, *, validate=True, counter=None):
    """Binomial tree: in round k, every rank that has the data sends it 2^k ranks further.

    ``src`` is a global rank, as in torch.distributed.
    """
    comm = Comm(group, counter)
    root = check_broadcast(comm, "tree broadcast", tensor, src, validate)
    N = comm.size
    v = (comm.rank - root) % N                  # my rank in the tree (root = 0)
    with contiguous_flat(tensor) as flat:
        mask = 1
        while mask < N:
            if v < mask and v + mask < N:       # I have it: pass it on
                comm.send(flat, (v + mask + root) % N)
            elif mask <= v < 2 * mask:          # my turn to get it
                comm.recv(flat, (v - mask + root) % N)
            mask <<= 1
    return None


@collective("tree reduce")
def reduce(tensor, dst, op=ReduceOp.SUM, group=None, *, validate=True, counter=None):
    """Binomial tree towards ``dst`` (global rank): in round k, ranks with bit k set send
    their partial result 2^k ranks down and drop out. Only ``dst``'s tensor changes.
    """
    comm = Comm(group, counter)
    root, op = check_reduce(comm, "tree reduce", tensor, dst, op, validate)
    N = comm.size
    v = (comm.rank - root) % N                  # my rank in the tree (root = 0)
    with contiguous_flat(tensor) as flat:
        acc = flat if v == 0 else flat.clone()  # non-roots keep their input intact
        incoming = torch.empty_like(acc)
        mask = 1
        while mask < N:
            if v & mask:                        # send my partial sum down, done
                comm.send(acc, (v - mask + root) % N)
                break
            if v + mask < N:
                comm.recv(incoming, (v + mask + root) % N)
                reduce_(acc, acc, incoming, op)
            mask <<= 1
        if v == 0:
            finish_avg(acc, op, N)
    return None


@collective("recursive doubling all_reduce")
def all_reduce(tensor, op=ReduceOp.SUM, group=None, *, validate=True, counter=None):
    """Recursive doubling: partners at distance 1, 2, 4, ... swap whole buffers and reduce.

    With N not a power of two, the first 2*(N - P) ranks pair up first (even ones
    hand their data to the odd neighbour and wait), P = largest power of two <= N;
    at the end the odd ones hand the result back: two extra rounds.
    """
    comm = Comm(group, counter)
    op = check_all_reduce(comm, "recursive doubling all_reduce", tensor, op, validate)
    N, r = comm.size, comm.rank
    if N == 1:
        return tensor
    P = 1 << (N.bit_length() - 1)
    extra = N - P
    with contiguous_flat(tensor) as flat:
        incoming = torch.empty_like(flat)
        if r < 2 * extra:                       # fold the extra ranks in
            if r % 2 == 0:
                comm.send(flat, r + 1)
            else:
                comm.recv(incoming, r - 1)
                reduce_(flat, incoming, flat, op)
        me = -1 if (r < 2 * extra and r % 2 == 0) else (r // 2 if r < 2 * extra else r - extra)
        if me >= 0:
            mask = 1
            while mask < P:
                partner = me ^ mask
                peer = 2 * partner + 1 if partner < extra else partner + extra
                comm.exchange(flat, peer, incoming, peer)
                reduce_(flat, flat, incoming, op)  # a (op) b == b (op) a bit for bit: both agree
                mask <<= 1
            finish_avg(flat, op, N)
        if r < 2 * extra:                       # hand the result back
            if r % 2 == 0:
                comm.recv(flat, r + 1)
            else:
                comm.send(flat, r - 1)
    return tensor


@collective("dissemination barrier")
def barrier(group=None, *, counter=None):
    """Dissemination barrier: in round k, send a token 2^k ranks ahead and wait for the one
    from 2^k ranks behind. After ceil(log2 N) rounds everyone has (indirectly) heard from all."""
    comm = Comm(group, counter)
    N, r = comm.size, comm.rank
    token = torch.zeros(1, dtype=torch.uint8, device=comm.backend_device)   # NCCL: on the GPU
    got = torch.empty(1, dtype=torch.uint8, device=comm.backend_device)
    k = 1
    while k < N:
        comm.exchange(token, (r + k) % N, got, (r - k) % N)
        k <<= 1
    return None
