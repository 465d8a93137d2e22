"""Figures of the pipeline chapter: a schedule drawn as a grid, measured next to simulated."""
from __future__ import annotations

import matplotlib.pyplot as plt

from course_lib.viz.timeline import timeline

OP_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def schedule_grid(spans, title=None, ax=None):
    """A simulated schedule (``schedules.simulate``): one row per rank, F blue, B orange, W
    green, the label the micro-batch (``@s``: virtual stage), idle time left white."""
    own = ax is None
    if own:
        ranks = sorted({s.rank for s in spans})
        fig, ax = plt.subplots(figsize=(10, 0.45 * len(ranks) + 0.9))
    else:
        fig = ax.figure
    for s in spans:
        if s.kind != "compute":
            continue
        ax.barh(s.rank, s.end - s.start, left=s.start, color=OP_COLORS.get(s.name[0], "grey"),
                edgecolor="white", height=0.8)
        ax.text((s.start + s.end) / 2, s.rank, s.name[1:], ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(sorted({s.rank for s in spans}))
    ax.set_yticklabels([f"rank {r}" for r in sorted({s.rank for s in spans})])
    ax.invert_yaxis()
    ax.set_xlabel("time (units of one forward)")
    if title:
        ax.set_title(title)
    if own:
        fig.tight_layout()
    return fig


def measured_and_simulated(measured, simulated, title_measured="measured", title_simulated="simulated"):
    """Two timelines, one above the other: a measured trace and a simulated step."""
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.5))
    timeline(measured, ax=axes[0], title=title_measured)
    timeline(simulated, ax=axes[1], title=title_simulated)
    fig.tight_layout()
    return fig


__all__ = ["schedule_grid", "measured_and_simulated", "OP_COLORS"]
