"""Compute on the virtual GPU: a dispatch mode that prices every aten op a rank runs.

``op_time(cluster, func, args, kwargs, out)`` is one kernel's time on the device: its FLOPs,
bytes and class (:func:`course_lib.planner.kernel_cost.op_cost`: the GPU's kernel where the CPU
runs another) priced by the cluster's :class:`~course_lib.planner.kernel_cost.KernelModel`.
Views and metadata (``func.is_view``, allocation, ``.item()``) launch no kernel: free.

Two chains make a rank's compute stream, as in eager PyTorch on a GPU:

* the host (``clock.host``): it issues one op every ``launch_overhead`` seconds;
* the device (``clock.t``, the time the rest of the clock reads as "now"): a kernel starts
  when the host has issued it and the previous kernel has ended, so ``clock.t`` is when the
  stream's last kernel ends: max(device chain, host chain), op by op.

``clock.join(end)`` (waiting on a message or a collective) moves ``clock.t`` only: on a GPU
``wait()`` makes the stream wait, not the host, which keeps issuing ops that then run back to
back once the data is there. A step whose kernels are long keeps its host ahead, one whose
kernels are short is paced by the host. The host waits for the device where it reads a value
(``.item()``, ``float(t)``, ``if t:``, and ``.tolist()``, ``.numpy()``, ``.cpu()``, a copy to
the host that CUDA makes the host wait for): ``clock.host`` moves to ``clock.t`` (an
optimizer's step counters excepted: on CUDA they stay on the CPU). The first three reach the
dispatcher as ``_local_scalar_dense``; the others do not on the CPU (a CPU tensor's
``.tolist()`` reads its memory and dispatches nothing), so :class:`HostCopies`, torch's methods
wrapped while the stream is entered, tells it. Under ``CUDA_LAUNCH_BLOCKING=1``
(``clock.launch_blocking``, :mod:`.software`'s ``"launch_blocking"``) every launch returns when
its kernel ends: the host moves to ``clock.t`` after each op, so a kernel costs the host's issue
interval plus its own time, never hidden behind the previous kernel.

torch's optimizers run their CUDA path while a rank is under the clock: a step of an Adam,
AdamW or (fp32/fp64) SGD whose ``foreach`` is unset runs with ``foreach=True`` (torch's
default on CUDA; on the CPU torch takes the per-tensor path, ~10 kernels per parameter
tensor), then the setting is put back. On the CPU both paths run the same per-tensor kernels
in the same order (the CPU's foreach ops loop over the tensors), so the results are the
same, bit for bit (tests/test_virtual_compute.py checks it on the course's models).
"""
from __future__ import annotations

import functools
import threading

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.planner.kernel_cost import (ATTENTION, FREE, GEMM, RATED, _add_bytes, compute_dtype,  # the planner's
                                            element_bytes, kernel_kind, kind_cost, op_cost)
from course_lib.virtual.contention import Tiles, contended_end, gemm_tiles


def _itemsize(cluster):
    """Floating tensors' bytes per element on ``cluster``: its dtype's, None for each tensor's own."""
    return None if cluster.dtype is None else cluster.dtype.itemsize


def tensor_bytes(cluster, tensors) -> int:
    """Bytes of ``tensors`` on the virtual GPU (floating tensors at the virtual dtype; a cluster
    of ``dtype=None``: each at its own)."""
    itemsize = _itemsize(cluster)
    return sum(_add_bytes(t, itemsize) for t in tensors)


def op_flops(func, args, kwargs, out) -> int:
    cost = op_cost(func, args, kwargs, out, 2)
    return cost[0] if cost else 0


def op_time(cluster, func, args, kwargs, out) -> float:
    """Seconds of one aten op's kernel on the virtual GPU's device (0 for views and metadata):
    :func:`course_lib.planner.kernel_cost.op_cost` (which the planner counts too) priced by the
    cluster's kernel model. The host's issue interval is the stream's (:class:`ComputeStream`)."""
    cost = op_cost(func, args, kwargs, out, _itemsize(cluster))
    if cost is None:
        return 0.0
    if cluster.dtype is None and cost[2] in RATED:      # a GEMM or attention at its own dtype's rate
        return cluster.kernels_for(compute_dtype(args, out)).seconds(*cost)
    return cluster.kernel_time(*cost)


def contention_shape(model, cost, seconds: float) -> float:
    """``seconds`` of a kernel (``cost``: (FLOPs, bytes, class, detail)) priced by ``model``, as
    :class:`~.contention.Tiles` where a collective beside it would slow it: a GEMM on its tile
    model's waves, a fused attention kernel (compute bound) its work shared out by SMs; else as
    they are."""
    flops, _, cls, detail = cost[:4]
    if cls is GEMM and detail is not None:
        return gemm_tiles(*detail, model.gemm_hw, seconds)
    if cls is ATTENTION and seconds > model.floor and model.compute(flops, cls, detail) == seconds:
        return Tiles(seconds)
    return seconds


