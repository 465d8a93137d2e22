"""The members' ready times of a collective: exchanged through shared memory when every rank
of the launch runs on this machine, else by a 16-byte MAX all-reduce on the group's backend.

Each collective the virtual clock prices needs the members' latest ready time and largest
payload (:meth:`course_lib.virtual.clock.RankClock.collective`). On the group's gloo backend
that is a tiny all-reduce beside the real one: 100-400 us of CPU a collective (gloo's
messages and threads), the larger part of the clock's own cost in a program of many small
collectives. The ranks that :func:`course_lib.launch.launch` starts all run on this machine
and share a directory (the launch's, named in ``COURSE_LIB_CLOCK_DIR``): there each group has a
file that every member maps, holding a ring of ``RING`` slots per member. The member's k-th
exchange on the group writes (ready, nbytes) into its slot ``k % RING`` and then stamps it
with ``k``; a reader takes the MAX over the members' slot ``k`` once every stamp reads ``k``.

Why a slot is never overwritten before every member has read it: a member reads exchange k
(``result``) before it writes exchange k+1 on the group (the clock's ``settle`` runs at the
start of every ``issue`` and ``collective``, and a blocking collective reads its exchange
before it returns; point-to-point messages carry their times in their own bytes and never
exchange). So when member A writes exchange k+RING into slot k % RING, it has read exchange
k+RING-1, so every member B had written k+RING-1, so B had already read exchange
k+RING-2 >= k: every member's read of A's slot k is done. RING = 2 would do; 4 is margin.

Why the stamp can be trusted: ready and nbytes are stored before the stamp, each an aligned
8-byte store (a numpy element assignment: one ``mov``); x86-64 is TSO (stores become visible
in program order, loads are not reordered with older loads), so a reader that sees stamp k
and then loads the values reads exchange k's. Other architectures would need fences: there,
and where no directory is shared (ranks under torchrun, possibly on several machines), the
exchange stays the backend's all-reduce. Both give the same two float64 maxima bit for bit.
"""
from __future__ import annotations

import hashlib
import os
import platform
import time

import numpy as np
import torch
import torch.distributed as dist

ENV = "COURSE_LIB_CLOCK_DIR"   # the launch's directory, set in each rank by course_lib.launch
RING = 4                        # slots per (member, group): see the module's docstring
TIMEOUT = 300.0                 # seconds a reader waits for a member's stamp
_FIELDS = 4                     # float64 per slot: stamp, ready, nbytes, (padding)
_TSO = platform.machine().lower() in ("x86_64", "amd64")


class GlooExchange:
    """The exchange as a MAX all-reduce of two float64 on the group's backend (async)."""
    __slots__ = ("work", "tensor")

    def __init__(self, comm, ready: float, nbytes: float):
        self.tensor = torch.tensor([ready, float(nbytes)], dtype=torch.float64, device=comm.backend_device)
        opts = dist.AllreduceOptions()
        opts.reduceOp, opts.asyncOp = dist.ReduceOp.MAX, True
        group = comm.group if comm.group is not None else dist.group.WORLD
        self.work = group.allreduce([self.tensor], opts)   # (torch's all_reduce adds only checks)

    def result(self) -> tuple[float, float]:
        """(the latest ready time, the largest payload) over the members."""
        self.work.wait()
        start, nbytes = self.tensor.tolist()
        return start, nbytes


class _Channel:
    """One group's file: ``RING`` slots per member; this member's count of exchanges on it."""
    __slots__ = ("slots", "me", "seq", "name", "ranks")

    def __init__(self, path: str, size: int, me: int, name: str, ranks):
        nbytes = size * RING * _FIELDS * 8
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < nbytes:   # (every member may: the same length, no data lost)
                os.ftruncate(fd, nbytes)
            buf = np.memmap(path, dtype=np.float64, mode="r+", shape=(size, RING, _FIELDS))
        finally:
            os.close(fd)
        self.slots, self.me, self.seq, self.name, self.ranks = buf, me, 0, name, tuple(ranks)


class SharedExchange:
    """Exchange k on one channel: written at issue, read by :meth:`result`."""
    __slots__ = ("channel", "k", "timeout")

    def __init__(self, channel: _Channel, ready: float, nbytes: float, timeout: float):
        channel.seq = k = channel.seq + 1
        mine = channel.slots[channel.me, k % RING]
        mine[1] = ready          # the values first,
        mine[2] = float(nbytes)
        mine[0] = k              # the stamp last (see the module's docstring)
        self.channel, self.k, self.timeout = channel, k, timeout

    def result(self) -> tuple[float, float]:
        channel, k = self.channel, self.k
        block = channel.slots[:, k % RING]
        stamps = block[:, 0]
        if not (stamps == k).all():
            self._wait(stamps)
        values = block[:, 1:3].max(axis=0)    # (loaded after the stamps)
        return float(values[0]), float(values[1])

    def _wait(self, stamps) -> None:
        deadline, pause = time.monotonic() + self.timeout, 0.0
        while not (stamps == self.k).all():
            if time.monotonic() > deadline:
                c = self.channel
                missing = [c.ranks[i] for i in range(len(c.ranks)) if stamps[i] != self.k]
                raise TimeoutError(
                    f"virtual clock: rank {c.ranks[c.me]} waited {self.timeout:g} s for the ready times of "
                    f"collective #{self.k} on group {c.name} (ranks {list(c.ranks)}): rank(s) {missing} "
                    f"never issued it (their last on this group: "
                    f"{[int(stamps[c.ranks.index(r)]) for r in missing]})")
            time.sleep(pause)      # (yield first, then back off: spinning would take the CPU
            pause = min(2 * pause or 1e-5, 1e-3)   # from the very members it waits for)


class Exchanges:
    """This process's shared-memory channels, one per group (or None: the backend's exchange)."""

    def __init__(self, directory: str, timeout: float = TIMEOUT):
        self.directory, self.timeout, self._channels = directory, timeout, {}

    def issue(self, comm, ready: float, nbytes: float) -> SharedExchange:
        channel = self._channels.get(comm.group)
        if channel is None:
            channel = self._channels[comm.group] = self._open(comm)
        return SharedExchange(channel, ready, nbytes, self.timeout)

    def _open(self, comm) -> _Channel:
        # a name every member computes alike: the process group's (new_group names groups
        # alike on every rank) and its global ranks (exchanges on one group are ordered alike)
        name = "world" if comm.group is None else str(getattr(comm.group, "group_name", "") or "")
        key = f"{name}|{','.join(map(str, comm.ranks))}"
        path = os.path.join(self.directory, "clock-" + hashlib.sha1(key.encode()).hexdigest()[:20])
        return _Channel(path, comm.size, comm.rank, name or "?", comm.ranks)


_SHARED: dict = {}


def shared() -> Exchanges | None:
    """This process's channels when the launch shares a directory (and stores are TSO), else None.
    Per process, not per clock: the counts must follow the group's exchanges, however many
    clocks a rank starts."""
    directory = os.environ.get(ENV)
    found = _SHARED.get(directory)
    if found is None and directory and _TSO and os.path.isdir(directory):
        found = _SHARED[directory] = Exchanges(directory)
    return found


def exchange(comm, ready: float, nbytes: float):
    """The members' (latest ready time, largest payload) of one collective: ``.result()``."""
    ex = shared()
    if ex is None:
        return GlooExchange(comm, ready, nbytes)
    return ex.issue(comm, ready, nbytes)


__all__ = ["exchange", "shared", "Exchanges", "GlooExchange", "SharedExchange", "ENV", "RING"]
