"""Llama 3's numerics (Dubey et al. 2024, Sec. 3.3.2, "Numerical stability"), stated for the
dry run's "Llama 3 T4" rows (:mod:`course_lib.lab.dry_runs`) and priced here: FP32 gradient
accumulation during backward over the micro-batches, and the FSDP reduce-scatter of the
gradients in FP32 across the data-parallel workers. Stated here, NOT run: the clock prices every
floating tensor at the cluster's dtype (bf16), so an fp32 buffer costs what a bf16 one does.
:func:`fp32_numerics` prices what they add on the dry run's own constants (the elementwise HBM
rate; the planner's collective formula on the dp group's link), per rank: the add reads 2 + 4
and writes 4 bytes per parameter where the course's bf16 ``add_`` moves 6 (and the first
micro-batch casts: 2 + 4 where the course writes nothing), the reduce-scatter sends 4 bytes per
parameter, not 2. Measured on the two 8k rows (2026-11-29): +0.137 s (m = 32) and +0.069 s
(m = 16) of backward on a middle rank, +0.157 s of DP reduce-scatter after the schedule.
FlashAttention's rate is not a cause either: the clock's "attention" class is 0.30 of peak
(296.7 TFLOP/s, its cited FlashAttention-2 measurements), below the "35% utilization on the
H100" Shah et al. 2024 (FlashAttention-3, abstract) state for FlashAttention-2: a faster
attention would shorten the middle rank's work, not lengthen it.
"""
from __future__ import annotations

import dataclasses

from course_lib.parallel.pipeline.rules import partition_layers
from course_lib.planner import formulas as F


def fp32_numerics(model, hw, layout) -> dict:
    """Seconds Llama 3's FP32 numerics would add to one step of ``layout`` (see above): the
    gradient accumulation on the fullest pipeline rank (in its backward) and the FP32 part of
    the DP reduce-scatter after the schedule; the bytes' difference with the bf16 the clock prices."""
    per_layer = (F.param_count(dataclasses.replace(model, n_layers=2)) -
                 F.param_count(dataclasses.replace(model, n_layers=1))) / layout.tp
    slots = [len(r) for r in partition_layers(model.n_layers, layout.pp * layout.chunks, layout.stage_layers)]
    layers = max(sum(slots[r::layout.pp]) for r in range(layout.pp))
    n = per_layer * layers                                # the rank's parameters
    ew = hw.hbm_bandwidth * hw.efficiencies()["elementwise"]
    m = layout.microbatches
    accumulation = ((m - 1) * (10 - 6) + 6) * n / ew     # fp32 adds, and the first micro-batch's cast
    alpha, bw = hw.link(False)
    group = layout.dp * layout.cp
    reduce_scatter = F.collective_time("reduce_scatter", 4 * n, group, alpha, bw) - \
        F.collective_time("reduce_scatter", 2 * n, group, alpha, bw)
    return {"parameters": n, "accumulation": accumulation, "reduce_scatter": reduce_scatter}


__all__ = ["fp32_numerics"]
