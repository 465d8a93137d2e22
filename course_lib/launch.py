"""Run a function on N real ranks from a notebook cell, a script or ``torchrun``.

    results = launch(fn, 4, x, backend="gloo")   # fn(x) on ranks 0..3, results in rank order
    results.spans                                # what every rank recorded with trace.span

How it avoids the walls learners hit with ``mp.spawn``:

* ``fn`` travels **by value** (cloudpickle), so a function defined in a notebook
  cell, a closure or a lambda runs in the ranks.
* Ranks start from a **forkserver** that has imported torch but never run a torch
  op. Plain ``fork`` of a kernel that has run a matmul hangs (OpenMP is not
  fork-safe); ``spawn`` re-imports torch in every rank (seconds).
* Rendezvous goes through a :class:`torch.distributed.FileStore` in a private
  temporary directory: no port to choose, no race between two launches, and no
  TCPStore listening on every interface. Gloo and NCCL are told to use the
  loopback interface, so nothing listens on a non-loopback address.
* Each rank gets ``max(1, cores // world_size)`` intra-op threads: oversubscribed
  ranks make communication look 5-15x slower than it is.
* Rank output goes to per-rank files and is printed afterwards in rank order,
  each line tagged ``[rank r]``: notebook output is deterministic.
* The first failing rank (exception, ``os._exit``, a signal) raises
  :class:`RankError` in the caller at once and the other ranks are killed (a rank's
  ValueError arrives as a RankError that is also a ValueError, so ``except ValueError``
  works; the same for every builtin exception type); a run
  past ``timeout`` raises :class:`LaunchTimeout` naming the stuck ranks, the span
  each was in and the torch.distributed call each was waiting in. Nothing (no
  process, directory or socket) outlives the call.

Under ``torchrun`` (RANK and WORLD_SIZE set) the same call runs ``fn`` in this
process only, with the process group initialised from the environment, and
returns every rank's result (all-gathered), so each demo is a real script too.

``clock=VirtualCluster(...)`` (:mod:`course_lib.virtual`) runs the same ranks and prices
their time on a modelled GPU cluster: ``.spans`` are then in virtual seconds.

This module starts the ranks and supervises them; the forkserver they start from is
:mod:`course_lib.forkserver`, what each rank's process runs (and a rank under torchrun) is
:mod:`course_lib.rank_process`, and the diagnosis of a failure :mod:`course_lib.debug`.
"""
from __future__ import annotations

import builtins
import functools
import inspect
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
import warnings

import cloudpickle

from course_lib.debug import postmortem as _debug   # flight recorder, desync check, which rank failed and where
from course_lib.forkserver import (FORKSERVER_PRELOAD, SHARED_FORKSERVER, can_share_forkserver, rank_context,
                                   start_shared_forkserver, starting_ranks)
from course_lib.rank_process import (BACKENDS, STARTUP_TIMEOUT, LaunchResult, cpu_count, default_threads,
                                     loopback_interface, rank_main, run_under_torchrun, to_cpu, under_torchrun)


class RankError(RuntimeError):
    """A rank raised an exception or died. ``.rank``, ``.exitcode``, ``.remote_traceback``,
    ``.diagnosis`` (every rank's flight recorder merged: course_lib.debug)."""
    diagnosis = ""

    def __init__(self, message, rank, exitcode=None, exc_type=None, remote_traceback=""):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback


@functools.lru_cache(maxsize=None)
def rank_error_type(exc_type: str) -> type:
    """RankError, made also an instance of the rank's exception type when that is a builtin
    (``RankError[ValueError]``): ``except ValueError`` around launch catches a rank's ValueError."""
    base = getattr(builtins, exc_type or "", None)
    if not (isinstance(base, type) and issubclass(base, Exception)) or issubclass(RankError, base):
        return RankError
    try:
        return type(f"RankError[{exc_type}]", (RankError, base), {"__str__": BaseException.__str__,
                                                                "__module__": __name__})
    except TypeError:  # a layout that cannot be combined with RuntimeError's
        return RankError


class LaunchTimeout(TimeoutError):
    """Ranks did not finish within ``timeout``. ``.stuck`` maps rank -> what it was doing;
    ``.diagnosis``: every rank's flight recorder merged (course_lib.debug)."""
    diagnosis = ""

    def __init__(self, message, stuck):
        super().__init__(message)
        self.stuck = stuck


