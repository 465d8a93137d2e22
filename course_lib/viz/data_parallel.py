"""Figures of chapters 3-4 (data parallelism, ZeRO, FSDP)."""
from __future__ import annotations

import matplotlib.pyplot as plt

from course_lib.trace import Span
from course_lib.viz.timeline import KIND_COLORS, legend_handles, timeline

CATEGORY_COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer_state": "#55A868"}


def overlap_timeline(spans, title=None, ranks=None, **kwargs):
    """Each rank on two lanes, compute above communication, so overlap is visible.

    Async collectives run on the backend's threads while the rank computes: on one lane
    their spans would hide the compute spans they overlap. An async collective's span
    runs from its launch to its completion; the backend runs a rank's collectives one
    after the other, so one queued behind another is drawn from the moment the previous
    one completed. A collective's mesh dimension (``Span.dim``) is its edge colour and hatch.
    """
    spans = list(spans)
    ranks = sorted({s.rank for s in spans}) if ranks is None else list(ranks)
    lanes, names = [], {}
    for k, r in enumerate(ranks):
        names[2 * k], names[2 * k + 1] = f"rank {r} compute", f"rank {r} comm"
        busy_until = float("-inf")
        for s in sorted((s for s in spans if s.rank == r), key=lambda s: (s.kind == "comm", s.start)):
            if s.kind == "comm":
                start = min(max(s.start, busy_until), s.end)
                busy_until = max(busy_until, s.end)
                lanes.append(Span(2 * k + 1, s.name, s.kind, start, s.end, s.dim))
            else:
                lanes.append(Span(2 * k, s.name, s.kind, s.start, s.end, s.dim))
    kwargs.setdefault("figsize", (10, 0.45 * len(names) + 1.5))
    fig = timeline(lanes, ranks=sorted(names), row_names=names, title=title, legend=False, **kwargs)
    ax = fig.axes[0]
    ax.legend(handles=legend_handles(lanes), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    fig.tight_layout()
    return fig


def memory_bars(rows, title="bytes per rank: measured (bars) and ZeRO formula (black line)"):
    """Stacked bars of measured model states per (config, ranks), formula as a tick.

    rows: dicts with ``label`` (e.g. "ZeRO-2, N=4"), ``parameters``, ``gradients``,
    ``optimizer_state`` (bytes, measured) and ``formula`` (bytes).
    """
    rows = list(rows)
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(rows) + 2), 3.6))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for cat, color in CATEGORY_COLORS.items():
        vals = [r[cat] / 2**20 for r in rows]
        ax.bar(x, vals, bottom=bottom, color=color, label=cat.replace("_", " "), width=0.7)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        ax.plot([i - 0.4, i + 0.4], [r["formula"] / 2**20] * 2, color="black", lw=2)
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["label"] for r in rows], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("MiB")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def step_time_bars(times, title="median step time"):
    """``times``: {label: seconds}. One bar each, compute-coloured."""
    fig, ax = plt.subplots(figsize=(6, 2.8))
    labels = list(times)
    ax.barh(labels, [times[k] * 1e3 for k in labels], color=KIND_COLORS["compute"])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


__all__ = ["overlap_timeline", "memory_bars", "step_time_bars", "CATEGORY_COLORS"]
