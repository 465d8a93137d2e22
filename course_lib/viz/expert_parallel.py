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
