"""Figures of chapter 5 (tensor and sequence parallelism)."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
WHOLE = "#BBBBBB"


def _box(ax, x, y, w, h, color, text="", fontsize=8, textcolor="white"):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="white", linewidth=1.0))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=textcolor)


def _arrow(ax, x0, y0, x1, y1, text=""):
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="->", mutation_scale=10, color="#444444"))
    if text:
        ax.text((x0 + x1) / 2, (y0 + y1) / 2 + 0.18, text, ha="center", va="bottom", fontsize=8, color="#444444")


def megatron_mlp_figure(t: int = 2, title=None):
    """Megatron's MLP on ``t`` ranks: X whole on every rank -> f -> X A_r (A split by columns)
    -> nonlinearity on the slice -> Y_r B_r (B split by rows): partial sums -> g (all-reduce) -> Z.
    One colour per rank; grey: whole on every rank."""
    if not 1 <= t <= len(RANK_COLORS):
        raise ValueError(f"t must be in 1..{len(RANK_COLORS)}, got {t}")
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.75 * t))
    rows = [(t - 1 - r) * 1.0 for r in range(t)]                       # one row per rank, rank 0 on top
    for r, y in enumerate(rows):
        c = RANK_COLORS[r]
        _box(ax, 0.0, y, 1.0, 0.7, WHOLE, "X", textcolor="black")      # (b s, h): the same on every rank
        _arrow(ax, 1.05, y + 0.35, 1.55, y + 0.35, "f")
        _box(ax, 1.6, y, 0.45, 0.7, c, f"A{r + 1}")                    # (h, 4h / t): columns of A
        _arrow(ax, 2.1, y + 0.35, 2.55, y + 0.35)
        _box(ax, 2.6, y, 0.9, 0.7, c, f"Y{r + 1} = σ(X A{r + 1})")      # (b s, 4h / t): σ on the slice
        _arrow(ax, 3.55, y + 0.35, 4.05, y + 0.35)
        _box(ax, 4.1, y + 0.125, 0.9, 0.45, c, f"B{r + 1}")              # (4h / t, h): rows of B
        _arrow(ax, 5.05, y + 0.35, 5.55, y + 0.35)
        _box(ax, 5.6, y, 1.0, 0.7, c, f"Z{r + 1} = Y{r + 1} B{r + 1}")    # (b s, h): a partial sum
        _arrow(ax, 6.65, y + 0.35, 7.55, y + 0.35, "g: all-reduce")
        _box(ax, 7.6, y, 1.0, 0.7, WHOLE, "Z = Σ Zr", textcolor="black")
    ax.set_xlim(-0.1, 8.8)
    ax.set_ylim(-0.3, t + 0.2)
    ax.set_yticks([y + 0.35 for y in rows])
    ax.set_yticklabels([f"rank {r}" for r in range(t)])
    ax.set_xticks([])
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"Megatron's MLP on {t} ranks: A split by columns, B by rows, "
                          f"one all-reduce forward (g), one backward (f)", fontsize=10)
    fig.tight_layout()
    return fig


def activation_bytes_figure(rows, title=None):
    """Bytes one layer keeps for backward, per rank: ``rows`` = [(label, counted, formula)];
    bars are counted, black ticks the formula."""
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    labels = [r[0] for r in rows]
    ys = range(len(rows))
    ax.barh(list(ys), [r[1] / 2**10 for r in rows], color=[RANK_COLORS[0] if "SP" not in r[0] else RANK_COLORS[1]
                                                           for r in rows], height=0.6, label="counted")
    ax.scatter([r[2] / 2**10 for r in rows], list(ys), marker="|", s=300, color="black", label="formula", zorder=3)
    ax.set_yticks(list(ys))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("KiB saved for backward, one layer, one rank")
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


__all__ = ["megatron_mlp_figure", "activation_bytes_figure", "RANK_COLORS"]


def layer_timeline(spans, title=None, fontsize=9):
    """``viz.timeline`` of one TP layer's spans (one lane per rank and mesh dimension), sized for
    the book's text column. Collective bars are numbered in time order on each lane, and a key
    under the plot names them (``"3  f: all-reduce (backward)"``): the bars are too short for
    their names, and every rank issues the same collectives in the same order."""
    from course_lib.viz.timeline import timeline

    fig = timeline(spans, by_dim=True, label_min_frac=0.0, figsize=(7.5, 3.4))
    ax = fig.axes[0]
    lanes = {}
    for text in ax.texts:
        text.set_fontsize(fontsize)
        if ":" in text.get_text():                      # a collective: "op: what (when)"
            lanes.setdefault(text.get_position()[1], []).append(text)
    key = []
    for texts in lanes.values():
        texts.sort(key=lambda t: t.get_position()[0])
        names = [t.get_text() for t in texts]
        key = names if len(names) > len(key) else key
        for i, text in enumerate(texts, 1):
            text.set_text(str(i))
            text.set_color("black")
            text.set_bbox(dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none"))
    for label in ax.get_yticklabels():
        label.set_fontsize(fontsize)
    if title:
        ax.set_title(title, loc="left", fontsize=fontsize + 1)
    rows = (len(key) + 1) // 2
    for i, name in enumerate(key):
        fig.text(0.02 + 0.5 * (i // rows), -0.02 - 0.055 * (i % rows), f"{i + 1:>2}  {name}", fontsize=fontsize - 1,
                 va="top", family="monospace")
    fig.tight_layout()
    return fig
