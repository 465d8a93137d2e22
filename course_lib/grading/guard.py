"""While a learner's function runs, the code that would do the exercise for it is off.

    answer = learner(fn, "course_lib.collectives.ring:all_reduce", TORCH_COLLECTIVES,
                     exercise="the ring", seconds=10)
    answer(x)   # fn(x); the ring's all_reduce and torch's collectives raise Shortcut meanwhile

The wrapper travels by value (into ranks too). A target is off *as an object*: a Python
function's ``__code__`` is swapped for one that raises (so a copy imported earlier is off
too), a class cannot be constructed, a ``ProcessGroup`` method raises; all restored after.
The grader's own code is pinned (:mod:`.integrity`): an answer that rebinds its names is
undone and fails with :class:`Tampered`; ``seconds`` stops an endless loop (:class:`TimeLimit`).

Targets: a callable, "module:attr.path", "module:*" (every function and method the module
defines or lists in ``__all__``; "module:_*" those starting with "_"), or lists of those. A
course_lib target that names nothing raises LookupError when the learner's function is
wrapped, before any case runs (tests/test_grading_guard.py resolves every grader's targets);
a torch name this torch version lacks is skipped.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import signal
import threading
from typing import Callable

from course_lib.grading.integrity import Tampered, pinned

# torch.distributed's collectives, at both levels: the Python functions (learners call these)
# and the ProcessGroup methods they end in (which a learner could call directly).
TORCH_COLLECTIVES = tuple(
    f"torch.distributed.distributed_c10d:{name}" for name in (
        "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "_all_gather_base",
        "all_gather_coalesced", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor",
        "_reduce_scatter_base", "broadcast", "broadcast_object_list", "reduce", "all_to_all",
        "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list",
        "all_gather_single", "reduce_scatter_single")  # torch 2.13's names; absent names are skipped
) + tuple(f"torch._C._distributed_c10d:ProcessGroup.{name}" for name in (
    "allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "all_gather_single",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
    "reduce_scatter_single", "reduce_scatter_tensor_coalesced", "broadcast", "reduce", "alltoall",
    "alltoall_base", "all_to_all_single", "gather", "scatter"))
# torch's own data-parallel wrappers and optimizers that shard (chapters 3-4)
TORCH_DATA_PARALLEL = (
    "torch.nn.parallel:DistributedDataParallel",
    "torch.distributed.optim:ZeroRedundancyOptimizer",
    "torch.distributed.fsdp:FullyShardedDataParallel",
    "torch.distributed.fsdp:fully_shard",
)
# the course's own (chapters 3-4): DDP's gradient sync, and FSDP with the parts it inherits
COURSE_DATA_PARALLEL = ("course_lib.parallel.grad_sync:*", "course_lib.parallel.data_parallel:*")
COURSE_FSDP = ("course_lib.parallel.fsdp:*", *(f"course_lib.parallel.fsdp_{m}:*" for m in (
    "controls", "gather", "gradients", "grad_norm", "state_dict")))


_DUNDERS = ("__init__", "__call__")


class Shortcut(RuntimeError):
    """The learner's code called what the exercise asks it to write."""


class TimeLimit(TimeoutError):
    """The learner's function ran past its time limit in the grading process."""


# The process-wide record of what is switched off (a target may be guarded by nested calls).
# Guarding is process state by nature: torch's own functions are what is switched off.
_ACTIVE: dict = {}
_LOCK = threading.RLock()


def _resolve(target):
    """(owner, attribute name, object) for "module:attr.path", or (None, None, obj) for an
    object; None for a name outside course_lib that this torch version does not have."""
    if not isinstance(target, str):
        return None, None, target
    module, _, path = target.partition(":")
    *parents, name = path.split(".")
    try:
        owner = importlib.import_module(module)
        for part in parents:
            owner = getattr(owner, part)
    except (ImportError, AttributeError) as exc:
        raise LookupError(f"guard target {target!r} does not resolve: {exc}") from exc
    if not hasattr(owner, name):
        if module.partition(".")[0] == "course_lib":
            raise LookupError(f"guard target {target!r} does not resolve: {module} has no {path!r} "
                              f"(renamed? the grader must name it as it is now)")
        return None
    return owner, name, getattr(owner, name)


