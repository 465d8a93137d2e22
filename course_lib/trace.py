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
"""
from __future__ import annotations

import contextlib
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
    "pp", "cp", "ep", or a flattened "dp+cp"); "" when it belongs to none.
    """

    rank: int
    name: str
    kind: str
    start: float
    end: float
    dim: str = ""

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
        return time.perf_counter() - self.origin

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

    def add(self, name: str, kind: str, start: float, end: float, dim: str = "") -> None:
        """Record an interval measured elsewhere (times on this recorder's clock)."""
        if kind not in KINDS:
            raise ValueError(f"span kind must be one of {KINDS}, got {kind!r}")
        if not getattr(_thread_state, "muted", False):
            self.spans.append(Span(self.rank, name, kind, start, end, dim or ""))

    def close(self) -> None:
        if self._status is not None:
            self._status.close()
            self._status = None


# The recorder of *this process*. A rank is one process, so one recorder per
# process is the natural scope (like the default process group itself).
_recorder = Recorder()


def recorder() -> Recorder:
    return _recorder


def install(rec: Recorder) -> Recorder:
    """Make ``rec`` this process's recorder (the launcher does this in each rank)."""
    global _recorder
    _recorder = rec
    return rec


def span(name: str, kind: str = "compute", dim: str = ""):
    """Context manager recording a span on this process's recorder (``dim``: its mesh dimension)."""
    return _recorder.span(name, kind, dim)


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
    return _recorder.now()


def spans() -> list[Span]:
    """The spans recorded so far in this process."""
    return list(_recorder.spans)


def reset() -> None:
    """Forget the spans recorded so far (keeps the clock)."""
    _recorder.spans.clear()
