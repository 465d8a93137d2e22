"""Two pipeline actions run as one overlapped pair on a rank's virtual clock: DualPipe's F&B.

DeepSeek-V3's DualPipe (technical report, Sec. 3.2.1, Figure 4) runs a forward chunk of one
micro-batch and a backward chunk of another together: while one waits for its MoE
all-to-all (dispatch, combine), the GPU computes the other. The arithmetic of each is
unchanged; only when its kernels run moves. ``RankClock.overlapped()`` prices that:

    with clock.overlapped() as pair:
        forward()          # the first action, from the pair's start
        pair.next()        # the second starts at the pair's start too
        backward()
    # clock.t: when the later of the two ends

Each action is a thread of its own (its compute stream's "now", its host issue chain, its
communication streams), both started at the pair's start. They share two resources, each a
:class:`KernelLane` (:class:`PairLanes`): the GPU's compute stream and the host that issues
the ops. The first action takes them as it comes, leaving gaps where it waits (its kernels
for a collective or a message, its host for a value it reads, such as an all-to-all's split
sizes); the second action's ops and kernels take the first gap that fits each (after its own
previous one: a thread's ops stay in order). So two actions whose host is the bottleneck
gain nothing, as on a GPU; DeepSeek's runtime issues the two chunks' pieces interleaved from
one host thread, which this reproduces op by op. Their collectives share the GPU's link
lanes (:mod:`.links`, as any two streams do).
"""
from __future__ import annotations

import bisect


class KernelLane:
    """The compute stream during an overlapped pair: its busy intervals, sorted, disjoint,
    merged where they touch (a run of kernels back to back is one interval)."""
    __slots__ = ("starts", "ends")

    def __init__(self):
        self.starts, self.ends = [], []

    EPS = 1e-12     # seconds: a gap that a kernel fills to within this is filled (float sums'
    #                 rounding: ten 2 us kernels in a 20 us gap must fit)

    def place(self, ready: float, seconds: float) -> float:
        """A kernel of ``seconds`` starts at the first time >= ``ready`` when the stream is free
        for that long; it is reserved there. Returns its end."""
        starts, ends, eps = self.starts, self.ends, self.EPS
        i = bisect.bisect_right(ends, ready)      # the first interval ending after ``ready``
        t = ready
        while i < len(starts) and starts[i] + eps < t + seconds:
            t = max(t, ends[i])
            i += 1
        end = t + seconds
        if seconds <= 0:
            return end
        # insert [t, end) before interval i, merged with the neighbours it touches
        if i > 0 and ends[i - 1] + eps >= t:
            i -= 1
            ends[i] = max(ends[i], end)
        else:
            starts.insert(i, t)
            ends.insert(i, end)
        if i + 1 < len(starts) and starts[i + 1] <= end + eps:
            ends[i] = max(ends[i], ends[i + 1])
            del starts[i + 1], ends[i + 1]
        return end

    def busy(self) -> float:
        return sum(e - s for s, e in zip(self.starts, self.ends))


class PairLanes:
    """The two resources the pair's actions share: the host that issues their ops (one op every
    ``launch_overhead``: :meth:`issue`) and the GPU's compute stream (:meth:`place`)."""
    __slots__ = ("host", "device")

    def __init__(self):
        self.host, self.device = KernelLane(), KernelLane()

    def issue(self, ready: float, seconds: float) -> float:
        """When the host has issued an op it could issue from ``ready`` on."""
        return self.host.place(ready, seconds)

    def place(self, ready: float, seconds: float) -> float:
        """When a kernel that could start at ``ready`` ends."""
        return self.device.place(ready, seconds)


class OverlappedPair:
    """``with clock.overlapped() as pair:`` (see the module doc)."""

    def __init__(self, clock):
        self.clock = clock

    def __enter__(self):
        c = self.clock
        if c.lane is not None:
            raise RuntimeError("overlapped pairs do not nest: this rank's clock is inside one already")
        c.settle()
        self.t0, self.host0, self.streams0 = c.t, c.host, dict(c.streams)
        self.ends, self.hosts, self.streams = [], [], {}
        c.lane = PairLanes()
        return self

    def _close_thread(self):
        c = self.clock
        c.settle()
        self.ends.append(c.t)
        self.hosts.append(c.host)
        for k, v in c.streams.items():
            self.streams[k] = max(self.streams.get(k, 0.0), v)

    def next(self) -> None:
        """The next action of the pair: from the pair's start, on its own streams."""
        self._close_thread()
        c = self.clock
        c.t, c.host = self.t0, self.host0
        c.streams.clear()
        c.streams.update(self.streams0)

    def __exit__(self, *exc):
        c = self.clock
        try:
            if exc[0] is None:
                self._close_thread()
                c.t, c.host = max(self.ends), max(self.hosts)
                c.streams.update(self.streams)
        finally:
            c.lane = None
        return False


__all__ = ["KernelLane", "PairLanes", "OverlappedPair"]
