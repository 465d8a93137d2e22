"""Figures of chapter 7: causal work per CP rank, activation memory vs sequence length."""
from __future__ import annotations

import matplotlib.pyplot as plt


def work_per_rank(per_layout: dict, title="causal attention FLOPs per CP rank", ylabel="FLOPs"):
    """Grouped bars: {layout: [work of rank 0, rank 1, ...]}."""
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    layouts = list(per_layout)
    n = len(per_layout[layouts[0]])
    width = 0.8 / len(layouts)
    for i, name in enumerate(layouts):
        ax.bar([r + i * width for r in range(n)], per_layout[name], width, label=name)
    ax.set_xticks([r + width * (len(layouts) - 1) / 2 for r in range(n)])
    ax.set_xticklabels([f"rank {r}" for r in range(n)])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


def memory_vs_length(lengths, series: dict, title="attention activations per rank"):
    """Lines: {label: [bytes at each length]}, log-log."""
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    for label, values in series.items():
        ax.plot(lengths, [v / 2**20 for v in values], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("MiB")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig


__all__ = ["work_per_rank", "memory_vs_length"]