def _check_call(fn, args, kwargs):
    """Before any rank starts: ``fn(*args, **kwargs)`` must bind (else a TypeError naming
    fn's signature, not one per rank); and a parameter of fn named like one of launch's own
    keywords, left unset, is warned about: launch keeps that keyword, so fn gets its default."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):   # a builtin or C function: nothing to read
        return
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    own = [n for n in sig.parameters if n in LAUNCH_KEYWORDS and sig.parameters[n].kind not in variadic]
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        hint = (f"; launch keeps {', '.join(n + '=' for n in own)} for itself: pass "
                f"{'it' if len(own) == 1 else 'them'} to {name} positionally" if own else "")
        raise TypeError(f"launch: {name}{sig} cannot be called with the arguments given "
                        f"({exc}){hint}") from None
    unset = [n for n in own if n not in bound.arguments]
    if unset:
        warnings.warn(f"launch: {name} has a parameter {', '.join(unset)} that launch keeps for itself "
                      f"(launch's own keyword{'s' if len(unset) > 1 else ''}): {name} gets its default. "
                      f"Pass it positionally, or read it inside {name} (e.g. dist.get_backend())",
                      stacklevel=3)


def _validate(fn, world_size, backend, timeout, clock=None):
    if not callable(fn):
        raise TypeError(f"launch needs a callable fn, got {type(fn).__name__}: {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: choose one of {BACKENDS}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if clock is not None:
        if not (hasattr(clock, "check") and hasattr(clock, "start")):
            raise TypeError(f"clock must be None (the wall clock) or a course_lib.virtual.VirtualCluster, "
                            f"got {clock!r}")
        clock.check(world_size)
    if backend == "nccl":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < world_size:
            raise RuntimeError(
                f"backend='nccl' needs one GPU per rank: world_size={world_size} but this machine "
                f"has {n} CUDA device(s). Use backend='gloo' (it also handles CUDA tensors) "
                f"or fewer ranks.")


# ----------------------------------------------------------------------------- the caller side

def launch(fn, world_size, /, *args, backend="gloo", timeout=60.0, threads=None,
           start_method=None, quiet=False, clock=None, debug=None, flight_recorder=_debug.flight_recorder.SLOTS,
           **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results in rank order.

    backend: 'gloo' (CPU tensors; CUDA tensors in collectives, not point-to-point) or 'nccl'
        (one GPU per rank).
    timeout: seconds for fn, counted once every rank has started and joined the
        process group (starting has its own limit, ``STARTUP_TIMEOUT``); past it
        every rank is stopped and :class:`LaunchTimeout` says where each unfinished
        rank was.
    threads: intra-op threads per rank (default ``max(1, cores // world_size)``).
    start_method: 'forkserver' (default where available) or 'spawn'.
    quiet: do not print the ranks' output.
    clock: None (the wall clock) or a :class:`course_lib.virtual.VirtualCluster`: the same
        run, its spans priced in virtual seconds on that modelled cluster.
    debug: None, "desync" (collectives compare fingerprints first), "nonfinite" (the first op
        making a NaN/Inf raises), or a tuple of them (:mod:`course_lib.debug`).
    flight_recorder: how many communication calls each rank keeps for the diagnosis of a
        hang or crash (``.diagnosis`` of the error); None: off.

    Returns a :class:`LaunchResult` (a list) with ``.spans`` (every rank's
    :class:`~course_lib.trace.Span`, on one clock) and ``.elapsed`` (seconds).
    """
    debug = _debug.check_options(debug, flight_recorder)
    _check_call(fn, args, kwargs)
    if under_torchrun():
        return run_under_torchrun(fn, world_size, args, kwargs, backend, timeout, clock, debug)
    _validate(fn, world_size, backend, timeout, clock)
    threads = default_threads(world_size) if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    try:
        payload = cloudpickle.dumps((fn, args, kwargs, clock))
    except Exception as exc:
        raise TypeError(f"launch cannot send fn or its arguments to the ranks (they must be "
                        f"picklable): {type(exc).__name__}: {exc}") from exc
    ctx = rank_context(start_method)
    workdir = tempfile.mkdtemp(prefix="course_lib_launch_")
    procs = []
    started = time.perf_counter()
    try:
        with starting_ranks():
            for rank in range(world_size):
                p = ctx.Process(target=rank_main, name=f"course_lib-rank{rank}",
                                args=(rank, world_size, backend, workdir, payload, threads, timeout,
                                      loopback_interface(), debug, dict(os.environ)))
                p.start()
                procs.append(p)
        failure = _wait(procs, workdir, timeout)
        if failure is not None:
            _debug.explain(failure, procs, workdir, min(_debug.SETTLE, timeout))
        _kill(procs)
        if not quiet:
            _print_outputs(workdir, world_size)
        if failure is not None:
            raise failure
        results, spans = LaunchResult(), []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"result{rank}"), "rb") as f:
                value, rank_spans = cloudpickle.loads(f.read())
            results.append(value)
            spans.extend(rank_spans)
        results.spans = spans
        results.elapsed = time.perf_counter() - started
        return results
    finally:
        _kill(procs)
        shutil.rmtree(workdir, ignore_errors=True)


