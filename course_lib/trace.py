"""Per-rank wall-clock spans: what each rank was doing, and when.

Inside a rank::

    from course_lib.trace import span
    with span("all_reduce grads", kind="comm"):
        dist.all_reduce(grad)

records one :class:`Span`. The launcher collects the spans of every rank and
returns them with the results (``launch(...).spans``), on one clock: each rank
measures time from the same barrier right after the process group is built, so
rank 0's ``t=0.010`` and rank 3's ``t=0.010`` are the same instant.

``viz.timeline`` draws spans; the planner's simulator produces the same
:class:`Span` objects, so a measured and a simulated step look alike.

Under ``launch(..., clock=VirtualCluster(...))`` a rank's recorder reads the virtual GPU
clock (:mod:`course_lib.virtual`) instead of ``perf_counter``: the same spans, in
modelled seconds. On GPUs (``backend="nccl"``, under ``launch`` or ``torchrun``) it reads
the GPU itself: :class:`CudaEventClock` records a CUDA event at each span's ends, on the
stream the work runs on, so the spans report measured GPU time, not when Python issued it.
:func:`to_chrome_trace` writes spans of any clock as Chrome trace JSON (ui.perfetto.dev,
chrome://tracing).
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import threading
import time
from dataclasses import dataclass

KINDS = ("compute", "comm", "idle", "other")
_thread_state = threading.local()  # .muted: spans of this thread are not recorded


@dataclass(frozen=True)
class Span:
    """One interval on one rank. Times are seconds on the launch's shared clock.

    ``dim`` names the mesh dimension a communication span belongs to ("dp", "tp",
    "pp", "cp", "ep", or a flattened "dp+cp"); "" when it belongs to none. ``flow`` ties a
    message's two ends (virtual clock): "send:ID" on the sender's span, "recv:ID" on the
    receiver's.
    """

    rank: int
    name: str
    kind: str
    start: float
    end: float
    dim: str = ""
    flow: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


class Recorder:
    """Collects the spans of one process.

    One recorder lives in each rank process (the launcher installs it); the
    status file, when given, always holds the innermost open span's name so the
    launcher can say what a stuck rank was doing.
    """

    def __init__(self, rank: int = 0, origin: float | None = None, status_path: str | None = None):
        self.rank = rank
        self.origin = time.perf_counter() if origin is None else origin
        self.clock = None         # a virtual clock (``.now()``) replaces perf_counter when set
        self.gpu = None           # a CudaEventClock: times are CUDA events, read by resolve()
        self.spans: list[Span] = []
        self._open: list[str] = []
        self._status = None       # the status file mapped in memory: publishing is a copy, not a syscall
        if status_path:
            fd = os.open(status_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, 256)
                self._status = mmap.mmap(fd, 256)
            finally:
                os.close(fd)

    def now(self) -> float:
        if self.clock is not None:
            return self.clock.now()
        if self.gpu is not None:
            return self.gpu.now()  # a CudaStamp: a float once the GPU has passed it
        return time.perf_counter() - self.origin

    def resolve(self) -> list[Span]:
        """The spans with every time a float (CUDA events read once the GPU has passed them;
        the virtual clock's async collectives priced)."""
        if self.clock is not None and hasattr(self.clock, "settle"):
            self.clock.settle()
        if self.gpu is not None and self.spans:
            self.gpu.synchronize()
            self.spans[:] = [s if isinstance(s.start, float) and isinstance(s.end, float)
                             else Span(s.rank, s.name, s.kind, float(s.start), float(s.end), s.dim, s.flow)
                             for s in self.spans]
        return self.spans

    def _publish(self) -> None:
        if self._status is None:
            return
        text = (self._open[-1] if self._open else "").encode("utf-8", "replace")[:255]
        self._status[:] = text.ljust(256, b"\0")

    @contextlib.contextmanager
    def span(self, name: str, kind: str = "compute", dim: str = ""):
        if kind not in KINDS:
            raise ValueError(f"span kind must be one of {KINDS}, got {kind!r}")
        entry = f"{name} [{kind}]"
        self._open.append(entry)
        self._publish()
        start = self.now()
        try:
            yield
        finally:
            if not getattr(_thread_state, "muted", False):
                self.spans.append(Span(self.rank, name, kind, start, self.now(), dim or ""))
            # a communication thread may have opened a span meanwhile: drop this one's entry
            for i in range(len(self._open) - 1, -1, -1):
                if self._open[i] == entry:
                    del self._open[i]
                    break
            self._publish()

    def add(self, name: str, kind: str, start: float, end: float, dim: str = "", flow: str = "") -> None:
        """Record an interval measured elsewhere (times on this recorder's clock)."""
        if kind not in KINDS:
            raise ValueError(f"span kind must be one of {KINDS}, got {kind!r}")
        if not getattr(_thread_state, "muted", False):
            self.spans.append(Span(self.rank, name, kind, start, end, dim or "", flow))

    def close(self) -> None:
        if self._status is not None:
            self._status.close()
            self._status = None


class CudaStamp:
    """A point on a rank's GPU stream (a recorded CUDA event): a time in seconds since the
    clock's origin once the GPU has passed it (``float(stamp)``, ``stamp - other``)."""
    __slots__ = ("event", "clock")

    def __init__(self, event, clock):
        self.event, self.clock = event, clock

    def __float__(self) -> float:
        return self.clock.seconds(self.event)

    def __sub__(self, other) -> float:
        return float(self) - float(other)

    def __rsub__(self, other) -> float:
        return float(other) - float(self)

    def __lt__(self, other) -> bool:
        return float(self) < float(other)

    def __gt__(self, other) -> bool:
        return float(self) > float(other)

    def __repr__(self) -> str:
        return "CudaStamp(pending)"


class CudaEventClock:
    """Measured GPU time for spans (``launch``/``torchrun`` with ``backend="nccl"``).

    ``now()`` records a CUDA event on the current stream and returns it: the span's end is
    when the GPU finishes the work issued before it, not when Python returned. A collective's
    span ends on the stream torch synchronises with the collective (its ``wait()``, or the
    callback of its future), so it covers the transfer. The origin is an event recorded
    right after the launch's barrier, with the device idle, on every rank: the ranks' zeros
    agree to within the barrier's skew (microseconds on one node). Reading a time waits for
    the GPU, so it happens once, when the spans are collected (``Recorder.resolve``).

    ``event`` and ``synchronize``: the CUDA calls (a test passes stand-ins on a CPU)."""

    def __init__(self, event=None, synchronize=None):
        if event is None:
            import torch
            event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
            synchronize = synchronize or torch.cuda.synchronize
        self._event, self.synchronize = event, synchronize or (lambda: None)
        self.synchronize()
        self.origin = self._record()

    def _record(self):
        ev = self._event()
        ev.record()
        return ev

    def now(self) -> CudaStamp:
        return CudaStamp(self._record(), self)

    def seconds(self, event) -> float:
        self.origin.synchronize()
        event.synchronize()
        return self.origin.elapsed_time(event) / 1e3  # (milliseconds)


# The recorder of *this process*. A rank is one process, so one recorder per
# process is the natural scope (like the default process group itself). A thread may
# install one of its own (``install_thread``): the dry run (course_lib.virtual.dry_run)
# drives several pipeline stages, each a rank with its own clock, from threads of one process.
_recorder = Recorder()


def recorder() -> Recorder:
    return getattr(_thread_state, "recorder", None) or _recorder


def install(rec: Recorder) -> Recorder:
    """Make ``rec`` this process's recorder (the launcher does this in each rank)."""
    global _recorder
    _recorder = rec
    return rec


def install_thread(rec: Recorder | None) -> Recorder | None:
    """Make ``rec`` this thread's recorder (None: the process's again)."""
    _thread_state.recorder = rec
    return rec


def span(name: str, kind: str = "compute", dim: str = ""):
    """Context manager recording a span on this process's recorder (``dim``: its mesh dimension)."""
    return recorder().span(name, kind, dim)


@contextlib.contextmanager
def muted():
    """Spans opened by this thread inside are not recorded (a caller records one of its own)."""
    previous = getattr(_thread_state, "muted", False)
    _thread_state.muted = True
    try:
        yield
    finally:
        _thread_state.muted = previous


def now() -> float:
    """Seconds on this rank's (launch-aligned) clock."""
    return recorder().now()


def clock():
    """This process's virtual clock (``launch(..., clock=...)``), or None on the wall clock."""
    return recorder().clock


def spans() -> list[Span]:
    """The spans recorded so far in this process."""
    return list(recorder().resolve())


def reset() -> None:
    """Forget the spans recorded so far (keeps the clock)."""
    recorder().spans.clear()


def to_chrome_trace(spans, path=None) -> dict:
    """Spans as Chrome trace JSON (``traceEvents``; written to ``path`` when given).

    One process per rank (``pid`` = rank); on it, one thread for compute (and idle, other),
    one per mesh dimension's communication (``tid`` named "comm dp", "comm tp", ...; "comm"
    without a dimension). Complete events (``ph`` "X", ``ts``/``dur`` in microseconds); a
    message's two ends (``Span.flow``) become a flow arrow from its send to its receive.
    """
    spans = sorted(spans, key=lambda s: (s.rank, s.start, s.end, s.name))
    lanes, events = {}, []

    def tid(s):
        lane = f"comm {s.dim}".strip() if s.kind == "comm" else "compute"
        if (s.rank, lane) not in lanes:
            lanes[s.rank, lane] = len([k for k in lanes if k[0] == s.rank])
            events.append({"ph": "M", "name": "thread_name", "pid": s.rank, "tid": lanes[s.rank, lane],
                           "args": {"name": lane}})
        return lanes[s.rank, lane]

    for r in sorted({s.rank for s in spans}):
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
    flow_ids = {}
    for s in spans:
        base = {"name": s.name, "cat": s.kind, "pid": s.rank, "tid": tid(s), "ts": s.start * 1e6}
        events.append({**base, "ph": "X", "dur": (s.end - s.start) * 1e6, "args": {"dim": s.dim}})
        side, _, key = getattr(s, "flow", "").partition(":")
        if side in ("send", "recv") and key:
            ident = flow_ids.setdefault(key, len(flow_ids) + 1)
            bind = {"bp": "e"} if side == "recv" else {}    # the arrow ends on the receive's slice
            events.append({**base, "ph": "s" if side == "send" else "f", "cat": "message", "name": "message",
                           "id": ident, **bind})
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f)
    return trace
