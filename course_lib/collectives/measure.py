"""Timing collectives honestly, across ranks (used by benchmarks/, the notebooks and the fit).

    times = time_ops({"ours": lambda: ring.all_reduce(x), "gloo": lambda: dist.all_reduce(x)}, reps=7)
    # inside ranks: {name: [seconds per repetition]}, identical on every rank

* Contestants run **interleaved** (ours, gloo, ours, gloo, ...), so a burst of
  load from elsewhere hits both alike instead of one of them.
* Each repetition starts from a barrier and counts the **slowest rank** (one
  all-reduce(MAX) at the end): a collective is done when its last rank is.
* Report medians; the first ``warmup`` calls (buffer allocation, connection
  setup) are not timed.

``builtin_ops`` gives gloo's own collectives in the same shape as ours, and
``BUILTIN_MODEL`` says which alpha-beta formula each follows, found by counting what
gloo writes to its sockets: the bytes (``bytes_written``; gloo's reduce-scatter sends
as much as an all-reduce) and the write system calls (``writes_made``; gloo's
all-reduce sends 1 MiB segments, at least two per rank, three writes each).

Everything here runs inside ranks; ``course_lib.lab.measure.sweep_builtin`` starts them
(over sizes and world sizes, in several rounds, keeping each point's fastest round with
:func:`fastest`; ``realtime_priority`` where the OS allows it).
"""
from __future__ import annotations

import contextlib
import random
import statistics
import time

import torch
import torch.distributed as dist

from course_lib import compat


def time_ops(ops: dict, reps: int = 5, warmup: int = 1, group=None, shuffle: bool = False) -> dict:
    """Time zero-argument callables on every rank; {name: [seconds of the slowest rank, per rep]}.

    ``shuffle``: each repetition runs the contestants in its own order (the same on every
    rank: a permutation seeded by the repetition's number), so none is always first after
    the barrier or always right after the same other contestant: the first call of a
    repetition was seen to pay up to a tenth more than the others on 2 cores."""
    names = list(ops)
    for f in ops.values():
        for _ in range(warmup):
            f()
    times = torch.zeros(len(names), reps, dtype=torch.float64, device=compat.backend_device(group))
    for i in range(reps):
        order = list(enumerate(names))
        if shuffle:
            random.Random(i).shuffle(order)
        for j, name in order:
            dist.barrier(group)
            start = time.perf_counter()
            ops[name]()
            times[j, i] = time.perf_counter() - start       # (a GPU's ops: synchronize in ops[name])
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return {name: times[j].tolist() for j, name in enumerate(names)}


def median(xs) -> float:
    return statistics.median(xs)


