"""Figures of chapters 1-2: every rank's buffer before and after a collective, the
ring all-reduce step by step, and measured times against the alpha-beta model.

    rank_buffers([("before", bufs0), ("after", bufs1)], title="all_reduce")
    ring_all_reduce_steps(world_size=4, step=None)     # small multiples; step=k: reveal up to k
    measured_vs_model(measurements, fit)                # log-log, one colour per world size
    bandwidths(rows)                                    # algbw and busbw against size
    size_sweep(sizes, times, model=None, crossover=...) # e.g. ring vs tree, measured and modelled
"""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from course_lib.viz.column import COLUMN_INCHES, LABEL_PT

RANK_COLORS = plt.get_cmap("tab10").colors


def _as_list(buf):
    if buf is None:
        return None
    if hasattr(buf, "tolist"):
        return buf.reshape(-1).tolist()
    return list(buf)


def _fmt(v):
    if isinstance(v, float):
        if v == int(v) and abs(v) < 1e6:
            return str(int(v))
        return f"{v:.3g}"
    return str(v)


def rank_buffers(panels, title=None, cell=0.42, fmt=_fmt):
    """Every rank's buffer, one row per rank, one column per panel (e.g. before | after).

    panels: list of (label, buffers) with buffers[r] a 1-D tensor / list for rank r,
        or None where the rank has no buffer (e.g. a non-root's scatter_list).
    Equal values get equal colours (the same piece of data is easy to follow);
    values seen only after a reduction get their own colours. At most the book's column wide
    (``viz.column``): many elements get narrower cells, never smaller labels.
    """
    panels = [(label, [_as_list(b) for b in bufs]) for label, bufs in panels]
    n_ranks = max(len(b) for _, b in panels)
    widths = [max([len(b) for b in bufs if b is not None] + [1]) for _, bufs in panels]
    values = []
    for _, bufs in panels:
        for b in bufs:
            for v in b or []:
                if v not in values:
                    values.append(v)
    palette = plt.get_cmap("tab20").colors + plt.get_cmap("tab20b").colors
    color = {v: palette[i % len(palette)] for i, v in enumerate(values)}
    gap = 1.2
    total_w = sum(widths) + gap * (len(panels) - 1)
    # the book's column at most: a wide figure is shrunk in the page, and its labels with it
    width = min(COLUMN_INCHES, max(4.0, (total_w + 1.6) * cell * 1.6))
    fig, ax = plt.subplots(figsize=(width, 0.5 + (n_ranks + 1) * cell * 1.4))
    x0 = 0.0
    for (label, bufs), w in zip(panels, widths):
        ax.text(x0 + w / 2, -0.9, label, ha="center", va="center", fontsize=LABEL_PT + 1, fontweight="bold")
        for r in range(n_ranks):
            b = bufs[r] if r < len(bufs) else None
            if b is None:
                ax.text(x0 + 0.1, r, "-", ha="left", va="center", color="0.5", fontsize=LABEL_PT)
                continue
            for i, v in enumerate(b):
                ax.add_patch(Rectangle((x0 + i, r - 0.42), 1, 0.84, facecolor=color[v], edgecolor="white", lw=1.5))
                ax.text(x0 + i + 0.5, r, fmt(v), ha="center", va="center", fontsize=LABEL_PT)
        x0 += w + gap
    ax.set_xlim(-1.6, total_w + 0.1)
    ax.set_ylim(n_ranks - 0.4, -1.4)
    for r in range(n_ranks):
        ax.text(-0.3, r, f"rank {r}", ha="right", va="center", fontsize=LABEL_PT)
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=11)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- the ring, step by step


