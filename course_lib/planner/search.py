"""Configuration search: every valid layout of a model on N GPUs, ranked by throughput.

Enumerates TP (a divisor of the node size), CP, PP (with 1F1B or the interleaved
schedule; ZB-V and DualPipeV when ``schedules`` names them), DP (what is left), the ZeRO
stage, recomputation and the micro-batch size; for MoE models EP, expert TP and the token
dispatch; drops what ``validate`` rejects (the reasons are counted) and what does not
fit in memory; ranks the rest by predicted tokens per second: the estimate's, or
(``timing="simulate"``) the step of the simulated timeline (:mod:`.simulator`), which runs
a schedule's own action lists: exact where the estimate's steady-state formulas are not (a
V schedule with few micro-batches never fills) and where the weight-gradient part of a
backward (``w_fraction``) is not the estimate's half.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from course_lib.planner.estimate import Estimate, estimate
from course_lib.planner.layout import Layout
from course_lib.planner.presets import get_hardware, get_model
from course_lib.planner.simulator import simulate
from course_lib.schedules import PLANNED

TIMINGS = ("estimate", "simulate")


@dataclass
class SearchResult:
    ranked: list                  # Estimates that fit, fastest first
    too_big: list                 # Estimates that do not fit in memory
    rejected: Counter = field(default_factory=Counter)   # ValueError message kind -> count

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    def table(self, top: int = 10) -> str:
        lines = [f"{'rank':>4}  {'layout':<62} {'tok/s':>10} {'MFU':>6} {'GiB/GPU':>8}"]
        for i, e in enumerate(self.ranked[:top], 1):
            lines.append(f"{i:>4}  {e.layout.describe()[:62]:<62} {e.tokens_per_second:>10.4g} "
                         f"{e.mfu:>6.1%} {e.memory['total'] / 2**30:>8.1f}")
        return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _simulated(est: Estimate, w_fraction: float) -> Estimate:
    """``est`` with the step of its simulated timeline (one GPU per stage), and what follows from it."""
    step = simulate(est.model, est.hardware, est.layout, max_gpus=0, w_fraction=w_fraction).step_time
    scale = est.step_time / step
    return replace(est, step_time=step, mfu=est.mfu * scale, hfu=est.hfu * scale,
                   tflops_per_gpu=est.tflops_per_gpu * scale,
                   notes=est.notes + [f"step time from the simulated timeline (W = {w_fraction:g} of a backward)"])


def _check_choices(schedules, timing, w_fraction, etp_sizes, dispatches):
    bad = [s for s in schedules if s not in PLANNED]
    if bad or not schedules:
        raise ValueError(f"schedules must name some of {PLANNED}, got {schedules!r}")
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
    if isinstance(w_fraction, bool) or not isinstance(w_fraction, (int, float)) or not 0 <= w_fraction <= 1:
        raise ValueError(f"w_fraction (W's part of a backward) must be a number in [0, 1], got {w_fraction!r}")
    if any(isinstance(e, bool) or not isinstance(e, int) or e < 1 for e in etp_sizes):
        raise ValueError(f"etp_sizes must be integers >= 1, got {etp_sizes!r}")
    if dispatches is not None and any(d not in ("all_to_all", "all_gather") for d in dispatches):
        raise ValueError(f"dispatches must be among ('all_to_all', 'all_gather'), got {dispatches!r}")


def search(model, hardware, n_gpus: int, global_batch: int, memory_limit: float | None = None,
           micro_batches=(1, 2, 4), recomputes=("none", "selective", "full"), zero_stages=(0, 1, 2, 3),
           cp_sizes=(1, 2, 4, 8), interleave=(1, 2), ep_sizes=None, tp_sizes=None, pp_sizes=None,
           seq_len=None, schedules=("1f1b", "interleaved"), etp_sizes=(1,), dispatches=None,
           timing="estimate", w_fraction=0.5) -> SearchResult:
    """Rank every valid layout of ``model`` on ``n_gpus`` GPUs for one ``global_batch``
    (sequences of ``seq_len``, default the model's). ``memory_limit`` bytes per GPU
    (default: the GPU's HBM). ``tp_sizes`` / ``pp_sizes`` restrict TP (default: the
    divisors of the node size) and PP (default: every divisor). With fused attention,
    "selective" stores and runs what "none" does, so only "none" is tried when both are asked.
    ``schedules``: the pipeline schedules tried where PP > 1 (of ``schedules.PLANNED``; add
    "zb-v", "dualpipe-v" for the V schedules; "interleaved" with each ``interleave`` v > 1).
    MoE models: ``ep_sizes`` (default every divisor of the experts), ``etp_sizes`` (expert TP),
    ``dispatches`` (token dispatch, "all_to_all" / "all_gather"; default the model's).
    ``timing``: "estimate" (the analytic step) or "simulate" (the simulated timeline, with a
    backward's weight-gradient part ``w_fraction``: where ZB-V pays and where it does not)."""
    model, hw = get_model(model), get_hardware(hardware)
    _check_choices(schedules, timing, w_fraction, etp_sizes, dispatches)
    limit = hw.hbm_bytes if memory_limit is None else memory_limit
    if ep_sizes is None:
        ep_sizes = _divisors(model.n_experts) if model.n_experts > 1 else (1,)
    models = [model] if dispatches is None or model.n_experts <= 1 else \
        [model.with_(moe_dispatch=d) for d in dispatches]
    experts = [(ep, etp) for ep in ep_sizes for etp in (etp_sizes if model.n_experts > 1 else (1,))]
    ranked, too_big, rejected = [], [], Counter()
    for tp in (tp_sizes or _divisors(min(n_gpus, hw.gpus_per_node))):
        for cp in cp_sizes:
            if n_gpus % (tp * cp):
                continue
            for pp in _divisors(n_gpus // (tp * cp)):
                if pp_sizes is not None and pp not in pp_sizes:
                    continue
                dp = n_gpus // (tp * cp * pp)
                tried = [("1f1b", 1)] if pp == 1 else \
                    [(s, 1) for s in schedules if s != "interleaved"] + \
                    [("interleaved", v) for v in interleave if v > 1 and "interleaved" in schedules]
                for (sched, v) in tried:
                    for zero in zero_stages:
                        if zero and dp * cp == 1:
                            continue                    # nothing to shard over
                        for rc in recomputes:
                            if rc == "selective" and hw.fused_attention and "none" in recomputes:
                                continue                # the same step: a fused kernel already recomputes
                            for mbs in micro_batches:
                                for (ep, etp), spec in ((e, s) for e in experts for s in models):
                                    layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, zero=zero,
                                                    sp=tp > 1, schedule=sched, v=v, micro_batch=mbs,
                                                    global_batch=global_batch, recompute=rc, seq_len=seq_len)
                                    try:
                                        est = estimate(spec, hw, layout, n_gpus)
                                    except ValueError as err:
                                        rejected[str(err).split(":")[0]] += 1
                                        continue
                                    if timing == "simulate":
                                        est = _simulated(est, w_fraction)
                                    (ranked if est.memory["total"] <= limit else too_big).append(est)
    ranked.sort(key=lambda e: (-e.tokens_per_second, e.memory["total"]))
    too_big.sort(key=lambda e: e.memory["total"])
    return SearchResult(ranked, too_big, rejected)
