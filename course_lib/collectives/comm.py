"""One communication object per process group: every byte any chapter moves goes through it.

    comm = Comm(group, dim="dp")                 # or mesh.comm("dp")
    comm.rank, comm.size, comm.next, comm.prev   # ranks INSIDE the group, everywhere
    work = comm.all_reduce(t, async_op=True)     # torch's semantics; .wait() on the handle
    comm.reduce_scatter_tensor(out, inp); comm.all_gather_into_tensor(out, inp)
    comm.broadcast(t, src=0)                     # src is a rank of this group
    comm.exchange(send, to=comm.next, recv=buf, frm=comm.prev)   # point-to-point
    post = comm.poster("send", comm.next); post(t).wait()       # many messages of one kind
    with comm.measuring():                       # bytes that left this rank, per call
        ...
    comm.log                                     # [CommCall(op, name, payload, sent)]

``impl`` picks who runs the collectives: ``"torch"`` (torch.distributed, default),
``"course"`` (the from-scratch algorithms of :mod:`course_lib.collectives`), or a dict
``{"all_reduce": my_ring_all_reduce, ...}`` of functions with torch's signature (what is
missing falls back to torch): a learner's ring from chapter 2 can drive DDP. Our
algorithms are blocking, so their ``async_op=True`` calls run, in order, on one
communication thread per Comm: they still overlap the caller's compute.

Bytes are **measured**, not computed: inside ``measuring()`` every call runs alone (async
calls complete before they return) between two reads of the bytes this process handed to
the kernel's write and send calls (Linux ``/proc/self/io``: payload plus the transport's
headers). Where that counter does not exist (macOS, Windows) our own algorithms still
report their payload bytes (counted message by message); torch's report None. On GPUs
(NCCL over NVLink) the kernel sees nothing: measured bytes are meaningful on gloo.

Every call records a ``comm`` span tagged with ``dim``, from launch to completion. Under a
virtual clock (``launch(..., clock=VirtualCluster(...))``, see :mod:`course_lib.virtual`)
every call still runs for real (collectives to completion before they return, messages
with an 8-byte header carrying their send time), and its span is priced on the clock.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import sys
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch.distributed as dist

from course_lib import compat, trace
from course_lib.debug import flight_recorder as flight  # every call recorded (a hang's diagnosis)
from course_lib.collectives.measure import bytes_written  # /proc/self/io wchar, None off Linux

IMPLS = ("torch", "course")
# torch's isend / irecv: while they are not wrapped, a message goes straight to the process group
# (their Python checks cost microseconds a message, and a ring posts 2(N-1) a call). None: they
# were already wrapped when this module was imported, and every message goes through dist.isend.
_TORCH_ISEND, _TORCH_IRECV = ((dist.isend, dist.irecv) if dist.isend.__module__ == dist.irecv.__module__ ==
                              "torch.distributed.distributed_c10d" else (None, None))
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast",
               "all_to_all_single", "barrier")
# impl="course": course_lib.collectives registers its algorithms here when it is imported
# (importing this module imports that package first), so this module never imports its package
COURSE_ALGORITHMS: dict = {}


@dataclass
class TrafficCounter:
    """Payload bytes and messages this rank sent and received through point-to-point calls."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    sent_to: dict = field(default_factory=lambda: defaultdict(int))  # group peer -> bytes

    def reset(self):
        self.bytes_sent = self.bytes_received = self.messages_sent = 0
        self.sent_to.clear()


def check_p2p_device(tensor, what: str) -> None:
    """gloo's point-to-point carries CPU tensors only: its collectives take CUDA tensors, but a
    send hands the GPU pointer to the socket (seen on an H100: "writev ...: Bad address"), and
    the peer waits on a message that never comes. Refuse by name, before anything is sent."""
    if tensor.device.type != "cpu":
        raise ValueError(f"cannot {what} a {tensor.device.type} tensor point-to-point over gloo: gloo "
                         f"sends and receives CPU tensors only (its collectives take CUDA tensors). "
                         f"Use backend='nccl' (one GPU per rank), or keep this rank's tensors on the CPU")


