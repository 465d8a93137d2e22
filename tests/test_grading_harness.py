"""The graders' harness (course_lib/grading/harness.py): a table of cases against the library's
reference, in this process; the reference runs first and outside the guard, the learner gets
a copy; a wrong kind of answer, a wrong answer with its hint, a shortcut, a mutated input and
a gradient that is None where one device has one are each named."""
from __future__ import annotations

import torch

from course_lib.grading import Case, Mismatch
from course_lib.grading.harness import check_answers, grads_differ, guarded, number, table
from grading_answers import graded


def _sorted_unique(xs):                         # the "library" of these tests
    return sorted(set(xs))


CASES = table([([3, 1, 3],), ([],), ([5, -2, 5, 0],)], "xs={}")


def _check(fn, **kw):
    return check_answers("unique", fn, CASES, _sorted_unique, guard=(_sorted_unique,),
                         exercise="deduplicating", **kw)


def test_right_answers_pass_and_wrong_ones_name_the_case(capsys):
    assert graded(capsys, _check, lambda xs: sorted(dict.fromkeys(xs))) == (True, "unique: 3/3 cases passed")
    ok, line = graded(capsys, _check, lambda xs: sorted(xs),
                      hint=lambda got, want, xs: " (each value once)" if len(got) > len(want) else "")
    assert not ok and line == "unique: FAILED case 1/3 (xs=[3, 1, 3]): got [1, 3, 3], expected [1, 3] (each value once)"


def test_the_reference_is_off_while_the_learner_runs_and_the_learner_gets_a_copy(capsys):
    ok, line = graded(capsys, _check, lambda xs: _sorted_unique(xs))
    assert not ok and "write this yourself" in line and "deduplicating" in line

    def mutating(xs):                           # changing its input must not change what is judged
        out = sorted(set(xs))
        xs.append(99)
        return out
    assert graded(capsys, _check, mutating, differ=lambda got, want, xs: None if got == want == _sorted_unique(xs)
                  else "the case's input changed")[0]


def test_read_and_differ_and_wanted_values(capsys):
    def read(got, xs):
        if not isinstance(got, list):
            raise Mismatch(f"return a list, got {type(got).__name__}")
        return got
    ok, line = graded(capsys, _check, lambda xs: tuple(sorted(set(xs))), read=read)
    assert not ok and line.endswith("return a list, got tuple")
    cases = [Case(dict(args=dict(a=2, b=3), want=5.0), label="2 + 3")]
    check = lambda fn: check_answers("add", fn, cases, None, exercise="adding", read=number,  # noqa: E731
                                     differ=lambda got, want, **_: None if got == want else "not the sum")
    assert graded(capsys, check, lambda a, b: a + b)[0]
    assert graded(capsys, check, lambda a, b: "5")[1].endswith("expected a finite number, got '5'")
    assert graded(capsys, check, lambda a, b: a * b)[1].endswith("not the sum")


def test_grads_differ_names_the_parameter():
    torch.manual_seed(0)
    ref, mine = torch.nn.Linear(3, 2).double(), torch.nn.Linear(3, 2).double()
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, dtype=torch.float64)
    ref(x).sum().backward()
    assert grads_differ(mine, ref).startswith("weight.grad is None, expected a gradient")
    mine(x).sum().backward()
    assert grads_differ(mine, ref) is None
    mine.bias.grad *= 2
    assert grads_differ(mine, ref, "step 1: ").startswith("step 1: bias.grad: got")


def test_guarded_runs_learner_code_in_pieces_with_the_targets_off():
    run = guarded(_sorted_unique, exercise="deduplicating", seconds=5)
    assert run(lambda xs: sorted(dict.fromkeys(xs)), [2, 1, 2]) == [1, 2]
    try:
        run(_sorted_unique, [1])
    except Exception as exc:  # noqa: BLE001 - the Shortcut
        assert "write this yourself" in str(exc)
    else:
        raise AssertionError("the target was not switched off")
    assert _sorted_unique([2, 2]) == [2]        # and on again afterwards
