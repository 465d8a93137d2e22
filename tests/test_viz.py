"""course_lib.viz.timeline: one row per rank, coloured by kind, labels where they fit."""
import matplotlib

matplotlib.use("Agg")

from course_lib.trace import Span  # noqa: E402
from course_lib.viz import KIND_COLORS, busy_fraction, timeline  # noqa: E402


def _spans():
    return [Span(0, "forward", "compute", 0.0, 0.010), Span(0, "all_reduce", "comm", 0.010, 0.014),
            Span(1, "forward", "compute", 0.001, 0.011), Span(1, "wait", "idle", 0.011, 0.012),
            Span(1, "tiny", "comm", 0.012, 0.0121)]


def test_timeline_rows_colours_and_labels():
    fig = timeline(_spans(), title="step")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    bars = ax.patches
    assert len(bars) == 5
    colours = {matplotlib.colors.to_hex(b.get_facecolor()) for b in bars}
    assert colours == {KIND_COLORS["compute"].lower(), KIND_COLORS["comm"].lower(), KIND_COLORS["idle"].lower()}
    labels = [t.get_text() for t in ax.texts]
    assert "forward" in labels and "all_reduce" in labels and "tiny" not in labels  # too narrow to label
    assert ax.get_xlabel() == "time (ms)"
    matplotlib.pyplot.close(fig)


def test_timeline_named_rows_and_empty():
    fig = timeline(_spans(), row_names={0: "stage 0", 1: "stage 1"}, unit="µs")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["stage 0", "stage 1"]
    assert fig.axes[0].get_xlabel() == "time (µs)"
    assert timeline([]).axes[0].get_title().startswith("timeline")


def test_busy_fraction():
    frac = busy_fraction(_spans(), kind="compute")
    assert abs(frac[0] - 10 / 14) < 1e-9 and abs(frac[1] - 10 / 14) < 1e-9
