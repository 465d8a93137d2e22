"""Ring collectives: reduce-scatter, all-gather and all-reduce, bandwidth optimal.

Ranks sit on a ring; every step each rank sends one chunk (n/N bytes) to its
right neighbour while receiving one from its left, so all links are busy at
once. N-1 steps of reduce-scatter leave rank r with chunk r fully reduced; N-1
steps of all-gather pass the finished chunks around. Each rank sends
2(N-1)/N * n bytes in all, which no algorithm can beat.

The schedule (which chunk moves where at each step) is :func:`ring_schedule`;
the implementation and the figures both read it. Each chunk travels in segments of
at most ``SEGMENT_BYTES`` (:func:`segments`), each sent on as soon as it has arrived
and been reduced, so a chunk's transfer and its reduction overlap (a pipeline, as
in gloo's ring); ``segment_bytes=None`` sends one message per chunk. Segmenting
does not change the order of any addition: results are bitwise the same.
"""
from __future__ import annotations

import threading

import torch

from course_lib.collectives.checks import (
    check_all_gather, check_all_gather_into_tensor, check_all_reduce, check_reduce_scatter,
    check_reduce_scatter_tensor)
from course_lib.collectives.core import (
    Comm, ReduceOp, chunks, collective, contiguous_flat, contiguous_flats, finish_avg, reduce_, reduction)


def ring_schedule(world_size: int, phase: str, rank: int, step: int) -> tuple[int, int]:
    """(chunk rank sends right, chunk it receives from the left) at ``step`` of ``phase``.

    reduce_scatter: send (r - s - 1) % N, receive (r - s - 2) % N and reduce it
    into its own copy; after N-1 steps rank r holds the full sum of chunk r.
    all_gather: send (r - s) % N (step 0: its own chunk), receive (r - s - 1) % N.
    """
    N, r, s = world_size, rank, step
    if phase == "reduce_scatter":
        return (r - s - 1) % N, (r - s - 2) % N
    if phase == "all_gather":
        return (r - s) % N, (r - s - 1) % N
    raise ValueError(f"phase must be 'reduce_scatter' or 'all_gather', got {phase!r}")


def simulate_ring_all_reduce(world_size: int):
    """Symbolic run of the ring all-reduce: which contributions each rank holds, step by step.

    Returns a list of states; state ``k`` is after ``k`` steps (0 = the start,
    2(N-1) = the end). A state is ``{"phase", "step", "sends": [(chunk, dst) per rank],
    "holds": [[frozenset of ranks summed in chunk c] per rank]}``.
    """
    N = world_size
    holds = [[frozenset([r]) for _ in range(N)] for r in range(N)]
    states = [{"phase": "start", "step": 0, "sends": [None] * N, "holds": [list(h) for h in holds]}]
    for phase in ("reduce_scatter", "all_gather"):
        for s in range(N - 1):
            plan = [ring_schedule(N, phase, r, s) for r in range(N)]
            msgs = [holds[r][send] for r, (send, _) in enumerate(plan)]  # what is on the wire
            for r, (_, recv) in enumerate(plan):
                incoming = msgs[(r - 1) % N]
                holds[r][recv] = holds[r][recv] | incoming if phase == "reduce_scatter" else incoming
            states.append({"phase": phase, "step": s + 1,
                           "sends": [(send, (r + 1) % N) for r, (send, _) in enumerate(plan)],
                           "holds": [list(h) for h in holds]})
    return states


# ----------------------------------------------------------------------------- the two phases

SEGMENT_BYTES = 1 << 20   # the largest message of the segmented ring (gloo's too; see segments())
GATHER_TAG = 1            # all_reduce's all-gather messages, posted early (see all_reduce)