class CommCall(NamedTuple):
    """One logged collective: ``payload`` = the tensor torch names (all-reduce: the tensor,
    all-gather: the output, reduce-scatter: the input, all-to-all: the input), ``sent`` =
    bytes measured leaving this rank (None outside ``measuring()``)."""
    op: str
    name: str
    payload: int
    sent: int | None


def _nbytes(t):
    return t.numel() * t.element_size()


_THIS = os.path.abspath(__file__)
_ALGORITHMS = os.path.dirname(_THIS) + os.sep   # course_lib/collectives/


def _built_by_an_algorithm() -> bool:
    """Whether Comm(...) was written in a module of this package other than this one (whose
    Comm.of serves any caller). Such a Comm is a local of one algorithm call."""
    path = sys._getframe(2).f_code.co_filename   # 0: here, 1: __init__, 2: the line Comm(...)
    return path.startswith(_ALGORITHMS) and path != _THIS and os.sep not in path[len(_ALGORITHMS):]


class Handle:
    """The handle of an async call: ``wait()`` blocks until it is done, ends its span."""
    _entry = None  # its flight-recorder record (course_lib.debug), marked waiting / completed

    def __init__(self, comm, wait_fn, name, start, done=False):
        self._comm, self._wait_fn = comm, wait_fn
        self._span = None if done else (name, start)  # done: the caller recorded the span

    def _end(self):
        if self._entry is not None:
            self._entry.complete()
        if self._span is not None:
            name, start = self._span
            self._span = None
            trace.recorder().add(name, "comm", start, trace.now(), self._comm.dim)

    def wait(self):
        if self._wait_fn is not None:
            if self._entry is not None:
                self._entry.waiting()
            self._wait_fn()
            self._wait_fn = None
        self._end()
        return True

    def is_completed(self) -> bool:
        return self._span is None


class _Nothing:
    """The handle of a message that was not sent (an empty tensor): done already."""
    __slots__ = ()

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


NOTHING = _Nothing()


# process group -> (this rank's group rank, size, global ranks, backend device or None: NCCL's
# current GPU). Facts fixed for a group's life, looked up in torch once, not once a call: an
# algorithm builds a Comm per call (torch's look-ups cost some 20 Python calls). Weak keys:
# a group that is gone takes its entry with it.
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _group_facts(pg, group, keep=True):
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the group")
    size = dist.get_world_size(group)
    device = compat.backend_device(group)
    facts = (rank, size, tuple(compat.global_rank(group, r) for r in range(size)),
             device if device.type == "cpu" else None)
    if keep:
        _GROUPS[pg] = facts
    return facts


