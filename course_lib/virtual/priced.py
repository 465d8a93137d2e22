"""Communication priced, not performed: what lets the dry run drive the course's own program
(:func:`course_lib.virtual.dry_run.dry_run`) with no process group and no data.

The dry run runs one rank per pipeline stage (the ranks at dp = cp = tp = 0, "the running
ranks"), each in a thread of one process with its own :class:`DryRankClock`. The ranks it
leaves out do exactly what a running rank does (dp replicas; the other members of a tp group
run the same kernels on the same shapes), so:

* :class:`PricedComm` is the course's :class:`~course_lib.collectives.comm.Comm` of a group,
  with the group's real global ranks (so NCCL's price sees its size and the nodes it spans),
  whose backend calls do nothing: the clock prices them (``Comm._virtual_call``, the clock's
  one pricing code, :mod:`.clock` and :mod:`.links`);
* :class:`DryRankClock` is the clock's :class:`~course_lib.virtual.clock.RankClock` with
  another transport for the two things that travel between ranks: a collective's members'
  ready times (:meth:`Stages.exchange`: the MAX over the running members; members that do not
  run issued at the same instant as their running twin, so they change no maximum) and a
  message's start and ready times (:meth:`Stages.post` / :meth:`Stages.take`, between running ranks;
  a ring's hop to and from a folded member, async TP's: by symmetry, the message received
  from k places behind left when this rank's own message to k places ahead did);
* :class:`StageMesh` is a :class:`~course_lib.parallel.mesh.Mesh` seen from one running rank,
  its Comms priced.
* :class:`MetaScalars`: on the meta device a tensor has no value; a read of one (``.item()``,
  ``float(loss)``, a token count, ``.tolist()``) reads 1 (it still costs what the clock says:
  the host waits for the stream). Nothing the program prices depends on these values.
  Context parallelism's token positions are the exception: they are index arithmetic, not
  data, so they keep their values on the host (the trim of a ring block's rows and keys
  reads them), and an op that meets them with meta activations sees them moved to meta.
"""
from __future__ import annotations

import itertools
import threading
from collections import defaultdict, deque

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib import trace
from course_lib.collectives.comm import Comm, CommCall
from course_lib.debug import flight_recorder as flight
from course_lib.meta import balanced_topk, mixed_devices, round_robin, to_meta
from course_lib.parallel.mesh import DIMS, EXPERT_DIMS, Mesh, MeshShape
from course_lib.virtual.clock import Message, RankClock
from course_lib.virtual.compute import ComputeStream

_SCALAR = torch.ops.aten._local_scalar_dense.default
# factories whose meta kernel is native (C++): run as they are, no key to make
_NATIVE = frozenset((torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default))
_TOPK = torch.ops.aten.topk.default
_TO_COPY, _COPY = torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default
WAIT = 1.0          # seconds between a waiting thread's checks that no other stage failed


class StageFailed(RuntimeError):
    """Another stage's thread raised: this one stops waiting for it."""


class Stages:
    """What the running ranks share: start times of messages in flight, ready times of the
    collectives that span several of them, and whether one failed (then every wait raises)."""

    def __init__(self, running):
        self.running = frozenset(running)
        self.cond = threading.Condition()
        self.messages = {}                     # flow id -> when its bytes start to leave
        self.waiting = {}                      # flow id -> the Event its receiver waits on
        self.ready = defaultdict(dict)         # (group, k) -> {running member: (ready, bytes)}
        self.reads = defaultdict(int)          # (group, k) -> members that read the maximum
        self.members = {}                      # group -> how many of its ranks run
        self.failed = None
        self.blocked = 0                       # threads waiting for a message or a collective
        self.progress = 0                      # messages posted and ready times given: a counter

    def _wait_for(self, done):
        self.blocked += 1
        try:
            while not done():
                if self.failed is not None:
                    raise StageFailed(f"stopped: another stage failed ({self.failed})")
                self.cond.wait(WAIT)
        finally:
            self.blocked -= 1

    def stuck(self, alive: int) -> tuple | None:
        """(blocked, progress) when every one of the ``alive`` stage threads waits (none can post
        what another waits for, unless something was posted since: the caller compares two
        snapshots), else None."""
        with self.cond:
            return (self.blocked, self.progress) if alive and self.blocked >= alive else None

    def fail(self, why) -> None:
        with self.cond:
            self.failed = why
            self.cond.notify_all()
            waiting = list(self.waiting.values())
        for ev in waiting:
            ev.set()

    def post(self, flow: str, sent: tuple) -> None:
        with self.cond:
            self.progress += 1
            self.messages[flow] = sent
            ev = self.waiting.pop(flow, None)
        if ev is not None:          # wake its receiver only (64 stages: not 63 others for nothing)
            ev.set()

    def take(self, flow: str) -> tuple:
        with self.cond:
            if flow in self.messages:
                return self.messages.pop(flow)
            ev = self.waiting[flow] = threading.Event()
            self.blocked += 1
        try:
            while not ev.wait(WAIT) or flow not in self.messages:
                if self.failed is not None:
                    raise StageFailed(f"stopped: another stage failed ({self.failed})")
        finally:
            with self.cond:
                self.blocked -= 1
        with self.cond:
            return self.messages.pop(flow)

    def exchange(self, comm, k: int, rank: int, ready: float, nbytes: float) -> "ReadyTimes":
        n = self.members.get(comm.group)
        if n is None:
            n = self.members[comm.group] = sum(r in self.running for r in comm.ranks)
        if n <= 1:
            return ReadyTimes(None, None, (ready, nbytes))
        with self.cond:
            self.ready[comm.group, k][rank] = (ready, nbytes)
            self.progress += 1
            self.cond.notify_all()
        return ReadyTimes(self, ((comm.group, k), n), None)


