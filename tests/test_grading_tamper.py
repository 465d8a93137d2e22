"""course_lib/grading/integrity.py: an answer that rebinds the grader's own names from inside
the rank (or the grading process) fails, and the grader is whole again afterwards (issue 34:
``compare`` and ``too_many_bytes`` replaced scored full marks)."""
from __future__ import annotations

import pytest
import torch

from course_lib.grading import Tampered, collective_algorithms as G, learner
from course_lib.grading import p2p
from grading_answers import refused


def _silence_the_grader(tensor):                       # no all-reduce at all: the grader is told to agree
    import sys

    for name in ("course_lib.grading.collective_algorithms", "course_lib.grading.p2p"):
        module = sys.modules[name]
        module.compare = lambda *a, **k: None
        module.too_many_bytes = lambda *a, **k: None


def _rewrite_compare_code(tensor):                     # the function object kept, its code swapped
    from course_lib import grading

    grading.compare.__code__ = (lambda *a, **k: None).__code__


def _patch_torch(tensor):                              # torch's own comparison made to agree
    torch.equal = lambda *a, **k: True
    torch.allclose = lambda *a, **k: True


@pytest.mark.parametrize("attack", [_silence_the_grader, _rewrite_compare_code, _patch_torch],
                         ids=["rebind-compare", "swap-code", "patch-torch"])
def test_an_answer_that_patches_the_grader_in_the_rank_fails(attack, capsys):
    refused(capsys, "ring_all_reduce", G.check_ring_all_reduce(attack, timeout=4), "changed the grader",
            "scores 0")


def test_an_answer_that_patches_the_grader_in_process_fails_and_the_grader_is_restored(capsys):
    from course_lib import grading

    def fit(rows):                                     # a wrong fit that silences the comparison
        grading.collective_algorithms.compare = lambda *a, **k: None
        return (0.0, 0.0)

    compare, equal = G.compare, torch.equal
    refused(capsys, "fit_alpha_beta", G.check_fit_alpha_beta(fit), "changed the grader",
            "collective_algorithms.compare")
    assert G.compare is compare and torch.equal is equal and p2p.too_many_bytes.__code__.co_name == "too_many_bytes"


def test_a_right_answer_that_imports_and_defines_things_is_not_tampering():
    def answer(x):
        import course_lib.grading.training  # noqa: F401  (a new module or name is no change)
        torch.manual_seed(0)
        return x + 1

    assert learner(answer, exercise="x")(1) == 2
    with pytest.raises(Tampered, match="builtins.len"):
        learner(lambda: __import__("builtins").__setattr__("len", lambda x: 0), exercise="x")()
    assert len([1]) == 1
