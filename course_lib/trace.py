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
import os
import time
from dataclasses import dataclass

KINDS = ("compute", "comm", "idle", "other")


@dataclass(frozen=True)
class Span:
    """One interval on one rank. Times are seconds on the launch's shared clock."""

    rank: int
    name: str
    kind: str
    start: float
    end: float

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
        self._status_fd = os.open(status_path, os.O_WRONLY | os.O_CREAT, 0o600) if status_path else None

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def _publish(self) -> None:
        if self._status_fd is None:
            return
        text = (self._open[-1] if self._open else "").encode("utf-8", "replace")[:255]
        os.pwrite(self._status_fd, text.ljust(256, b"\0"), 0)

    @contextlib.contextmanager
    def span(self, name: str, kind: str = "compute"):
        if kind not in KINDS:
            raise ValueError(f"span kind must be one of {KINDS}, got {kind!r}")
        self._open.append(f"{name} [{kind}]")
        self._publish()
        start = self.now()
        try:
            yield
        finally:
            self.spans.append(Span(self.rank, name, kind, start, self.now()))
            self._open.pop()
            self._publish()

    def add(self, name: str, kind: str, start: float, end: float) -> None:
        """Record an interval measured elsewhere (times on this recorder's clock)."""
        if kind not in KINDS:
            raise ValueError(f"span kind must be one of {KINDS}, got {kind!r}")
        self.spans.append(Span(self.rank, name, kind, start, end))

    def close(self) -> None:
        if self._status_fd is not None:
            os.close(self._status_fd)
            self._status_fd = None


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


def span(name: str, kind: str = "compute"):
    """Context manager recording a span on this process's recorder."""
    return _recorder.span(name, kind)


def now() -> float:
    """Seconds on this rank's (launch-aligned) clock."""
    return _recorder.now()


def spans() -> list[Span]:
    """The spans recorded so far in this process."""
    return list(_recorder.spans)


def reset() -> None:
    """Forget the spans recorded so far (keeps the clock)."""
    _recorder.spans.clear()
