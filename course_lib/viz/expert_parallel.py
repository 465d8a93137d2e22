"""Figures of chapter 8: tokens routed to each expert (and how many were dropped), rows each
EP rank computes."""
from __future__ import annotations

import matplotlib.pyplot as plt


def tokens_per_expert(counts, capacity=None, kept=None, title="tokens routed to each expert"):
    """Bars of assignments per expert (before dropping); with ``kept``, the part that fit in
    the capacity is drawn solid and the dropped rest hatched; a line at ``capacity``."""
    counts = [int(c) for c in counts]
    fig, ax = plt.subplots(figsize=(6.4, 2.8))
    experts = range(len(counts))
    if kept is None:
        ax.bar(experts, counts, color="tab:blue", label="routed")
    else:
        kept = [int(c) for c in kept]
        ax.bar(experts, kept, color="tab:blue", label="kept")
        ax.bar(experts, [c - k for c, k in zip(counts, kept)], bottom=kept, color="white",
               edgecolor="tab:red", hatch="//", label="dropped")
    if capacity is not None:
        ax.axhline(capacity, color="tab:red", linestyle="--", label=f"capacity {capacity}")
    ax.axhline(sum(counts) / len(counts), color="gray", linestyle=":", label="mean")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_xticks(list(experts))
    ax.set_xlabel("expert")
    ax.set_ylabel("tokens")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def rows_per_rank(rows, title="rows each EP rank's experts compute"):
    """Bars: {label: [rows of rank 0, rank 1, ...]} side by side (e.g. before / after balancing)."""
    fig, ax = plt.subplots(figsize=(6.4, 2.6))
    labels = list(rows)
    n = len(rows[labels[0]])
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        ax.bar([r + i * width for r in range(n)], rows[label], width, label=label)
    ax.set_xticks([r + width * (len(labels) - 1) / 2 for r in range(n)])
    ax.set_xticklabels([f"EP rank {r}" for r in range(n)])
    ax.set_ylabel("rows")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


__all__ = ["tokens_per_expert", "rows_per_rank"]


def folded_meshes(shape, stage: int = 0):
    """MoE parallel folding on one pipeline stage of ``shape`` (a MeshShape): the same ranks
    drawn twice, on the left labelled by attention's (dp, cp, tp) and coloured by their TP x CP
    group, on the right by the experts' (edp, ep, etp) and coloured by their EP group."""
    ranks = [r for r in range(shape.world_size) if shape.coords(r)["pp"] == stage]
    cols = shape.sizes["cp"] * shape.sizes["tp"]
    rows = len(ranks) // cols
    fig, axes = plt.subplots(1, 2, figsize=(7.2, 0.9 + 0.75 * rows))
    cmap = plt.get_cmap("tab10")
    panels = (("attention: dp x cp x tp", ("dp", "cp", "tp"), lambda c: c["dp"]),
              ("experts: edp x ep x etp", ("edp", "ep", "etp"), None))
    ep_groups = {tuple(g): i for i, g in enumerate(shape.rank_sets("ep"))}
    for ax, (title, dims, colour) in zip(axes, panels):
        for i, r in enumerate(ranks):
            c = shape.coords(r)
            y, x = divmod(i, cols)
            k = colour(c) if colour else next(v for g, v in ep_groups.items() if r in g)
            ax.add_patch(plt.Rectangle((x, -y), 0.9, 0.8, color=cmap(k % 10), alpha=0.55))
            label = ",".join(str(c[d]) for d in dims)
            ax.text(x + 0.45, -y + 0.5, f"rank {r}", ha="center", fontsize=7)
            ax.text(x + 0.45, -y + 0.2, f"({label})", ha="center", fontsize=7)
        ax.set_xlim(-0.1, cols)
        ax.set_ylim(-rows + 0.7, 0.9)
        ax.set_title(title + (" (colour: dp)" if colour else " (colour: EP group)"), fontsize=9)
        ax.axis("off")
    fig.suptitle(f"{shape.describe()}, stage {stage}", fontsize=9)
    fig.tight_layout()
    return fig
