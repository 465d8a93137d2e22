"""course_lib/viz/dry_run.py: the step of one rank cut into parts, on spans whose parts are
known by construction (integer times: exact sums)."""
import pytest

from course_lib.trace import Span
from course_lib.viz.dry_run import largest_loss, step_breakdown


def _spans():
    return [
        Span(0, "F0", "compute", 0, 4, "pp"), Span(0, "SP all-gather", "comm", 1, 2, "tp"),
        Span(0, "recv grad", "comm", 4, 7, "pp"),          # waiting on stage 1: bubble
        Span(0, "B0", "compute", 7, 12, "pp"), Span(0, "SP reduce-scatter", "comm", 11, 13, "tp"),
        Span(0, "all-reduce", "comm", 14, 17, "dp"),        # after the schedule
        Span(0, "embedding sync", "comm", 17, 18, "pp"),
        Span(1, "F0", "compute", 4, 6, "pp"), Span(1, "B0", "compute", 6, 7, "pp"),
        Span(1, "embedding sync", "comm", 12, 14, "pp"),    # waits for stage 0's last backward
    ]


def test_parts_sum_to_the_step_and_each_is_exact():
    parts = step_breakdown(_spans(), 0)
    assert parts == {"compute": 7, "exposed TP": 3, "pipeline bubble": 3, "DP all-reduce": 3,
                     "optimizer and syncs": 2}
    assert sum(parts.values()) == 18
    assert largest_loss(parts) == "exposed TP"     # first of the ties, in the parts' order
    later = step_breakdown(_spans(), 0, step_end=20)  # optimizer kernels without a span
    assert later["optimizer and syncs"] == 4 and sum(later.values()) == 20


def test_a_stage_done_early_waits_for_the_drain():
    parts = step_breakdown(_spans(), 1)               # rank 1's last op ends at 7, rank 0's at 12
    assert parts == {"compute": 3, "exposed TP": 0, "pipeline bubble": 5, "DP all-reduce": 0,
                     "optimizer and syncs": 2}
    assert largest_loss(parts) == "pipeline bubble"


def test_unknown_rank_is_refused():
    with pytest.raises(ValueError, match="no span of rank 5"):
        step_breakdown(_spans(), 5)


def test_a_gradient_sum_over_tp_is_data_parallelism():
    """The SP norms' sum (dp x tp) and the experts' (tp x edp) after the schedule are DP's, not
    exposed TP: on the sweep's MoE beside tp 2 + SP, 165 ms of "exposed TP" was mostly the
    experts' bucket all-reduces over tp x edp."""
    spans = [Span(0, "F0", "compute", 0, 4, "pp"), Span(0, "SP all-gather", "comm", 1, 2, "tp"),
             Span(0, "all-reduce b0", "comm", 4, 6, "dp+tp"), Span(0, "all-reduce b1", "comm", 6, 9, "tp+edp")]
    parts = step_breakdown(spans, 0)
    assert parts["exposed TP"] == 1 and parts["DP all-reduce"] == 5 and sum(parts.values()) == 9
