"""The launcher's side of debugging: options, the rank's setup, and the diagnosis of a failure.

``course_lib.launch`` calls these functions and nothing else:

* :func:`check_options` before any rank starts (an unknown mode or a ring of < 1 call is a
  ValueError naming it);
* :func:`in_rank` around ``fn`` in each rank: installs the flight recorder (its ring is the
  file ``flight<rank>`` in the launch's private folder; under NCCL it completes calls by
  CUDA event), the desync check, the NaN tracer; :func:`dump_stack_on_signal` as each rank
  starts, so that a stuck rank can be asked for its Python stack;
* :func:`first_failure` when ranks failed: which one is the root cause, and what it raised;
* :func:`timeout_report` when the run timed out: where each unfinished rank was (the span
  it was in, the torch.distributed call it waits in, read from its stack);
* :func:`explain` when a rank failed or the run timed out: reads every rank's ring file (the
  ranks do nothing: a hung or dead rank cannot), merges them (:func:`diagnosis.diagnose`)
  and sets ``failure.diagnosis``, also appended to the error's message.

After a rank fails, the others keep running until they block (or the launcher kills them).
What they had called by then depends on timing, so :func:`explain` first waits, at most
``SETTLE`` seconds, until every surviving rank is *stuck*: blocked in a call that waits for
a rank that is gone or stuck itself. Then the records, and the diagnosis, are those of the
program, not of the moment.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import time

from course_lib.debug import flight_recorder
from course_lib.debug.diagnosis import NOTHING, diagnose, stuck

DEBUG_MODES = ("desync", "nonfinite")
SETTLE = 2.0   # seconds the survivors of a failure get to block (each check: ms)


def check_options(debug, slots) -> tuple:
    """``debug``: None, a mode or modes of DEBUG_MODES; ``slots``: None (no flight recorder) or >= 1."""
    modes = () if debug is None else (debug,) if isinstance(debug, str) else tuple(debug)
    for m in modes:
        if m not in DEBUG_MODES:
            raise ValueError(f"unknown debug mode {m!r}: choose from {DEBUG_MODES}, a tuple of them, or None")
    if slots is not None:
        flight_recorder.check_slots(slots)
    return modes, slots


def _backend() -> str:
    import torch.distributed as dist
    return dist.get_backend() if dist.is_available() and dist.is_initialized() else ""


@contextlib.contextmanager
def in_rank(workdir, rank, options):
    """This rank's recorder (a file the launcher can read), desync check, NaN tracer."""
    modes, slots = options
    ring = None
    if slots is not None:   # NCCL returns when the kernel is enqueued: complete by CUDA event
        ring = flight_recorder.FlightRecorder(os.path.join(workdir, f"flight{rank}") if workdir else None,
                                              rank, slots, cuda_events=_backend() == "nccl")
    flight_recorder.install(ring, desync="desync" in modes)
    try:
        if "nonfinite" in modes:
            from course_lib.debug.nonfinite import NonFiniteTracer
            with NonFiniteTracer(rank=rank):
                yield ring
        else:
            yield ring
    finally:
        flight_recorder.install(None)


def outcomes(procs, workdir) -> dict:
    """{rank: how it ended} for the ranks no longer running fn (the others: absent)."""
    out = {}
    for rank, p in enumerate(procs):
        error = os.path.join(workdir, f"error{rank}")
        if os.path.exists(error):
            try:
                with open(error, "rb") as f:
                    out[rank] = f"raised {pickle.load(f)['type']}"
            except (OSError, EOFError, pickle.UnpicklingError, KeyError):
                out[rank] = "raised an exception"
        elif os.path.exists(os.path.join(workdir, f"returned{rank}")):
            out[rank] = "returned from fn"
        elif p.exitcode is not None:
            code = p.exitcode
            out[rank] = (f"was killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
                         else f"exited with code {code}")
    return out


def records(procs, workdir) -> dict:
    return {rank: flight_recorder.read(os.path.join(workdir, f"flight{rank}"), rank) for rank in range(len(procs))}


def explain(failure, procs, workdir, settle: float = SETTLE):
    """Attach the merged diagnosis to ``failure`` (a RankError or LaunchTimeout) and its message.
    A diagnosis that fails says so in ``.diagnosis``: it never hides the failure it explains."""
    try:
        return _explain(failure, procs, workdir, settle)
    except Exception as exc:  # noqa: BLE001 - the run's own error matters more than ours
        failure.diagnosis = f"(no diagnosis: {type(exc).__name__}: {exc})"
        return failure


def _explain(failure, procs, workdir, settle):
    timed_out = isinstance(failure, TimeoutError)
    deadline = time.monotonic() + (0 if timed_out else settle)
    while True:
        recs, ended = records(procs, workdir), outcomes(procs, workdir)
        if len(stuck(recs, ended)) == len(procs) or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if not any(recs.values()):
        failure.diagnosis = ""
        return failure
    text = diagnose(recs, ended)
    failure.diagnosis = text
    if text == NOTHING:   # (a rank's own exception, nobody blocked: its message says it all)
        return failure
    failure.args = (f"{failure.args[0]}\n\ndiagnosis (every rank's flight recorder, merged):\n{text}",) \
        + tuple(failure.args[1:])
    return failure


# ----------------------------------------------------------------------------- which rank, and where

