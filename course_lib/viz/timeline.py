"""Static figures. Every figure of the course is a function here that returns a
matplotlib Figure; a widget only wraps one of them (see ``widgets``), so the
rendered book always has the picture.

A span's colour says its kind (compute, comm, idle, other). A communication span that
carries a mesh dimension (``Span.dim``: "dp", "tp", "dp+cp", ...) also gets that
dimension's edge colour and hatch, and the legend names both; ``by_dim=True`` instead
gives each (rank, dimension) a lane of its own.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch
from matplotlib.transforms import offset_copy

from course_lib.viz.column import COLUMN_INCHES, LABEL_PT, text_fits

KIND_COLORS = {
    "compute": "#4C72B0",  # blue
    "comm": "#DD8452",     # orange
    "idle": "#C8C8C8",     # grey
    "other": "#55A868",    # green
}
DIM_STYLES = {  # mesh dimension -> (edge colour, hatch)
    "dp": ("#1B5E20", "//"), "tp": ("#B71C1C", "\\\\"), "pp": ("#4A148C", ".."),
    "cp": ("#0D47A1", "xx"), "ep": ("#5D4037", "oo"), "edp": ("#33691E", "--"),
}
_MORE_DIMS = [("#263238", "++"), ("#880E4F", "||"), ("#E65100", "**"), ("#006064", "OO")]


def dim_style(dim: str):
    """(edge colour, hatch) of a mesh dimension; a flattened one ("dp+cp") gets a style of its own."""
    if dim in DIM_STYLES:
        return DIM_STYLES[dim]
    return _MORE_DIMS[sum(map(ord, dim)) % len(_MORE_DIMS)]


def legend_handles(spans):
    """One patch per kind drawn, then one per mesh dimension drawn (edge colour + hatch;
    "comm" alone only for communication spans that carry no dimension)."""
    spans = list(spans)
    kinds = list(dict.fromkeys(s.kind for s in spans if s.kind != "comm" or not getattr(s, "dim", "")))
    dims = list(dict.fromkeys(getattr(s, "dim", "") for s in spans if getattr(s, "dim", "")))
    handles = [Patch(color=KIND_COLORS.get(k, KIND_COLORS["other"]), label=k) for k in kinds]
    for d in dims:
        edge, hatch = dim_style(d)
        handles.append(Patch(facecolor=KIND_COLORS["comm"], edgecolor=edge, hatch=hatch, label=f"comm over {d}"))
    return handles


def _time_unit(span_seconds: float):
    if span_seconds >= 2:
        return 1.0, "s"
    if span_seconds >= 2e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def timeline(spans, ax=None, title=None, ranks=None, row_names=None, label_min_frac=0.04,
             unit=None, legend=True, figsize=None, by_dim=False, clock=None, messages=True):
    """Draw spans as one row per rank, coloured by kind and labelled when wide enough.

    spans: iterable of objects with ``rank, name, kind, start, end`` (``trace.Span``;
        measured by ``launch`` or produced by the planner's simulator).
    ranks: which rows to draw (default: every rank that has a span).
    row_names: optional {rank: label} for the y axis (e.g. "stage 1").
    label_min_frac: a span is labelled only if it is at least this fraction of the
        drawn time range and its name fits in its bar (keeps the figure readable);
        0: every span is labelled, fitting or not (a caller that renames the labels).
    unit: 's', 'ms' or 'µs' (default: chosen from the time range).
    by_dim: one row per (rank, mesh dimension): a rank's spans without a dimension on
        its first row, then one row per dimension its spans carry.
    clock: the ``VirtualCluster`` the spans were priced on (``launch(..., clock=...)``): the
        axis then says "virtual time on <GPU>"; None: measured (wall-clock) time.
    messages: draw an arrow from each send to its receive (spans that carry ``flow``, the
        virtual clock's messages).
    """
    spans = list(spans)
    if ranks is None:
        ranks = sorted({s.rank for s in spans})
    ranks = list(ranks)
    if by_dim:
        spans, ranks, row_names = _lanes_by_dim(spans, ranks, row_names)
    if figsize is None:   # the book's column; room under the axes for the legend
        figsize = (COLUMN_INCHES, 0.45 * max(len(ranks), 1) + (1.9 if legend else 1.3))
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
    else:
        fig = ax.figure
    if not spans:
        ax.set_title(title or "timeline (no spans)")
        return fig
    t0 = min(s.start for s in spans)
    t1 = max(s.end for s in spans)
    total = max(t1 - t0, 1e-12)
    scale, unit_name = _time_unit(total) if unit is None else ({"s": 1.0, "ms": 1e3, "µs": 1e6}[unit], unit)
    row = {r: i for i, r in enumerate(ranks)}
    inches = ax.get_position().width * fig.get_figwidth() * 0.9 / (total * scale)   # per unit of time
    drawn = []
    for s in spans:
        if s.rank not in row:
            continue
        y = row[s.rank]
        drawn.append(s)
        color = KIND_COLORS.get(s.kind, KIND_COLORS["other"])
        edge, hatch, lw = "white", None, 0.5
        if getattr(s, "dim", ""):
            (edge, hatch), lw = dim_style(s.dim), 1.2
        left, width = (s.start - t0) * scale, max((s.end - s.start) * scale, 0.0)
        ax.barh(y, width, left=left, height=0.8, color=color, edgecolor=edge, linewidth=lw, hatch=hatch)
        fits = label_min_frac == 0 or text_fits(s.name, width * inches)
        if (s.end - s.start) / total >= label_min_frac and s.name and fits:
            ax.text(left + width / 2, y, s.name, ha="center", va="center", fontsize=LABEL_PT,
                    color="white" if s.kind in ("compute", "comm") else "black", clip_on=True)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([(row_names or {}).get(r, f"rank {r}") for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, total * scale)
    ax.set_xlabel(f"virtual time on {clock.hw.name} ({unit_name})" if clock is not None else f"time ({unit_name})")
    if messages and not by_dim:
        _arrows(ax, drawn, row, t0, scale)
    if title:
        ax.set_title(title)
    ax.tick_params(labelsize=LABEL_PT + 1)
    if legend:   # under the axes, so that it never covers a bar or the title
        handles = legend_handles(drawn)
        ax.legend(handles=handles, loc="upper center", fontsize=LABEL_PT, ncol=min(len(handles), 4),
                  frameon=False, bbox_to_anchor=(0.5, 0.0),   # half an inch under the axes: below the x label
                  bbox_transform=offset_copy(ax.transAxes, fig=fig, y=-0.5, units="inches"))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def _arrows(ax, spans, row, t0, scale):
    """An arrow per message: from its send's start to its receive's end (``Span.flow`` pairs them)."""
    ends = {}
    for s in spans:
        side, _, key = getattr(s, "flow", "").partition(":")
        if key:
            ends.setdefault(key, {})[side] = s
    for pair in ends.values():
        if "send" in pair and "recv" in pair:
            a, b = pair["send"], pair["recv"]
            ax.annotate("", xy=((b.end - t0) * scale, row[b.rank]), xytext=((a.start - t0) * scale, row[a.rank]),
                        arrowprops=dict(arrowstyle="->", lw=0.6, color="#444444", alpha=0.7))


def _lanes_by_dim(spans, ranks, row_names):
    """Spans moved to one lane per (rank, dimension): lane names "rank 0", "rank 0 · dp", ..."""
    from course_lib.trace import Span

    lanes = []
    for r in ranks:
        lanes.append((r, ""))
        lanes += [(r, d) for d in sorted({getattr(s, "dim", "") for s in spans if s.rank == r} - {""})]
    index = {lane: i for i, lane in enumerate(lanes)}
    moved = [Span(index[s.rank, getattr(s, "dim", "")], s.name, s.kind, s.start, s.end, getattr(s, "dim", ""))
             for s in spans if s.rank in ranks]
    base = row_names or {}
    names = {i: base.get(r, f"rank {r}") + (f" · {d}" if d else "") for (r, d), i in index.items()}
    return moved, list(range(len(lanes))), names


def busy_fraction(spans, kind=None):
    """Fraction of the drawn time range each rank spends in spans (of ``kind``, if given)."""
    spans = list(spans)
    if not spans:
        return {}
    t0 = min(s.start for s in spans)
    t1 = max(s.end for s in spans)
    out = {}
    for s in spans:
        if kind is None or s.kind == kind:
            out[s.rank] = out.get(s.rank, 0.0) + (s.end - s.start) / max(t1 - t0, 1e-12)
    return out
