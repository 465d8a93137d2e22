"""Figures of the pipeline chapter: a schedule drawn as a grid, measured next to simulated."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.transforms import offset_copy

from matplotlib.patches import Patch

from course_lib.viz.column import COLUMN_INCHES, LABEL_PT, text_fits
from course_lib.viz.timeline import timeline

OP_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def op_handles(spans):
    """Legend patches of the ops drawn: F forward, B backward (its input-gradient half where a
    schedule has W, the weight-gradient half, apart: zero bubble), W."""
    ops = [op for op in OP_COLORS if any(s.kind == "compute" and s.name[:1] == op for s in spans)]
    names = {"F": "F: forward", "B": "B: backward" + (" (input gradient)" if "W" in ops else ""),
             "W": "W: weight gradient"}
    return [Patch(color=OP_COLORS[op], label=names[op]) for op in ops]


def schedule_grid(spans, title=None, ax=None, legend=True):
    """A simulated schedule (``schedules.simulate``): one row per rank, F blue, B orange, W
    green, the label the micro-batch (``@s``: virtual stage, dropped where it does not fit), idle time left
    white; drawn at the book's column width, labels of at least 9 pt, a legend of the ops."""
    own = ax is None
    if own:
        ranks = sorted({s.rank for s in spans})
        fig, ax = plt.subplots(figsize=(COLUMN_INCHES, 0.4 * len(ranks) + (1.6 if legend else 1.1)))
    else:
        fig = ax.figure
    compute = [s for s in spans if s.kind == "compute"]
    end = max((s.end for s in compute), default=1.0)
    inches = ax.get_position().width * fig.get_figwidth() * 0.9 / end   # per unit of time
    for s in compute:
        ax.barh(s.rank, s.end - s.start, left=s.start, color=OP_COLORS.get(s.name[0], "grey"),
                edgecolor="white", height=0.8)
        # the label: micro-batch@virtual stage, or the micro-batch alone where that does not fit
        label = next((t for t in (s.name[1:], s.name[1:].split("@")[0]) if text_fits(t, (s.end - s.start) * inches)),
                     None)
        if label:
            ax.text((s.start + s.end) / 2, s.rank, label, ha="center", va="center", fontsize=LABEL_PT, color="white")
    ranks = sorted({s.rank for s in spans})
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.tick_params(labelsize=LABEL_PT)
    ax.set_xlabel("time (units of one forward)", fontsize=LABEL_PT)
    if title:
        ax.set_title(title, fontsize=LABEL_PT + 1)
    if legend:
        handles = op_handles(compute)
        ax.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=LABEL_PT, frameon=False, bbox_to_anchor=(0.5, 0.0),
                  bbox_transform=offset_copy(ax.transAxes, fig=fig, y=-0.45, units="inches"))
    if own:
        fig.tight_layout()
    return fig


def schedule_grids(schedules):
    """Several simulated schedules, one above the other, at the book's column width, with one
    legend of the ops under them. schedules: list of (spans, title)."""
    rows = [len({s.rank for s in spans}) for spans, _ in schedules]
    heights = [0.35 * n + 0.75 for n in rows]
    total = sum(heights) + 0.6
    fig, axes = plt.subplots(len(schedules), 1, figsize=(COLUMN_INCHES, total), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (spans, title) in zip(axes[:, 0], schedules):
        schedule_grid(spans, title=title, ax=ax, legend=False)
    handles = op_handles([s for spans, _ in schedules for s in spans])
    fig.tight_layout(rect=(0, 0.45 / total, 1, 1))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=LABEL_PT, frameon=False)
    return fig


def measured_and_simulated(measured, simulated, title_measured="measured", title_simulated="simulated"):
    """Two timelines, one above the other: a measured trace and a simulated step."""
    fig, axes = plt.subplots(2, 1, figsize=(COLUMN_INCHES, 5.5))
    timeline(measured, ax=axes[0], title=title_measured)
    timeline(simulated, ax=axes[1], title=title_simulated)
    fig.tight_layout()
    return fig


__all__ = ["schedule_grid", "schedule_grids", "measured_and_simulated", "op_handles", "OP_COLORS"]


def stage_placement(p: int, n_layers: int, placements=("loop", "v"), v: int = 2):
    """Where each of the p * v stages (``schedules.stage_rank``) of an ``n_layers`` model sits:
    one panel per placement, the ranks as rows, the stages in model order left to right, the
    path a micro-batch's forward takes drawn through them (its backward walks it back).
    "loop" (Megatron-LM's interleaved) climbs p ranks v times; "v" goes down and back up,
    so the first and the last layers share rank 0 and the turn needs no message."""
    from course_lib.parallel.pipeline.rules import partition_layers
    from course_lib.schedules import stage_rank
    layers = partition_layers(n_layers, p * v)
    fig, axes = plt.subplots(1, len(placements), figsize=(COLUMN_INCHES, 0.5 * p + 1.3), squeeze=False)
    for ax, placement in zip(axes[0], placements):
        ranks = [stage_rank(s, p, placement) for s in range(p * v)]
        ax.plot(range(p * v), ranks, color="grey", zorder=1)
        for s, r in enumerate(ranks):
            ax.scatter(s, r, s=260, color=OP_COLORS["F"], zorder=2)
            lo, hi = layers[s].start, layers[s].stop - 1
            ax.annotate(f"{lo}" if lo == hi else f"{lo}-{hi}", (s, r), ha="center", va="center",
                        fontsize=LABEL_PT - 2, color="white", zorder=3)
        hops = sum(a != b for a, b in zip(ranks, ranks[1:]))
        ax.set_title(f"{placement}: {hops} hops between ranks", fontsize=LABEL_PT)
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"rank {r}" for r in range(p)], fontsize=LABEL_PT)
        ax.invert_yaxis()
        ax.set_xticks(range(p * v))
        ax.tick_params(labelsize=LABEL_PT - 1)
        ax.set_xlabel("stage (its layers on the dot)", fontsize=LABEL_PT)
        ax.set_ylim(p - 0.4, -0.6)
    fig.tight_layout()
    return fig
