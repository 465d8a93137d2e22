"""Static figures. Every figure of the course is a function here that returns a
matplotlib Figure; a widget only wraps one of them (see ``widgets``), so the
rendered book always has the picture.
"""
from __future__ import annotations



import matplotlib.pyplot as plt
from matplotlib.patches import Patch

KIND_COLORS = {
    "compute": "#4C72B0",  # blue
    "comm": "#DD8452",     # orange
    "idle": "#C8C8C8",     # grey
    "other": "#55A868",    # green
}


def _time_unit(span_seconds: float):
    if span_seconds >= 2:
        return 1.0, "s"
    if span_seconds >= 2e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def timeline(spans, ax=None, title=None, ranks=None, row_names=None, label_min_frac=0.04,
             unit=None, legend=True, figsize=None):
    """Draw spans as one row per rank, coloured by kind and labelled when wide enough.

    spans: iterable of objects with ``rank, name, kind, start, end`` (``trace.Span``;
        measured by ``launch`` or produced by the planner's simulator).
    ranks: which rows to draw (default: every rank that has a span).
    row_names: optional {rank: label} for the y axis (e.g. "stage 1").
    label_min_frac: a span is labelled only if it is at least this fraction of the
        drawn time range (keeps the figure readable).
    unit: 's', 'ms' or 'µs' (default: chosen from the time range).
    """
    spans = list(spans)
    if ranks is None:
        ranks = sorted({s.rank for s in spans})
    ranks = list(ranks)
    if figsize is None:
        figsize = (10, 0.55 * max(len(ranks), 1) + 1.2)
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
    kinds_seen = []
    for s in spans:
        if s.rank not in row:
            continue
        y = row[s.rank]
        color = KIND_COLORS.get(s.kind, KIND_COLORS["other"])
        if s.kind not in kinds_seen:
            kinds_seen.append(s.kind)
        left, width = (s.start - t0) * scale, max((s.end - s.start) * scale, 0.0)
        ax.barh(y, width, left=left, height=0.8, color=color, edgecolor="white", linewidth=0.5)
        if (s.end - s.start) / total >= label_min_frac and s.name:
            ax.text(left + width / 2, y, s.name, ha="center", va="center", fontsize=7,
                    color="white" if s.kind in ("compute", "comm") else "black", clip_on=True)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([(row_names or {}).get(r, f"rank {r}") for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, total * scale)
    ax.set_xlabel(f"time ({unit_name})")
    if title:
        ax.set_title(title)
    if legend:
        ax.legend(handles=[Patch(color=KIND_COLORS.get(k, KIND_COLORS["other"]), label=k) for k in kinds_seen],
                  loc="upper right", fontsize=7, ncol=len(kinds_seen), frameon=False,
                  bbox_to_anchor=(1.0, 1.0 + 0.9 / max(len(ranks) + 2, 3)))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


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
