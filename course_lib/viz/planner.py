"""Figures of the planning chapter: memory bars against HBM, step-time breakdowns,
the 0D-to-4D story, the configuration search, and the calculator (one figure that a
widget wraps). Each takes planner Estimates and returns a matplotlib Figure."""
from __future__ import annotations

import matplotlib.pyplot as plt

GiB = 2**30
MEMORY_COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868",
                 "activations": "#C44E52", "temporaries": "#8172B3"}
TIME_COLORS = {"compute": "#4C72B0", "elementwise": "#64B5CD", "tp": "#DD8452", "cp": "#CCB974",
               "ep": "#937860", "pp": "#DA8BC3", "zero": "#8172B3", "bubble": "#C8C8C8",
               "dp": "#C44E52", "optimizer": "#55A868"}


def memory_bars(estimates, labels=None, ax=None, title="memory per GPU"):
    """Stacked bars of each estimate's per-GPU memory by category, with the HBM line."""
    estimates = list(estimates)
    labels = labels or [e.layout.describe().split(",")[0] for e in estimates]
    fig, ax = (plt.subplots(figsize=(max(4, 1.2 * len(estimates) + 2), 3.6)) if ax is None else (ax.figure, ax))
    for i, e in enumerate(estimates):
        bottom = 0.0
        for kind, color in MEMORY_COLORS.items():
            val = e.memory[kind] / GiB
            ax.bar(i, val, bottom=bottom, color=color, label=kind if i == 0 else None)
            bottom += val
        ax.text(i, bottom, f"{bottom:.0f}", ha="center", va="bottom", fontsize=8)
    hbm = {e.hardware.hbm_bytes for e in estimates}
    for j, cap in enumerate(sorted(hbm)):
        ax.axhline(cap / GiB, color="black", ls="--", lw=1, label="HBM" if j == 0 else None)
    ax.set_xticks(range(len(estimates)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("GiB")
    top = max([e.memory["total"] for e in estimates] + list(hbm)) / GiB
    if top > 20 * min(hbm) / GiB:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=7, frameon=False, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    return fig


def time_bars(estimates, labels=None, ax=None, title="step time", per_token=False):
    """Stacked horizontal bars of each estimate's step time by what it is spent on."""
    estimates = list(estimates)
    labels = labels or [e.layout.describe().split(",")[0] for e in estimates]
    fig, ax = (plt.subplots(figsize=(8, 0.5 * len(estimates) + 1.5)) if ax is None else (ax.figure, ax))
    seen = set()
    for i, e in enumerate(estimates):
        left = 0.0
        scale = 1.0 / e.tokens_per_second / e.step_time * 1e6 if per_token else 1.0
        for kind, color in TIME_COLORS.items():
            val = e.time.get(kind, 0.0) * scale
            if val <= 0:
                continue
            ax.barh(i, val, left=left, color=color, label=kind if kind not in seen else None)
            seen.add(kind)
            left += val
        ax.text(left, i, f" MFU {e.mfu:.0%}", va="center", fontsize=8)
    ax.set_yticks(range(len(estimates)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("µs per token (cluster)" if per_token else "seconds per step")
    ax.set_title(title)
    ax.legend(fontsize=7, frameon=False, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    ax.set_xlim(0, ax.get_xlim()[1] * 1.15)          # room for the MFU label
    fig.tight_layout()
    return fig


def story(estimates, labels):
    """The 0D -> 4D story: memory per GPU against HBM, step time, and MFU, per step."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    xs = range(len(estimates))
    mem = [e.memory["total"] / GiB for e in estimates]
    colors = ["#C44E52" if e.violations else "#4C72B0" for e in estimates]
    panels = ((axes[0], mem, "memory per GPU (GiB)", "{:.0f}"),
              (axes[1], [e.step_time for e in estimates], "step time (s)", "{:.3g}"),
              (axes[2], [100 * e.mfu for e in estimates], "MFU (%)", "{:.0f}"))
    for ax, vals, title, fmt in panels:
        ax.bar(xs, vals, color=colors)
        for x, val in zip(xs, vals):
            ax.text(x, val, fmt.format(val), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title, fontsize=10)
    for ax in axes[:2]:
        ax.set_yscale("log")
    for cap in sorted({e.hardware.hbm_bytes for e in estimates}):
        axes[0].axhline(cap / GiB, color="black", ls="--", lw=1)
    axes[0].text(len(estimates) - 0.5, estimates[0].hardware.hbm_bytes / GiB, "HBM", fontsize=8, va="bottom", ha="right")
    axes[2].set_ylim(0, 100)
    fig.suptitle("red: does not fit in HBM", fontsize=8, color="#C44E52", x=0.99, ha="right")
    fig.tight_layout()
    return fig


def calculator(est, ax_title=None):
    """One layout at a glance: memory per stage against HBM, the step's breakdown, MFU,
    and every violated constraint named."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [1, 1.3]})
    stages = est.memory_by_stage
    show = list(range(len(stages)))
    if len(show) > 8:
        show = sorted({0, 1, len(stages) // 2, len(stages) - 2, len(stages) - 1})
    for j, st in enumerate(show):
        bottom = 0.0
        for kind, color in MEMORY_COLORS.items():
            val = stages[st][kind] / GiB
            a.bar(j, val, bottom=bottom, color=color, label=kind if j == 0 else None)
            bottom += val
    a.axhline(est.hardware.hbm_bytes / GiB, color="black", ls="--", lw=1, label="HBM")
    a.set_xticks(range(len(show)))
    a.set_xticklabels([f"stage {s}" for s in show], fontsize=8)
    a.set_ylabel("GiB per GPU")
    a.legend(fontsize=7, frameon=False, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    a.set_title("memory per GPU, by pipeline stage")
    time_bars([est], [""], ax=b, title=f"step {est.step_time:.3g} s, {est.tflops_per_gpu:.0f} TFLOP/s/GPU, "
                                        f"MFU {est.mfu:.1%}")
    problems = est.violations + est.notes
    text = "\n".join(("VIOLATED: " if p in est.violations else "note: ") + p for p in problems) or "fits; no warnings"
    fig.suptitle(ax_title or f"{est.model.name} on {est.layout.n_gpus} x {est.hardware.name}: {est.layout.describe()}",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.text(0.01, 0.01, text, fontsize=8, va="bottom", color="#C44E52" if est.violations else "black")
    return fig


def search_scatter(result, top: int = 5):
    """Every layout of a search: memory per GPU against predicted throughput."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for group, color, label in ((result.too_big, "#C8C8C8", "does not fit"), (result.ranked, "#4C72B0", "fits")):
        if group:
            ax.scatter([e.memory["total"] / GiB for e in group], [e.tokens_per_second for e in group],
                       s=10, color=color, label=label, alpha=0.7)
    for i, e in enumerate(result.ranked[:top], 1):
        ax.annotate(str(i), (e.memory["total"] / GiB, e.tokens_per_second), fontsize=8, color="#C44E52")
    hw = (result.ranked or result.too_big)[0].hardware if (result.ranked or result.too_big) else None
    if hw is not None:
        ax.axvline(hw.hbm_bytes / GiB, color="black", ls="--", lw=1, label="HBM")
    ax.set_xscale("log")
    ax.set_xlabel("memory per GPU (GiB)")
    ax.set_ylabel("tokens / s (cluster)")
    ax.legend(fontsize=8, frameon=False)
    ax.set_title("every valid layout: the best ones fit and are fast")
    fig.tight_layout()
    return fig


def predicted_vs_measured(rows, title="calibration on this machine"):
    """Bars of predicted and measured seconds, one pair per row ({'name', 'predicted', 'measured'})."""
    fig, ax = plt.subplots(figsize=(6, 3))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["predicted"] for r in rows], 0.4, label="predicted", color="#4C72B0")
    ax.bar([x + 0.2 for x in xs], [r["measured"] for r in rows], 0.4, label="measured", color="#DD8452")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["name"] for r in rows], fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title(title)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