def dump_stack_on_signal(workdir, rank):
    """In a rank: on SIGUSR1, write every thread's Python stack to ``stack<rank>`` (faulthandler,
    which works while the rank is blocked in C++); returns the open file, kept by faulthandler."""
    stack_file = open(os.path.join(workdir, f"stack{rank}"), "w")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    return stack_file


def describe_exit(code):
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (signal {-code})"
    return f"exited with code {code}"


def first_failure(procs, workdir, first_seen) -> dict:
    """The root cause among failed ranks: a silent death, else the earliest exception; as the
    keywords of a ``RankError`` (message, rank, exitcode, exc_type, remote_traceback)."""
    errors, deaths = {}, []
    for rank, p in enumerate(procs):
        path = os.path.join(workdir, f"error{rank}")
        if os.path.exists(path):
            with open(path, "rb") as f:
                errors[rank] = pickle.load(f)
        elif p.exitcode is not None and (p.exitcode != 0 or not os.path.exists(os.path.join(workdir, f"result{rank}"))):
            deaths.append(rank)
    if deaths:
        rank = first_seen if first_seen in deaths else deaths[0]
        code = procs[rank].exitcode
        hint = " without returning (did fn call sys.exit or os._exit?)" if code == 0 else ""
        msg = f"rank {rank} {describe_exit(code)}{hint}"
        others = [r for r in errors]
        if others:
            msg += f"; ranks {others} then failed because it was gone"
        return dict(message=msg, rank=rank, exitcode=code, exc_type=None, remote_traceback="")
    rank = min(errors, key=lambda r: errors[r]["time"])
    e = errors[rank]
    msg = f"rank {rank} raised {e['type']}: {e['message']}\n\n--- traceback of rank {rank} ---\n{e['traceback']}"
    return dict(message=msg, rank=rank, exitcode=procs[rank].exitcode, exc_type=e["type"],
                remote_traceback=e["traceback"])


def timeout_report(procs, pending, workdir) -> tuple:
    """(message, {rank: what it was doing}) for the ranks in ``pending`` when the run timed out:
    each rank not yet returned is asked for its stack (SIGUSR1), read with its current span."""
    returned = [r for r in pending if os.path.exists(os.path.join(workdir, f"returned{r}"))]
    stuck_ranks = [r for r in pending if r not in returned]
    for rank in stuck_ranks:  # ask each stuck rank for its Python stack (faulthandler)
        if procs[rank].is_alive() and hasattr(signal, "SIGUSR1"):
            try:
                os.kill(procs[rank].pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(0.3)
    where_each = {}
    for rank in stuck_ranks:
        status = _read(os.path.join(workdir, f"status{rank}"), binary=True).rstrip(b"\0").decode("utf-8", "replace")
        where = describe_stack(_read(os.path.join(workdir, f"stack{rank}")))
        parts = []
        if status:
            parts.append(f"in span '{status}'")
        if where:
            parts.append(where)
        where_each[rank] = "; ".join(parts) or "no trace available"
    lines = "\n".join(f"  rank {r}: {what}" for r, what in where_each.items())
    done = [r for r in range(len(procs)) if r not in where_each]
    msg = (f"ranks {stuck_ranks} did not finish within the timeout"
           + (f" (ranks {done} returned from fn and waited for them)" if done else "") + f":\n{lines}\n"
           "A collective or recv that never gets its partner waits forever: check that every rank "
           "calls the same collectives in the same order, and that each send has a matching recv.")
    return msg, where_each


def describe_stack(dump: str) -> str:
    """From a faulthandler dump, name the torch.distributed call a rank waits in and its caller."""
    if not dump.strip():
        return ""
    threads = dump.split("\n\n")
    main = next((t for t in threads if "rank_main" in t), threads[0])   # (launch's rank entry point)
    frames = []  # most recent first: (file, line, function)
    for line in main.splitlines():
        line = line.strip()
        if line.startswith("File "):
            try:
                file_part, rest = line[len("File "):].rsplit(", line ", 1)
                lineno, func = rest.split(" in ", 1)
                frames.append((file_part.strip('"'), lineno, func.strip()))
            except ValueError:
                continue

    def is_torch(f):
        return f"{os.sep}torch{os.sep}" in f[0]

    def is_launcher(f):  # (the virtual clock's frames too: a stuck rank waits in the call that used it)
        return (any(f[0].endswith(os.path.join("course_lib", n)) for n in ("launch.py", "rank_process.py"))
                or f"{os.sep}multiprocessing{os.sep}" in f[0]
                or f"course_lib{os.sep}virtual{os.sep}" in f[0])

    caller_idx = next((i for i, f in enumerate(frames) if not is_torch(f) and not is_launcher(f)), None)
    if caller_idx is None:
        return ""
    caller = frames[caller_idx]
    op = next((f for f in reversed(frames[:caller_idx]) if f[2] != "wrapper" and "c10d_logger" not in f[0]), None)
    where = f"{caller[2]} ({os.path.basename(caller[0])}:{caller[1]})"
    if op is not None:
        return f"waiting in torch.distributed.{op[2]}, called from {where}"
    return f"waiting at {where}"


def _read(path, binary=False):
    try:
        with open(path, "rb" if binary else "r", **({} if binary else {"errors": "replace"})) as f:
            return f.read()
    except OSError:
        return b"" if binary else ""


__all__ = ["DEBUG_MODES", "SETTLE", "check_options", "in_rank", "outcomes", "records", "explain",
           "dump_stack_on_signal", "first_failure", "timeout_report", "describe_stack", "describe_exit"]