def segments(chunk, segment_bytes=SEGMENT_BYTES):
    """Views of a 1-D ``chunk`` cut into ceil(bytes / segment_bytes) nearly equal segments.

    The count depends only on the chunk's size and dtype, which sender and receiver
    share, so both cut it alike. ``segment_bytes=None``: one segment (the unsegmented ring).
    """
    if segment_bytes is not None and not (isinstance(segment_bytes, int) and segment_bytes > 0):
        raise ValueError(f"segment_bytes must be an int > 0 or None, got {segment_bytes!r}")
    if segment_bytes is None or chunk.numel() == 0:
        return [chunk]
    count = min(chunk.numel(), -(-chunk.numel() * chunk.element_size() // segment_bytes))
    return [chunk] if count == 1 else chunks(chunk, count)


_kept = threading.local()   # this thread's scratch buffers, by dtype


def _scratch(count: int, numel: int, dtype, device):
    """``count`` buffers of ``numel`` elements, kept by this thread from one call to the next.
    No call allocates them (memory fresh from the OS is faulted in and zeroed page by page;
    how often a freed buffer comes back fresh depends on the allocator: chapter 2 counts it).
    Per thread: two collectives running at once on two communication threads never share one."""
    pool = _kept.__dict__.setdefault("pool", {})
    bufs = pool.get((dtype, device), [])
    if len(bufs) < count or bufs[0].numel() < numel:
        if numel * dtype.itemsize > SEGMENT_BYTES:
            return [torch.empty(numel, dtype=dtype, device=device) for _ in range(count)]  # unsegmented: not kept
        bufs = pool[dtype, device] = [torch.empty(numel, dtype=dtype, device=device)
                                      for _ in range(max(count, len(bufs)))]
    return bufs[:count] if bufs[0].numel() == numel else [b[:numel] for b in bufs[:count]]


def _reduce_scatter_ring(comm: Comm, pieces, out, op, prepost=True, segment_bytes=SEGMENT_BYTES,
                         in_place=False, window=2):
    """out <- the reduction over ranks of every rank's pieces[rank]; pieces: N contiguous 1-D tensors.

    Step s: receive the left neighbour's partial sum of chunk c, add our own
    piece c, pass it right. Each chunk travels in segments (:func:`segments`), step
    by step and, within a step, segment by segment: segment j is sent on as soon as
    it is reduced, while segment j+1 is still on the wire, so a hop's transfer, the
    reduction and the next hop overlap (the pipelining term of
    ``costmodel.pipelined_ring_all_reduce``). Every element is still combined in the
    unsegmented ring's order (the left neighbour's partial sum op ours; at the end
    ours op the rest): the results are bitwise the same.

    ``in_place`` (all-reduce; out is pieces[rank]): sums go into ``pieces`` and are sent
    from there, and the arriving segments land in ``window`` scratch buffers, reused
    round-robin: the receive of message i + window is posted once message i is
    reduced. The scratch stays in the cache, as in gloo's ring, and is kept from call to
    call (:func:`_scratch`). Otherwise ``pieces`` are left untouched: every message gets
    its own buffer, all receives posted first.
    ``prepost=False``: no receive posted ahead, each step's send and receive in
    lockstep, unsegmented (one more handshake per step; benchmarks/collectives.py
    times it).
    """
    N, r = comm.size, comm.rank
    if N == 1:
        out.copy_(pieces[0])
        return out
    if not prepost:
        segment_bytes, in_place = None, False   # lockstep: a step's send must finish before the next receive
    right, left = (r + 1) % N, (r - 1) % N
    plan = [ring_schedule(N, "reduce_scatter", r, s) for s in range(N - 1)]
    # one row per message, in the order they travel (step-major, segment-minor):
    # (our piece's segment, where the sum goes); the last step's sums go to out
    work = []
    for s, (_, c) in enumerate(plan):
        ours = segments(pieces[c], segment_bytes)
        sums = segments(out, segment_bytes) if s == N - 2 and out is not pieces[c] else ours
        work += zip(ours, sums)
    last = len(work) - len(sums)                                # rows from here on: the last step, c == r
    sizes = [mine.numel() for mine, _ in work]
    if in_place:                                   # window x (segment,) scratch, reused
        most = max(sizes)
        scratch = _scratch(min(window, len(work)), most, out.dtype, out.device)
        landing = [scratch[i % len(scratch)] if n == most else scratch[i % len(scratch)][:n]
                   for i, n in enumerate(sizes)]
        ahead = len(scratch)
    else:                                          # (N-1) x (n/N,) in all, one buffer per message
        landing = [torch.empty(n, dtype=out.dtype, device=out.device) for n in sizes]
        ahead = len(work) if prepost else 0
    send, recv = comm.poster("send", right), comm.poster("recv", left)   # post(tensor) -> handle
    combine = reduction(op)                                     # combine(a, b, out=c): c = a op b
    recvs = [recv(landing[i]) for i in range(ahead)]
    sends = [send(seg) for seg in segments(pieces[plan[0][0]], segment_bytes)]  # ours, as is
    for i, (mine, dst) in enumerate(work):
        if not prepost:
            recvs.append(recv(landing[i]))
        recvs[i].wait()
        if not prepost:
            comm.wait(*sends)
            sends = []
        if i >= last:                                           # the result: ours op the rest
            combine(mine, landing[i], out=dst)
        else:                                                   # the rest op ours, passed on
            dst = dst if in_place else landing[i]
            combine(landing[i], mine, out=dst)
            sends.append(send(dst))
        if prepost and len(recvs) < len(work):                  # landing[i]'s buffer is free again
            recvs.append(recv(landing[len(recvs)]))
    comm.wait(*sends)
    return out


def _post_gather_recvs(comm: Comm, outs, segment_bytes, tag):
    """The all-gather's receives, every segment of every step, in the order they arrive:
    (step, the segment it lands in, its posted receive) per message."""
    N, r = comm.size, comm.rank
    recv = comm.poster("recv", (r - 1) % N, tag)
    return [(s, seg, recv(seg)) for s in range(N - 1)
            for seg in segments(outs[ring_schedule(N, "all_gather", r, s)[1]], segment_bytes)]


def _all_gather_ring(comm: Comm, outs, prepost=True, segment_bytes=SEGMENT_BYTES, recvs=None, tag=0):
    """outs: N contiguous 1-D tensors; outs[rank] holds this rank's part; fills the others.

    Step s: pass on the chunk that arrived at step s-1 (step 0: our own), segment by
    segment, each as soon as it has arrived. ``recvs``: its receives, already posted
    (:func:`_post_gather_recvs`); ``tag`` tells its messages from a reduce-scatter's.
    """
    N, r = comm.size, comm.rank
    if N == 1:
        return outs
    if not prepost:
        segment_bytes = None
    right, left = (r + 1) % N, (r - 1) % N
    plan = [ring_schedule(N, "all_gather", r, s) for s in range(N - 1)]
    if recvs is None:                              # (step, segment, receive) per message, in order
        recvs = (_post_gather_recvs(comm, outs, segment_bytes, tag) if prepost else
                 [(s, seg, None) for s, (_, c) in enumerate(plan) for seg in segments(outs[c], segment_bytes)])
    send = comm.poster("send", right, tag)
    recv_from_left = None if prepost else comm.poster("recv", left, tag)   # lockstep: each receive in turn
    sends = [send(seg) for seg in segments(outs[plan[0][0]], segment_bytes)]
    for s, seg, recv in recvs:
        if not prepost:
            recv = recv_from_left(seg)
        recv.wait()
        if not prepost:
            comm.wait(*sends)
            sends = []
        if s < N - 2:
            sends.append(send(seg))
    comm.wait(*sends)
    return outs


# ----------------------------------------------------------------------------- public API


@collective("ring all_reduce")
def all_reduce(tensor, op=ReduceOp.SUM, group=None, *, validate=True, counter=None, prepost=True,
               segment_bytes=SEGMENT_BYTES):
    """In place: every rank's ``tensor`` becomes the reduction over ranks (ring: RS + AG).

    ``segment_bytes``: the largest message (:func:`segments`); None: one message per chunk.
    """
    comm = Comm(group, counter)
    op = check_all_reduce(comm, "ring all_reduce", tensor, op, validate)
    if comm.size == 1:
        return tensor
    with contiguous_flat(tensor) as flat:              # (n,)
        parts = chunks(flat, comm.size)                # N x (n/N,), uneven when N does not divide n
        mine = parts[comm.rank]
        # the all-gather's receives, posted before the reduce-scatter starts (on their own tag):
        # gloo sends a message only after the receiver has said its receive is posted, so that
        # notice is already there when a chunk is finished. Safe: chunk c arrives here only
        # after this rank's send of its partial sum of c has been read.
        gathers = _post_gather_recvs(comm, parts, segment_bytes, GATHER_TAG) if prepost else None
        _reduce_scatter_ring(comm, parts, mine, op, prepost, segment_bytes, in_place=True)  # sums into parts
        finish_avg(mine, op, comm.size)
        _all_gather_ring(comm, parts, prepost, segment_bytes, recvs=gathers, tag=GATHER_TAG)
    return tensor


@collective("ring reduce_scatter")
def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, *, validate=True, counter=None,
                          segment_bytes=SEGMENT_BYTES):
    """``output`` <- the reduction over ranks of piece ``rank`` of ``input`` (N equal pieces)."""
    comm = Comm(group, counter)
    op = check_reduce_scatter_tensor(comm, "ring reduce_scatter_tensor", output, input, op, validate)
    src = input.reshape(-1).contiguous()
    with contiguous_flat(output) as out:
        _reduce_scatter_ring(comm, list(src.view(comm.size, -1)), out, op, segment_bytes=segment_bytes)
        finish_avg(out, op, comm.size)
    return output


@collective("ring reduce_scatter")
def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, *, validate=True, counter=None,
                   segment_bytes=SEGMENT_BYTES):
    """``output`` <- reduction over ranks of ``input_list[rank]``; pieces may differ in size."""
    comm = Comm(group, counter)
    op = check_reduce_scatter(comm, "ring reduce_scatter", output, input_list, op, validate)
    pieces = [t.reshape(-1).contiguous() for t in input_list]
    with contiguous_flat(output) as out:
        _reduce_scatter_ring(comm, pieces, out, op, segment_bytes=segment_bytes)
        finish_avg(out, op, comm.size)
    return output