class ReadyTimes:
    """The members' (latest ready time, largest payload) of one collective: ``.result()``."""
    __slots__ = ("stages", "key", "value")

    def __init__(self, stages, key, value):
        self.stages, self.key, self.value = stages, key, value

    def result(self) -> tuple[float, float]:
        if self.value is None:
            (key, n), stages = self.key, self.stages
            with stages.cond:
                stages._wait_for(lambda: len(stages.ready[key]) == n)
                times = stages.ready[key]
                self.value = (max(t for t, _ in times.values()), max(b for _, b in times.values()))
                stages.reads[key] += 1
                if stages.reads[key] == n:          # every member has read it: forget it
                    del stages.ready[key], stages.reads[key]
        return self.value


class DryRankClock(RankClock):
    """A running rank's clock: :class:`RankClock`'s prices, :class:`Stages` as the transport."""

    def __init__(self, cluster, rank: int, world_size: int, recorder, stages: Stages):
        super().__init__(cluster, rank, world_size, recorder)
        self._mode = DryStream(self)
        self.stages = stages
        self._k = defaultdict(int)             # group -> collectives this rank issued on it
        self._twin_sends = defaultdict(deque)  # (group, offset, tag) -> (start, ready) of sends to folded ranks

    memo = None             # an ActionMemo (:mod:`.replay`), when the dry run replays actions

    def stream_tape(self, tape) -> None:
        """Every priced op of the compute stream appended to ``tape`` (None: stop)."""
        self._mode.tape = tape

    def stream(self):
        """The compute stream (its ``replay``)."""
        return self._mode

    def _exchange(self, comm, ready: float, nbytes: float):
        self._k[comm.group] += 1
        return self.stages.exchange(comm, self._k[comm.group], self.rank, ready, nbytes)

    def isend(self, comm, tensor, peer: int, tag: int):
        dst = comm.ranks[peer]
        flow, begin, end, told = self.sent(comm, tensor, dst, tag)
        if dst in self.stages.running:
            self.stages.post(flow, told)
        else:       # a folded peer: its twin k places behind sends me the same message now
            self._twin_sends[self._twin_key(comm, peer - comm.rank, tag)].append(told)
        self.recorder.add(f"send to {dst}", "comm", begin, end, comm.dim, "send:" + flow)
        return Message(self, (), (), sent=end)

    def irecv(self, comm, tensor, peer: int, tag: int):
        src = comm.ranks[peer]
        flow, kind, latency, data = self._message(comm, src, self.rank, tag, tensor)
        recv = (self.t, kind, latency, data, flow, src, comm.dim)
        if src in self.stages.running:
            return Arrival(self, flow, recv)
        return TwinArrival(self, self._twin_key(comm, comm.rank - peer, tag), recv)

    def _twin_key(self, comm, offset: int, tag: int):
        """A message between this rank and a folded member ``offset`` places along the group
        (a ring's hop): the folded members run what this rank runs, so the message this rank
        receives from ``-offset`` left when this rank's own message to ``+offset`` left."""
        return comm.group, offset % comm.size, tag

    def twin_sent(self, key) -> tuple:
        sends = self._twin_sends[key]
        if not sends:
            raise NotImplementedError(f"dry run: a receive from a folded rank of group {list(key[0])} (offset "
                                      f"{key[1]}, tag {key[2]}) waited before this rank sent its twin message: "
                                      f"only symmetric exchanges (every member sends, then receives) fold")
        return sends.popleft()


