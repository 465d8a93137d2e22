"""One rank's process: started by :func:`~course_lib.launch.launch` (:func:`rank_main`, a fork
of the forkserver) or by ``torchrun`` (:func:`run_under_torchrun`, this process is the rank).

A forked rank writes its output to per-rank files, joins the process group through a
:class:`torch.distributed.FileStore` in the launch's private directory, runs ``fn`` (on the
wall clock or a virtual one) and reports each stage as a file the launcher watches: ``ready``
(the launcher's timeout for fn starts), ``result``, or ``error`` with the traceback. A
watchdog ends it if its launcher disappears.
"""
from __future__ import annotations

import atexit
import datetime
import multiprocessing as mp
import os
import pickle
import socket
import sys
import threading
import time
import traceback

import cloudpickle

from course_lib import trace as _trace
from course_lib.debug import postmortem as _debug   # flight recorder, desync check, which rank failed and where

BACKENDS = ("gloo", "nccl")
# Seconds allowed to start the ranks and build the process group. ``timeout`` counts
# from when every rank is ready, so a slow first start (the forkserver imports torch;
# spawn imports it in every rank) never eats into the time a learner gave fn.
STARTUP_TIMEOUT = 120.0


class LaunchResult(list):
    """The per-rank return values, in rank order, plus ``.spans`` and ``.elapsed``."""

    spans: list
    elapsed: float

    def spans_of(self, rank):
        return [s for s in self.spans if s.rank == rank]


def cpu_count() -> int:
    """Cores this process may use (respects affinity masks and containers)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def default_threads(world_size: int) -> int:
    return max(1, cpu_count() // world_size)


def loopback_interface() -> str:
    """Name of the loopback interface: 'lo' on Linux, 'lo0' on macOS/BSD."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):
        names = []
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return "lo0" if sys.platform == "darwin" else "lo"


def to_cpu(obj):
    """Move every tensor inside lists/tuples/dicts to the CPU (detached)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank_main(rank, world_size, backend, workdir, payload, threads, timeout, ifname, debug=((), None),
               environ=None):
    """Entry point of one rank process."""
    if environ is not None:   # the launcher's environment now, not the forkserver's at its start
        os.environ.clear()
        os.environ.update(environ)
    out_fd = os.open(os.path.join(workdir, f"out{rank}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    err_fd = os.open(os.path.join(workdir, f"err{rank}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")
    stacks = _debug.dump_stack_on_signal(workdir, rank)  # (a timeout asks for them: LaunchTimeout)
    _start_watchdog(timeout)

    def report(kind, data):
        path = os.path.join(workdir, f"{kind}{rank}")
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)  # atomic: the parent never reads half a file

    try:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
        os.environ["NCCL_SOCKET_IFNAME"] = ifname
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
        os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world_size)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        fn, args, kwargs, clock = cloudpickle.loads(payload)
        if clock is not None:   # every rank on this machine: the virtual clock's ready times go
            os.environ["COURSE_LIB_CLOCK_DIR"] = workdir   # through files here (course_lib.virtual.exchange)
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        init = dict(backend=backend, store=store, rank=rank, world_size=world_size,
                    timeout=datetime.timedelta(seconds=timeout + 30))
        if backend == "nccl":
            torch.cuda.set_device(rank)
            init["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(**init)
        dist.barrier()  # every rank leaves this together: the shared zero of the trace clock
        origin = None
        if sys.platform == "linux":  # one machine, one CLOCK_MONOTONIC: rank 0's reading is every rank's zero
            zero = torch.tensor([time.perf_counter()], dtype=torch.float64,  # (a barrier's exits are ms
                                device=init.get("device_id", "cpu"))         # apart under load)
            dist.broadcast(zero, 0)
            origin = float(zero)
        rec = _trace.install(_trace.Recorder(rank, origin=origin, status_path=os.path.join(workdir, f"status{rank}")))
        if backend == "nccl" and clock is None:
            rec.gpu = _trace.CudaEventClock()  # spans in measured GPU time
        report("ready", b"")  # the launcher's timeout for fn starts now
        with _debug.in_rank(workdir, rank, debug):
            result = to_cpu(_run(fn, args, kwargs, clock, rank, world_size, rec))
        try:
            data = cloudpickle.dumps((result, rec.resolve()))
        except Exception as exc:
            raise TypeError(f"the value returned by rank {rank} cannot be pickled "
                            f"({type(result).__name__}): {exc}") from exc
        report("returned", b"")
        dist.barrier()  # nobody tears down the group while a peer may still receive from it
        report("result", data)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        sys.stdout.flush()
        sys.stderr.flush()
        report("error", pickle.dumps({
            "time": time.time(),
            "type": getattr(exc, "launch_as", None) or type(exc).__name__,  # (a builtin: RankError[it])
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        }))
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: fast, and cannot hang in a destructor


def _run(fn, args, kwargs, clock, rank, world_size, rec):
    """fn on the wall clock, or inside this rank's virtual clock (its spans in virtual seconds)."""
    if clock is None:
        return fn(*args, **kwargs)
    rec.clock = clock.start(rank, world_size, rec)
    with rec.clock:
        return fn(*args, **kwargs)