@collective("ring all_gather")
def all_gather_into_tensor(output_tensor, input_tensor, group=None, *, validate=True, counter=None,
                           segment_bytes=SEGMENT_BYTES):
    """``output_tensor`` <- every rank's ``input_tensor``, concatenated in rank order."""
    comm = Comm(group, counter)
    check_all_gather_into_tensor(comm, "ring all_gather_into_tensor", output_tensor, input_tensor, validate)
    with contiguous_flat(output_tensor) as out:
        outs = list(out.view(comm.size, -1))
        outs[comm.rank].copy_(input_tensor.reshape(-1))
        _all_gather_ring(comm, outs, segment_bytes=segment_bytes)
    return output_tensor


@collective("ring all_gather")
def all_gather(tensor_list, tensor, group=None, *, validate=True, counter=None, segment_bytes=SEGMENT_BYTES):
    """``tensor_list[i]`` <- rank i's ``tensor``; ranks may contribute different sizes."""
    comm = Comm(group, counter)
    check_all_gather(comm, "ring all_gather", tensor_list, tensor, validate)
    with contiguous_flats(tensor_list) as outs:
        outs[comm.rank].copy_(tensor.reshape(-1))
        _all_gather_ring(comm, outs, segment_bytes=segment_bytes)
    return tensor_list


