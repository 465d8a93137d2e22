"""course_lib/grading/guard.py and the grading core: the library is switched off while a
learner's function runs (in this process and in ranks), everything comes back afterwards,
an endless loop stops, and in a notebook a failed check raises a one-line GradeFailed."""
from __future__ import annotations

import ast
import importlib
import pathlib
import re
import time

import pytest
import torch
import torch.distributed as dist

from course_lib import collectives as C
from course_lib import tolerance
from course_lib.grading import (Case, GradeFailed, Shortcut, TimeLimit, check, check_distributed, compare, learner,
                                learner_class)
from course_lib.grading.guard import TORCH_COLLECTIVES, switched_off


def test_a_switched_off_function_raises_whatever_name_holds_it():
    from course_lib.collectives.ring import all_reduce as imported_before  # a copy made earlier

    def cheat(x):
        return imported_before(x)

    with pytest.raises(Shortcut, match="write this yourself: the exercise is the ring .*ring.all_reduce"):
        learner(cheat, "course_lib.collectives.ring:*", exercise="the ring")(torch.ones(2))
    assert imported_before.__code__.co_name != "stub"  # restored afterwards


def test_a_prefix_pattern_switches_off_the_grader_references():
    """"module:_*" switches off every function whose name starts with "_" (a grader's private
    references), and only those: it once named an attribute literally called "_*"."""
    from course_lib.grading import ddp_overlap as performance

    private = [name for name, v in vars(performance).items()
               if name.startswith("_") and getattr(v, "__module__", "") == performance.__name__ and hasattr(v, "__code__")]
    assert private
    for name in private:
        with pytest.raises(Shortcut, match="write this yourself"):
            learner(lambda: getattr(performance, name)(), "course_lib.grading.ddp_overlap:_*", exercise="x")()
    assert learner(lambda: performance.check_bucket_cap.__name__, "course_lib.grading.ddp_overlap:_*",
                   exercise="x")() == "check_bucket_cap"


def test_classes_methods_and_torch_are_switched_off_and_restored():
    from course_lib.parallel.zero import ShardedOptimizer

    code = ShardedOptimizer.__init__.__code__
    with switched_off(["course_lib.parallel.zero:*", "torch.nn.parallel:DistributedDataParallel",
                       TORCH_COLLECTIVES], "ZeRO"):
        with pytest.raises(Shortcut):
            ShardedOptimizer([torch.zeros(2, requires_grad=True)], torch.optim.SGD, lr=0.1)
        with pytest.raises(Shortcut, match="DistributedDataParallel"):
            torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        with pytest.raises(Shortcut):
            dist.all_reduce(torch.ones(1))
        with switched_off(["course_lib.parallel.zero:*"], "nested"):  # nested: restored once, at the end
            pass
        with pytest.raises(Shortcut):
            ShardedOptimizer([torch.zeros(2, requires_grad=True)], torch.optim.SGD, lr=0.1)
    assert ShardedOptimizer.__init__.__code__ is code
    assert "__new__" not in vars(torch.nn.parallel.DistributedDataParallel)
    assert dist.all_reduce.__code__.co_name != "stub"


class _WithInit(torch.nn.Module):
    def __init__(self, width, *, bias=True):
        super().__init__()
        self.lin = torch.nn.Linear(width, width, bias=bias)


class _Inherits(_WithInit):
    pass


def test_a_switched_off_class_can_be_built_with_arguments_afterwards():
    """Switching a class off must not break it for the rest of the process (assigning and then
    deleting a class's __new__ does: CPython then hands the arguments to object.__new__)."""
    from course_lib.moe import MoE

    for cls, args in ((_WithInit, (3,)), (_Inherits, (3,)), (MoE, (8, 16, 4, 1))):
        with switched_off([cls], "the layer"):
            with pytest.raises(Shortcut, match="write this yourself"):
                cls(*args)
        assert isinstance(cls(*args), cls)           # built again, with its arguments
    assert isinstance(_Inherits(2, bias=False), _WithInit)


def test_an_autograd_function_class_runs_guarded():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return C.ring.all_reduce(x)  # the library inside forward

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(Shortcut):
        learner_class(Double, "course_lib.collectives.ring:*", exercise="the unit").apply(torch.ones(2))


def test_a_target_that_does_not_resolve_fails_loudly():
    """A renamed library function must not quietly unguard a question (it once was a no-op)."""
    for target in ("course_lib.collectives.ring:no_such_function", "course_lib.collectives.ring:Nope.method",
                   "course_lib.collectives.no_such_module:*", "course_lib.collectives.ring:_no_such_prefix*"):
        with pytest.raises(LookupError, match=re.escape(repr(target))):
            learner(lambda: None, target, exercise="x")       # when the grader wraps, before any case
    # the doc's example
    with pytest.raises(Shortcut, match="course_lib.collectives.ring.all_reduce is switched off"):
        learner(lambda: C.ring.all_reduce(torch.ones(2)), "course_lib.collectives.ring:all_reduce",
                exercise="the ring")()
    with switched_off(["torch.distributed.distributed_c10d:a_collective_of_a_later_torch"], "x"):
        pass   # torch's names differ between versions: one this torch lacks is skipped


