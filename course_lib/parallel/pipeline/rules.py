"""The pipeline's rules, written once: :func:`check_layout` runs them before any rank starts,
and the pipeline code calls them as it cuts the model and the batch.

    partition_layers(n_layers, p * v)     # stages: at least one layer each, balanced
    partition_layers(n_layers, p * v, (0, 1, 1, 0))   # given counts: the ends may hold none
    split_with_ends(n_layers, p * v)      # the embedding and the head weigh a layer each
    rule_pipeline(cfg, layout)            # + the schedule exists for (p, m, v); zb-h1's limits
    rule_batch(batch, dp, microbatches)   # the batch cuts into dp replicas of m micro-batches
"""
from __future__ import annotations

from course_lib.layout import rule_stage_layers, split_with_ends  # noqa: F401  (re-exported: the rules' home)
from course_lib.parallel.vocab_parallel import shard_range
from course_lib.recompute import layer_policies
from course_lib.schedules import chunks, make_schedule, schedule_name, validate

SPLIT_BACKWARD = ("zb-h1", "zb-v", "dualpipe-v")     # the schedules with W actions


def partition_layers(n_layers: int, n_stages: int, stage_layers=()) -> list[range]:
    """Contiguous runs of the blocks, one per virtual stage. Balanced (:func:`shard_range`: the
    first ``n_layers % n_stages`` stages get one layer more), or ``stage_layers`` layers each
    (:func:`rule_stage_layers`: the first stage may hold only the embedding, the last only the
    head; every other needs a layer)."""
    if stage_layers:
        rule_stage_layers(n_layers, n_stages, stage_layers)
        ends = [sum(stage_layers[:i]) for i in range(n_stages + 1)]
        return [range(ends[i], ends[i + 1]) for i in range(n_stages)]
    if n_stages > n_layers:
        raise ValueError(f"more pipeline stages ({n_stages}) than layers ({n_layers}): every stage needs a layer")
    return [range(*shard_range(n_layers, n_stages, i)) for i in range(n_stages)]


def splits_weight_gradients(schedule, v=1) -> bool:
    """Does the schedule compute weight gradients apart (W actions: zb-h1, zb-v, dualpipe-v)?"""
    if isinstance(schedule, str):
        return schedule_name(schedule, v) in SPLIT_BACKWARD
    return any(a[0] == "W" for row in schedule for a in row)


def rule_pipeline(cfg, L):
    """Stages: at least one layer each (or the layout's ``stage_layers``); the schedule exists
    for (p, m, v) (v > 1: interleaved); zb-h1's split weight gradients (recorded Linear inputs,
    outside autograd) run neither under FSDP nor with recomputation, which does not keep those
    inputs."""
    if isinstance(L.schedule, str):
        make_schedule(schedule_name(L.schedule, L.v), L.pp, L.microbatches, L.v)
    else:
        validate(L.schedule, L.pp, L.microbatches, L.v)
    partition_layers(cfg.n_layers, L.pp * chunks(L.schedule, L.v), L.stage_layers)
    if not splits_weight_gradients(L.schedule, L.v):
        return
    name = L.schedule if isinstance(L.schedule, str) else "a schedule with W actions"
    if L.data != "ddp":
        raise ValueError(f"{name} computes weight gradients outside autograd: it does not run under FSDP here "
                         "(use data='ddp')")
    if any(p != "none" for p in layer_policies(L.recompute, cfg.n_layers)):
        raise ValueError(f"recompute with {name}: the zero-bubble split records each Linear call's input in "
                         "forward, which recomputation does not keep; use another schedule or recompute='none'")


def rule_batch(batch, dp, microbatches):
    """The global batch cuts into dp replicas of ``microbatches`` equal micro-batches."""
    if batch % dp:
        raise ValueError(f"the global batch ({batch} sequences) must be divisible by dp={dp}")
    if (batch // dp) % microbatches:
        raise ValueError(f"each DP replica's {batch // dp} sequences must cut into microbatches="
                         f"{microbatches} equal ones")


__all__ = ["SPLIT_BACKWARD", "partition_layers", "rule_stage_layers", "split_with_ends", "splits_weight_gradients",
           "rule_pipeline", "rule_batch"]