# launch's own keywords: a parameter of fn with one of these names never receives its value
LAUNCH_KEYWORDS = frozenset(n for n, p in inspect.signature(launch).parameters.items()
                            if p.kind is p.KEYWORD_ONLY)


def _wait(procs, workdir, timeout):
    """Wait for all ranks; return None on success, or the exception to raise.

    Up to STARTUP_TIMEOUT for every rank to be ready, then ``timeout`` for fn.
    """
    pending = {p.sentinel: rank for rank, p in enumerate(procs)}
    ready = [os.path.join(workdir, f"ready{rank}") for rank in range(len(procs))]
    start_deadline, deadline = time.perf_counter() + STARTUP_TIMEOUT, None
    while pending:
        now = time.perf_counter()
        if deadline is None and all(os.path.exists(path) for path in ready):
            deadline = now + timeout
        limit = start_deadline if deadline is None else deadline
        if now >= limit:
            if deadline is None:
                late = [r for r, path in enumerate(ready) if not os.path.exists(path)]
                return LaunchTimeout(f"ranks {late} did not start within {STARTUP_TIMEOUT:g} s (starting the "
                                     f"process and building the process group)", {r: "starting" for r in late})
            return LaunchTimeout(*_debug.timeout_report(procs, sorted(pending.values()), workdir))
        poll = 1.0 if deadline is not None else 0.02  # while starting, look for readiness often
        for sentinel in mp.connection.wait(list(pending), timeout=min(limit - now, poll)):
            rank = pending.pop(sentinel)
            procs[rank].join()
            if procs[rank].exitcode != 0 or not os.path.exists(os.path.join(workdir, f"result{rank}")):
                _settle(pending, 0.05)  # let peers that fail because of this rank report too
                cause = _debug.first_failure(procs, workdir, first_seen=rank)
                return rank_error_type(cause["exc_type"])(**cause)
    return None


def _settle(pending, seconds):
    """Wait ``seconds`` for the ranks in ``pending`` (sentinel -> rank) to end, less when they all
    have (a rank reports its error before it exits): a failed launch does not sleep for nothing."""
    end = time.perf_counter() + seconds
    while pending and time.perf_counter() < end:
        for sentinel in mp.connection.wait(list(pending), timeout=max(0.0, end - time.perf_counter())):
            pending.pop(sentinel)


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _kill(procs):
    for p in procs:
        try:
            if p.is_alive():
                p.kill()
        except ValueError:  # already closed by an earlier call
            continue
    for p in procs:
        try:
            p.join(5)
            p.close()
        except ValueError:
            pass


def _print_outputs(workdir, world_size):
    for stream, name in ((sys.stdout, "out"), (sys.stderr, "err")):
        for rank in range(world_size):
            text = _read(os.path.join(workdir, f"{name}{rank}"))
            for line in text.splitlines():
                print(f"[rank {rank}] {line}", file=stream)
        stream.flush()


__all__ = ["launch", "LaunchResult", "LaunchTimeout", "RankError", "rank_error_type", "LAUNCH_KEYWORDS", "BACKENDS",
           "STARTUP_TIMEOUT", "FORKSERVER_PRELOAD", "SHARED_FORKSERVER", "can_share_forkserver",
           "start_shared_forkserver", "cpu_count", "default_threads", "loopback_interface", "to_cpu", "under_torchrun"]
