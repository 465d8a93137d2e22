"""The host's issue chain of one pass, as the virtual clock runs it (``runtime="course"``, TP > 1).

Eager PyTorch issues one op every ``Hardware.launch_overhead`` seconds; a kernel starts when it
is issued and the previous kernel has ended (:mod:`course_lib.virtual.compute`). A blocking
collective makes the host wait for the stream before it is priced (the clock reads the members'
ready times there, as a value read: ``RankClock._host_reads``), then the stream waits for the
collective. So a stretch of small kernels after each of TP's collectives is paced by the host
again, however far ahead the host was before it: the sum over the stretches, not one max over the
pass. :func:`pass_time` runs that arithmetic on the kernels of one TP rank in their traced order,
marked with the collectives (:func:`course_lib.planner.kernels.trace_step`, ``"sequence"``).
"""
from __future__ import annotations


def run_chain(seq, state: list, issue: float, costs: dict | None = None) -> None:
    """``state`` [host, stream] after the kernels (seconds each) and blocking collectives
    (names, ``costs[name]`` seconds each) of ``seq``, in order."""
    costs = costs or {}
    host, t = state
    for x in seq:
        if isinstance(x, str):                       # a blocking collective
            host = host if host > t else t
            t += costs.get(x, 0.0)
        else:                                        # a kernel: issued, then run
            host += issue
            t = (t if t > host else host) + x
    state[0], state[1] = host, t


def gather_chain(buckets, state: list, issue: float, in_flight: int = 2) -> None:
    """``state`` [host, stream, communication stream] after ZeRO's step-start gathers of
    ``buckets`` [(pack seconds, all-gather seconds, [copy seconds])], ``in_flight`` at a time
    (``parallel.zero.all_gather_buckets``): each bucket's pack issued and run, its all-gather
    issued async behind it (it starts when the stream has run the pack and the communication
    stream is free, as the clock's ``RankClock.issue``); with ``in_flight`` of them issued (or
    the last), each waited for by the stream (not the host) and its copies run, while the
    next all-gathers may still be on the wire."""
    host, t, comm = state
    pending = []
    for k, (pack, gather, copies) in enumerate(buckets):
        host += issue
        t = (t if t > host else host) + pack
        comm = (comm if comm > t else t) + gather
        pending.append((comm, copies))
        if len(pending) >= in_flight or k == len(buckets) - 1:
            for end, copies_ in pending:
                t = t if t > end else end
                for x in copies_:
                    host += issue
                    t = (t if t > host else host) + x
            pending = []
    state[0], state[1], state[2] = host, t, comm


def pass_time(pieces: dict, order: tuple, n_layers: int, issue: float, costs: dict) -> float:
    """Seconds of one pass: ``pieces`` {"embedding" | "layer" | "head": sequence} run in ``order``
    ("layer" ``n_layers`` times), each kernel issued ``issue`` seconds after the last, each
    collective ``costs[kind]`` seconds. Once a layer leaves the host as far ahead of the stream as
    the layer before did, the rest repeat it: the chain is shift invariant."""
    state = [0.0, 0.0]
    for part in order:
        if part != "layer":
            run_chain(pieces.get(part, ()), state, issue, costs)
            continue
        done, lead = 0, None
        while done < n_layers:
            before = state[1]
            run_chain(pieces["layer"], state, issue, costs)
            done += 1
            now = state[0] - state[1]
            if lead is not None and abs(now - lead) <= 1e-12:
                step = state[1] - before             # every further layer: the same seconds
                state[0] += step * (n_layers - done)
                state[1] += step * (n_layers - done)
                break
            lead = now
    return state[1]


__all__ = ["pass_time", "run_chain", "gather_chain"]