class Comm:
    """A process group seen from one rank: group ranks, counted point-to-point messages,
    and torch.distributed's collectives (torch's or ours), traced and measured.

    ``Comm.of(group)`` is None on a rank outside ``group``: like torch.distributed,
    a collective called there returns at once and does nothing.
    """

    def __init__(self, group=None, counter: TrafficCounter | None = None, *, dim: str = "",
                 impl="torch", validate: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: run inside course_lib.launch(fn, world_size)")
        if not (impl in IMPLS or isinstance(impl, dict)):
            raise ValueError(f"impl must be one of {IMPLS} or a dict {{collective: function}}, got {impl!r}")
        if isinstance(impl, dict) and set(impl) - set(COLLECTIVES):
            raise ValueError(f"impl: unknown collective(s) {sorted(set(impl) - set(COLLECTIVES))}; "
                             f"known: {COLLECTIVES}")
        self.group, self.dim, self.impl, self.validate = group, dim, impl, validate
        self._pg = pg = group if group is not None else dist.group.WORLD   # its process group object
        try:
            facts = _GROUPS.get(pg) or _group_facts(pg, group)
        except TypeError:   # not a process group (torch's NON_GROUP_MEMBER is an int): torch says what
            facts = _group_facts(pg, group, keep=False)
        self.rank, self.size, ranks, self.backend_device = facts
        self.ranks = list(ranks)   # group rank -> global
        self.counter = counter
        if self.backend_device is None:   # NCCL: this rank's current GPU, which may change
            self.backend_device = compat.backend_device(group)   # where this group's small exchanges live
        self._p2p_cpu_only = self.backend_device.type == "cpu"   # gloo
        self.log: list[CommCall] = []
        # built by an algorithm of this package (ring.all_reduce, tree.broadcast, ...) for one of
        # its calls: every message it carries has the same call site, the algorithm's caller,
        # which the flight recorder then looks up once, not once a message (flight.p2p)
        self.one_call = _built_by_an_algorithm()
        self._site = None
        self._measuring = False
        self._thread = self._pending = None  # our algorithms' async calls run there, in order

    world_size = property(lambda self: self.size)
    next = property(lambda self: (self.rank + 1) % self.size, doc="the next group rank on the ring")
    prev = property(lambda self: (self.rank - 1) % self.size, doc="the previous group rank on the ring")

    @staticmethod
    def outside(group) -> bool:
        """True on a rank that is not a member of ``group``."""
        return dist.is_initialized() and group is not None and dist.get_rank(group) < 0

    @classmethod
    def of(cls, group=None, counter: TrafficCounter | None = None, **kw):
        return None if cls.outside(group) else cls(group, counter, **kw)

    def group_rank(self, global_rank: int, what: str = "root") -> int:
        """The group rank of a global rank (torch's src/dst are global ranks)."""
        if not isinstance(global_rank, int) or isinstance(global_rank, bool):
            raise TypeError(f"{what} must be an int (a global rank), got {global_rank!r}")
        if global_rank not in self.ranks:
            raise ValueError(f"{what}={global_rank} is not a rank of this group (its global ranks: {self.ranks})")
        return self.ranks.index(global_rank)

    # ------------------------------------------------------------------ point-to-point
    def isend(self, tensor, peer: int, tag: int = 0):
        """Start sending ``tensor`` (contiguous) to group rank ``peer``; returns the work handle.
        ``tag`` tells apart messages between the same two ranks (a pipeline's activations and gradients)."""
        return self._message("send", tensor, peer, tag)

    def irecv(self, tensor, peer: int, tag: int = 0):
        return self._message("recv", tensor, peer, tag)

    def post_send(self, tensor, peer: int, tag: int = 0):
        """isend, or None for an empty tensor (nothing to send; the receiver skips it too)."""
        shape = tensor.shape
        return None if 0 in shape else self._message("send", tensor, peer, tag, shape)

    def post_recv(self, tensor, peer: int, tag: int = 0):
        shape = tensor.shape
        return None if 0 in shape else self._message("recv", tensor, peer, tag, shape)

    def poster(self, op: str, peer: int, tag: int = 0):
        """``post(tensor)``: :meth:`post_send` (``op="send"``) or :meth:`post_recv` (``"recv"``)
        with ``peer`` and ``tag`` fixed, for an algorithm that posts many such messages in one
        call (a ring: 2(N-1) and more). The same messages, counted and recorded alike; what
        they share (the process group's call, the recorder's call site and text) is looked
        up once, and the flight recorder keeps its recorded posts from one call to the next
        (``flight_recorder.p2p_poster``: this call's group and Comm held weakly). An empty
        tensor posts nothing and gets :data:`NOTHING`, whose wait returns."""
        if op not in ("send", "recv"):
            raise ValueError(f"op must be 'send' or 'recv', got {op!r}")
        if (trace.clock() is not None or (dist.isend, dist.irecv) != (_TORCH_ISEND, _TORCH_IRECV)
                or self.counter is not None):   # priced on a virtual clock, isend / irecv wrapped, or
            return functools.partial(self.post_slow, op, peer=peer, tag=tag)   # counted: all through _message
        recorded = flight.p2p_poster(self, op, peer, tag)   # None: recorder off
        if recorded is not None:
            return recorded
        call, cpu_only, slow = self._pg.send if op == "send" else self._pg.recv, self._p2p_cpu_only, self.post_slow

        def post(tensor):
            shape = tensor.shape
            if 0 in shape:
                return NOTHING
            if tensor.dtype.is_complex or (cpu_only and not tensor.is_cpu):
                return slow(op, tensor, peer, tag)   # torch's isend views complex as real; the device check
            return call([tensor], peer, tag)
        return post

    def post_slow(self, op, tensor, peer, tag):
        """What post_send / post_recv do: a poster's path for what its fast path leaves out."""
        shape = tensor.shape
        return NOTHING if 0 in shape else self._message(op, tensor, peer, tag, shape)

    def _message(self, op, tensor, peer, tag, shape=None):
        """One message posted, counted, recorded. Called straight from the four methods above:
        the flight recorder takes the frame two above this one as the first candidate call site.
        A ring posts 2(N-1) messages a call, each between copies of megabytes that leave the
        caches cold: every attribute read here costs (``shape``: the tensor's, read already)."""
        if self._p2p_cpu_only and not tensor.is_cpu:
            check_p2p_device(tensor, "send" if op == "send" else "receive")
        counter = self.counter
        if counter is not None:
            nbytes = _nbytes(tensor)
            if op == "send":
                counter.bytes_sent += nbytes
                counter.messages_sent += 1
                counter.sent_to[peer] += nbytes
            else:
                counter.bytes_received += nbytes
        dtype = tensor.dtype
        clock = trace.clock()
        if clock is not None and not clock.muted_depth:   # (muted: a message inside a priced collective)
            work = (clock.isend if op == "send" else clock.irecv)(self, tensor, peer, tag)
        elif op == "send":
            if dist.isend is _TORCH_ISEND and not dtype.is_complex:   # what torch's isend does, its checks
                work = self._pg.send([tensor], peer, tag)             # (for any tensor, any group) skipped
            else:                                    # wrapped (measure.simulated_link, grading's P2PWatch)
                work = dist.isend(tensor, self.ranks[peer], group=self.group, tag=tag)
        elif dist.irecv is _TORCH_IRECV and not dtype.is_complex:
            work = self._pg.recv([tensor], peer, tag)
        else:
            work = dist.irecv(tensor, self.ranks[peer], group=self.group, tag=tag)
        return flight.p2p(self, op, tensor, peer, tag, work, shape, dtype)

    @staticmethod
    def wait(*works):
        for w in works:
            if w is not None:
                w.wait()

    def send(self, tensor, peer: int):
        if tensor.numel():
            self.isend(tensor, peer).wait()

    def recv(self, tensor, peer: int):
        if tensor.numel():
            self.irecv(tensor, peer).wait()

    def exchange(self, send=None, to: int | None = None, recv=None, frm: int | None = None):
        """Send ``send`` to ``to`` while receiving ``recv`` from ``frm``; return when both are done.

        Posting both before waiting is what keeps a ring from deadlocking:
        every rank sends right and receives left at the same time. Empty
        tensors are skipped on both sides (both sides know the sizes).
        """
        works = []
        if recv is not None and recv.numel():
            works.append(self.irecv(recv, frm))
        if send is not None and send.numel():
            works.append(self.isend(send, to))
        for w in works:
            w.wait()

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, async_op=False, name="all-reduce"):
        return self._call("all_reduce", name, _nbytes(tensor), async_op, (tensor,), dict(op=op))

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, async_op=False, name="reduce-scatter"):
        """``output`` (n, ...) <- the sum over ranks of this rank's n-row slice of ``input`` (size * n, ...)."""
        return self._call("reduce_scatter_tensor", name, _nbytes(input), async_op, (output, input), dict(op=op))

    def all_gather_into_tensor(self, output, input, async_op=False, name="all-gather"):
        """``output`` (size * n, ...) <- every rank's ``input`` (n, ...), in group-rank order."""
        return self._call("all_gather_into_tensor", name, _nbytes(output), async_op, (output, input), {})

    def broadcast(self, tensor, src: int = 0, async_op=False, name="broadcast"):
        """``src`` is a rank of THIS group (torch's ``group_src``), not a global rank."""
        if not 0 <= src < self.size:
            raise ValueError(f"broadcast: src={src} must be a rank of this group (0..{self.size - 1})")
        return self._call("broadcast", name, _nbytes(tensor), async_op, (tensor,), dict(src=self.ranks[src]))

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          async_op=False, name="all-to-all"):
        return self._call("all_to_all_single", name, _nbytes(input), async_op, (output, input, output_split_sizes,
                          input_split_sizes), {})

    def barrier(self, name="barrier"):
        return self._call("barrier", name, 0, False, (), {})

    # ------------------------------------------------------------------ measuring
    @contextlib.contextmanager
    def measuring(self, enabled: bool = True):
        """Inside: every call completes before it returns and logs the bytes that left this rank."""
        previous, self._measuring = self._measuring, enabled
        try:
            yield self
        finally:
            self._measuring = previous

    def bytes_sent(self) -> int | None:
        """Measured bytes of the logged calls (None if a call was not measured)."""
        sent = [c.sent for c in self.log]
        return None if any(s is None for s in sent) else sum(sent)

    def payload_bytes(self) -> int:
        return sum(c.payload for c in self.log)

    def reset(self):
        self.log.clear()

    # ------------------------------------------------------------------ dispatch
    def _function(self, op):
        """The function that runs ``op`` and who wrote it: "torch", "course" or "custom"."""
        if isinstance(self.impl, dict) and op in self.impl:
            return self.impl[op], "custom"
        if self.impl == "course" and op != "barrier":
            fn = COURSE_ALGORITHMS[op]
            return (lambda *a, **kw: fn(*a, validate=self.validate, **kw)), "course"
        if self.size == 1 and op in ("all_reduce", "broadcast", "barrier"):
            return (lambda *a, **kw: None), "course"  # nothing to exchange with anyone
        if op == "all_gather_into_tensor":
            return compat.all_gather_into_tensor, "torch"
        if op == "reduce_scatter_tensor":
            return compat.reduce_scatter_tensor, "torch"
        return getattr(dist, op), "torch"

    def _call(self, op, name, payload, async_op, args, kwargs):
        entry = flight.collective(self, op, args, kwargs, async_op)  # recorded first (None: off)
        return flight.completed(entry, self._run(op, name, payload, async_op, args, kwargs))

    def _run(self, op, name, payload, async_op, args, kwargs):
        fn, who = self._function(op)
        clock = trace.clock()
        if clock is not None and not clock.muted_depth:
            return self._virtual_call(clock, op, name, payload, async_op, args, kwargs, fn, who)
        start = trace.now()
        if self._measuring:
            return self._measured_call(op, name, payload, async_op, args, kwargs, fn, who, start)
        self.log.append(CommCall(op, name, payload, None))
        if who == "torch":
            work = fn(*args, group=self.group, async_op=async_op, **kwargs)
            if work is None:
                trace.recorder().add(name, "comm", start, trace.now(), self.dim)
                return None
            handle = Handle(self, work.wait, name, start)
            try:  # the span ends when the backend finishes the work, not when someone waits
                work.get_future().then(lambda _: handle._end())
            except RuntimeError:  # gloo's reduce-scatter has no future
                pass
            return handle
        run = self._quiet(fn, args, kwargs)
        if not async_op:
            self._drain()  # keep this group's calls in order
            run()
            trace.recorder().add(name, "comm", start, trace.now(), self.dim)
            return None
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"comm-{self.dim}")
        self._pending = future = self._thread.submit(run)
        handle = Handle(self, future.result, name, start)
        future.add_done_callback(lambda _: handle._end())
        return handle

    def _virtual_call(self, clock, op, name, payload, async_op, args, kwargs, fn, who):
        """Run the collective for real and price it on the virtual clock: one span from its start
        to its end. The backend's collectives (torch's) are priced as NCCL would run them, on
        the group's communication stream; an async one runs beside the program, as on the wall
        clock (priced when waited for). One built from send/recv (``impl="course"``, a learner's)
        runs to completion, priced from its own messages and reductions."""
        if async_op and who == "torch" and not self._measuring and not clock.muted_depth:
            self.log.append(CommCall(op, name, payload, None))
            pending = clock.issue(self, op, payload, args[0] if args else None, name)
            with clock.muted(), trace.muted():
                work = fn(*args, group=self.group, async_op=True, **kwargs)

            def wait():
                with clock.muted():
                    if work is not None:
                        work.wait()
                    clock.settle()
                clock.join(pending.end)
            return Handle(self, wait, name, pending.ready, done=True)
        if who != "torch" and not self._measuring:
            # built from send/recv: its own messages are priced, as they would run on the GPUs
            self.log.append(CommCall(op, name, payload, None))
            self._drain()
            clock.settle()
            start = clock.t
            with trace.muted():
                self._quiet(fn, args, kwargs)()
            trace.recorder().add(name, "comm", start, clock.t, self.dim)
            return Handle(self, None, name, start, done=True) if async_op else None
        # the backend's collectives, and any collective while measuring (its bytes are counted
        # alone, without the clock's headers on its messages): NCCL's price
        def run():
            with clock.muted(), trace.muted():
                if self._measuring:
                    self._measured_call(op, name, payload, False, args, kwargs, fn, who, 0.0)
                else:
                    self.log.append(CommCall(op, name, payload, None))
                    if who == "torch":
                        fn(*args, group=self.group, **kwargs)
                    else:
                        self._quiet(fn, args, kwargs)()
        if not self._measuring:
            self._drain()
        # the members' ready times travel beside the real collective (alone after it when
        # measuring: the byte counter must see the collective's own bytes only)
        start, end = clock.collective(self, op, payload, args[0] if args else None, run, beside=not self._measuring)
        trace.recorder().add(name, "comm", start, end, self.dim)
        if not async_op:
            clock.join(end)
            return None
        return Handle(self, lambda: clock.join(end), name, start, done=True)

    def _quiet(self, fn, args, kwargs):
        """``fn`` on this group, its own algorithm span muted (this call records one, with dim)."""
        def run():
            with trace.muted():
                fn(*args, group=self.group, **kwargs)
        return run

    def _measured_call(self, op, name, payload, async_op, args, kwargs, fn, who, start):
        """Alone and blocking, between two reads of the kernel's byte counter."""
        self._drain()
        counter = TrafficCounter()
        if who == "course":
            kwargs = dict(kwargs, counter=counter)
        before = bytes_written()
        if who == "torch":
            fn(*args, group=self.group, **kwargs)
        else:
            self._quiet(fn, args, kwargs)()
        after = bytes_written()
        trace.recorder().add(name, "comm", start, trace.now(), self.dim)
        if before is not None and after is not None:
            sent = after - before
        else:
            sent = counter.bytes_sent if who == "course" else None
        self.log.append(CommCall(op, name, payload, sent))
        return Handle(self, None, name, start, done=True) if async_op else None

    def _drain(self):
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def __del__(self):
        if getattr(self, "_thread", None) is not None:
            self._thread.shutdown(wait=False)

    def __repr__(self):
        impl = self.impl if isinstance(self.impl, str) else "custom"
        return f"Comm(dim={self.dim or '-'}, rank {self.rank} of {self.size}, ranks={self.ranks}, impl={impl})"


__all__ = ["Comm", "CommCall", "Handle", "NOTHING", "TrafficCounter", "bytes_written", "IMPLS", "COLLECTIVES"]
