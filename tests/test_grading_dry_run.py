"""course_lib/grading/dry_run.py (chapter 10, issue #36): each grader fails the classic
mistakes, an answer hard-coded to one case and a call to the library's own search or
breakdown, with a hint naming the mistake, and passes a right answer written differently."""
from __future__ import annotations

import itertools

import pytest

from course_lib.grading import dry_run as G
from course_lib.planner import Layout, estimate
from grading_answers import passed, refused


# ----------------------------------------------------------------------------- a layout for a target MFU
def _first_reaching(model, hardware, n_gpus, global_batch, memory_limit, target_mfu):
    """Right, written differently from the solution: the first candidate reaching the target."""
    for tp, zero, rc, mb in itertools.product((1, 2, 4, 8), (3, 2, 1, 0), ("none", "selective", "full"),
                                              (4, 2, 1)):
        if n_gpus % tp:
            continue
        layout = Layout(dp=n_gpus // tp, tp=tp, sp=tp > 1, zero=zero, recompute=rc, micro_batch=mb,
                        global_batch=global_batch)
        try:
            est = estimate(model, hardware, layout, n_gpus=n_gpus)
        except ValueError:
            continue
        if est.memory["total"] <= memory_limit and est.mfu >= target_mfu:
            return layout
    return None


def _hard_coded(model, hardware, n_gpus, global_batch, memory_limit, target_mfu):
    return Layout(dp=8, tp=2, sp=True, zero=2, micro_batch=4, global_batch=64)   # case 1's best


def _all_tp(model, hardware, n_gpus, global_batch, memory_limit, target_mfu):
    """The classic "TP inside the node, PP across": TP 8 and the rest pipeline stages."""
    return Layout(tp=8, sp=True, pp=n_gpus // 8, global_batch=global_batch, recompute="selective")


def _plain_dp(model, hardware, n_gpus, global_batch, memory_limit, target_mfu):
    """The classic "just data parallel": no ZeRO, no recomputation, micro-batch 1."""
    return Layout(dp=n_gpus, global_batch=global_batch)


def _library_search(model, hardware, n_gpus, global_batch, memory_limit, target_mfu):
    from course_lib.planner.search import search

    return search(model, hardware, n_gpus, global_batch, memory_limit=memory_limit).best.layout


@pytest.mark.parametrize("wrong, hints", [
    (_hard_coded, ["case 2/", "8 x h100-sxm"]),
    # (38.6% before #36 priced the a100-80gb preset's fused attention at its 0.30 of peak; 38.9%
    # before FlashAttention's tile x wave model, which charges the A100's kernel its waves)
    (_all_tp, ["case 1/", "reaches MFU", "the search's best: 38.4%"]),
    (_plain_dp, ["case 1/", "reaches MFU", "under the target"]),
    (_library_search, ["write this yourself", "search"]),
], ids=["hard-coded", "tp-inside-pp-across", "plain-dp", "library-search"])
def test_layout_for_mfu_refuses(wrong, hints, capsys):
    refused(capsys, "layout_for_mfu", G.check_layout_for_mfu(wrong), *hints)


def test_layout_for_mfu_accepts_the_first_layout_reaching_the_target(capsys):
    passed(capsys, G.check_layout_for_mfu(_first_reaching), "layout_for_mfu: 3/3 cases passed")


# ----------------------------------------------------------------------------- the largest loss of a row
def _by_utilization(model, hardware, layout):
    """Right, written differently: recompute from MFU over HFU, shares of the step."""
    est = estimate(model, hardware, layout)
    t, step = est.time, est.step_time
    shares = [((t["bubble"] + t["pp"]) / step, "pipeline bubble"), (t["tp"] / step, "exposed TP communication"),
              ((t["dp"] + t["zero"]) / step, "DP all-reduce"),
              (t["compute"] * (1 - est.mfu / est.hfu) / step, "recompute")]
    return sorted(shares)[-1][1]


def _always_bubble(model, hardware, layout):
    return "pipeline bubble"


def _time_kinds_only(model, hardware, layout):
    """The classic: the largest of the planner's time kinds, forgetting that recompute hides
    inside compute."""
    t = estimate(model, hardware, layout).time
    named = {"pipeline bubble": t["bubble"] + t["pp"], "exposed TP communication": t["tp"],
             "DP all-reduce": t["dp"] + t["zero"]}
    return max(named, key=named.get)


def _not_a_choice(model, hardware, layout):
    return "TP"


def _library_breakdown(model, hardware, layout):
    from course_lib.viz.dry_run import largest_loss

    t = estimate(model, hardware, layout).time
    return largest_loss({"compute": t["compute"], "pipeline bubble": t["bubble"], "exposed TP communication": t["tp"]})


@pytest.mark.parametrize("wrong, hints", [
    (_always_bubble, ["case 1/", "GPT 22B", "exposed TP communication 14.8%"]),
    (_time_kinds_only, ["case 5/", "GPT 1.7B", "recompute 15.9%"]),
    (_not_a_choice, ["case 1/", "expected one of", "'TP'"]),
    (_library_breakdown, ["write this yourself"]),
], ids=["hard-coded", "forgets-recompute", "not-a-choice", "library-breakdown"])
def test_largest_loss_refuses(wrong, hints, capsys):
    refused(capsys, "largest_loss", G.check_largest_loss(wrong), *hints)


def test_largest_loss_accepts_shares_of_the_step(capsys):
    passed(capsys, G.check_largest_loss(_by_utilization), "largest_loss: 7/7 cases passed")