class DryStream(ComputeStream):
    """The compute stream of a running rank: a copy between the meta device and the host (a
    meta tensor read by the host, ``.tolist()``; CP's positions, which keep values, moved next
    to the activations) is free, as on the real launch the dry run equals, where both sides
    are on one device and no copy runs (a read still waits for the stream:
    :class:`~course_lib.virtual.compute.HostCopies`, on both)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _TO_COPY and args[0].is_meta != ((kwargs or {}).get("device", args[0].device).type == "meta"):
            with self.clock.muted():
                return super().__torch_dispatch__(func, types, args, kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


class Arrival:
    """The handle of a receive on the dry run: ``wait()`` takes its start time from the sender."""
    __slots__ = ("clock", "flow", "recv", "done")

    def __init__(self, clock, flow, recv):
        self.clock, self.flow, self.recv, self.done = clock, flow, recv, False

    def wait(self, timeout=None):
        if not self.done:
            self.clock.received(self.recv, self.clock.stages.take(self.flow))
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class TwinArrival(Arrival):
    """A receive from a folded rank: its bytes left when this rank's twin message did."""
    __slots__ = ("key",)

    def __init__(self, clock, key, recv):
        super().__init__(clock, None, recv)
        self.key = key

    def wait(self, timeout=None):
        if not self.done:
            self.clock.received(self.recv, self.clock.twin_sent(self.key))
            self.done = True
        return True


class TapedWait:
    """The handle of an async collective taped by an action's memo (:mod:`.replay`): its wait is
    taped where it happens, then done."""
    __slots__ = ("handle", "memo", "at")

    def __init__(self, handle, memo, at):
        self.handle, self.memo, self.at = handle, memo, at

    def wait(self, timeout=None):
        self.memo.comm_wait(self.at)
        return self.handle.wait()

    def is_completed(self) -> bool:
        return self.handle.is_completed()


class PricedComm(Comm):
    """A :class:`Comm` of the global ranks ``ranks`` seen from ``rank``: the same calls, traced
    and priced on the rank's clock; the backend's part of each call does nothing."""
    moves_data = False      # (checks that compare values across the group skip it)

    def __init__(self, ranks, rank: int, dim: str = ""):   # (no process group: Comm's checks skipped)
        self.ranks, self.dim, self.impl, self.validate = list(ranks), dim, "torch", False
        self.rank, self.size = self.ranks.index(rank), len(self.ranks)
        self.group = tuple(self.ranks)           # the clock's key for the group's stream
        self.counter, self._pg, self.backend_device, self._p2p_cpu_only = None, None, torch.device("meta"), False
        self.log, self.one_call, self._site, self._measuring = [], False, None, False
        self._thread = self._pending = None
        self.folded_values, self._calling = {}, None   # call name -> fn(member) -> what that member holds

    def _run(self, op, name, payload, async_op, args, kwargs):
        self._calling = name                     # (read by _function, for folded_values)
        return super()._run(op, name, payload, async_op, args, kwargs)

    def _call(self, op, name, payload, async_op, args, kwargs):
        clock = trace.clock()
        memo = clock.memo if clock is not None else None
        at = memo.comm_call(self, op, name, payload, async_op, args, kwargs) if memo is not None else None
        handle = super()._call(op, name, payload, async_op, args, kwargs)
        if async_op and at is not None and handle is not None:
            return TapedWait(handle, memo, at)      # its wait taped where the action waits
        return handle

    def replay_call(self, op, name, payload, async_op, args, kwargs):
        """The call again, not taped (:mod:`.replay`). A blocking collective of the backend is
        priced here at once: what ``Comm._virtual_call`` does for it (logged, the members' ready
        times exchanged, NCCL's price, its span, the stream joins its end) less the backend's
        call, which moves nothing into a replay's meta tensors. Any other call goes the whole way."""
        clock = trace.clock()
        if async_op or clock is None or clock.muted_depth or self._measuring or self.impl != "torch" \
                or (self.size == 1 and op in ("all_reduce", "broadcast", "barrier")):
            return super()._call(op, name, payload, async_op, args, kwargs)
        entry = flight.collective(self, op, args, kwargs, async_op)
        self._calling = name
        self.log.append(CommCall(op, name, payload, None))
        start, end = clock.collective(self, op, payload, args[0] if args else None, _nothing_to_run)
        trace.recorder().add(name, "comm", start, end, self.dim)
        clock.join(end)
        return flight.completed(entry, None)

    def _function(self, op):
        fn, who = super()._function(op)
        if who != "torch":
            return fn, who
        return _twins(op, self.rank, self.size, self.folded_values.get(self._calling)), who


