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


def _spans_with_dims():
    return [Span(0, "forward", "compute", 0.0, 0.010), Span(0, "all-reduce", "comm", 0.010, 0.014, "dp"),
            Span(0, "all-gather", "comm", 0.002, 0.006, "tp"), Span(1, "forward", "compute", 0.001, 0.011),
            Span(1, "all-reduce", "comm", 0.011, 0.015, "dp")]


def test_timeline_marks_the_mesh_dimension_of_comm_spans():
    from course_lib.viz.timeline import dim_style

    fig = timeline(_spans_with_dims())
    ax = fig.axes[0]
    by_label = {}
    for bar in ax.patches:  # one bar per span, in order
        by_label.setdefault(bar.get_hatch(), set()).add(matplotlib.colors.to_hex(bar.get_edgecolor()))
    assert by_label[dim_style("dp")[1]] == {dim_style("dp")[0].lower()}
    assert by_label[dim_style("tp")[1]] == {dim_style("tp")[0].lower()}
    assert dim_style("dp") != dim_style("tp") and dim_style("dp+cp") == dim_style("dp+cp")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["compute", "comm over dp", "comm over tp"]
    plt.close(fig)


def test_timeline_by_dim_gives_each_rank_and_dimension_a_lane():
    fig = timeline(_spans_with_dims(), by_dim=True, row_names={1: "stage 1"})
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 0 · dp", "rank 0 · tp",
                                                          "stage 1", "stage 1 · dp"]
    lanes = sorted(round(bar.get_y() + bar.get_height() / 2) for bar in ax.patches)
    assert lanes == [0, 1, 2, 3, 4]
    plt.close(fig)


def test_overlap_timeline_keeps_the_dimension():
    from course_lib.viz.data_parallel import overlap_timeline

    fig = overlap_timeline(_spans_with_dims())
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "comm over dp" in labels and "comm over tp" in labels
    plt.close(fig)


def test_segments_sweep_draws_measured_model_and_reference():
    from course_lib.viz.collectives import segments_sweep

    fig = segments_sweep([1, 2, 4], {"ring": [3e-3, 2e-3, 1.5e-3]}, model={"ring": [2.9e-3, 2.1e-3, 1.6e-3]},
                         reference={"gloo": 1.4e-3})
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert [list(line.get_ydata()) for line in lines[:2]] == [[3.0, 2.0, 1.5], [2.9, 2.1, 1.6]]   # ms
    assert any(line.get_linestyle() == ":" for line in lines)                                     # gloo's line
    plt.close(fig)


def test_nd_figures():
    from types import SimpleNamespace

    from course_lib.viz import nd

    runs = [SimpleNamespace(name="2D", world_size=4, losses=[3.0, 2.0]),
            SimpleNamespace(name="4D", world_size=16, losses=[3.0, 2.0])]
    fig = nd.loss_curves([3.0, 2.0], runs)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["one device", "2D (4 ranks)",
                                                                             "4D (16 ranks)"]
    plt.close(fig)
    rows = [dict(name=n, measured_states=2**20, predicted_states=2**20, measured_peak=3 * 2**20,
                 predicted_peak=2.5 * 2**20, measured_time=0.1, predicted_time=0.08) for n in ("0D", "4D")]
    fig = nd.story(rows)
    assert [round(b.get_height(), 3) for b in fig.axes[0].patches] == [1.0, 1.0, 2.0, 2.0]    # MiB, stacked
    assert [round(b.get_height(), 3) for b in fig.axes[1].patches] == [100.0, 100.0]          # ms
    plt.close(fig)
    fig = nd.story([dict(rows[0], name="4D DP x TP x PP x CP")])
    assert fig.axes[0].get_xticklabels()[0].get_text() == "4D DP x TP\nx PP x CP"   # wrapped: no overlap
    plt.close(fig)
    measured = _spans() + [Span(r, "ar", "comm", 0.002, 0.003, d) for r in (2, 3) for d in ("tp", "dp+cp")]
    fig = nd.step_timelines(measured, _spans(), [0, 1, 2, 3], "2D")       # 2 ranks per measured panel
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["2D: measured, ranks 0, 1", "2D: measured, ranks 2, 3", "2D: planner's simulation"]
    assert len(fig.axes[1].get_yticks()) == 6 and fig.legends                  # 3 lanes per rank; one legend
    plt.close(fig)