_READ = torch.ops.aten._local_scalar_dense.default    # the host reads a value: it waits for the device
_HOST_READ = object()                                 # the memo's mark of _READ
_KIND_OF: dict = {}   # an OpOverload's C++ operator -> its kernel_kind (or _HOST_READ): a memo whose
#                       lookup hashes natively (an OpOverload's own __hash__ is a Python call)
# optimizers whose foreach path is the per-tensor path's arithmetic, op for op, on the CPU
_FOREACH_SAME = (torch.optim.Adam, torch.optim.AdamW)


def _cuda_path(optimizer) -> list:
    """The param groups to run with ``foreach=True``: those torch would run so on CUDA (unset,
    not fused, not differentiable, not capturable) where the CPU's results stay the same."""
    if not isinstance(optimizer, _FOREACH_SAME + (torch.optim.SGD,)):
        return []
    groups = []
    for g in optimizer.param_groups:
        if g.get("foreach", False) is not None or g.get("fused") or g.get("differentiable") or g.get("capturable"):
            continue
        if isinstance(g.get("lr"), torch.Tensor):      # foreach needs a float lr (torch refuses a tensor)
            continue
        if not isinstance(optimizer, _FOREACH_SAME) and any(
                p.dtype not in (torch.float32, torch.float64) for p in g["params"]):
            continue                                   # SGD's two paths round 16-bit parameters differently
        groups.append(g)
    return groups


class HostCopies:
    """The host reads a tensor's values by a copy to the host (``.tolist()``, ``.numpy()``,
    ``.cpu()``): on a GPU a blocking device-to-host copy, so the host waits for the stream
    (:meth:`ComputeStream.host_read`). On the CPU these dispatch no aten op, so no dispatch
    mode sees them; a ``TorchFunctionMode`` would, but it also makes every attribute read a
    Python call (1.4M on the 175B dry run: 12-26% more CPU). So while any stream is entered
    the three methods of ``torch.Tensor`` are wrapped: the wrapper tells the calling
    thread's innermost stream, if it has one, then runs torch's method; the last stream to
    leave puts torch's methods back. The wait is priced, not the copy's own bytes over PCIe
    (the program copies a bucket's flags or a handful of counts). ``.to("cpu")`` is not
    caught: the program does not read values that way."""

    NAMES = ("tolist", "numpy", "cpu")
    _lock, _entered, _saved = threading.Lock(), 0, {}
    _local = threading.local()          # .streams: this thread's entered streams, innermost last

    @classmethod
    def enter(cls, stream) -> None:
        streams = cls._local.__dict__.setdefault("streams", [])
        streams.append(stream)
        with cls._lock:
            if cls._entered == 0:
                for name in cls.NAMES:
                    cls._saved[name] = method = getattr(torch.Tensor, name)
                    setattr(torch.Tensor, name, cls._waiting(method))
            cls._entered += 1

    @classmethod
    def leave(cls, stream) -> None:
        streams = cls._local.streams
        streams.remove(stream)
        with cls._lock:
            cls._entered -= 1
            if cls._entered == 0:
                for name in cls.NAMES:
                    setattr(torch.Tensor, name, cls._saved.pop(name))

    @classmethod
    def _waiting(cls, method):
        local = cls._local

        @functools.wraps(method)
        def read(self, *args, **kwargs):
            streams = getattr(local, "streams", None)
            if streams:
                streams[-1].host_read()
            return method(self, *args, **kwargs)
        return read


