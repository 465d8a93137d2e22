"""Figure of chapter 12: one weight's saved boxes, the boxes of a new layout, and what one new
rank reads (the overlaps of :func:`course_lib.checkpoint.plan.read_plan`)."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from course_lib.checkpoint.plan import read_plan

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def _draw(ax, shape, boxes, title, filled=True):
    rows, cols = shape
    ax.add_patch(Rectangle((0, 0), cols, rows, facecolor="none", edgecolor="black", linewidth=1.2))
    for k, ((r0, c0), (nr, nc), label, *which) in enumerate(boxes):
        color = RANK_COLORS[(which[0] if which else k) % len(RANK_COLORS)]
        ax.add_patch(Rectangle((c0, r0), nc, nr, facecolor=color if filled else "none",
                               edgecolor="white" if filled else color, linewidth=2 if filled else 2.5,
                               alpha=0.85 if filled else 1.0))
        ax.text(c0 + nc / 2, r0 + nr / 2, label, ha="center", va="center", fontsize=8,
                color="white" if filled else color)
    ax.set_xlim(-1, cols + 1)
    ax.set_ylim(rows + 1, -1)                               # row 0 on top, as the tensor prints
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(f"columns 0..{cols - 1}", fontsize=8)
    ax.set_ylabel(f"rows 0..{rows - 1}", fontsize=8)
    ax.tick_params(labelsize=7)


def reshard_figure(shape, saved, new, reader=0, name="weight"):
    """Three panels for a 2-D weight of ``shape``: the ``saved`` boxes [((r0, c0), (rows,
    cols), label)], the ``new`` layout's boxes, and the overlaps new box ``reader`` copies out
    of the saved boxes it reads."""
    if len(shape) != 2:
        raise ValueError(f"reshard_figure draws 2-D weights, got shape {tuple(shape)}")
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    _draw(axes[0], shape, saved, f"saved: {name} {tuple(shape)}")
    _draw(axes[1], shape, new, "the new layout's boxes", filled=False)
    offsets, lengths, label = new[reader]
    plan = read_plan(offsets, lengths, [(o, n) for o, n, _ in saved])
    reads = [(o, n, f"from {saved[i][2]}", i) for i, (o, n) in plan]     # coloured as the saved box
    # each saved box it meets is read whole (for its CRC), the overlap copied out of it
    _draw(axes[2], shape, reads, f"{label} reads {len(plan)} saved boxes, copies their overlaps")
    axes[2].add_patch(Rectangle((offsets[1], offsets[0]), lengths[1], lengths[0], facecolor="none",
                                edgecolor="black", linestyle="--", linewidth=1.5))
    fig.tight_layout()
    return fig


__all__ = ["reshard_figure"]