def _nothing_to_run() -> None:
    """A replayed collective's backend call: its tensors are meta, nothing moves."""


def _twins(op: str, me: int, n: int, values=None):
    """A collective's backend call on the dry run: nothing moves. A meta tensor has no values;
    a host tensor (an MoE's routing counts, expert ids: index arithmetic that keeps values)
    gets what its folded twins would send, each holding what this rank holds; or, for a call
    whose members hold different values that the dry run knows (``values(member)``: an MoE's
    token places over cp x tp, :attr:`PricedComm.folded_values`), theirs."""
    def run(*args, group=None, async_op=False, op=None, **kw):
        host = [t for t in args if isinstance(t, torch.Tensor) and not t.is_meta]
        if not host:
            return None
        clock = trace.clock()
        with clock.muted() if clock is not None else _nothing():
            if values is not None and name == "all_gather_into_tensor":
                out, inp = args[:2]
                out.view(n, *inp.shape).copy_(torch.stack([values(i) for i in range(n)]))
            else:
                _twin_values(name, args, me, n, op)
        return None
    name = op
    return run


def _twin_values(op, args, me, n, reduce_op) -> None:
    sum_ = reduce_op is None or reduce_op == torch.distributed.ReduceOp.SUM
    if op == "all_gather_into_tensor":
        out, inp = args[:2]
        out.view(n, *inp.shape).copy_(inp.expand(n, *inp.shape))
    elif op == "all_to_all_single":
        out, inp = args[:2]
        if len(args) > 2 and any(a is not None for a in args[2:4]):
            raise NotImplementedError("dry run: an uneven all-to-all of values on the host")
        out.view(n, -1).copy_(inp.reshape(n, -1)[me].expand(n, -1))
    elif op == "all_reduce":
        if sum_:
            args[0].mul_(n)
    elif op == "reduce_scatter_tensor":
        out, inp = args[:2]
        out.copy_(inp.reshape(n, *out.shape)[me] * (n if sum_ else 1))
    elif op not in ("broadcast", "barrier"):
        raise NotImplementedError(f"dry run: {op} of values on the host")


class StageMesh(Mesh):
    """The :class:`Mesh` of ``sizes`` seen from global rank ``rank``, every Comm a
    :class:`PricedComm` (nothing to build: no process group)."""

    def __init__(self, rank: int, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, etp: int = 1, *,
                 order=None, fold_order: str = "dp_first"):
        MeshShape.__init__(self, dp, pp, cp, tp, ep, etp, order=order, fold_order=fold_order)
        self.impl, self.rank = "torch", rank
        self.coord = self.coords(rank)
        self._comms = {}

    def group(self, dims):
        return tuple(self.ranks(self._key(dims)))

    def ranks(self, dims) -> list[int]:
        """:meth:`Mesh.ranks` (this rank's group along ``dims``, in group-rank order), found
        among the ranks that differ from this one only where the group reaches: not by
        building every group of the world (a 3,072-GPU row's stages ask about 260 times)."""
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        if not names:
            return super().ranks(dims)          # (its error)
        self._check(names)
        covered, me = self._covered(names), self.coords(self.rank)
        outside = [d for d in DIMS + EXPERT_DIMS if d not in covered]
        varying = [d for d in DIMS if d in covered]
        mine, members = tuple(me[d] for d in outside), []
        for values in itertools.product(*(range(self.sizes[d]) for d in varying)):
            rank = self.rank_of(**{**{d: me[d] for d in DIMS}, **dict(zip(varying, values))})
            c = self.coords(rank)
            if tuple(c[d] for d in outside) == mine:
                members.append((tuple(c[d] for d in self.order + ("edp", "ep", "etp") if d in names), rank))
        return [r for _, r in sorted(members)]

    def comm(self, dims, impl=None) -> Comm:
        key = self._key(dims)
        if key not in self._comms:
            self._comms[key] = PricedComm(self.ranks(key), self.rank, dim="+".join(key))
        return self._comms[key]

    def comm_of_sets(self, sets, dim: str, impl=None) -> Comm:
        """The PricedComm of the one of ``sets`` (lists of global ranks) that holds this rank."""
        ranks = next(sorted(r) for r in sets if self.rank in r)
        key = ("sets", tuple(ranks), dim)
        if key not in self._comms:
            self._comms[key] = PricedComm(ranks, self.rank, dim=dim)
        return self._comms[key]

    def embedding_comm(self):
        if self.coord["pp"] not in (0, self.sizes["pp"] - 1):
            return None
        if "embedding" not in self._comms:
            stages = self.ranks("pp")
            self._comms["embedding"] = PricedComm(sorted({stages[0], stages[-1]}), self.rank, dim="pp")
        return self._comms["embedding"]


