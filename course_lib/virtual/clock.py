"""One rank's virtual clock: a compute stream, a communication stream, and the times that
travel with the real messages.

``t`` is the compute stream (and the rank's "now": the host waits for its kernels, as a
step that synchronises would); ``comm_free`` is when the communication stream finishes its
last collective. The communication layer (:class:`course_lib.collectives.comm.Comm`) calls:

* ``collective(comm, op, payload, ref, run)`` around the real collective (``run()``): the
  members all-reduce (MAX) their ready times ``max(t, comm_free)`` in one 8-byte message
  beside it (async, issued first; not counted in any byte count), so the collective starts
  at the latest member's ready time and ends ``cost`` later on every member: ``cost`` = the
  algorithm's alpha-beta time (:data:`ALGORITHMS`, ``course_lib.costmodel``) on the group's
  link;
* ``isend`` / ``irecv``: the real message, its payload's bytes followed by 8 bytes holding the
  send's issue time (one message, not two: half the transport's work); the receive completes at
  ``max(its issue, send issue + alpha + bytes / bandwidth)``;
* ``join(end)`` when the rank waits on async work: ``t = max(t, end)``.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from course_lib.costmodel import cost as algorithm_cost
from course_lib.virtual.compute import ComputeStream, tensor_bytes

# the algorithm that prices each Comm collective (NCCL's and course_lib's defaults: rings,
# a binomial-tree broadcast, pairwise all-to-all); n = torch's payload (see Comm's CommCall)
ALGORITHMS = {"all_reduce": "ring_all_reduce", "reduce_scatter_tensor": "ring_reduce_scatter",
              "all_gather_into_tensor": "ring_all_gather", "broadcast": "tree_broadcast",
              "all_to_all_single": "pairwise_all_to_all", "barrier": "ring_all_reduce"}


class RankClock:
    """The virtual clock of one rank (made by ``VirtualCluster.start``; ``with clock:`` prices
    the compute of the code inside)."""

    def __init__(self, cluster, rank: int, world_size: int, recorder):
        self.cluster, self.rank, self.world_size, self.recorder = cluster, rank, world_size, recorder
        self.t = 0.0            # compute stream: when its last kernel ends
        self.comm_free = 0.0    # communication stream: when its last collective ends
        self.muted_depth = 0
        self.kernels = 0        # kernels priced on the compute stream so far
        self._messages = defaultdict(int)     # (src, dst, group, tag) -> messages so far: flow ids
        self._pending = []      # async collectives issued, not priced yet (settle() prices them in order)
        self._mode = ComputeStream(self)

    def now(self) -> float:
        return self.t

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            if exc[0] is None:
                self.settle()   # (async work the program never waited for)
        finally:
            self._mode.__exit__(*exc)
        return False            # an error inside (or from settle) propagates

    def muted(self) -> "_Muted":
        """Ops run inside are not compute (a communication call's own work, bookkeeping)."""
        return _Muted(self)

    def join(self, end: float) -> None:
        """The compute stream waits for work that ends at ``end``."""
        self.t = max(self.t, end)

    # ------------------------------------------------------------------ collectives
    def collective(self, comm, op: str, payload: int, ref, run, beside=True) -> tuple[float, float]:
        """(start, end) of a blocking collective that ``run()`` runs for real on every member of
        ``comm``. ``beside``: the ready times' exchange is issued (async) before ``run()`` and
        waited for after it (the two messages overlap); else it follows ``run()``."""
        self.settle()
        ready = max(self.t, self.comm_free)
        exchange = self._exchange(comm, ready, ref, async_op=True) if comm.size > 1 and beside else None
        run()
        start = ready
        if comm.size > 1:
            if exchange is None:
                exchange = self._exchange(comm, ready, ref, async_op=True)
            with self.muted():
                exchange[0].wait()
            start = float(exchange[1])
        return start, self._priced(comm, op, payload, ref, start)

    def issue(self, comm, op: str, payload: int, ref, name: str) -> "Pending":
        """An async collective whose real work runs beside the program (as on the wall clock):
        its ready time is fixed now and the members' ready times are exchanged beside it
        (async); it is priced, in issue order, by :meth:`settle`, when it is waited for or the
        next collective is issued: the same start and end as a blocking call would get."""
        self.settle()
        ready = max(self.t, self.comm_free)
        exchange = self._exchange(comm, ready, ref, async_op=True) if comm.size > 1 else None
        index = len(self.recorder.spans)     # its span keeps its place among the rank's spans
        self.recorder.add(name, "comm", ready, ready, comm.dim)
        if len(self.recorder.spans) == index:   # (spans muted here: none to record)
            index = None
        pending = Pending(comm, op, payload, ref, name, ready, exchange, index)
        self._pending.append(pending)
        return pending

    def settle(self) -> None:
        """Price the async collectives issued so far, in order (waiting for their exchanges)."""
        while self._pending:
            p = self._pending.pop(0)
            start = p.ready
            if p.exchange is not None:
                with self.muted():
                    p.exchange[0].wait()
                    start = float(p.exchange[1])
            p.end = self._priced(p.comm, p.op, p.payload, p.ref, start)
            if p.index is not None:
                old = self.recorder.spans[p.index]
                self.recorder.spans[p.index] = type(old)(old.rank, old.name, old.kind, start, p.end, old.dim, old.flow)

    def _exchange(self, comm, ready: float, ref, async_op: bool):
        """The members' latest ready time: a MAX all-reduce of one float64 (not counted in bytes)."""
        with self.muted():
            issued = torch.tensor([ready], dtype=torch.float64, device=comm.backend_device)
            work = dist.all_reduce(issued, op=dist.ReduceOp.MAX, group=comm.group, async_op=async_op)
        return work, issued

    def _priced(self, comm, op: str, payload: int, ref, start: float) -> float:
        """The end of collective ``op`` started at ``start``: its algorithm's cost on the group's link."""
        nbytes = payload // ref.element_size() * self.cluster.itemsize(ref) if ref is not None else 0
        alpha, bandwidth = self.cluster.link(comm.ranks)
        self.comm_free = start + algorithm_cost(ALGORITHMS[op], nbytes, comm.size, alpha, 1.0 / bandwidth)
        return self.comm_free

    # ------------------------------------------------------------------ point-to-point
    def _message(self, comm, src: int, dst: int, tag: int, tensor):
        key = (src, dst, tuple(comm.ranks), tag)
        k = self._messages[key]
        self._messages[key] += 1
        alpha, bandwidth = self.cluster.link((src, dst))
        return f"{src}>{dst} tag {tag} #{k}", alpha + tensor_bytes(self.cluster, [tensor]) / bandwidth

    def isend(self, comm, tensor, peer: int, tag: int):
        dst = comm.ranks[peer]
        with self.muted():        # one message: the payload's bytes, then the send time's 8
            header = torch.tensor([self.t], dtype=torch.float64, device=tensor.device)
            wire = torch.cat([_as_bytes(tensor), header.view(torch.uint8)])
            work = dist.isend(wire, dst, group=comm.group, tag=tag)
        flow, cost = self._message(comm, self.rank, dst, tag, tensor)
        self.recorder.add(f"send to {dst}", "comm", self.t, self.t + cost, comm.dim, "send:" + flow)
        return Message(self, (work,), (wire,))

    def irecv(self, comm, tensor, peer: int, tag: int):
        src = comm.ranks[peer]
        with self.muted():
            wire = torch.empty(tensor.numel() * tensor.element_size() + 8, dtype=torch.uint8, device=tensor.device)
            work = dist.irecv(wire, src, group=comm.group, tag=tag)
        flow, cost = self._message(comm, src, self.rank, tag, tensor)
        return Message(self, (work,), (wire, tensor), recv=(self.t, cost, flow, src, comm.dim))


class _Muted:
    """``with clock.muted():`` ops inside are not priced. The compute stream's dispatch mode is
    also taken off torch's mode stack meanwhile (when it is on top): a muted op then costs what
    it costs on the wall clock, not a Python call per op (a ring all-reduce's adds, the wire's
    copies, the collectives' own dispatch)."""
    __slots__ = ("clock", "mode")

    def __init__(self, clock):
        self.clock, self.mode = clock, None

    def __enter__(self):
        clock = self.clock
        clock.muted_depth += 1
        n = _stack_len()
        if n and _stack_at(n - 1) is clock._mode:
            self.mode = _stack_pop(None)

    def __exit__(self, *exc):
        if self.mode is not None:
            _stack_push(self.mode)
            self.mode = None
        self.clock.muted_depth -= 1
        return False


_stack_len, _stack_at = torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at
_stack_pop, _stack_push = torch._C._pop_torch_dispatch_stack, torch._C._push_on_torch_dispatch_stack


class Pending:
    """An async collective issued on the virtual clock, priced by ``RankClock.settle``."""
    __slots__ = ("comm", "op", "payload", "ref", "name", "ready", "exchange", "index", "end")

    def __init__(self, comm, op, payload, ref, name, ready, exchange, index):
        self.comm, self.op, self.payload, self.ref, self.name = comm, op, payload, ref, name
        self.ready, self.exchange, self.index, self.end = ready, exchange, index, None


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class Message:
    """The work handle of a virtual send or receive: ``wait()`` waits for the real message and,
    for a receive, moves the compute stream to its arrival."""

    def __init__(self, clock, works, keep, recv=None):
        self._clock, self._works, self._keep, self._recv = clock, works, keep, recv
        self._done = False

    def wait(self, timeout=None):
        if self._done:
            return True
        clock = self._clock
        with clock.muted():
            for w in self._works:
                w.wait()
        if self._recv is not None:
            issued, cost, flow, src, dim = self._recv
            wire, tensor = self._keep
            with clock.muted():   # the payload into the receive's tensor, the send time after it
                if tensor.is_contiguous():
                    _as_bytes(tensor).copy_(wire[:-8])
                else:
                    tensor.copy_(wire[:-8].view(tensor.dtype).view(tensor.shape))
                sent = float(wire[-8:].view(torch.float64))
            start, end = max(issued, sent), max(issued, sent + cost)
            clock.recorder.add(f"recv from {src}", "comm", start, end, dim, "recv:" + flow)
            clock.join(end)
        self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


__all__ = ["RankClock", "Message", "ALGORITHMS"]