def _start_watchdog(timeout):
    """Kill this rank if its launcher disappears or the run overstays by far."""
    parent, launcher = os.getppid(), mp.parent_process()   # the forkserver; the launcher
    hard_deadline = time.monotonic() + STARTUP_TIMEOUT + timeout + 60

    def watch():
        while True:
            time.sleep(0.5)
            if (os.getppid() != parent or time.monotonic() > hard_deadline
                    or (launcher is not None and not launcher.is_alive())):
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="course_lib-watchdog").start()


def run_under_torchrun(fn, world_size, args, kwargs, backend, timeout, clock=None, debug=((), None)):
    """torchrun started this process as one rank: run fn here, return all ranks' results."""
    import torch
    import torch.distributed as dist

    env_world = int(os.environ["WORLD_SIZE"])
    if world_size is not None and world_size != env_world:
        raise ValueError(f"launch(world_size={world_size}) under torchrun with WORLD_SIZE={env_world}: "
                         f"pass world_size=None or match --nproc_per_node * --nnodes")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of {BACKENDS}")
    if clock is not None:
        clock.check(env_world)
    if not dist.is_initialized():
        init = dict(backend=backend, timeout=datetime.timedelta(seconds=timeout))
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise RuntimeError("backend='nccl' under torchrun but this process sees no CUDA device")
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)
            init["device_id"] = torch.device("cuda", local)
        dist.init_process_group(**init)
        # We created the group, so we tear it down; a live gloo group at interpreter
        # exit aborts the process ("terminate called without an active exception").
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    rank = dist.get_rank()
    dist.barrier()
    rec = _trace.install(_trace.Recorder(rank))
    if backend == "nccl" and clock is None:
        rec.gpu = _trace.CudaEventClock()  # spans in measured GPU time (CUDA events)
    started = time.perf_counter()
    with _debug.in_rank(None, rank, debug):   # (the ring in memory: no launcher reads it)
        value = to_cpu(_run(fn, args, kwargs, clock, rank, env_world, rec))
    rec.clock = None
    spans = rec.resolve()
    rec.gpu = None
    gathered = [None] * env_world
    dist.all_gather_object(gathered, (value, spans))
    results = LaunchResult(v for v, _ in gathered)
    results.spans = [s for _, spans in gathered for s in spans]
    results.elapsed = time.perf_counter() - started
    return results


__all__ = ["BACKENDS", "STARTUP_TIMEOUT", "LaunchResult", "cpu_count", "default_threads", "loopback_interface",
           "to_cpu", "under_torchrun", "rank_main", "run_under_torchrun"]