def _flatten(targets):
    """Targets one by one; "module:*" stands for every function that module defines,
    "module:_*" for those whose name starts with "_" (any prefix before the "*")."""
    for t in targets:
        if isinstance(t, (list, tuple)):
            yield from _flatten(t)
        elif isinstance(t, str) and t.endswith("*") and ":" in t:
            modname, _, prefix = t[:-1].partition(":")
            try:
                module = importlib.import_module(modname)
            except ImportError as exc:
                raise LookupError(f"guard target {t!r} does not resolve: {exc}") from exc
            public = set(getattr(module, "__all__", ()))  # re-exports of a module that moved count too
            matched = False
            for name, value in sorted(vars(module).items()):
                if not name.startswith(prefix):
                    continue
                home = getattr(value, "__module__", None) or ""
                if home != module.__name__ and not (name in public and home.startswith("course_lib")):
                    continue
                if hasattr(value, "__code__"):
                    matched = True
                    yield f"{module.__name__}:{name}"
                elif isinstance(value, type):  # a class: each method it defines (autograd Functions too)
                    for attr, member in sorted(vars(value).items()):
                        raw = getattr(member, "__func__", member)
                        if hasattr(raw, "__code__") and (not attr.startswith("__") or attr in _DUNDERS):
                            matched = True
                            yield f"{module.__name__}:{name}.{attr}"
            if not matched:
                raise LookupError(f"guard target {t!r} matches no function or method of {modname}")
        else:
            yield t


def _stub_code(code, message: str):
    """A code object that raises Shortcut(message) with the same free variables as ``code``
    (a function's __code__ may only be swapped for one with as many free variables)."""
    free = code.co_freevars
    lines = ["def _outer():"]
    if free:
        lines.append("    " + " = ".join(free) + " = None")
    lines.append("    def stub(*args, **kwargs):")
    if free:
        lines.append("        " + ", ".join(free))
    lines.append("        raise __import__('course_lib.grading.guard', fromlist=['Shortcut'])"
                 f".Shortcut({message!r})")
    lines.append("    return stub")
    namespace: dict = {}
    exec(compile("\n".join(lines), f"<switched off: {code.co_name}>", "exec"), namespace)
    return namespace["_outer"]().__code__


def _label(owner, name, obj) -> str:
    if owner is not None:
        return f"{getattr(owner, '__module__', None) or getattr(owner, '__name__', '')}.{name}".lstrip(".")
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"


def _held(key, switch, restore):
    """``switch()`` unless ``key`` is already off (nested guards count in ``_ACTIVE``); returns
    the function that, at the last release, calls ``restore()``."""
    if key not in _ACTIVE:
        _ACTIVE[key] = [restore, 0]
        switch()
    _ACTIVE[key][1] += 1

    def release():
        entry = _ACTIVE[key]
        entry[1] -= 1
        if entry[1] == 0:
            entry[0]()
            del _ACTIVE[key]
    return release


def _switch_off_code(raw, message: str):
    """Swap a Python function's code for one raising Shortcut; returns the restore function."""
    code = raw.__code__
    return _held(("code", id(raw)), lambda: setattr(raw, "__code__", _stub_code(code, message)),
                 lambda: setattr(raw, "__code__", code))


