"""The grader's own code, pinned while a learner's function runs.

A learner's function runs in the process that then judges it (the notebook's kernel for
in-process checks, a rank for distributed ones), so it could rebind the grader's names:

    sys.modules["course_lib.grading.collective_algorithms"].compare = lambda *a, **k: None

:func:`pinned` records, before the learner's code runs, what a verdict rests on: the
namespaces of every loaded ``course_lib.grading`` module, ``course_lib.tolerance`` and
``course_lib.launch`` (each name's object, each function's code, defaults and closure, each
class's attributes), ``builtins``, ``math``, and torch's top-level names and Tensor methods.
Afterwards anything changed is put back, so the comparison that follows runs the grader's
own code, and the answer fails with :class:`Tampered` naming what it changed. Names the
learner's code added (an import) are left alone.

The limit: this checks the rank's state when the learner's function returns; code the
learner leaves running (a thread) could still act later. The verdict's inputs, not only
its functions, live in the same process, which is why graders compute expected values from
seeds rather than from objects the learner's function receives.
"""
from __future__ import annotations

import builtins
import contextlib
import math
import sys
import types

_MISSING = object()


class Tampered(RuntimeError):
    """The learner's function changed the code that grades it."""


def _namespaces():
    """(label, owner, its attribute dict) for everything a verdict rests on: builtins and this
    module first, so that restoring them first makes the rest of the restore trustworthy."""
    import torch

    mine = sys.modules[__name__]
    out = [("builtins", builtins, vars(builtins)), (__name__, mine, vars(mine)), ("math", math, vars(math)),
           ("torch", torch, vars(torch)), ("torch.Tensor", torch.Tensor, vars(torch.Tensor)),
           ("torch.Tensor", torch._C.TensorBase, vars(torch._C.TensorBase))]
    for name, module in list(sys.modules.items()):
        if module is None or module is mine or not (name.startswith("course_lib.grading")
                                                    or name in ("course_lib.tolerance", "course_lib.launch",
                                                                "course_lib.forkserver", "course_lib.rank_process")):
            continue
        out.append((name, module, vars(module)))
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                out.append((f"{name}.{value.__qualname__}", value, vars(value)))
    return out


def _cells(fn) -> tuple:
    out = []
    for cell in fn.__closure__ or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            out.append(_MISSING)
    return tuple(out)


def snapshot():
    """What the grader's verdict rests on, now (see the module doc)."""
    spaces, functions = [], []
    for label, owner, ns in _namespaces():
        items = dict(ns)
        spaces.append((label, owner, ns, items, isinstance(owner, types.ModuleType)))
        if label.startswith("course_lib"):
            for key, value in items.items():
                raw = getattr(value, "__func__", value)  # static and class methods: their function
                if hasattr(raw, "__code__") and getattr(raw, "__module__", "").startswith("course_lib"):
                    functions.append((f"{label}.{key}", raw, raw.__code__, raw.__defaults__,
                                      raw.__kwdefaults__, _cells(raw)))
    return spaces, functions


def restore(state) -> list:
    """Put back what changed since ``snapshot()``; returns the changed names (empty: untouched).

    Written to run even if the learner replaced builtins or this module's names: a module's
    names are put back by assigning to its dict (builtins and this module first), before any
    builtin or helper is called."""
    spaces, functions = state
    changed = []
    for label, owner, ns, items, is_module in spaces:
        for key, value in items.items():
            if ns.get(key, _MISSING) is value:
                continue
            changed.append(label + "." + key)
            if is_module:  # a module's dict: assign directly
                ns[key] = value
                continue
            try:
                setattr(owner, key, value)
            except (TypeError, AttributeError):  # a builtin type refuses: nothing could have changed it
                pass
    for label, fn, code, defaults, kwdefaults, cells in functions:
        now = _cells(fn)
        if (fn.__code__ is code and fn.__defaults__ is defaults and fn.__kwdefaults__ is kwdefaults
                and len(now) == len(cells) and all(a is b for a, b in zip(now, cells))):
            continue
        changed.append(label)
        fn.__code__, fn.__defaults__, fn.__kwdefaults__ = code, defaults, kwdefaults
        for cell, value in zip(fn.__closure__ or (), cells):
            if value is not _MISSING:
                cell.cell_contents = value
    return sorted(set(changed))


@contextlib.contextmanager
def pinned():
    """Inside the block the learner's code runs; on leaving, the grader is restored and a
    change raises :class:`Tampered` (a change made while the block raised is restored too)."""
    state, undo, code = snapshot(), restore, restore.__code__   # held by this frame, not by names
    try:
        yield
    finally:
        undo.__code__ = code
        changed = undo(state)
        if changed:
            names = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            raise Tampered(f"your function changed the grader ({names}): an answer is graded by code it "
                           f"may not replace; this case scores 0")


__all__ = ["Tampered", "pinned", "snapshot", "restore"]
