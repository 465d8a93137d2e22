"""The graders' harness: a question is a table of cases, the learner's function, the
library's reference, a comparison and a hint per classic mistake.

    check_answers(name, fn, cases, reference, guard=..., exercise=...)   # in this process
    grads_differ(model, reference_model, **bounds)                        # every gradient, named
    run = guarded(targets, exercise=...); run(f, *args)                    # learner code in pieces
    check_in_process(name, harness, cases, timeout=...)                   # one process per case
    on_ranks(name, harness, (2, 3), "label", fn=answer)                    # a case per world size
    results = once(lambda: launch(...), hang=...); results()             # one launch, many cases

Cases, checks on ranks, comparisons: :mod:`course_lib.grading`; guards:
:mod:`~course_lib.grading.guard`; traffic: :mod:`~course_lib.grading.traffic`; training:
:mod:`~course_lib.grading.training`.
"""
from __future__ import annotations

import copy
import math
from typing import Callable

from course_lib.grading import Case, Mismatch, check, check_distributed, compare
from course_lib.grading.guard import learner
from course_lib.launch import LaunchTimeout, launch


def check_answers(name: str, fn, cases, reference: Callable | None, *, guard=(), exercise: str,
                  seconds: float = 10, read: Callable | None = None, hint: Callable | None = None,
                  differ: Callable | None = None, given: Callable | None = None) -> bool:
    """Grade ``fn`` on ``cases`` against ``reference`` in this process.

    Each case's ``params["args"]`` (a tuple, or a dict of keywords) go to ``reference(*args)``
    first, outside the guard (or the case holds ``params["want"]`` and ``reference`` is None);
    then a deep copy of them (or what ``given(*args)`` builds afresh) to the learner's ``fn``,
    guarded: ``guard``'s targets off, the grader pinned, ``seconds`` at most. ``read(got, *args)``
    turns the answer into the reference's form (raise :class:`~course_lib.grading.Mismatch` for
    an answer of the wrong kind); ``differ(got, want, *args)`` is None when they agree (default:
    ``==``, else ``got .. expected ..``); ``hint(got, want, *args)`` adds the classic mistake's
    advice to a wrong answer."""
    answer = learner(fn, *guard, exercise=exercise, seconds=seconds)

    def run(case):
        args = case.params["args"]
        want = case.params["want"] if reference is None else _call(reference, args)
        got = answer(*_call(given, args)) if given else _call(answer, copy.deepcopy(args))
        got = _call(read, args, got) if read else got
        msg = (_call(differ, args, got, want) if differ
               else None if got == want else f"got {got!r}, expected {want!r}")
        return msg and msg + ((_call(hint, args, got, want) or "") if hint else "")
    return check(name, cases, run)


def _call(fn, args, *first):
    """``fn(*first, *args)``, or ``fn(*first, **args)`` when the case's args are a dict."""
    return fn(*first, **args) if isinstance(args, dict) else fn(*first, *args)


def number(got, *args, **kwargs):
    """A ``read`` for an answer that is a finite number (not a bool)."""
    if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isfinite(got):
        raise Mismatch(f"expected a finite number, got {got!r}")
    return got


def table(rows, label: Callable | str = "", world_size: int = 1) -> list:
    """One :class:`Case` per row of ``args``; ``label`` a format string of the row or a function of it."""
    return [Case(dict(args=tuple(row)), world_size,
                 label(*row) if callable(label) else label.format(*row)) for row in rows]


def grads_differ(model, reference, what: str = "", **bounds) -> str | None:
    """None when every parameter's ``.grad`` of ``model`` equals the one of ``reference`` (the
    same parameters in the same order) within ``course_lib.tolerance``'s ``bounds`` (default:
    the one-step bound of the reference's dtype), else the first that differs, named."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if (p.grad is None) != (q.grad is None):
            return (f"{what}{name}.grad is {'None' if p.grad is None else 'set'}, expected "
                    f"{'None' if q.grad is None else 'a gradient'}")
        if q.grad is not None:
            msg = compare(p.grad, q.grad, what=f"{what}{name}.grad", **({"dtype": q.grad.dtype} | bounds))
            if msg:
                return msg
    return None


def guarded(*targets, exercise: str, seconds: float | None = None) -> Callable:
    """``run(f, *args)``: ``f(*args)`` as a learner's call (``targets`` off, the grader pinned, a
    time limit), for learner code that runs in pieces: an autograd Function's forward, then the
    backward that reaches its backward."""
    return learner(_run, *targets, exercise=exercise, seconds=seconds)


def _run(f, *args, **kwargs):
    return f(*args, **kwargs)


def check_in_process(name: str, harness: Callable, cases, timeout: float, hang: str = "an endless loop?") -> bool:
    """``harness(**case.params)`` in a process of its own per case (one rank): its answer, or a
    hint after ``timeout`` seconds (``hang`` says what would not stop)."""
    def run(case):
        try:
            [outcome] = launch(harness, 1, timeout=timeout, quiet=True, **case.params)
        except LaunchTimeout:
            return f"no answer after {timeout:g} s: {hang}"
        return outcome
    return check(name, cases, run)


def on_ranks(name: str, harness: Callable, worlds, label: Callable | str = "", timeout: float = 30.0,
             **params) -> bool:
    """:func:`~course_lib.grading.check_distributed` of ``harness(**params)`` on each world size
    of ``worlds`` (``label`` a string, or a function of the world size)."""
    cases = [Case(dict(params), n, label(n) if callable(label) else label) for n in worlds]
    return check_distributed(name, harness, cases, timeout=timeout)


def once(run: Callable, hang: Callable | None = None) -> Callable:
    """``results()``: ``run()``'s value (a launch that every case of a grader reads), computed
    at the first call only; after a hang, the hint ``hang(exc)`` (a str, from the
    :class:`LaunchTimeout`) instead; a run that failed (or hung, without ``hang``) raises its
    error again at each call."""
    memo = []

    def results():
        if not memo:
            try:
                memo.append(run())
            except LaunchTimeout as exc:
                memo.append(hang(exc) if hang else exc)
            except Exception as exc:  # noqa: BLE001 - a rank died: check() turns it into its hint
                memo.append(exc)
        if isinstance(memo[0], Exception):
            raise memo[0]
        return memo[0]
    return results


__all__ = ["check_answers", "check_in_process", "grads_differ", "guarded", "once", "number", "on_ranks", "table"]
