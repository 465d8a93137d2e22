"""ZeRO-1 and ZeRO-2 as the course's ranks run them (``parallel/zero_nd.py``), priced for the
planner's ``runtime="course"``; the planner sits below ``parallel/`` and imports none of it.

Per step, on GradSync's buckets (:mod:`.buckets`: the same 25 MiB rule, one bucket per set of
reduce dims), the ZeRO group being a bucket's dims among (dp, cp):

- step start: each bucket's owned slices packed (a copy per piece), all-gathered over the
  group, copied into the parameters (a copy per parameter); before the first forward;
- after the schedule: each parameter's gradient copied into its bucket, the bucket
  reduce-scattered (blocking: no overlap with the next bucket's copies), its owned slice then
  all-reduced over the bucket's other dims (the SP norms' tp);

ZeRO-1 and ZeRO-2 send the same (ZeRO-2 frees the full gradients once reduced): no
reduce-scatter per micro-batch, unlike DeepSpeed's ZeRO-2, which the default runtime prices.
"""
from __future__ import annotations

from course_lib.planner.buckets import assign_buckets, bucket_copy, stage_params

SHARD_DIMS = ("dp", "cp")


def zero_sync(model, hw, layout, k: dict, n_layers: int, first: bool, last: bool, calls: dict,
              collective, size) -> tuple:
    """(seconds after the schedule beyond the copies, seconds of the step-start gather, kernels,
    seconds of the copies) of ZeRO-1/2 on one stage. ``collective(layout, hw, kind, nbytes,
    dims)`` and ``size(layout, dims)``: :mod:`.runtime`'s; ``calls`` gets the calls per dims."""
    tail = gather = copies = 0.0
    kernels = 0
    for dims, n, sizes in assign_buckets(stage_params(model, layout, k["params"], n_layers, first, last)):
        shard = tuple(d for d in dims if d in SHARD_DIMS and size(layout, (d,)) > 1)
        rest = tuple(d for d in dims if d not in SHARD_DIMS and size(layout, (d,)) > 1)
        group = size(layout, shard) if shard else 1
        fill = sum((bucket_copy(hw, n_i) for n_i in sizes), bucket_copy(hw, len(sizes))).device
        out = sum(bucket_copy(hw, n_i).device for n_i in sizes)
        pack = sum(bucket_copy(hw, -(-n_i // group)).device for n_i in sizes)
        kernels += 3 * len(sizes) + 1
        copies += fill
        gather += pack + out
        if shard:
            tail += collective(layout, hw, "reduce_scatter", n * 2, shard)
            gather += collective(layout, hw, "all_gather", n * 2, shard)
            calls["+".join(shard)] = calls.get("+".join(shard), 0) + 2
        if rest:
            tail += collective(layout, hw, "all_reduce", -(-n // group) * 2, rest)
            calls["+".join(rest)] = calls.get("+".join(rest), 0) + 1
    return tail, gather, kernels, copies


__all__ = ["zero_sync", "SHARD_DIMS"]