def _switch_off(target, exercise: str):
    """Switch one target off; returns a function that switches it back on."""
    resolved = _resolve(target)
    if resolved is None:
        return lambda: None
    owner, name, obj = resolved
    label = _label(owner, name, obj)
    message = (f"write this yourself: the exercise is {exercise} ({label} is switched off while "
               f"your function runs)")
    raw = getattr(obj, "__func__", obj)  # a bound or class method: its function
    if hasattr(raw, "__code__"):           # a Python function: every reference to it is off
        return _switch_off_code(raw, message)

    def replacement(*args, **kwargs):
        raise Shortcut(message)
    if isinstance(obj, type):              # a class: constructing it raises
        # Through __init__, never __new__: once a __new__ assigned to a class is deleted again,
        # CPython's tp_new slot passes the arguments on to object.__new__, and the class can
        # no longer be built anywhere in the process ("object.__new__() takes exactly one
        # argument"). A class's own __init__ is switched off like any function.
        own_init = obj.__dict__.get("__init__")
        if hasattr(own_init, "__code__"):
            return _switch_off_code(own_init, message)
        owner, name, saved_attr = obj, "__init__", None   # inherited: a refusing one, deleted after
        key = ("attr", id(obj), "__init__")
    else:                                  # a builtin method (ProcessGroup.allreduce): replace the attribute
        if owner is None:
            raise TypeError(f"cannot switch off {obj!r}: name it as 'module:attr'")
        saved_attr = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        key = ("attr", id(owner), name)
    return _held(key, lambda: setattr(owner, name, replacement),
                 lambda: delattr(owner, name) if saved_attr is None else setattr(owner, name, saved_attr))


@contextlib.contextmanager
def switched_off(targets, exercise: str):
    """Inside the block, every target raises :class:`Shortcut` naming ``exercise``."""
    restores = []
    with _LOCK:
        try:
            for target in _flatten(targets):
                restores.append(_switch_off(target, exercise))
        except BaseException:
            for restore in reversed(restores):
                restore()
            raise
    try:
        yield
    finally:
        with _LOCK:
            for restore in reversed(restores):
                restore()


@contextlib.contextmanager
def time_limit(seconds):
    """Raise :class:`TimeLimit` in the block after ``seconds`` (main thread, where SIGALRM exists)."""
    usable = (seconds and hasattr(signal, "SIGALRM")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def expire(signum, frame):
        raise TimeLimit(f"your function ran for more than {seconds:g} s and was stopped "
                        f"(an endless loop, or far more work than this case needs)")
    previous = signal.signal(signal.SIGALRM, expire)
    old_timer = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if old_timer[0]:  # an enclosing limit keeps running
            signal.setitimer(signal.ITIMER_REAL, old_timer[0])


def learner(fn: Callable, *targets, exercise: str, seconds: float | None = None) -> Callable:
    """``fn`` wrapped so that each call runs with ``targets`` switched off (and a time limit)."""
    if not callable(fn):
        raise TypeError(f"expected your function, got {type(fn).__name__}: {fn!r}")
    for target in _flatten(targets):   # a target naming nothing fails here, before any case runs
        _resolve(target)

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        # pinned outermost: the grader is recorded before anything is switched off, and
        # checked (and put back) after everything is switched on again
        with pinned(), switched_off(targets, exercise), time_limit(seconds):
            return fn(*args, **kwargs)
    return guarded


def learner_class(cls, *targets, exercise: str, seconds: float | None = None):
    """A subclass of the learner's class whose methods (and constructor) run guarded."""
    if not isinstance(cls, type):
        raise TypeError(f"expected your class, got {type(cls).__name__}: {cls!r}")
    wrapped = {}
    for name, value in vars(cls).items():
        if isinstance(value, (staticmethod, classmethod)):
            wrapped[name] = type(value)(learner(value.__func__, *targets, exercise=exercise, seconds=seconds))
        elif callable(value) and not isinstance(value, type) and hasattr(value, "__code__"):
            wrapped[name] = learner(value, *targets, exercise=exercise, seconds=seconds)
    return type(cls.__name__, (cls,), wrapped)


__all__ = ["learner", "learner_class", "switched_off", "time_limit", "Shortcut", "TimeLimit", "Tampered",
           "TORCH_COLLECTIVES", "TORCH_DATA_PARALLEL", "COURSE_DATA_PARALLEL", "COURSE_FSDP"]