@collective("serialized ring all_reduce")
def serialized_ring_all_reduce(tensor, op=ReduceOp.SUM, group=None, *, validate=True, counter=None):
    """The WRONG ring, kept to be measured: the whole buffer hops rank 0 -> 1 -> ... -> N-1
    (each adding its own), then the result hops on around the ring.

    Correct result, but 2(N-1) sequential messages of n bytes: one link busy at a
    time and N times the bytes of the real ring on the critical path.
    """
    comm = Comm(group, counter)
    op = check_all_reduce(comm, "serialized_ring_all_reduce", tensor, op, validate)
    N, r = comm.size, comm.rank
    if N == 1:
        return tensor
    with contiguous_flat(tensor) as flat:
        incoming = torch.empty_like(flat)
        if r > 0:                                    # first lap: partial sums travel 0 -> N-1
            comm.recv(incoming, r - 1)
            reduce_(flat, incoming, flat, op)
        if r < N - 1:
            comm.send(flat, r + 1)
        else:
            finish_avg(flat, op, N)
        if r == N - 1:                               # second lap: N-1 -> 0 -> 1 -> ... -> N-2
            comm.send(flat, 0)
        else:
            comm.recv(flat, (r - 1) % N)
            if r < N - 2:
                comm.send(flat, r + 1)
    return tensor
