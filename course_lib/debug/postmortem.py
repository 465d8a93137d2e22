"""The launcher's side of debugging: options, the rank's setup, and the diagnosis of a failure.

``course_lib.launch`` calls three functions and nothing else:

* :func:`check_options` before any rank starts (an unknown mode or a ring of < 1 call is a
  ValueError naming it);
* :func:`in_rank` around ``fn`` in each rank: installs the flight recorder (its ring is the
  file ``flight<rank>`` in the launch's private folder; under NCCL it completes calls by
  CUDA event), the desync check, the NaN tracer;
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
import os
import pickle
import signal
import time

from course_lib.debug import flight_recorder
from course_lib.debug.diagnosis import NOTHING, _blocking, _messages, diagnose

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


def stuck(recs: dict, ended: dict) -> set:
    """Ranks that will not move again: ended, never used the communication layer, or blocked
    in a call whose missing member is itself stuck (a fixpoint)."""
    out = {r for r in recs if r in ended or not recs[r]}
    changed = True
    while changed:
        changed = False
        for r in recs:
            if r in out:
                continue
            b = _blocking(recs[r])
            if b is None:
                continue
            if _waits_on_stuck(recs, r, b, out):
                out.add(r)
                changed = True
    return out


def _waits_on_stuck(recs, r, b, out) -> bool:
    """Does rank r's blocking call ``b`` need a rank in ``out`` that will never join it, or
    a member that joined with another call (a mismatch never completes)?"""
    if b.p2p:
        mirror = "recv" if b.op == "send" else "send"
        return b.peer in out and _messages(recs, b.peer, (b.dim, b.ranks, mirror, r, b.tag)) < b.seq
    for m in b.ranks:
        if m == r:
            continue
        theirs = next((x for x in recs.get(m, ()) if not x.p2p and (x.dim, x.ranks, x.seq) == (b.dim, b.ranks, b.seq)),
                      None)
        if theirs is not None and theirs.fingerprint() != b.fingerprint():
            return True
        if m in out and (theirs is None or theirs.state != "completed"):
            return True
    return False


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


__all__ = ["DEBUG_MODES", "SETTLE", "check_options", "in_rank", "outcomes", "records", "stuck", "explain"]