def paired_ratio(ours, theirs) -> float:
    """The median over repetitions of ours[i] / theirs[i]: two contestants timed in the same
    repetition (interleaved) shared its load, so each pair's ratio cancels most of it."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired_ratio needs two equally long, non-empty lists, got {len(ours)} and {len(theirs)}")
    return statistics.median(a / b for a, b in zip(ours, theirs))


# collective -> the costmodel formula gloo's implementation follows, and what n means
BUILTIN_MODEL = {
    "all_reduce": "segmented_ring_all_reduce",  # n = the tensor; 1 MiB segments, >= 2 per rank
    "all_gather": "ring_all_gather",            # n = the gathered output
    "reduce_scatter": "ring_all_reduce",        # n = the input: gloo all-reduces, then keeps a piece
    "broadcast": "tree_broadcast",              # n = the tensor (binomial tree: root sends log2 N times)
}


def builtin_ops(n_bytes: int, collectives=("all_reduce",), group=None, dtype=torch.float32) -> dict:
    """gloo's collectives on buffers of ``n_bytes`` (the model's n), as zero-argument callables."""
    N = dist.get_world_size(group)
    numel = max(N, n_bytes // dtype.itemsize // N * N)  # divisible by N for the tensor forms
    device = compat.backend_device(group)
    x = torch.ones(numel, dtype=dtype, device=device)
    piece = torch.ones(numel // N, dtype=dtype, device=device)
    out_full, out_piece = x.new_empty(numel), x.new_empty(numel // N)
    make = {
        "all_reduce": lambda: dist.all_reduce(x, group=group),
        "all_gather": lambda: compat.all_gather_into_tensor(out_full, piece, group=group),
        "reduce_scatter": lambda: compat.reduce_scatter_tensor(out_piece, x, group=group),
        "broadcast": lambda: dist.broadcast(x, src=compat.global_rank(group, 0), group=group),
    }
    return {c: make[c] for c in collectives}


def stat_of(name: str):
    """The statistic a measurement keeps of its repetitions: "median" or "min"."""
    stats = {"median": median, "min": min}
    if name not in stats:
        raise ValueError(f"stat must be one of {sorted(stats)}, got {name!r}")
    return stats[name]


def measure_builtin(sizes, collectives=("all_reduce",), reps: int = 5, warmup: int = 1, group=None,
                    stat: str = "median"):
    """Inside ranks: costmodel Measurement rows of gloo's collectives.

    ``stat``: "median" of ``reps`` (what a run typically takes) or "min" (the
    machine's capability, least disturbed by other programs).
    """
    from course_lib.costmodel import Measurement

    reduce_times = stat_of(stat)
    N = dist.get_world_size(group)
    rows = []
    for n in sizes:
        ops = builtin_ops(n, collectives, group)
        for name, ts in time_ops(ops, reps, warmup, group).items():
            rows.append(Measurement(BUILTIN_MODEL[name], n, N, reduce_times(ts)))
    return rows


def fastest(rows) -> list:
    """One Measurement per (algorithm, size, world size): the fastest, in first-seen order."""
    best = {}
    for m in rows:
        key = (m.algorithm, m.n_bytes, m.world_size)
        if key not in best or m.seconds < best[key].seconds:
            best[key] = m
    return list(best.values())


@contextlib.contextmanager
def realtime_priority(enabled: bool = True, priority: int = 1):
    """Inside a rank: run all of this process's threads (gloo's too) under SCHED_FIFO.

    Yields whether it was granted. Under the normal (fair) scheduler, a rank whose
    message has arrived may wait for a core while other ranks' threads run, and gloo's
    network thread polls; with more ranks than cores those waits, not the
    alpha-beta link, dominate small messages and vary from run to run. Real-time
    scheduling runs a woken rank at once. Needs root or CAP_SYS_NICE (Linux); elsewhere
    yields False and changes nothing. The previous policy is restored on exit.
    """
    import os

    tids = []
    if enabled and hasattr(os, "sched_setscheduler"):
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
            before = {t: (os.sched_getscheduler(t), os.sched_getparam(t)) for t in tids}
            for t in tids:
                os.sched_setscheduler(t, os.SCHED_FIFO, os.sched_param(priority))
        except OSError:                                  # PermissionError: not root, no CAP_SYS_NICE
            for t in tids:
                with contextlib.suppress(OSError):
                    os.sched_setscheduler(t, os.SCHED_OTHER, os.sched_param(0))
            tids = []
    try:
        yield bool(tids)
    finally:
        for t in tids:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(t, *before[t])


@contextlib.contextmanager
def simulated_link(alpha: float, beta: float):
    """Inside a rank: give it a virtual network link of latency ``alpha`` s and ``1/beta`` B/s.

    Every ``isend`` of our collectives first sleeps ``alpha + bytes * beta`` (the
    time the message would occupy this rank's link), as a NIC would. Sleeping uses
    no CPU, so ranks on different links really run in parallel, as on a cluster;
    on a laptop the loopback "network" is the CPU copying bytes, which all ranks
    share. Affects course_lib's collectives (they send through ``dist.isend``),
    not gloo's built-ins.
    """
    original = dist.isend

    def isend(tensor, *args, **kwargs):
        time.sleep(alpha + tensor.numel() * tensor.element_size() * beta)
        return original(tensor, *args, **kwargs)

    dist.isend = isend
    try:
        yield
    finally:
        dist.isend = original


def last_level_cache_bytes() -> int | None:
    """Size of this machine's largest CPU cache (Linux sysfs, then glibc's sysconf); None if unknown."""
    import glob
    import os

    best = None
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(index, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text.rstrip("KMGkmg")
        if digits.isdigit():
            best = max(best or 0, int(digits) * unit)
    if best is None:
        for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
            try:
                size = os.sysconf(name)
            except (ValueError, OSError, AttributeError):
                continue
            if size and size > 0:
                return int(size)
    return best


def _proc_io(field: str) -> int | None:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def bytes_written() -> int | None:
    """Bytes this process has passed to write/send system calls (Linux /proc/self/io ``wchar``).

    Gloo writes through sockets from its own threads; their bytes count too. None
    where /proc is not available (macOS, Windows).
    """
    return _proc_io("wchar")


def writes_made() -> int | None:
    """Write system calls this process has made (Linux /proc/self/io ``syscw``); None elsewhere."""
    return _proc_io("syscw")


def bytes_sent_by(fn, group=None) -> int | None:
    """Bytes this rank writes while ``fn()`` runs (barriers around it keep others' traffic out)."""
    dist.barrier(group)
    before = bytes_written()
    fn()
    after = bytes_written()
    dist.barrier(group)
    return None if before is None or after is None else after - before


__all__ = ["time_ops", "median", "paired_ratio", "BUILTIN_MODEL", "builtin_ops", "measure_builtin", "stat_of", "fastest",
           "realtime_priority", "simulated_link", "bytes_written", "writes_made", "bytes_sent_by", "last_level_cache_bytes"]
