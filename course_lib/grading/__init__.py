"""Graders for the exercises: run a learner's function on several cases and world
sizes, compare with a reference, print ONE stable line.

    ring_all_reduce: 8/8 cases passed
    ring_all_reduce: FAILED case 3/8 (world_size=3, numel=7, dtype=int64): rank 1 got ... expected ...

A learner's exception (in a rank too) becomes a one-line hint; a deadlock, one naming the
stuck ranks. The chapters' checks (``grading.collectives``, ...) are built from
:func:`check`, :func:`check_distributed` and :mod:`.harness`; what would do the exercise is
off while the learner's code runs (:mod:`.guard`).

In a notebook a failed check raises :class:`GradeFailed` (shown as its line), so
``pytest --nbval-lax`` fails until every check passes; the last cell,
:func:`all_checks_passed`, fails while a check cell was deleted or not run. The solutions
store each pass line (``# NBVAL_CHECK_OUTPUT``), which ``scripts/grade.py`` compares; the
generated exercises keep the cells without it. In plain Python a check prints and returns False.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from course_lib import tolerance
from course_lib.grading.guard import Shortcut, Tampered, TimeLimit, learner, learner_class
from course_lib.launch import LaunchTimeout, RankError, launch


@dataclass
class Case:
    """One graded case. ``params`` go to the harness; ``label`` is shown in hints."""

    params: dict = field(default_factory=dict)
    world_size: int = 1
    label: str = ""

    def describe(self) -> str:
        shown = self.world_size > 1 and "world_size" not in self.label
        return ", ".join(([f"world_size={self.world_size}"] if shown else []) + ([self.label] if self.label else []))


class Mismatch(AssertionError):
    """Raised by a harness (or returned as a string) when the learner's answer is wrong."""


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _explain_rank_error(err: RankError) -> str:
    if err.exc_type == "NotImplementedError":
        return f"rank {err.rank}: not implemented yet (NotImplementedError)"
    if err.exc_type in ("Mismatch", "AssertionError", "Shortcut", "TimeLimit", "Tampered"):
        return _one_line(str(err).split("\n\n--- traceback")[0].split(": ", 1)[-1])
    if err.exc_type is None:
        return _one_line(str(err))
    frames = [ln.strip()[len("File "):] for ln in err.remote_traceback.splitlines()   # the learner's
              if ln.strip().startswith("File ") and "course_lib" not in ln and "torch" not in ln]
    where = f" at {frames[-1]}" if frames else ""                                     # innermost, if any
    head = str(err).split("\n\n--- traceback")[0]
    return _one_line(f"{head}{where}")


def explain(exc: BaseException) -> str:
    """A learner's exception (or a rank's, or a hang) as the one-line hint a failed case prints."""
    if isinstance(exc, RankError):
        return _explain_rank_error(exc)
    if isinstance(exc, LaunchTimeout):
        stuck = "; ".join(f"rank {r} {what}" for r, what in exc.stuck.items())
        return _one_line(f"deadlock or hang (timed out): {stuck}", 400)
    if isinstance(exc, NotImplementedError):
        return "not implemented yet (NotImplementedError)"
    if isinstance(exc, (Mismatch, Shortcut, TimeLimit, Tampered)):
        return _one_line(str(exc))
    return _one_line(f"{type(exc).__name__}: {exc}")


class GradeFailed(AssertionError):
    """A check failed inside a notebook: IPython shows only its one line, not a traceback."""

    def _render_traceback_(self):  # IPython's hook for an exception's own rendering
        return [f"\x1b[31m{self}\x1b[0m"]


def _in_notebook() -> bool:
    """True inside an IPython kernel (Jupyter, Colab, nbval, grade.py), where a failure raises."""
    import sys

    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and shell.__class__.__name__ != "TerminalInteractiveShell"


def _report(line: str, passed: bool) -> bool:
    if not passed and _in_notebook():
        raise GradeFailed(line)
    print(line)
    return passed


# The checks that passed in this process (a notebook's kernel): the graders' one piece of
# process state, read by the last cell of an exercise notebook (all_checks_passed), so that a
# deleted or skipped check cell fails ``pytest --nbval-lax`` too. grade.py does not read it.
_PASSED_HERE: set = set()


def all_checks_passed(names) -> bool:
    """Every named check passed in this session (the last cell of each exercise notebook):
    a check cell deleted, skipped, not yet run or failing since makes this fail, naming it."""
    names = list(names)
    missing = [n for n in names if n not in _PASSED_HERE]
    if missing:
        return _report(f"not passed in this session: {', '.join(missing)} (run each question's check "
                       f"cell; a deleted check cell fails here)", False)
    return _report(f"all {len(names)} questions of this notebook passed in this session", True)


def check(name: str, cases, run_case: Callable[[Case], Any]) -> bool:
    """``run_case(case)`` for each case: None/True passes; a mismatch string, False or an
    exception fails. Prints one line (all passed, or the first failing case with its hint) and
    returns True iff all passed; in a notebook a failure raises :class:`GradeFailed`."""
    cases = list(cases)
    for i, case in enumerate(cases, 1):
        try:
            outcome = run_case(case)
        except BaseException as exc:  # noqa: BLE001 - a learner's error becomes a hint
            if isinstance(exc, KeyboardInterrupt):
                raise
            outcome = explain(exc)
        if outcome is None or outcome is True:
            continue
        detail = "wrong answer" if outcome is False else outcome
        where = case.describe()
        _PASSED_HERE.discard(name)
        return _report(f"{name}: FAILED case {i}/{len(cases)}" + (f" ({where})" if where else "") + f": {detail}",
                       False)
    _PASSED_HERE.add(name)
    return _report(f"{name}: {len(cases)}/{len(cases)} cases passed", True)