def _draw_ring_state(ax, state, N, show_sends=True):
    """One state of ``collectives.simulate_ring_all_reduce``: ranks x chunks, cell = ranks summed in."""
    holds, sends = state["holds"], state["sends"]
    for r in range(N):
        for c in range(N):
            have = holds[r][c]
            frac = len(have) / N
            full = len(have) == N
            face = (0.2, 0.55, 0.3, 0.25 + 0.75 * frac) if full else (0.25, 0.45, 0.75, 0.15 + 0.6 * frac)
            ax.add_patch(Rectangle((c, r), 1, 1, facecolor=face, edgecolor="white", lw=1.5))
            label = "Σ" if full and N > 1 else "+".join(str(q) for q in sorted(have))
            ax.text(c + 0.5, r + 0.5, label, ha="center", va="center", fontsize=7 if len(label) < 6 else 5.5)
    for r in range(N):  # outlines last, so no cell covers them
        if show_sends and sends[r] is not None:
            sent_chunk, dst = sends[r]
            # the chunk rank r sent to get here: outlined on the receiving rank's row
            ax.add_patch(Rectangle((sent_chunk + 0.04, dst + 0.04), 0.92, 0.92, fill=False, edgecolor="crimson", lw=1.6))
    ax.set_xlim(0, N)
    ax.set_ylim(N, 0)
    ax.set_xticks([c + 0.5 for c in range(N)], [f"c{c}" for c in range(N)], fontsize=7)
    ax.set_yticks([r + 0.5 for r in range(N)], [f"r{r}" for r in range(N)], fontsize=7)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)


def ring_all_reduce_steps(world_size: int = 4, step: int | None = None, ncols: int | None = None):
    """Small multiples of the ring all-reduce: after each step, which ranks' data every
    chunk of every rank holds ("0+1" = the sum of ranks 0 and 1's pieces, Σ = all).

    Rows of a panel are ranks, columns chunks. A red outline marks the chunk that
    just arrived (sent by the rank above, around the ring). Steps 1..N-1 are the
    reduce-scatter (sums grow), N..2(N-1) the all-gather (finished chunks spread).
    ``step``: draw only the states up to this step (the widget's slider); None: all.
    """
    from course_lib.collectives.ring import simulate_ring_all_reduce

    N = world_size
    states = simulate_ring_all_reduce(N)
    last = len(states) - 1 if step is None else max(0, min(int(step), len(states) - 1))
    ncols = ncols or min(len(states), N if N > 2 else 3)
    nrows = math.ceil(len(states) / ncols)
    size = 0.38 * N + 0.5
    fig, axes = plt.subplots(nrows, ncols, figsize=(ncols * size + 0.4, nrows * (size + 0.35) + 0.5), squeeze=False)
    for k, ax in enumerate(axes.flat):
        if k >= len(states):
            ax.axis("off")
            continue
        st = states[k]
        if k > last:
            ax.axis("off")
            continue
        _draw_ring_state(ax, st, N)
        phase = {"start": "start", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather"}[st["phase"]]
        ax.set_title(f"{k}: {phase}" if k else "start", fontsize=8, color="crimson" if k == last and step is not None else "black")
    fig.suptitle(f"ring all-reduce on {N} ranks: {2 * (N - 1)} steps, each moving one chunk (n/{N}) per rank",
                 fontsize=10)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- measurements


def _bytes_label(n):
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            v = n / k
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def _size_axis(ax, sizes):
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes))
    ax.set_xticks(ticks, [_bytes_label(s) for s in ticks], rotation=45, fontsize=8)
    ax.minorticks_off()


def measured_vs_model(measurements, fit, title=None):
    """Measured times (points) against the fitted alpha-beta model (lines), per world size.

    measurements: costmodel.Measurement rows (algorithm, n_bytes, world_size, seconds).
    """
    from course_lib.costmodel.fit import as_measurement

    ms = [as_measurement(m) for m in measurements]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    groups = sorted({(m.algorithm, m.world_size) for m in ms}, key=lambda g: (g[0], g[1]))
    sizes = sorted({m.n_bytes for m in ms})
    for i, (algo, N) in enumerate(groups):
        pts = sorted((m.n_bytes, m.seconds) for m in ms if (m.algorithm, m.world_size) == (algo, N))
        col = RANK_COLORS[i % len(RANK_COLORS)]
        label = f"{algo}, N={N}" if len({g[0] for g in groups}) > 1 else f"N={N}"
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], "o", color=col, label=f"{label} measured")
        ax.plot(sizes, [fit.predict(algo, n, N) * 1e3 for n in sizes], "-", color=col, alpha=0.7)
        ax2.plot([p[0] for p in pts], [(fit.predict(algo, p[0], N) - p[1]) / p[1] * 100 for p in pts],
                 "o-", color=col, label=label)
    ax.set_yscale("log")
    _size_axis(ax, sizes)
    ax.set_ylabel("time (ms)")
    shared = f", ranks sharing {fit.cores} cores" if getattr(fit, "cores", None) else ""
    beta = f"beta = {fit.beta * 1e9:.3f} ns/B"
    if getattr(fit, "cache_bytes", None):
        beta += f" in cache, {fit.beta_memory * 1e9:.3f} beyond"
    ax.set_title(title or (f"measured (points) vs alpha-beta model (lines)\nalpha = {fit.alpha * 1e6:.1f} us, "
                           f"{beta}{shared}"), fontsize=9)
    ax.legend(fontsize=7)
    _size_axis(ax2, sizes)
    ax2.axhline(0, color="0.3", lw=0.8)
    for lim in (-25, 25):
        ax2.axhline(lim, color="0.6", lw=0.8, ls="--")
    ax2.set_ylabel("model error (%)")
    ax2.set_title(f"(predicted - measured) / measured: |error| median {fit.median_abs_rel_error:.0%}, "
                  f"max {fit.max_abs_rel_error:.0%}", fontsize=9)
    fig.tight_layout()
    return fig