class ComputeStream(TorchDispatchMode):
    """Advances ``clock.t`` (the device) and ``clock.host`` (the host's issue chain) by every op,
    unless the clock is muted (inside a communication call, or the clock's own bookkeeping);
    while it is entered, torch's optimizers take their CUDA path (see the module doc)."""

    def __init__(self, clock):
        super().__init__()
        self.clock, self.itemsize = clock, _itemsize(clock.cluster)
        self.sizes = element_bytes(self.itemsize)       # dtype -> bytes per element on the virtual GPU
        self.model = clock.cluster.kernels
        self.own = clock.cluster.dtype is None          # each tensor at its own dtype: GEMMs at theirs
        self.issue = clock.cluster.launch_overhead
        self._seconds = {}                 # (FLOPs, bytes, class, detail) -> the model's seconds: a memo
        if not hasattr(clock, "host"):
            clock.host = 0.0               # the host: when it issued its last op
        if not hasattr(clock, "lane"):
            clock.lane = None              # set during an overlapped pair (clock.overlapped())
        if not hasattr(clock, "launch_blocking"):
            clock.launch_blocking = False  # CUDA_LAUNCH_BLOCKING=1 (RankClock.launched)
        self._hooks, self._switched, self._thread = None, [], None
        self.tape = None                   # a list: every priced op's seconds appended (see replay)
        self.live = None                   # a live_memory.LiveBytes: every new storage followed
        hw = clock.cluster.hw               # collectives take SMs from the kernels beside them
        self.contended = bool(getattr(hw, "nccl_channels", 0) and getattr(hw, "sm_count", 0))
        if not hasattr(clock, "sm_busy_until"):
            clock.sm_windows, clock.sm_busy_until = [], 0.0   # (a clock that runs no collective)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False      # no torch.compile under the virtual clock: skip the per-op dynamo guard (~10 us)

    def __enter__(self):
        self._thread = threading.get_ident()   # torch's optimizer hooks are global: this thread's steps only
        pre = register_optimizer_step_pre_hook(self._step_begins)
        post = register_optimizer_step_post_hook(self._step_ends)
        self._hooks = (pre, post)
        HostCopies.enter(self)              # .tolist(), .numpy(), .cpu(): the host waits
        try:
            return super().__enter__()
        except BaseException:
            HostCopies.leave(self)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            HostCopies.leave(self)
            for h in self._hooks or ():
                h.remove()
            self._hooks = None
            while self._switched:           # a step that raised: its groups as they were
                for g in self._switched.pop():
                    g["foreach"] = None

    def _step_begins(self, optimizer, args, kwargs):
        if threading.get_ident() != self._thread:     # another thread's rank (the dry run's stages)
            return
        groups = _cuda_path(optimizer)
        for g in groups:
            g["foreach"] = True
        self._switched.append(groups)

    def _step_ends(self, optimizer, args, kwargs):
        if threading.get_ident() != self._thread:
            return
        for g in self._switched.pop() if self._switched else ():
            g["foreach"] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = getattr(func, "_op", func)     # an OpOverload's C++ operator: one Python frame less per op
        out = op(*args, **kwargs) if kwargs else op(*args)
        if self.live is not None:
            self.live.note(func, out)
        kind = _KIND_OF.get(op)
        if kind is None:
            kind = _KIND_OF[op] = _HOST_READ if func is _READ else kernel_kind(func)
        if kind is False:                   # a view or metadata: free
            return out
        clock = self.clock
        if kind is _HOST_READ:              # .item(), float(t), if t:
            self.host_read()
            return out
        if not clock.muted_depth:           # op_time, inlined: one call less per op
            cost = kind_cost(kind, func, args, kwargs, out, self.sizes)
            key = (*cost, compute_dtype(args, out)) if self.own and cost[2] in RATED else cost
            seconds = self._seconds.get(key)
            if seconds is None:             # (a step repeats its kernels: each priced once)
                if len(self._seconds) > 65536:
                    self._seconds.clear()
                model = self.clock.cluster.kernels_for(key[4]) if key is not cost else self.model
                seconds = model.seconds(*cost)
                if self.contended:
                    seconds = contention_shape(model, cost, seconds)
                self._seconds[key] = seconds
            t, lane = clock.t, clock.lane
            if lane is None:
                host = clock.host + self.issue      # the host issues it...
                start = t if t > host else host     # ...the device runs it
                if start < clock.sm_busy_until and type(seconds) is Tiles:      # beside a collective
                    clock.t = contended_end(start, seconds, clock.sm_windows, clock.cluster.hw.sm_count)
                else:
                    clock.t = start + seconds
            else:                                   # (an overlapped pair: the first gaps that fit)
                host = lane.issue(clock.host, self.issue)
                start = t if t > host else host
                clock.t = lane.place(start, self._beside(start, seconds))
            # CUDA_LAUNCH_BLOCKING=1: the launch returns when the kernel ends (launch_blocking)
            clock.host = clock.t if clock.launch_blocking else host
            clock.kernels += 1
            if self.tape is not None:
                self.tape.append(seconds)
        return out

    def host_read(self) -> None:
        """The host reads a value: it waits for the stream's last kernel (not muted, not in an
        optimizer's step, whose step counters stay on the CPU under CUDA)."""
        clock = self.clock
        if not self._switched and not clock.muted_depth:
            clock.host = max(clock.host, clock.t)
            if self.tape is not None:
                self.tape.append(None)

    def _beside(self, start: float, seconds: float) -> float:
        """A kernel's seconds from ``start``: longer where a collective holds SMs meanwhile."""
        clock = self.clock
        if start < clock.sm_busy_until and type(seconds) is Tiles:
            return contended_end(start, seconds, clock.sm_windows, clock.cluster.hw.sm_count) - start
        return seconds

    def replay(self, tape) -> None:
        """The stream's time for a recorded run of ops (``tape``: each priced op's seconds, None
        where the host read a value), without running them: the arithmetic above, op by op."""
        clock, issue = self.clock, self.issue
        t, host, lane, blocking = clock.t, clock.host, clock.lane, clock.launch_blocking
        for seconds in tape:
            if seconds is None:
                host = max(host, t)
            else:
                if lane is None:
                    host = host + issue
                    start = t if t > host else host
                    if start < clock.sm_busy_until and type(seconds) is Tiles:
                        t = contended_end(start, seconds, clock.sm_windows, clock.cluster.hw.sm_count)
                    else:
                        t = start + seconds
                else:
                    host = lane.issue(host, issue)
                    start = max(t, host)
                    t = lane.place(start, self._beside(start, seconds))
                if blocking:
                    host = t
                clock.kernels += 1
        clock.t, clock.host = t, host


__all__ = ["op_time", "op_flops", "tensor_bytes", "ComputeStream", "HostCopies", "FREE"]
