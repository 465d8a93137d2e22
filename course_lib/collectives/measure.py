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
``builtin_model`` says which alpha-beta formula each follows (found by counting
the bytes gloo writes to its sockets, ``bytes_written``: gloo's reduce-scatter
sends as much as an all-reduce).
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from course_lib import compat


def time_ops(ops: dict, reps: int = 5, warmup: int = 1, group=None) -> dict:
    """Time zero-argument callables on every rank; {name: [seconds of the slowest rank, per rep]}."""
    names = list(ops)
    for f in ops.values():
        for _ in range(warmup):
            f()
    times = torch.zeros(len(names), reps, dtype=torch.float64)
    for i in range(reps):
        for j, name in enumerate(names):
            dist.barrier(group)
            start = time.perf_counter()
            ops[name]()
            times[j, i] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return {name: times[j].tolist() for j, name in enumerate(names)}


def median(xs) -> float:
    return statistics.median(xs)


# collective -> the costmodel formula gloo's implementation follows, and what n means
BUILTIN_MODEL = {
    "all_reduce": "ring_all_reduce",            # n = the tensor
    "all_gather": "ring_all_gather",            # n = the gathered output
    "reduce_scatter": "ring_all_reduce",        # n = the input: gloo all-reduces, then keeps a piece
    "broadcast": "tree_broadcast",              # n = the tensor (binomial tree: root sends log2 N times)
}


def builtin_ops(n_bytes: int, collectives=("all_reduce",), group=None, dtype=torch.float32) -> dict:
    """gloo's collectives on buffers of ``n_bytes`` (the model's n), as zero-argument callables."""
    N = dist.get_world_size(group)
    esize = torch.empty(0, dtype=dtype).element_size()
    numel = max(N, n_bytes // esize // N * N)  # divisible by N for the tensor forms
    x = torch.ones(numel, dtype=dtype)
    piece = torch.ones(numel // N, dtype=dtype)
    out_full, out_piece = torch.empty(numel, dtype=dtype), torch.empty(numel // N, dtype=dtype)
    make = {
        "all_reduce": lambda: dist.all_reduce(x, group=group),
        "all_gather": lambda: compat.all_gather_into_tensor(out_full, piece, group=group),
        "reduce_scatter": lambda: compat.reduce_scatter_tensor(out_piece, x, group=group),
        "broadcast": lambda: dist.broadcast(x, src=compat.global_rank(group, 0), group=group),
    }
    return {c: make[c] for c in collectives}


def measure_builtin(sizes, collectives=("all_reduce",), reps: int = 5, warmup: int = 1, group=None,
                    stat: str = "median"):
    """Inside ranks: costmodel Measurement rows of gloo's collectives.

    ``stat``: "median" of ``reps`` (what a run typically takes) or "min" (the
    machine's capability, least disturbed by other programs).
    """
    from course_lib.costmodel import Measurement

    reduce_times = {"median": median, "min": min}[stat]
    N = dist.get_world_size(group)
    rows = []
    for n in sizes:
        ops = builtin_ops(n, collectives, group)
        for name, ts in time_ops(ops, reps, warmup, group).items():
            rows.append(Measurement(BUILTIN_MODEL[name], n, N, reduce_times(ts)))
    return rows


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


def bytes_written() -> int | None:
    """Bytes this process has passed to write/send system calls (Linux /proc/self/io ``wchar``).

    Gloo writes through sockets from its own threads; their bytes count too. None
    where /proc is not available (macOS, Windows).
    """
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def bytes_sent_by(fn, group=None) -> int | None:
    """Bytes this rank writes while ``fn()`` runs (barriers around it keep others' traffic out)."""
    dist.barrier(group)
    before = bytes_written()
    fn()
    after = bytes_written()
    dist.barrier(group)
    return None if before is None or after is None else after - before


__all__ = ["time_ops", "median", "BUILTIN_MODEL", "builtin_ops", "measure_builtin", "simulated_link",
           "bytes_written", "bytes_sent_by"]
