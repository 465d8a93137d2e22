"""course_lib.viz: the timeline (one row per rank, coloured by kind), the model-vs-measured plot."""
import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

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


def test_measured_vs_model_plots_the_fit_and_its_errors():
    from course_lib import costmodel as cm
    from course_lib.viz import collectives as vc

    A, B, cache = 30e-6, 0.25e-9, 8 << 20
    ms = [cm.Measurement("segmented_ring_all_reduce", n, N,
                         cm.segmented_ring_all_reduce(n, N, A, B * (1.5 if cm.in_memory(n, N, cache) else 1)) * w)
          for N in (2, 4) for n, w in ((64 << 10, 1.0), (1 << 20, 1.1), (16 << 20, 0.9))]
    fit = cm.fit_alpha_beta(ms, cache_bytes=cache)
    fig = vc.measured_vs_model(ms, fit)
    ax, ax2 = fig.axes
    assert "in cache" in ax.get_title() and "beyond" in ax.get_title()
    plotted = sorted(y for line in ax2.get_lines() if len(line.get_ydata()) == 3 for y in line.get_ydata())
    assert plotted == pytest.approx(sorted(100 * e for e in fit.rel_errors))
    plt.close(fig)
