"""How long a pipeline sits idle: the bubble of a simulated timeline (:func:`bubble`), the
textbook formulas for each schedule (:func:`bubble_fraction`, :func:`formula_bubble`,
:func:`formula_idle`) and the activations a rank holds at once (:func:`in_flight`,
:func:`formula_peak_activations`)."""
from __future__ import annotations

from course_lib.schedules.actions import PLANNED, V_SCHEDULES

def bubble(spans, rank=None):
    """Idle fraction of the step (first start to last end over all ranks) of ``rank``'s
    compute spans; the mean over ranks if ``rank`` is None. (Narayanan's (p-1)/m is idle
    time relative to the IDEAL compute time instead: (p-1)/(m+p-1) = x / (1 + x).)"""
    spans = [s for s in spans if s.kind == "compute"]
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    ranks = sorted({s.rank for s in spans}) if rank is None else [rank]
    fr = [1.0 - sum(s.end - s.start for s in spans if s.rank == r) / (t1 - t0) for r in ranks]
    return sum(fr) / len(fr)


def bubble_fraction(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> float:
    """Fraction of a pipeline step that a stage sits idle (equal stages, free p2p).

    GPipe and 1F1B: the first micro-batch needs p - 1 stage-times to reach the last
    stage and the last backward p - 1 to come back, so a step lasts (m + p - 1)
    (t_f + t_b) of which m (t_f + t_b) is work: bubble = (p-1)/(m+p-1) (Huang et al.
    2019; Narayanan et al. 2021). Interleaved with v chunks per stage: each chunk
    takes (t_f + t_b)/v, the fill and drain shrink to (p-1)(t_f + t_b)/v, the work
    stays m (t_f + t_b): bubble = (p-1)/(v m + p - 1) (Narayanan et al. 2021, Sec. 2.2.2),
    for any micro-batch group N >= p (:func:`~course_lib.schedules.microbatch_group`). With
    m < p micro-batches (torch's one round, N = m) a micro-batch comes back to rank 0 for its
    next chunk p - m chunk-times after the group left it: the step is (p v + m - 1) chunk-times
    of forward and backward, bubble = ((p - m) v + m - 1)/(p v + m - 1) (the same at m = p).
    The simulator reproduces them (tests/test_planner_simulator.py). ZB-V and DualPipeV:
    :func:`formula_bubble` with a chunk's F : B : W = 1 : 2 : 1 (the weight-gradient GEMMs are
    half of a backward's), (p-1)/(6m + p-1) and (p-1)/(3m + p-1).
    """
    if schedule not in PLANNED:
        raise ValueError(f"schedule must be one of {PLANNED}, got {schedule!r}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be >= 1, got p={p}, m={m}, v={v}")
    if schedule in V_SCHEDULES or schedule == "zb-h1":
        return formula_bubble(schedule, p, m)
    vv = v if schedule == "interleaved" else 1
    if vv > 1 and m < p:
        return ((p - m) * vv + m - 1) / (p * vv + m - 1)
    return (p - 1) / (vv * m + p - 1)


def formula_bubble(name: str, p: int, m: int, v: int = 1, t_f=1.0, t_b=2.0, t_w=1.0) -> float:
    """The textbook bubble as a fraction of the step: :func:`bubble_fraction`
    for GPipe / 1F1B / interleaved. ZB-H1 (t_b: the whole backward, B + W) idles

        (p - 1)(t_f + t_b - t_w) - (min(m, p) - 1) t_w     per rank per step:

    1F1B's fill and drain with a split backward, (p - 1)(t_f + t_b - t_w), less the W passes
    that fill it: p - 1 of them once m >= p (Qi et al. 2023, Sec. 3.1: (p - 1)(t_f + t_b - 2 t_w)),
    only m - 1 when m < p, where the step is (p - 1 + m)(t_f + t_b - t_w) + t_w: the F and B
    passes through every stage, then rank 0's last W. No less than 0, where a W outlasts a
    forward and an input-gradient pass together. Exact for the timeline of :func:`zero_bubble_h1`
    on the clock it is built on (t_f = t_b - t_w = t_w, any scale); tested for p 2..4, m 1..8."""
    if name == "zb-h1":
        idle = max(0.0, (p - 1) * (t_f + t_b - t_w) - (min(m, p) - 1) * t_w)
        return idle / (m * (t_f + t_b) + idle)
    if name in V_SCHEDULES:             # t_f, t_b, t_w: a chunk's; each rank runs two per micro-batch
        idle = formula_idle(name, p, t_f=t_f, t_b=t_b, t_w=t_w)
        return idle / (2 * m * (t_f + t_b) + idle)
    return bubble_fraction(p, m, name, v)


def formula_idle(name: str, p: int, t_f=1.0, t_b=2.0, t_w=1.0, t_fb=None) -> float:
    """Idle time per rank per step, the formulas of DeepSeek-V3's technical report (DeepSeek-AI
    2024, Table 2; the DualPipe repository's README): with F a forward, B a full backward, W its
    weight part, F&B (``t_fb``, default F + B: not overlapped) a forward and a backward of two
    micro-batches run as one overlapped pair, on PP stages,

        1F1B  (PP - 1)(F + B)     ZB1P (= zb-h1)  (PP - 1)(F + B - 2W)     DualPipe  (PP/2 - 1)(F&B + B - 3W)

    F, B, W are a stage's for 1F1B and ZB1P (p = PP ranks), a chunk's for the V schedules.
    DualPipeV is DualPipe cut in half: its 2p chunks on p ranks are DualPipe's PP = 2p stages,
    so (p - 1)(F&B + B - 3W). ZB-V (Qi et al. 2024, Sec. 6) runs ZB1P's idea over the V's 2p
    chunks, each rank's two chunks filling each other's bubbles: (p - 1)(F + B - 2W) with a
    chunk's times, zero-bubble's "zero" being this (p - 1) chunk-forwards at F = B - W = W.
    Steady-state formulas (m >= 2p); :func:`simulate` gives the exact timeline of any order."""
    t_fb = t_f + t_b if t_fb is None else t_fb
    if name in ("gpipe", "1f1b"):
        return (p - 1) * (t_f + t_b)
    if name in ("zb-h1", "zb-v"):
        return (p - 1) * (t_f + t_b - 2 * t_w)
    if name == "dualpipe-v":
        return (p - 1) * (t_fb + t_b - 3 * t_w)
    raise ValueError(f"formula_idle knows gpipe, 1f1b, zb-h1, zb-v and dualpipe-v, got {name!r}")


def formula_peak_activations(name: str, p: int, m: int) -> int:
    """The most micro-batches' activations a rank holds at once (:func:`in_flight` of its
    busiest rank), counted in its own chunks: 1F1B and ZB1P min(p, m) stages' worth (DeepSeek-V3
    Table 2: PP); ZB-V min(2p, 2m) chunks, half a stage each: 1F1B's memory (Qi et al. 2024);
    DualPipeV 2p + 1 chunks (Table 2's PP + 1, with PP = 2p chunks). Parameters per rank: a
    V rank's two chunks are 1/p of the model, as a 1F1B stage (DualPipe's 2x is the bidirectional
    version's two copies of every stage)."""
    if name == "gpipe":
        return m
    if name in ("1f1b", "zb-h1"):
        return min(p, m)
    if name == "zb-v":
        return min(2 * p, 2 * m)
    if name == "dualpipe-v":
        return 2 * p + 1
    raise ValueError(f"formula_peak_activations knows gpipe, 1f1b, zb-h1, zb-v and dualpipe-v, got {name!r}")


def in_flight(actions) -> int:
    """Peak number of micro-batches (per chunk) whose forward ran and whose last backward
    part (B, or W where split) has not: the activations a rank holds at once."""
    split = {(a.stage, a.mb) for a in actions if a.op == "W"}
    live = peak = 0
    for a in actions:
        if a.op == "F":
            live += 1
            peak = max(peak, live)
        elif a.op == "W" or (a.op == "B" and (a.stage, a.mb) not in split):
            live -= 1
    return peak


__all__ = ["bubble", "bubble_fraction", "formula_bubble", "formula_idle", "formula_peak_activations", "in_flight"]