def bandwidths(rows, title="algorithm and bus bandwidth"):
    """rows: (label, collective, n_bytes, seconds, world_size). Left algbw, right busbw (GB/s)."""
    from course_lib import costmodel

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    labels = list(dict.fromkeys(r[0] for r in rows))
    sizes = sorted({r[2] for r in rows})
    for i, label in enumerate(labels):
        pts = sorted((n, t, coll, N) for lab, coll, n, t, N in rows if lab == label)
        col = RANK_COLORS[i % len(RANK_COLORS)]
        axes[0].plot([p[0] for p in pts], [costmodel.algbw(n, t) / 1e9 for n, t, _, _ in pts], "o-", color=col, label=label)
        axes[1].plot([p[0] for p in pts], [costmodel.busbw(c, n, t, N) / 1e9 for n, t, c, N in pts], "o-", color=col,
                     label=label)
    for ax, name in zip(axes, ("algbw = n / t", "busbw = algbw x bus factor")):
        _size_axis(ax, sizes)
        ax.set_title(name, fontsize=9)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def size_sweep(sizes, times, model=None, crossovers=None, title=None, ylabel="time (ms)"):
    """Times against buffer size, one line per algorithm.

    times: {label: [seconds per size]} measured (points + line);
    model: {label: [seconds per size]} predicted (dashed, same colour by order);
    crossovers: {label: n_bytes} drawn as vertical lines.
    """
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, ts) in enumerate(times.items()):
        ax.plot(sizes, [t * 1e3 for t in ts], "o-", color=RANK_COLORS[i % 10], label=f"{label} (measured)")
    for i, (label, ts) in enumerate((model or {}).items()):
        ax.plot(sizes, [t * 1e3 for t in ts], "--", color=RANK_COLORS[i % 10], alpha=0.8, label=f"{label} (model)")
    for j, (label, n) in enumerate((crossovers or {}).items()):
        if n:
            ax.axvline(n, color="0.4" if j == 0 else "0.7", ls=":", lw=1.5)
            ax.text(n, ax.get_ylim()[1] if False else 0.98, f" {label}\n {_bytes_label(n)}", rotation=0,
                    transform=ax.get_xaxis_transform(), va="top", fontsize=7)
    ax.set_yscale("log")
    _size_axis(ax, sizes)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def segments_sweep(segments, times, model=None, reference=None, title=None):
    """Time of one all-reduce against the number of segments per chunk (log axis).

    times: {label: [seconds per k]} measured; model: {label: [seconds per k]} dashed;
    reference: {label: seconds} drawn as horizontal lines (gloo's time, say).
    """
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, ts) in enumerate(times.items()):
        ax.plot(segments, [t * 1e3 for t in ts], "o-", color=RANK_COLORS[i % 10], label=f"{label} (measured)")
    for i, (label, ts) in enumerate((model or {}).items()):
        ax.plot(segments, [t * 1e3 for t in ts], "--", color=RANK_COLORS[i % 10], alpha=0.8, label=f"{label} (model)")
    for j, (label, t) in enumerate((reference or {}).items()):
        ax.axhline(t * 1e3, color="0.4" if j == 0 else "0.7", ls=":", lw=1.5, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(segments), [str(k) for k in segments])
    ax.set_xlabel("segments per chunk (k)")
    ax.set_ylabel("time (ms)")
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


__all__ = ["rank_buffers", "ring_all_reduce_steps", "measured_vs_model", "bandwidths", "size_sweep",
           "segments_sweep"]
