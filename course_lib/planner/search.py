"""Configuration search: every valid layout of a model on N GPUs, ranked by throughput.

Enumerates TP (a divisor of the node size), CP, PP (with 1F1B or the interleaved
schedule), DP (what is left), the ZeRO stage, recomputation and the micro-batch
size; drops what ``validate`` rejects (the reasons are counted) and what does not
fit in memory; ranks the rest by predicted tokens per second.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from course_lib.planner.estimate import Estimate, estimate
from course_lib.planner.layout import Layout
from course_lib.planner.presets import get_hardware, get_model


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


def search(model, hardware, n_gpus: int, global_batch: int, memory_limit: float | None = None,
           micro_batches=(1, 2, 4), recomputes=("none", "selective", "full"), zero_stages=(0, 1, 2, 3),
           cp_sizes=(1, 2, 4, 8), interleave=(1, 2), ep_sizes=None, tp_sizes=None, pp_sizes=None,
           seq_len=None) -> SearchResult:
    """Rank every valid layout of ``model`` on ``n_gpus`` GPUs for one ``global_batch``
    (sequences of ``seq_len``, default the model's). ``memory_limit`` bytes per GPU
    (default: the GPU's HBM). ``tp_sizes`` / ``pp_sizes`` restrict TP (default: the
    divisors of the node size) and PP (default: every divisor). With fused attention,
    "selective" stores and runs what "none" does, so only "none" is tried when both are asked."""
    model, hw = get_model(model), get_hardware(hardware)
    limit = hw.hbm_bytes if memory_limit is None else memory_limit
    if ep_sizes is None:
        ep_sizes = _divisors(model.n_experts) if model.n_experts > 1 else (1,)
    ranked, too_big, rejected = [], [], Counter()
    for tp in (tp_sizes or _divisors(min(n_gpus, hw.gpus_per_node))):
        for cp in cp_sizes:
            if n_gpus % (tp * cp):
                continue
            for pp in _divisors(n_gpus // (tp * cp)):
                if pp_sizes is not None and pp not in pp_sizes:
                    continue
                dp = n_gpus // (tp * cp * pp)
                schedules = [("1f1b", 1)] if pp == 1 else \
                    [("1f1b", 1)] + [("interleaved", v) for v in interleave if v > 1]
                for (sched, v) in schedules:
                    for zero in zero_stages:
                        if zero and dp * cp == 1:
                            continue                    # nothing to shard over
                        for rc in recomputes:
                            if rc == "selective" and hw.fused_attention and "none" in recomputes:
                                continue                # the same step: a fused kernel already recomputes
                            for mbs in micro_batches:
                                for ep in ep_sizes:
                                    layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, sp=tp > 1,
                                                    schedule=sched, v=v, micro_batch=mbs,
                                                    global_batch=global_batch, recompute=rc, seq_len=seq_len)
                                    try:
                                        est = estimate(model, hw, layout, n_gpus)
                                    except ValueError as err:
                                        rejected[str(err).split(":")[0]] += 1
                                        continue
                                    (ranked if est.memory["total"] <= limit else too_big).append(est)
    ranked.sort(key=lambda e: (-e.tokens_per_second, e.memory["total"]))
    too_big.sort(key=lambda e: e.memory["total"])
    return SearchResult(ranked, too_big, rejected)
