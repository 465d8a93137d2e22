"""One rank's virtual clock: a compute stream, a stream per communicator, the GPU's link
lanes, and the times that travel with the real messages.

``t`` is the compute stream (and the rank's "now": the host waits for its kernels, as a
step that synchronises would). Communication runs on streams of its own, as NCCL's does:
one per communicator (``streams[group]``), and one per peer and direction for
point-to-point (torch's NCCL backend gives each pair of ranks a communicator of its own).
The bytes cross this GPU's lanes (:mod:`.links`: NVLink and NIC, send and receive), which
every stream shares: collectives of different groups overlap in time and meet only where
they cross the same lane, and there they share it (:meth:`.links.Lane.shared`). The communication layer
(:class:`course_lib.collectives.comm.Comm`) calls:

* ``collective(comm, op, payload, ref, run)`` around a backend collective (``run()``): the
  members exchange (MAX) their ready times (compute stream, the group's stream, their
  lanes) and payloads beside it (issued first; not counted in any byte count): through
  shared memory when the launch's ranks share this machine, else one 16-byte all-reduce on
  the backend (:mod:`.exchange`), so the collective starts at the latest member's ready time and ends
  NCCL's time for it later (:func:`.links.nccl_collective`) on every member; it holds each
  member's lanes for the bytes its algorithm moves there;
* ``isend`` / ``irecv``: the real message, its payload's bytes followed by 16 bytes holding
  the time its bytes start to leave and the time they were ready to (one message, not two:
  half the transport's work); the receive completes ``latency + bytes / bandwidth`` after its
  bytes can enter the receiver's lane, shared with what is on it (:func:`.links.p2p_time`). A collective built from ``send``/``recv`` (the course's
  rings, trees, a learner's answer) is priced from these messages: what runs is what is priced;
* ``join(end)`` when the rank waits on async work: ``t = max(t, end)``.

An async collective's kernel holds SMs (NCCL's channels, one CTA each) from when its stream
reaches it until it ends, waiting for its peers included (``sm_windows``): a compute kernel
that runs meanwhile gets the other SMs (:mod:`.contention`: a GEMM's tiles, a fused attention
kernel's share). So an overlapped collective is not free: it costs the compute beside it.

Under ``CUDA_LAUNCH_BLOCKING=1`` (``launch_blocking``, :meth:`launched`) every kernel launch
returns when the kernel ends, NCCL's too: the host waits for each collective's end where it
issues it (an async one is priced there), for each send's last byte delivered where it posts
it, and for each receive's arrival where it waits for it.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from course_lib.virtual import links
from course_lib.virtual.compute import ComputeStream, tensor_bytes
from course_lib.virtual.contention import ctas
from course_lib.virtual.exchange import exchange as _exchange
from course_lib.virtual.live_memory import unfollowed
from course_lib.virtual.overlap import OverlappedPair

# Comm's collective -> NCCL's (all-to-all is grouped point-to-point; barrier an all-reduce)
NCCL_OPS = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
            "all_gather_into_tensor": "all_gather", "broadcast": "broadcast",
            "all_to_all_single": "all_to_all", "barrier": "all_reduce"}


class RankClock:
    """The virtual clock of one rank (made by ``VirtualCluster.start``; ``with clock:`` prices
    the compute of the code inside)."""

    def __init__(self, cluster, rank: int, world_size: int, recorder):
        self.cluster, self.rank, self.world_size, self.recorder = cluster, rank, world_size, recorder
        self.t = 0.0            # compute stream: when its last kernel ends
        self.streams = defaultdict(float)     # communicator (or peer, direction) -> when its last work ends
        self.lanes = defaultdict(links.Lane)  # ("nvlink" | "net", "send" | "recv") -> this GPU's lane
        self.muted_depth = 0
        self.kernels = 0        # kernels priced on the compute stream so far
        self._messages = defaultdict(int)     # (src, dst, group, tag) -> messages so far: flow ids
        self._groups = {}       # (Comm, node map) -> (stream key, nodes, ranks on the fullest node)
        self._pending = []      # async collectives issued, not priced yet (settle() prices them in order)
        self.lane = None        # the compute stream's KernelLane inside an overlapped pair
        self.launch_blocking = False    # CUDA_LAUNCH_BLOCKING=1: each launch returns at its kernel's end
        self.sequence_first = False     # the program's activations (s, b, h): comm_ops.layout_copies
        self.sm_windows = []    # [start, end, CTAs] of the async collectives' kernels (:mod:`.contention`)
        self.sm_busy_until = 0.0            # the latest of their ends
        self._mode = ComputeStream(self)

    @property
    def comm_free(self) -> float:
        """When the last communication stream goes idle."""
        return max(self.streams.values(), default=0.0)

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

    def overlapped(self) -> OverlappedPair:
        """``with clock.overlapped() as pair:`` two actions, ``pair.next()`` between them, run
        as one overlapped pair: each from the pair's start, their kernels sharing the compute
        stream's gaps (:mod:`.overlap`: DualPipe's F&B)."""
        return OverlappedPair(self)

    def join(self, end: float) -> None:
        """The compute stream waits for work that ends at ``end``."""
        self.t = max(self.t, end)

    def launched(self, end: float) -> None:
        """A communication kernel that ends at ``end`` was launched: under ``CUDA_LAUNCH_BLOCKING=1``
        the launch returns then, so the host issues nothing before (the compute stream's kernels
        do the same in :class:`~.compute.ComputeStream`)."""
        if self.launch_blocking:
            self.host = max(self.host, end)

    # ------------------------------------------------------------------ collectives
    def collective(self, comm, op: str, payload: int, ref, run, beside=True) -> tuple[float, float]:
        """(start, end) of a blocking collective that ``run()`` runs for real on every member of
        ``comm``. ``beside``: the ready times' exchange is issued (async) before ``run()`` and
        waited for after it (the two messages overlap); else it follows ``run()``."""
        self.settle()
        nbytes = self._bytes(payload, ref)
        group = self._group(comm)
        ready, _ = self._ready(comm, op, nbytes, group)
        exchange = self._exchange(comm, ready, nbytes) if comm.size > 1 and beside else None
        run()
        start = ready
        if comm.size > 1:
            if exchange is None:
                exchange = self._exchange(comm, ready, nbytes)
            with self.muted():
                start, nbytes = exchange.result()
            self._host_reads()
        end = self._priced(comm, op, nbytes, start, group)
        self.launched(end)
        return start, end

    def _host_reads(self) -> None:
        """The host read the members' ready times (a blocking collective's): like any read of a
        tensor's value on the compute stream's watch (``.item()``, :mod:`.compute`), it waits for
        the stream (unless muted, in an optimizer step, or outside the stream's mode)."""
        mode = self._mode
        if not (mode._switched or self.muted_depth) and \
                any(_stack_at(i) is mode for i in range(_stack_len() - 1, -1, -1)):   # (most often on top)
            self.host = max(self.host, self.t)

    def issue(self, comm, op: str, payload: int, ref, name: str) -> "Pending":
        """An async collective whose real work runs beside the program (as on the wall clock):
        its ready time is fixed now and the members' ready times are exchanged beside it
        (async); it is priced, in issue order, by :meth:`settle`, when it is waited for or the
        next collective is issued: the same start and end as a blocking call would get."""
        self.settle()
        nbytes = self._bytes(payload, ref)
        ready, slot = self._ready(comm, op, nbytes)
        exchange = self._exchange(comm, ready, nbytes) if comm.size > 1 else None
        window = None
        if comm.size > 1:    # its lanes held (where its bytes fit) until it is priced (settle)
            for lane, seconds in self._occupancy(comm, op, nbytes):
                self.lanes[lane].reserve(slot, seconds)
            window = self._hold_sms(comm, op, nbytes, ready)
        spans = self.recorder.spans
        n = len(spans)
        self.recorder.add(name, "comm", ready, ready, comm.dim)
        placeholder = spans[-1] if len(spans) > n else None     # (spans muted here: none)
        pending = Pending(comm, op, nbytes, name, ready, exchange, placeholder, window, slot)
        self._pending.append(pending)
        if self.launch_blocking:     # the launch returns at its end: priced now, the host waits
            self.settle()
            self.launched(pending.end)
        return pending

    def settle(self) -> None:
        """Price the async collectives issued so far, in order (waiting for their exchanges)."""
        while self._pending:
            p = self._pending.pop(0)
            start, nbytes = p.ready, p.nbytes
            if p.exchange is not None:
                with self.muted():
                    start, nbytes = p.exchange.result()
            if p.comm.size > 1:
                for lane, seconds in self._occupancy(p.comm, p.op, p.nbytes):
                    self.lanes[lane].release(p.slot, seconds)
            p.end = self._priced(p.comm, p.op, nbytes, start)
            if p.window is not None and p.end > p.window[1]:   # its kernel holds its SMs until it ends
                p.window[1] = p.end
                self.sm_busy_until = max(self.sm_busy_until, p.end)
            if p.placeholder is not None:
                self._replace(p.placeholder, start, p.end)

    def _hold_sms(self, comm, op: str, nbytes: float, ready: float):
        """The SMs an async collective's kernel holds from ``ready`` (when its stream reaches it:
        it launches and waits there for its peers) for NCCL's time for it, until :meth:`settle`
        knows its end: a window [start, end, CTAs] the compute kernels beside it see
        (:mod:`.contention`); None where it holds none."""
        group = self._group(comm)
        cost, _, held = self._price(comm, op, nbytes, group)
        if not held:
            return None
        if self.lane is None:           # (an overlapped pair's second action restarts the time)
            self.sm_windows = [w for w in self.sm_windows if w[1] > self.t]
        window = [ready, ready + cost, held]
        self.sm_windows.append(window)
        self.sm_busy_until = max(self.sm_busy_until, window[1])
        return window

    def _replace(self, old, start: float, end: float) -> None:
        """The priced span in place of its placeholder; where the trace was reset since it was
        issued (the placeholder is gone), the span is recorded anew: it ends after the reset."""
        spans, new = self.recorder.spans, type(old)(old.rank, old.name, old.kind, start, end, old.dim, old.flow)
        for i in range(len(spans) - 1, -1, -1):
            if spans[i] is old:
                spans[i] = new
                return
        spans.append(new)

    def _bytes(self, payload: int, ref) -> int:
        return payload // ref.element_size() * self.cluster.itemsize(ref) if ref is not None else 0

    def _group(self, comm) -> "_Group":
        """The group's communication stream key, number of nodes it spans and most ranks on one
        node, remembered per Comm and node map (a grader moves ranks between nodes from one
        step to the next by giving the cluster another map)."""
        key = (comm, id(getattr(self.cluster, "nodes", None)))
        found = self._groups.get(key)
        if found is None:
            nodes = defaultdict(int)
            for r in comm.ranks:
                nodes[self.cluster.node(r)] += 1
            found = self._groups[key] = _Group(("group", comm.group), len(nodes), max(nodes.values()))
        return found

    def _price(self, comm, op: str, nbytes: float, group=None) -> tuple:
        """(NCCL's seconds for collective ``op`` of ``nbytes`` on ``comm``, ((lane, seconds) this
        member's lanes are busy with it, ...), the CTAs its kernel holds (:func:`.contention.ctas`;
        an all-to-all: none counted, NCCL's point-to-point channels are not modelled)), memoised
        per group (a step repeats its sizes); ``group``: ``self._group(comm)``, where the caller
        has it."""
        group = group or self._group(comm)
        found = group.prices.get((op, nbytes))
        if found is None:
            hw, n_nodes, local = self.cluster.hw, group.n_nodes, group.local
            if comm.size <= 1:
                found = (0.0, (), 0)
            elif op == "all_to_all_single":
                cost, nv, net = links.all_to_all_time(hw, nbytes, comm.size, local, n_nodes)
                found = (cost, _both_ways((("nvlink", nv), ("net", net))), 0)
            else:
                kind = "nvlink" if n_nodes == 1 else "net"
                cost, _, algorithm = links.nccl_collective(hw, NCCL_OPS[op], nbytes, comm.size, n_nodes)
                seconds = links.lane_bytes(NCCL_OPS[op], nbytes, comm.size) / links.bus_bandwidth(hw, kind)
                held = ctas(hw, nbytes, comm.size, n_nodes, local, algorithm) if self._mode.contended else 0
                found = (cost, _both_ways(((kind, seconds),)), held)
            if len(group.prices) > 4096:
                group.prices.clear()
            group.prices[op, nbytes] = found
        return found

    def _occupancy(self, comm, op: str, nbytes: float):
        """((lane, seconds), ...) this member's lanes are busy with collective ``op`` of ``nbytes``."""
        return self._price(comm, op, nbytes)[1]

    def _ready(self, comm, op: str, nbytes: float, group=None) -> tuple[float, float]:
        """(start, slot): when this member could start ``op`` (its compute stream issued it and
        the group's stream is idle), sharing its lanes with the transfers on them (slowed as
        :meth:`.links.Lane.shared` says, by its busiest lane), and where its bytes fit in every
        lane at once (the slot its lane time is reserved at)."""
        group = group or self._group(comm)
        issued = slot = max(self.t, self.streams[group.stream])
        occupancy = self._price(comm, op, nbytes, group)[1]
        for _ in range(len(occupancy) + 1):      # a gap in every lane at once
            moved = slot
            for lane, seconds in occupancy:
                moved = self.lanes[lane].earliest(moved, seconds)
            if moved == slot:
                break
            slot = moved
        start = issued
        for lane, seconds in occupancy:
            start = max(start, self.lanes[lane].shared(issued, seconds)[0])
        return min(start, slot), slot

    def _exchange(self, comm, ready: float, nbytes: float):
        """The members' latest ready time and largest payload (``.result()``, not counted in
        bytes): through a file every member maps when the launch's ranks share this machine,
        else a MAX all-reduce of two float64 on the group's backend (:mod:`.exchange`)."""
        with self.muted():
            return _exchange(comm, ready, nbytes)

    def _priced(self, comm, op: str, nbytes: float, start: float, group=None) -> float:
        """The end of collective ``op`` started at ``start``: NCCL's time for it on the group's
        links; the group's stream and this member's lanes are busy meanwhile."""
        group = group or self._group(comm)
        cost, occupancy, _ = self._price(comm, op, nbytes, group)
        for lane, seconds in occupancy:         # its bytes where they fit (they share from start)
            lane = self.lanes[lane]
            lane.reserve(lane.earliest(start, seconds), seconds)
        end = start + cost
        key = group.stream
        self.streams[key] = max(self.streams[key], end)
        return end

    # ------------------------------------------------------------------ point-to-point
    def _message(self, comm, src: int, dst: int, tag: int, tensor):
        """(flow id, link kind, latency, seconds of bytes) of one message."""
        key = (src, dst, tuple(comm.ranks), tag)
        k = self._messages[key]
        self._messages[key] += 1
        intra = self.cluster.node(src) == self.cluster.node(dst)
        latency, data = links.p2p_time(self.cluster.hw, tensor_bytes(self.cluster, [tensor]), intra)
        return f"{src}>{dst} tag {tag} #{k}", ("nvlink" if intra else "net"), latency, data

    def sent(self, comm, tensor, dst: int, tag: int) -> tuple[str, float, float, tuple]:
        """(flow id, when its bytes start to leave, when its last byte is delivered, what the
        message tells its receiver: (that start, when it was ready to leave)) of one message to
        global rank ``dst``: it takes this GPU's send lane and the pair's stream."""
        flow, kind, latency, data = self._message(comm, self.rank, dst, tag, tensor)
        stream, lane = ("send", comm.group, dst), self.lanes[kind, "send"]
        ready = max(self.t, self.streams[stream])           # after this pair's last message
        begin, slot = lane.shared(ready, data)
        lane.reserve(slot, data)
        self.streams[stream] = begin + latency + data
        self.launched(begin + latency + data)
        return flow, begin, begin + latency + data, (begin, ready)

    def received(self, recv: tuple, sent: tuple) -> None:
        """A receive (``recv``: what :meth:`irecv` noted) of a message that ``sent`` (the
        sender's (start, ready), :meth:`sent`) completes: its span recorded, the compute stream
        waits for it."""
        issued, kind, latency, data, flow, src, dim = recv
        start, end = self.arrived(issued, sent, kind, latency, data)
        self.recorder.add(f"recv from {src}", "comm", start, end, dim, "recv:" + flow)
        self.join(end)
        self.launched(end)      # (DeepSpeed's receives are blocking: posted where they are waited for)

    def isend(self, comm, tensor, peer: int, tag: int):
        dst = comm.ranks[peer]
        flow, begin, end, told = self.sent(comm, tensor, dst, tag)
        # one message: the payload's bytes, then its start and ready times; gloo's staging copy,
        # which a GPU's NCCL send does not make, is not the program's memory (live_memory)
        with self.muted(), unfollowed(self._mode):
            header = torch.tensor(told, dtype=torch.float64, device=tensor.device)
            wire = torch.cat([_as_bytes(tensor), header.view(torch.uint8)])
            work = dist.isend(wire, dst, group=comm.group, tag=tag)
        self.recorder.add(f"send to {dst}", "comm", begin, end, comm.dim, "send:" + flow)
        return Message(self, (work,), (wire,), sent=end)

    def irecv(self, comm, tensor, peer: int, tag: int):
        src = comm.ranks[peer]
        with self.muted(), unfollowed(self._mode):     # (the staging buffer: gloo's, as above)
            wire = torch.empty(tensor.numel() * tensor.element_size() + 16, dtype=torch.uint8, device=tensor.device)
            work = dist.irecv(wire, src, group=comm.group, tag=tag)
        flow, kind, latency, data = self._message(comm, src, self.rank, tag, tensor)
        return Message(self, (work,), (wire, tensor), recv=(self.t, kind, latency, data, flow, src, comm.dim))

    def arrived(self, issued: float, sent: tuple, kind: str, latency: float, data: float) -> tuple[float, float]:
        """(start, end) of a receive issued at ``issued`` of a message whose bytes started leaving
        at ``sent[0]``, ready at ``sent[1]``: they share this GPU's receive lane with what is on
        it. One transfer crossing two shared lanes is slowed by the busier (it moves at the
        lower of its two shares), not by both: its start is the later of the sender's and of
        what this lane alone would give it from when it was ready."""
        begin, ready = sent
        lane = self.lanes[kind, "recv"]
        start, slot = lane.shared(ready, data)
        lane.reserve(lane.earliest(begin, data) if slot < begin else slot, data)
        begin = max(begin, start)
        return max(issued, begin), max(issued, begin + latency + data)


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


def _both_ways(lanes) -> tuple:
    """((lane, direction), seconds) for the send and receive lane of each busy link."""
    return tuple(((k, d), s) for k, s in lanes if s > 0 for d in ("send", "recv"))


class _Group:
    """What the clock remembers of one communicator (under one node map)."""
    __slots__ = ("stream", "n_nodes", "local", "prices")

    def __init__(self, stream, n_nodes: int, local: int):
        self.stream, self.n_nodes, self.local = stream, n_nodes, local   # stream key; nodes; most on one
        self.prices = {}        # (op, bytes) -> (seconds, lanes' occupancy): RankClock._price's memo


class Pending:
    """An async collective issued on the virtual clock, priced by ``RankClock.settle``."""
    __slots__ = ("comm", "op", "nbytes", "name", "ready", "exchange", "placeholder", "end", "window", "slot")

    def __init__(self, comm, op, nbytes, name, ready, exchange, placeholder, window=None, slot=None):
        self.comm, self.op, self.nbytes, self.name = comm, op, nbytes, name
        self.ready, self.exchange, self.placeholder, self.end = ready, exchange, placeholder, None
        self.window = window        # [start, end, CTAs] of its kernel's SMs (RankClock._hold_sms)
        self.slot = ready if slot is None else slot     # where its lane time is held meanwhile


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class Message:
    """The work handle of a virtual send or receive: ``wait()`` waits for the real message and
    moves the compute stream to its end: a receive's arrival, a send's last byte delivered (its
    buffer may be reused: NCCL's send completes once the data is in the peer's buffer)."""

    def __init__(self, clock, works, keep, recv=None, sent=None):
        self._clock, self._works, self._keep, self._recv, self._sent = clock, works, keep, recv, sent
        self._done = False

    def wait(self, timeout=None):
        if self._done:
            return True
        clock = self._clock
        with clock.muted():
            for w in self._works:
                w.wait()
        if self._recv is not None:
            wire, tensor = self._keep
            with clock.muted():   # the payload into the receive's tensor, the send time after it
                if tensor.is_contiguous():
                    _as_bytes(tensor).copy_(wire[:-16])
                else:
                    tensor.copy_(wire[:-16].view(tensor.dtype).view(tensor.shape))
                sent = tuple(wire[-16:].view(torch.float64).tolist())
            clock.received(self._recv, sent)
        elif self._sent is not None:
            clock.join(self._sent)
        self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


__all__ = ["RankClock", "Message", "NCCL_OPS"]
