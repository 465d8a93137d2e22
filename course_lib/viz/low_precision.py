"""Figures of chapter 9c (fp16 loss scaling, FP8)."""
from __future__ import annotations

import matplotlib.pyplot as plt


def loss_curves(curves: dict, title: str = "", smooth: int = 10, ylabel: str = "training loss (nats/byte)"):
    """One line per run: ``curves`` = {label: [loss per step]}, a running mean over ``smooth``
    steps (a tiny batch's loss is noisy)."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for label, losses in curves.items():
        means = [sum(losses[max(0, i - smooth + 1):i + 1]) / len(losses[max(0, i - smooth + 1):i + 1])
                 for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), means, label=label, lw=1.4)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def scale_history(scales, skipped, title: str = "the loss scale, step by step"):
    """The scale before each step (log2), skipped steps marked."""
    import math

    fig, ax = plt.subplots(figsize=(7, 2.6))
    steps = range(len(scales))
    ax.step(steps, [math.log2(s) for s in scales], where="post", lw=1.4, label="log2(scale)")
    ax.scatter([i for i in steps if skipped[i]], [math.log2(scales[i]) for i in steps if skipped[i]],
               color="#C44E52", zorder=3, label="step skipped (overflow)")
    ax.set_xlabel("step")
    ax.set_ylabel("log2 scale")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


__all__ = ["loss_curves", "scale_history"]
