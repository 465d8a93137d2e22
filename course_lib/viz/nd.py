"""Figures of the N-D chapter: loss curves overlaid, the 0D -> 4D story (memory and step
time measured next to the planner), a step's timeline measured over simulated."""
from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
import numpy as np

from course_lib.viz.column import COLUMN_INCHES, LABEL_PT
from course_lib.viz.timeline import legend_handles, timeline


def loss_curves(reference_losses, runs, title="every layout on the one-device curve"):
    """The one-device losses (thick grey) and each layout's (markers): they overlap."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    steps = np.arange(len(reference_losses))
    ax.plot(steps, reference_losses, color="0.75", lw=6, label="one device", zorder=1)
    markers = "os^vDPX*"
    for k, run in enumerate(runs):
        ax.plot(steps, run.losses, marker=markers[k % len(markers)], ls="none", ms=6 - k * 0.5,
                label=f"{run.name} ({run.world_size} ranks)", zorder=2 + k)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def story(rows, title="0D -> 4D: per rank, measured (bars) and planner (black ticks)", time_label="measured"):
    """rows: dicts with name, measured/predicted memory (bytes) and step time (s) per layout;
    ``time_label``: where the measured step time comes from (e.g. "virtual H100s"). Memory
    above step time, at the book's column width, labels of at least 9 pt."""
    fig, (ax_m, ax_t) = plt.subplots(2, 1, figsize=(COLUMN_INCHES, 6.2))
    names = [r["name"] for r in rows]
    x = np.arange(len(rows))
    states = np.array([r["measured_states"] for r in rows]) / 2**20
    rest = np.array([r["measured_peak"] for r in rows]) / 2**20 - states
    tick = 3000 / max(len(rows), 1)   # the planner's tick: about a bar wide
    ax_m.bar(x, states, color="#4C72B0", label="model states (measured)")
    ax_m.bar(x, rest, bottom=states, color="#DD8452", label="activations + buffers (measured peak)")
    ax_m.scatter(x, np.array([r["predicted_states"] for r in rows]) / 2**20, marker="_", s=tick, color="k",
                 label="planner: model states", zorder=3)
    ax_m.scatter(x, np.array([r["predicted_peak"] for r in rows]) / 2**20, marker="_", s=tick, color="k",
                 linestyle="--", label="planner: total", zorder=3)
    ax_m.set_ylabel("MiB, busiest rank", fontsize=LABEL_PT + 1)
    ax_t.bar(x, [r["measured_time"] * 1e3 for r in rows], color="#55A868", label=time_label)
    ax_t.scatter(x, [r["predicted_time"] * 1e3 for r in rows], marker="_", s=tick, color="k",
                 label="planner", zorder=3)
    ax_t.set_ylabel("step time (ms)", fontsize=LABEL_PT + 1)
    for ax in (ax_m, ax_t):
        ax.set_xticks(x)
        ax.set_xticklabels([textwrap.fill(n, 11) for n in names], fontsize=LABEL_PT)   # "4D DP x TP\nx PP x CP"
        ax.tick_params(axis="y", labelsize=LABEL_PT)
        ax.legend(fontsize=LABEL_PT, ncol=2, loc="upper left", frameon=False)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.35)    # room for the legend above the bars
    fig.suptitle(textwrap.fill(title, 80), fontsize=LABEL_PT + 2)
    fig.tight_layout()
    return fig


def step_timelines(measured, simulated, ranks, title, ranks_per_panel=2, clock=None):
    """A measured step over the planner's simulated one (``clock``: the VirtualCluster the
    measured spans were priced on, None for the wall clock). The measured step has a lane per rank
    and mesh dimension (a rank of a 4D layout has 5-6), so it is drawn ``ranks_per_panel``
    ranks to a panel, about 0.3 inch per lane, at the book's column width with labels of at
    least 9 pt; one legend (kinds, and the mesh dimension of each communication) under them."""
    groups = [list(ranks[i:i + ranks_per_panel]) for i in range(0, len(ranks), ranks_per_panel)]
    lanes = [len({(s.rank, getattr(s, "dim", "")) for s in measured if s.rank in g} | {(r, "") for r in g})
             for g in groups]
    sim_ranks = sorted({s.rank for s in simulated})[:len(ranks)]
    heights = [0.3 * n + 0.8 for n in lanes] + [0.35 * len(sim_ranks) + 0.8]
    drawn = [s for s in measured if s.rank in ranks] + list(simulated)
    handles = legend_handles(drawn)
    ncol = min(len(handles), 4)
    legend_inches = 0.22 * -(-len(handles) // ncol) + 0.15      # its rows, under the panels
    total = sum(heights) + legend_inches + 0.1
    fig, axes = plt.subplots(len(heights), 1, figsize=(COLUMN_INCHES, total),
                             gridspec_kw={"height_ratios": heights})
    for ax, group in zip(axes, groups):
        names = ", ".join(map(str, group))
        timeline(measured, ax=ax, ranks=group, by_dim=True, legend=False, clock=clock,
                 title=f"{title}: {'virtual' if clock else 'measured'}, rank{'s' if len(group) > 1 else ''} {names}")
    timeline(simulated, ax=axes[-1], ranks=sim_ranks, title=f"{title}: planner's simulation", legend=False)
    for ax in axes:
        ax.tick_params(labelsize=LABEL_PT)
        ax.title.set_fontsize(LABEL_PT + 1)
        ax.xaxis.label.set_fontsize(LABEL_PT)
    fig.tight_layout(rect=(0, legend_inches / total, 1, 1))
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=LABEL_PT, frameon=False)
    return fig


__all__ = ["loss_curves", "story", "step_timelines"]
