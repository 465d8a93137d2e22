"""A module a grader switches off whole ("module:*") stays off when it is split (issue #35).

"module:*" covers what that module defines or re-exports in ``__all__``, and each method a
class there defines itself. A split can move code out of that reach while every import keeps
working: a package's ``__init__`` re-exports its submodules' public names but not their
helpers, and a class that inherits its methods from parts in other modules (FSDP's) defines
few of them itself. So wherever a grader's constant names one of the modules in SPLIT
"module:*", it must also name every submodule of that package, and the module of every
course_lib class a covered class inherits from. (Not every "package:*" means its parts:
"course_lib.collectives:*" names the algorithms' modules one by one and leaves the Comm layer
on, on purpose.) Checked on the graders' own constants, and shown to bite on a made-up tuple.
"""
from __future__ import annotations

import importlib
import pkgutil



# Modules split into parts (issue #35) that graders switch off whole: add one when you split it.
SPLIT = ("course_lib.schedules", "course_lib.parallel.fsdp")


def _strings(value):
    """The strings in a constant, tuples of tuples (and ``*(...)`` expansions) flattened."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _strings(v)


def _whole(targets):
    return {t[:-2] for t in targets if t.endswith(":*") and t.startswith("course_lib")}


def uncovered(targets) -> list[str]:
    """The parts of the modules ``targets`` switch off whole that they leave on."""
    whole, missing = _whole(targets), []
    for name in sorted(whole & set(SPLIT)):
        module = importlib.import_module(name)
        parts = [f"{name}.{m.name}" for m in pkgutil.iter_modules(getattr(module, "__path__", []))]
        public = set(getattr(module, "__all__", ()))
        for attr, value in vars(module).items():
            home = getattr(value, "__module__", "") or ""
            if isinstance(value, type) and (home == name or (attr in public and home.startswith("course_lib"))):
                parts += [base.__module__ for base in value.__mro__[1:] if base.__module__.startswith("course_lib")]
        missing += [f"{name}:* leaves {part}:* on" for part in dict.fromkeys(parts)
                    if part != name and part not in whole]
    return missing


def test_a_split_module_stays_switched_off():
    import course_lib.grading as grading

    found = 0
    for info in pkgutil.iter_modules(grading.__path__):
        module = importlib.import_module(f"course_lib.grading.{info.name}")
        for constant, value in vars(module).items():
            targets = list(_strings(value)) if constant.isupper() else []
            if not _whole(targets) & set(SPLIT):
                continue
            found += 1
            assert not uncovered(targets), (module.__name__, constant, uncovered(targets))
    assert found >= 5   # (the graders of chapters 4, 6, 10 and 11 switch them off whole)


def test_the_check_sees_a_part_left_on():
    assert uncovered(("course_lib.schedules:*",))[0] == "course_lib.schedules:* leaves course_lib.schedules.actions:* on"
    left_on = uncovered(("course_lib.parallel.fsdp:*", "course_lib.parallel.fsdp_gather:*"))
    assert "course_lib.parallel.fsdp:* leaves course_lib.parallel.fsdp_gradients:* on" in left_on
    assert not any("fsdp_gather" in m for m in left_on)