def check_distributed(name: str, harness: Callable, cases, timeout: float = 30.0,
                      on_timeout: Callable[[LaunchTimeout], str] | None = None) -> bool:
    """:func:`check` with ``harness(**case.params)`` on ``case.world_size`` ranks per case: on
    each rank None when its answer is right, else a mismatch string (or :class:`Mismatch`
    raised). The learner's exceptions and deadlocks become hints (``on_timeout`` writes a
    deadlock's own from the :class:`LaunchTimeout`)."""

    def run_case(case: Case):
        try:
            results = launch(harness, case.world_size, timeout=timeout, quiet=True, **case.params)
        except LaunchTimeout as exc:
            if on_timeout is None:
                raise
            return on_timeout(exc)
        for rank, outcome in enumerate(results):
            if outcome is not None and outcome is not True:
                return f"rank {rank}: {outcome}"
        return None

    return check(name, cases, run_case)


def compare(got, expected, rtol: float | None = None, atol: float | None = None, what: str = "", *,
            exact: bool = False, **bounds) -> str | None:
    """None if ``got`` matches ``expected`` (tensors, numbers or sequences), else a short message.

    Floating point (integers, bools and other values compare exactly): ``exact=True`` (or
    ``rtol=0, atol=0``) bit for bit, for what moves data without adding; by default the bound
    the arithmetic allows, :func:`course_lib.tolerance.compare` with ``bounds`` (``dtype``,
    ``terms``, ``scale``, ``optimizer``, ``steps``, ``lr``, ``grad_scale``, ...; a sum of N
    ranks' values is ``terms=N + 1, scale=max sum |x_i|``; numbers are float64 unless ``dtype``
    says); ``rtol``/``atol`` a stated tolerance (a fit of measurements, a bound derived by the caller).
    """
    import torch

    if bounds and (rtol is not None or atol is not None or exact):
        raise ValueError("compare takes either rtol/atol, exact=True, or tolerance bounds, not several")
    exact = exact or (rtol == 0 and atol == 0)
    prefix = f"{what}: " if what else ""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{prefix}expected a tensor, got {type(got).__name__}"
        if tuple(got.shape) != tuple(expected.shape):
            return f"{prefix}shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
        if got.dtype != expected.dtype:
            return f"{prefix}dtype {got.dtype}, expected {expected.dtype}"
        bound = ""
        if exact or not expected.is_floating_point():
            ok = torch.equal(got, expected)
        elif rtol is not None or atol is not None:
            ok = torch.allclose(got.double(), expected.double(), rtol=rtol or 0.0, atol=atol or 0.0, equal_nan=False)
        else:
            result = tolerance.compare(got.detach(), expected.detach(), **bounds)
            ok, bound = result.ok, f", bound {result.bound:.3g} from rounding"
        if ok:
            return None
        diff = (got.detach().double() - expected.detach().double()).abs()
        idx = int(diff.nan_to_num(math.inf).flatten().argmax())
        return (f"{prefix}got {_short(got)} expected {_short(expected)} "
                f"(largest difference {float(diff.flatten()[idx]):.3g} at flat index {idx}{bound})")
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        if not isinstance(got, (int, float)) or isinstance(got, bool):
            return f"{prefix}expected a number, got {type(got).__name__}"
        if exact or (isinstance(expected, int) and rtol is None and atol is None and not bounds):
            ok = got == expected
        elif rtol is not None or atol is not None:
            ok = math.isclose(float(got), float(expected), rel_tol=rtol or 0.0, abs_tol=atol or 0.0)
        else:
            bounds.setdefault("dtype", torch.float64)
            ok = bool(tolerance.compare(torch.tensor(float(got), dtype=torch.float64),
                                        torch.tensor(float(expected), dtype=torch.float64), **bounds))
        return None if ok else f"{prefix}got {got!r} expected {expected!r}"
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return f"{prefix}expected a sequence of length {len(expected)}, got {_short(got)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            msg = compare(g, e, rtol, atol, what=f"{what}[{i}]" if what else f"[{i}]", exact=exact, **bounds)
            if msg:
                return msg
        return None
    return None if got == expected else f"{prefix}got {got!r} expected {expected!r}"


def reorder_tolerance(dtype, *wants) -> dict:
    """``compare``'s ``rtol``/``atol`` for a result computed in another order: derived, not tuned
    (course_lib.tolerance), 2 K u of its terms' scale, the largest finite value of ``wants``."""
    import torch

    scale = max([float(w.detach()[torch.isfinite(w.detach())].abs().max()) for w in wants
                 if isinstance(w, torch.Tensor) and torch.isfinite(w.detach()).any()] + [1e-30])
    return dict(rtol=0.0, atol=tolerance.reorder_bound(dtype) * scale)


def _short(x, n: int = 6) -> str:
    import torch

    if isinstance(x, torch.Tensor):
        flat = x.detach().flatten()
        vals = ", ".join(f"{v:.4g}" if x.is_floating_point() else str(int(v)) for v in flat[:n].tolist())
        more = ", ..." if flat.numel() > n else ""
        return f"[{vals}{more}]"
    return _one_line(repr(x), 80)


__all__ = ["Case", "Mismatch", "GradeFailed", "Shortcut", "Tampered", "TimeLimit", "all_checks_passed", "check",
           "check_distributed", "compare", "explain", "learner", "learner_class", "reorder_tolerance"]
