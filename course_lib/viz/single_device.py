"""Figures of the single-device chapter (0D): the loss curve, where the bytes of a
training step go, and what one transformer layer saves for backward."""
from __future__ import annotations

import matplotlib.pyplot as plt

CATEGORY_COLORS = {
    "params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
}


def loss_curve(losses, val=None, ax=None, title="training loss", every=1):
    """Training loss per step; ``val`` is an optional list of (step, loss) points."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.2))
    else:
        fig = ax.figure
    steps = [i * every for i in range(len(losses))]
    ax.plot(steps, losses, color="#4C72B0", lw=1.5, label="train")
    if val:
        vs, vl = zip(*val)
        ax.plot(vs, vl, "o", color="#C44E52", ms=5, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


def memory_bars(recipes: dict, ax=None, title="bytes of the training state", unit="KiB"):
    """Stacked bars, one per recipe: ``{"fp32 AdamW": {"params": B, "grads": B, ...}, ...}``.

    Each bar is split into the categories present (params, grads, optimizer,
    activations); the total is written on top.
    """
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 0.9 * len(recipes) + 1.4))
    else:
        fig = ax.figure
    names = list(recipes)
    for row, name in enumerate(names):
        left = 0.0
        for cat, nbytes in recipes[name].items():
            if cat == "total":
                continue
            width = nbytes / scale
            ax.barh(row, width, left=left, color=CATEGORY_COLORS.get(cat, "#8172B3"), edgecolor="white",
                    label=cat if row == 0 else None)
            left += width
        ax.text(left, row, f"  {left:,.0f} {unit}", va="center", fontsize=9)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title)
    ax.set_xlim(0, ax.get_xlim()[1] * 1.18)
    ax.legend(frameon=False, ncol=4, loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def saved_bytes_by_part(blocks: dict, ax=None, title="bytes one layer saves for backward"):
    """Grouped bars: for each block variant (``{"GPT-2": rows, "Llama": rows}``, rows from
    ``models.saved_activations``), the saved bytes per top-level part of the block
    (norms, attention, MLP, dropout masks)."""
    def part(row):
        if str(row.dtype) == "torch.bool":
            return "dropout masks"
        head = row.saved_by.split(",")[0].split(".")[0]
        return {"attn_norm": "norms", "mlp_norm": "norms", "attn": "attention", "mlp": "MLP"}.get(head, head)

    parts = ["norms", "attention", "MLP", "dropout masks"]
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.2))
    else:
        fig = ax.figure
    width = 0.8 / max(len(blocks), 1)
    colors = ["#4C72B0", "#DD8452", "#55A868", "#8172B3"]
    for i, (name, rows) in enumerate(blocks.items()):
        totals = {p: 0 for p in parts}
        for r in rows:
            totals[part(r)] = totals.get(part(r), 0) + r.nbytes
        xs = [j + (i - (len(blocks) - 1) / 2) * width for j in range(len(parts))]
        ax.bar(xs, [totals[p] / 1024 for p in parts], width, label=name, color=colors[i % len(colors)])
    ax.set_xticks(range(len(parts)), parts)
    ax.set_ylabel("KiB")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    return fig


__all__ = ["loss_curve", "memory_bars", "saved_bytes_by_part", "CATEGORY_COLORS"]
