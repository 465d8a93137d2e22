"""Figures of chapter 9b: the bytes a rank keeps per block by recompute policy (measured bars,
planner ticks), and the bytes each mesh dimension moves in fp32 and bf16."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

POLICY_COLORS = {"none": "#4C72B0", "selective": "#55A868", "full": "#C44E52", "every 2": "#8172B2"}
PRECISION_COLORS = {"full": "#4C72B0", "bf16": "#DD8452", "bf16-reduce-fp32": "#55A868"}


def memory_and_wire(rows, wire, title="what recomputation and bf16 buy back, per rank"):
    """rows: (layout, policy, alive, saved, planner) per layout and policy (bytes of all blocks);
    wire: {(case, dim): {precision: bytes}} of one step. Left: saved bytes (bars) and the
    planner (black ticks); right: bytes on the wire per mesh dimension and precision."""
    fig, (ax_a, ax_w) = plt.subplots(1, 2, figsize=(11, 3.9))
    layouts = list(dict.fromkeys(r[0] for r in rows))
    policies = list(dict.fromkeys(r[1] for r in rows))
    width = 0.8 / len(policies)
    for j, policy in enumerate(policies):
        got = {r[0]: r for r in rows if r[1] == policy}
        x = np.arange(len(layouts)) + (j - (len(policies) - 1) / 2) * width
        ax_a.bar(x, [got[n][3] / 1024 for n in layouts], width, color=POLICY_COLORS.get(policy, "0.5"),
                 label=policy)
        ax_a.scatter(x, [got[n][4] / 1024 for n in layouts], marker="_", s=120, color="k", zorder=3)
    ax_a.set_xticks(np.arange(len(layouts)), layouts, fontsize=8)
    ax_a.set_ylabel("KiB kept for backward (4 blocks)")
    ax_a.set_title("activations by policy: measured, planner (ticks)", fontsize=9)
    ax_a.set_ylim(0, ax_a.get_ylim()[1] * 1.25)                 # room for the legend above the bars
    ax_a.legend(fontsize=8, ncol=len(policies), loc="upper center")
    keys = list(wire)
    precisions = list(dict.fromkeys(p for v in wire.values() for p in v))
    width = 0.8 / len(precisions)
    for j, precision in enumerate(precisions):
        x = np.arange(len(keys)) + (j - (len(precisions) - 1) / 2) * width
        ax_w.bar(x, [wire[k][precision] / 1024 for k in keys], width, label=precision,
                 color=PRECISION_COLORS.get(precision, "0.5"))
    ax_w.set_xticks(np.arange(len(keys)), [f"{c}: {d}" for c, d in keys], fontsize=7, rotation=20, ha="right")
    ax_w.set_ylabel("KiB sent in one step (rank 0)")
    ax_w.set_title("bytes on the wire per mesh dimension", fontsize=9)
    ax_w.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


__all__ = ["memory_and_wire"]