class MetaScalars(TorchDispatchMode):
    """The meta device, fast, and readable: a value read from a meta tensor is 1 (see the
    module's docstring); an op's output shapes are remembered by its inputs' shapes (most meta
    kernels are Python, ~1 ms an op; their outputs depend on shapes, dtypes and arguments only),
    for the ops that make new tensors (not views, not in place: those run their meta kernel)."""

    def __init__(self):
        super().__init__()
        self.shapes = {}        # (op, inputs' metadata) -> the outputs' (shape, stride, dtype), or None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False            # (no torch.compile here: skip the per-op dynamo guard)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SCALAR and args[0].is_meta:
            return 1.0 if args[0].is_floating_point() else 1
        if func is _TO_COPY and args[0].is_meta and kwargs.get("device", args[0].device).type != "meta":
            return torch.ones(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=kwargs["device"])
        if func is _COPY and args[1].is_meta and not args[0].is_meta:   # (.tolist(), .cpu(): to the host)
            return args[0].fill_(1)
        if func is _TOPK and args[0].is_meta:
            return balanced_topk(*args, **kwargs)
        if mixed_devices(args):        # positions (values, on the host) meet the meta activations
            args = tuple(to_meta(a) for a in args)
        if func in _NATIVE:
            return func(*args, **kwargs)
        fresh = _FRESH.get(func)
        if fresh is None:
            fresh = _FRESH[func] = _makes_new_tensors(func)
        if not fresh:
            return func(*args, **kwargs)
        try:
            key = (func, _key(args), _key(kwargs)) if kwargs else (func, _key(args))
        except TypeError:       # an argument that cannot be a key: run the meta kernel
            return func(*args, **kwargs)
        outs = self.shapes.get(key)
        if outs is None:
            out = func(*args, **kwargs)
            if not all(isinstance(t, torch.Tensor) and t.is_meta for t in (out if isinstance(out, tuple) else (out,))):
                return out
            self.shapes[key] = ([_meta(t) for t in out] if isinstance(out, tuple) else _meta(out))
            return out
        if isinstance(outs, list):
            return tuple(torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in outs)
        shape, stride, dtype = outs
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


_FRESH: dict = {}       # op -> whether its outputs are new tensors (no alias, no mutation)


def _makes_new_tensors(func) -> bool:
    schema = func._schema
    if schema.is_mutable or not schema.returns:
        return False
    return all(r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns)


class BalancedRouting(TorchDispatchMode):
    """Every top-k (the MoE router's choice) takes :func:`~course_lib.meta.round_robin`'s
    indices, values as computed: what the dry run assumes of the routing, on a real run
    (tests compare the two).
    Enter it inside the rank's virtual clock: the clock prices the top-k as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _TOPK:
            clock = trace.clock()
            with clock.muted() if clock is not None else _nothing():
                values, idx = out
                n, k = args[0].shape[-1], idx.shape[-1]
                pattern = round_robin(idx.numel() // max(k, 1), n, k, idx.device).view(idx.shape)
                out = (torch.gather(args[0], -1, pattern).to(values.dtype), pattern)
            live = getattr(getattr(clock, "_mode", None), "live", None)
            for t in out if live is not None else ():   # the program holds these in place of the
                live.follow(t)                           # top-k's own results (made muted, unfollowed)
        return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _meta(t):
    return tuple(t.shape), t.stride(), t.dtype


def _key(x):
    """A hashable key of an op's argument: a tensor by its metadata (never its values)."""
    if isinstance(x, torch.Tensor):
        if not x.is_meta:
            raise TypeError("a tensor with values")
        return (tuple(x.shape), x.stride(), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_key(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _key(v)) for k, v in x.items())
    hash(x)
    return (type(x), x)     # (1 and 1.0 promote an integer tensor differently)


__all__ = ["Stages", "StageFailed", "DryRankClock", "PricedComm", "StageMesh", "MetaScalars", "BalancedRouting"]
