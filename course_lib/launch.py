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
"""
from __future__ import annotations

import atexit
import builtins
import datetime
import functools
import inspect
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings

import cloudpickle

from course_lib import trace as _trace
from course_lib.debug import postmortem as _debug   # flight recorder, desync check, which rank failed and where

BACKENDS = ("gloo", "nccl")
# Seconds allowed to start the ranks and build the process group. ``timeout`` counts
# from when every rank is ready, so a slow first start (the forkserver imports torch;
# spawn imports it in every rank) never eats into the time a learner gave fn.
STARTUP_TIMEOUT = 120.0
# What the forkserver imports once, so that every rank (a fork of it) starts with it instead of
# importing it again: torch; torch._dynamo (the first optimizer a rank builds imports it, ~10 s for
# 4 ranks on 2 cores); course_lib.rank_imports, the course_lib modules ranks use (~0.1 s of CPU per
# rank per launch). Append names before the first launch to add more (tests/conftest.py adds pytest:
# a rank running a test's function imports its test module). Nothing here may run a torch op at
# import: a fork of a process that has run one hangs in OpenMP. Ranks see these modules as they were
# at the first launch of this process: an edit to course_lib reaches them after a kernel restart,
# as it reaches the kernel's own imports.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "cloudpickle", "course_lib.launch",
                      "course_lib.rank_imports"]


# A forkserver that another process started and keeps (tests/conftest.py: one for the whole test
# session), named by the address of its socket in this variable: ranks are forked from it instead
# of from a server of this process's own, which would import FORKSERVER_PRELOAD again (~2.8 s of
# CPU in every notebook kernel). Each rank still runs in the launcher's environment, cwd and sys.path.
SHARED_FORKSERVER = "COURSE_LIB_FORKSERVER"


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


class LaunchResult(list):
    """The per-rank return values, in rank order, plus ``.spans`` and ``.elapsed``."""

    spans: list
    elapsed: float

    def spans_of(self, rank):
        return [s for s in self.spans if s.rank == rank]


# ----------------------------------------------------------------------------- helpers

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


_CONTEXTS: dict = {}
_STARTING = threading.local()


def _install_no_main_reimport():
    """Ranks get fn by value, so they never need to re-import the caller's __main__.

    multiprocessing's spawn/forkserver children normally re-run the main script
    (hence the ``if __name__ == "__main__"`` idiom); a launch from an unguarded
    script or ``python -m`` module would then recurse. While *we* start ranks,
    drop the main-module entries from the preparation data.
    """
    import multiprocessing.spawn as mp_spawn

    if getattr(mp_spawn.get_preparation_data, "_course_lib", False):
        return
    original = mp_spawn.get_preparation_data

    def get_preparation_data(name):
        data = original(name)
        if getattr(_STARTING, "active", False):
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    get_preparation_data._course_lib = True
    mp_spawn.get_preparation_data = get_preparation_data


def can_share_forkserver() -> bool:
    """Whether this Python's forkserver client can be pointed at a server it did not start
    (3.8-3.13; 3.14's client authenticates to the server it started itself)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    return (sys.platform == "linux" and hasattr(server, "_forkserver_address")
            and hasattr(server, "_forkserver_alive_fd") and not hasattr(server, "_forkserver_authkey"))


def start_shared_forkserver():
    """Start a forkserver with FORKSERVER_PRELOAD imported, for other processes to fork their
    ranks from (pass its address in SHARED_FORKSERVER); it lives as long as this process."""
    from multiprocessing import forkserver

    server = forkserver.ForkServer()
    server.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    server.ensure_running()
    return server


def _use_shared_forkserver(address) -> bool:
    """Point this process's forkserver client at the running server at ``address``."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    if not (address and os.path.exists(address) and can_share_forkserver()):
        return False
    if server._forkserver_address is None:
        read, write = os.pipe()   # the server hands ``write`` to each rank as its own "alive" end
        os.close(read)
        server._forkserver_address, server._forkserver_alive_fd = address, write
        server.ensure_running = resource_tracker.ensure_running   # not ours to (re)start
    return True


def _context(start_method):
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start_method == "fork":
        raise ValueError(
            "start_method='fork' is unsafe once torch has run an op in this process "
            "(forked ranks hang in OpenMP); use 'forkserver' (default) or 'spawn'")
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    _install_no_main_reimport()
    if start_method not in _CONTEXTS:
        ctx = mp.get_context(start_method)
        if start_method == "forkserver" and not _use_shared_forkserver(os.environ.get(SHARED_FORKSERVER)):
            # Import torch once in the server; every rank is then a cheap fork of it.
            ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        _CONTEXTS[start_method] = ctx
    return _CONTEXTS[start_method]


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


# ----------------------------------------------------------------------------- the rank side

def _rank_main(rank, world_size, backend, workdir, payload, threads, timeout, ifname, debug=((), None),
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
        return _launch_here(fn, world_size, args, kwargs, backend, timeout, clock, debug)
    _validate(fn, world_size, backend, timeout, clock)
    threads = default_threads(world_size) if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    try:
        payload = cloudpickle.dumps((fn, args, kwargs, clock))
    except Exception as exc:
        raise TypeError(f"launch cannot send fn or its arguments to the ranks (they must be "
                        f"picklable): {type(exc).__name__}: {exc}") from exc
    ctx = _context(start_method)
    workdir = tempfile.mkdtemp(prefix="course_lib_launch_")
    procs = []
    started = time.perf_counter()
    try:
        _STARTING.active = True
        try:
            for rank in range(world_size):
                p = ctx.Process(target=_rank_main, name=f"course_lib-rank{rank}",
                                args=(rank, world_size, backend, workdir, payload, threads, timeout,
                                      loopback_interface(), debug, dict(os.environ)))
                p.start()
                procs.append(p)
        finally:
            _STARTING.active = False
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


# ----------------------------------------------------------------------------- under torchrun

def _launch_here(fn, world_size, args, kwargs, backend, timeout, clock=None, debug=((), None)):
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