TARGET = re.compile(r"^(course_lib|torch)(\.\w+)*:(\w+(\.\w+)*|\w*\*)$")


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, (tuple, list, frozenset, set)):
        for v in value:
            yield from _strings(v)


def grading_targets() -> dict:
    """{grading module: its guard targets}: every "module:attr" string in its source (those
    written inline in a call too) and in its module-level constants (those built by f-strings)."""
    import course_lib.grading as grading

    found = {}
    for path in sorted(pathlib.Path(grading.__file__).parent.glob("*.py")):
        name = "course_lib.grading" + ("" if path.stem == "__init__" else "." + path.stem)
        module = importlib.import_module(name)
        tree = ast.parse(path.read_text())
        in_fstrings = {id(c) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for c in node.values}
        literals = [n.value for n in ast.walk(tree)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in in_fstrings]
        constants = [s for k, v in vars(module).items() if k.isupper() for s in _strings(v)]
        found[name] = sorted({s for s in literals + constants if TARGET.match(s)})
    return found


def test_every_graders_targets_resolve():
    """What the graders switch off exists: switching each grader's targets on and off (what a
    grader does around a learner's function) raises LookupError naming any renamed one."""
    targets = grading_targets()
    harness = {"course_lib.grading", "course_lib.grading.guard", "course_lib.grading.training",
               "course_lib.grading.harness"}  # (given targets)
    for name, module_targets in targets.items():
        source = pathlib.Path(importlib.import_module(name).__file__).read_text()
        if name not in harness and re.search(r"\b(learner|learner_class|switched_off)\(", source):
            assert module_targets, f"{name} guards a learner's function but no target was found in it"
        with switched_off(module_targets, "resolving the graders' targets"):
            pass
    assert sum(map(len, targets.values())) > 100


def test_an_endless_loop_stops_with_a_hint():
    def spin():
        while True:
            pass

    started = time.perf_counter()
    with pytest.raises(TimeLimit, match="more than 1 s"):
        learner(spin, exercise="x", seconds=1)()
    assert time.perf_counter() - started < 5


def _uses_gloo_all_reduce(x):
    dist.all_reduce(x)


def _uses_course_ring(x):
    C.all_reduce(x)


def _harness(fn):
    x = torch.ones(3)
    learner(fn, "course_lib.collectives:*", "course_lib.collectives.ring:*", TORCH_COLLECTIVES,
            exercise="the ring")(x)
    dist.all_reduce(x)  # the grader's own collective, after the learner's call: allowed
    return None


@pytest.mark.parametrize("cheat, what", [(_uses_gloo_all_reduce, "distributed_c10d.all_reduce"),
                                         (_uses_course_ring, "course_lib.collectives")])
def test_the_guard_is_active_inside_ranks(cheat, what, capsys):
    assert not check_distributed("ring", _harness, [Case({"fn": cheat}, 2)], timeout=20)
    line = capsys.readouterr().out.strip()
    assert "write this yourself: the exercise is the ring" in line and what in line, line


def test_in_a_notebook_a_failure_raises_one_line(monkeypatch, capsys):
    import course_lib.grading as G

    assert check("t", [Case()], lambda case: None)
    monkeypatch.setattr(G, "_in_notebook", lambda: True)
    with pytest.raises(GradeFailed) as err:
        check("t", [Case(label="the only case")], lambda case: "got 1 expected 2")
    assert str(err.value) == "t: FAILED case 1/1 (the only case): got 1 expected 2"
    assert err.value._render_traceback_() == ["\x1b[31m" + str(err.value) + "\x1b[0m"]
    assert capsys.readouterr().out.strip() == "t: 1/1 cases passed"  # the pass line only


def test_compare_uses_the_derived_bound_unless_told_exact_or_a_stated_tolerance():
    want = torch.linspace(-1, 1, 9)                               # fp32, max |want| = 1
    bound = tolerance.reorder_bound(torch.float32, 3) * 2.0       # 3 terms of sum |x_i| = 2
    assert compare(want + 0.9 * bound, want, dtype=torch.float32, terms=3, scale=2.0) is None
    msg = compare(want + 1.1 * bound, want, dtype=torch.float32, terms=3, scale=2.0, what="sum")
    assert msg.startswith("sum: got") and f"bound {bound:.3g} from rounding" in msg, msg
    assert compare(want * 2, want) is not None                    # a sum for a mean: far outside
    assert compare(want + 1e-4, want) is None                     # default: the course's TERMS, 4.9e-4 of 1
    assert compare(want.nextafter(torch.full_like(want, 2)), want, exact=True) is not None   # one ulp
    assert compare(torch.arange(3), torch.arange(3) + 1) is not None            # integers: exactly
    assert compare(1.02, 1.0, rtol=0.02) is None and compare(1.03, 1.0, rtol=0.02) is not None
    assert compare([1, 2], [1, 2]) is None and compare(3, 4) is not None
    after_sgd = dict(dtype=torch.float32, optimizer="sgd", steps=4, lr=0.1, grad_scale=1.0)
    assert compare(want + 1e-5, want, **after_sgd) is None and compare(want + 1e-3, want, **after_sgd)
    with pytest.raises(ValueError, match="not several"):
        compare(want, want, rtol=1e-5, terms=3)