def test_tensor_parallel_layer_timeline_numbers_the_collectives():
    from course_lib.viz.tensor_parallel import layer_timeline

    spans = [Span(r, "forward", "compute", 0.0, 0.01) for r in (0, 1)] + [
        Span(r, name, "comm", t, t + 0.001, "tp") for r in (0, 1)
        for name, t in (("g: all-reduce", 0.002), ("f: all-reduce (backward)", 0.008))]
    fig = layer_timeline(spans, title="one layer")
    ax = fig.axes[0]
    assert sorted(t.get_text() for t in ax.texts) == ["1", "1", "2", "2", "forward", "forward"]
    assert [t.get_text() for t in fig.texts] == [" 1  g: all-reduce", " 2  f: all-reduce (backward)"]
    plt.close(fig)


# ----------------------------------------------------------------------------- the book's column
# At 1280 px the book shows a figure at full size up to about 7.5 inches (100 dpi); a wider one is
# shrunk with its labels (chapter 1's 14.7-inch figure showed at 46%, 8 pt labels at ~5 px).


def _readable_at_the_column(fig):
    """The figure fits the column and every label drawn is at least 9 pt (viz.column)."""
    from matplotlib.text import Text

    from course_lib.viz.column import COLUMN_INCHES, LABEL_PT

    fig.canvas.draw()
    assert fig.get_figwidth() <= COLUMN_INCHES + 1e-9, fig.get_figwidth()
    small = {(t.get_text(), t.get_fontsize()) for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip() and t.get_fontsize() < LABEL_PT}
    assert not small, f"labels under {LABEL_PT} pt: {sorted(small)[:8]}"


def test_timeline_reads_at_the_column_width_with_a_legend():
    fig = timeline(_spans_with_dims(), title="a step")
    _readable_at_the_column(fig)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["compute", "comm over dp",
                                                                             "comm over tp"]
    plt.close(fig)


def test_rank_buffers_fit_the_column_however_many_elements():
    """Chapter 1's all-reduce = reduce-scatter + all-gather: 18 elements per rank in three panels."""
    from course_lib.viz import collectives as vc

    xs = [[float(i * (r + 1)) for i in range(1, 9)] for r in range(4)]
    total = [sum(col) for col in zip(*xs)]
    fig = vc.rank_buffers([("x", xs), ("reduce_scatter", [total[2 * r:2 * r + 2] for r in range(4)]),
                           ("then all_gather", [total] * 4)], title="all-reduce = reduce-scatter + all-gather")
    _readable_at_the_column(fig)
    assert sum(t.get_text() == "80" for t in fig.axes[0].texts) == 5      # every value still labelled
    plt.close(fig)


def test_pipeline_schedule_grids_read_at_the_column_width_with_a_legend():
    from course_lib import schedules as S
    from course_lib.viz.pipeline import schedule_grid, schedule_grids

    grids = [(S.simulate(S.make_schedule(name, 4, 8, v), 4, v), name)
             for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))]
    fig = schedule_grids(grids)
    _readable_at_the_column(fig)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["F: forward", "B: backward (input gradient)",
                                                                  "W: weight gradient"]
    assert [ax.get_title() for ax in fig.axes] == ["gpipe", "1f1b", "interleaved", "zb-h1"]
    plt.close(fig)
    fig = schedule_grid(grids[0][0], title="gpipe")
    _readable_at_the_column(fig)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["F: forward", "B: backward"]
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert "0" in labels and "7@3" in labels          # micro-batch@stage where it fits
    plt.close(fig)


def test_nd_step_timelines_read_at_the_column_width_with_a_legend():
    from course_lib.viz import nd

    measured = _spans() + [Span(r, "ar", "comm", 0.002, 0.003, d) for r in (2, 3) for d in ("tp", "dp+cp")]
    fig = nd.step_timelines(measured, _spans(), [0, 1, 2, 3], "2D")
    _readable_at_the_column(fig)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["compute", "comm", "idle", "comm over tp", "comm over dp+cp"]
    plt.close(fig)


def test_nd_story_reads_at_the_column_width():
    from course_lib.viz import nd

    rows = [dict(name=n, measured_states=2**20, predicted_states=2**20, measured_peak=3 * 2**20,
                 predicted_peak=2.5 * 2**20, measured_time=0.1, predicted_time=0.08)
            for n in ("0D", "1D FSDP", "2D DP x TP", "3D DP x TP x PP", "4D DP x TP x PP x CP")]
    fig = nd.story(rows, title="0D -> 4D: per rank, measured on virtual H100s (bars) and planner (ticks)")
    _readable_at_the_column(fig)
    assert all(ax.get_legend() for ax in fig.axes)
    plt.close(fig)
