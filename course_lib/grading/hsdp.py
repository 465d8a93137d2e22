"""Graders of chapter 4's HSDP and FSDP-controls questions, on real ranks.

    check_hsdp_gradient(hsdp_gradient)      # (grad, shard_group, replicate_group) -> my shard of the mean
    check_accumulate_no_sync(accumulate)     # (micro_grads) -> my shard, one reduce-scatter a step

Each prints one line. The expected value is the definition (every rank's gradient summed,
divided by the ranks, this rank's rows); the traffic is watched: HSDP's replicas all-reduce
the shard only, and accumulation without sync reduce-scatters once. While the learner's code
runs, course_lib's FSDP / HSDP / data parallelism and torch's are switched off.
"""
from __future__ import annotations

import torch

from course_lib.grading import Case, check_distributed, compare, learner
from course_lib.grading.guard import COURSE_DATA_PARALLEL, COURSE_FSDP, TORCH_DATA_PARALLEL
from course_lib.grading.training import CollectiveWatch

LIBRARY = ("course_lib.parallel.hsdp:*", COURSE_FSDP, "course_lib.parallel.zero:*", COURSE_DATA_PARALLEL,
           TORCH_DATA_PARALLEL)


def _gradient(rank, numel, seed):
    """This rank's gradient: different on every rank and case, float64 (exact sums to rounding)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(numel, generator=g, dtype=torch.float64)


def _mean_rows(grad, lo, hi, world):
    """The definition: every rank's gradient summed, divided by the ranks; rows [lo, hi)."""
    import torch.distributed as dist

    total = grad.clone()
    dist.all_reduce(total)
    return total[lo:hi] / world


def _hsdp_harness(hsdp_gradient, shard_size, numel, seed):
    import torch.distributed as dist

    from course_lib.parallel.hsdp import block_sets, make_comms

    rank, world = dist.get_rank(), dist.get_world_size()
    shards, replicas = block_sets([list(range(world))], shard_size)   # consecutive ranks shard
    shard, replicate = make_comms(shards, "dp_shard"), make_comms(replicas, "dp_replicate")
    grad = _gradient(rank, numel, seed)
    part = numel // shard_size
    want = _mean_rows(grad, shard.rank * part, (shard.rank + 1) * part, world)
    answer = learner(hsdp_gradient, *LIBRARY, exercise="the HSDP gradient path")
    with CollectiveWatch() as watch:
        got = answer(grad.clone(), shard.group, replicate.group)
    if not torch.is_tensor(got) or tuple(got.shape) != (part,):
        return f"return this rank's shard, a tensor of shape ({part},), got {getattr(got, 'shape', got)!r}"
    if shard_size > 1 and "reduce_scatter" not in watch.kinds():
        return "the shard group's sum is one reduce-scatter (each rank receives its summed rows)"
    too_big = [b for k, b in watch.calls if k == "all_reduce" and b > part * grad.element_size()]
    if too_big:
        return (f"an all-reduce of {too_big[0]} bytes: across the replicas only the shard travels "
                f"({part * grad.element_size()} bytes), never the whole gradient")
    return compare(got, want, dtype=torch.float64, terms=world + 1, scale=float(grad.abs().max()) * world,
                   what="your shard (all-reduced over the replicas: the same rows on every replica)")


def check_hsdp_gradient(hsdp_gradient):
    """hsdp_gradient(grad, shard_group, replicate_group): grad (n,) this rank's gradient, n a
    multiple of the shard group's size S; return this rank's (n / S,) rows of the mean over all
    R * S ranks: reduce-scatter inside the shard group, all-reduce of the shard over the replicas."""
    cases = [Case({"hsdp_gradient": hsdp_gradient, "shard_size": S, "numel": n, "seed": i},
                  world_size=w, label=f"R x S = {w // S} x {S}, n = {n}")
             for i, (w, S, n) in enumerate(((4, 2, 12), (6, 3, 9), (6, 2, 10)))]   # odd S, odd R
    return check_distributed("hsdp_gradient", _hsdp_harness, cases, timeout=60)


def _no_sync_harness(accumulate, micro, numel, seed):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    grads = [_gradient(rank, numel, seed * 10 + k) for k in range(micro)]
    summed = torch.stack(grads).sum(0)
    part = numel // world
    want = _mean_rows(summed, rank * part, (rank + 1) * part, world)
    answer = learner(accumulate, *LIBRARY, exercise="gradient accumulation without sync")
    with CollectiveWatch() as watch:
        got = answer([g.clone() for g in grads])
    if not torch.is_tensor(got) or tuple(got.shape) != (part,):
        return f"return this rank's shard, a tensor of shape ({part},), got {getattr(got, 'shape', got)!r}"
    kinds = [k for k, _ in watch.calls]
    if world > 1 and kinds != ["reduce_scatter"]:
        return (f"collectives called: {kinds or 'none'}; without sync the micro-batches' gradients are "
                f"added locally and ONE reduce-scatter runs per step")
    return compare(got, want, dtype=torch.float64, terms=world + micro, scale=float(summed.abs().max()) * world,
                   what="your shard of the mean over ranks of the summed micro-batch gradients")


def check_accumulate_no_sync(accumulate):
    """accumulate(micro_grads): micro_grads [k tensors (n,)], this rank's gradient of each
    micro-batch, n a multiple of the world size; return this rank's (n / world,) rows of the
    mean over ranks of their sum, with one reduce-scatter (set_requires_gradient_sync(False))."""
    cases = [Case({"accumulate": accumulate, "micro": k, "numel": n, "seed": i}, world_size=w,
                  label=f"{k} micro-batches, n = {n}")
             for i, (w, k, n) in enumerate(((2, 3, 8), (3, 2, 9), (1, 2, 3)))]
    return check_distributed("accumulate_no_sync", _no_sync_harness, cases, timeout=60)


__all__ = ["check_hsdp_gradient", "check_accumulate_no_sync"]
