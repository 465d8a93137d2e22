"""ZeRO-1 and ZeRO-2 as the course's ranks run them (``parallel/zero_nd.py``), priced for the
planner's ``runtime="course"``; the planner sits below ``parallel/`` and imports none of it.

Per step, on GradSync's buckets (:mod:`.buckets`: the same 25 MiB rule, one bucket per set of
reduce dims), the ZeRO group being a bucket's dims among (dp, cp), N ranks (an expert's: the
ranks holding it, ``layout.expert_zero_group``):

- step start: each bucket's owned slice packed (one ``cat`` of its pieces, a parameter's part
  each), all-gathered over the group, copied into the parameters (a copy per parameter);
- after the schedule: each parameter's gradient copied into its bucket, the "used" flags made
  and copied in, the bucket reduce-scattered (blocking: the host waits for it), the owned
  slice then all-reduced over the bucket's other dims (the SP norms' tp), the flags tested and
  read by the host; the sums handed out: cast once to the masters' dtype (a mixed precision
  reducing in 16 bits), or written into the full gradients by one foreach copy (ZeRO-1), or
  kept (ZeRO-2). One kernel per step whatever the pieces: every rank of the group does the
  same work (what lets the dry run fold them).

Every op through the host's issue chain (:func:`.issue.run_chain`: one op per
``launch_overhead``, a blocking collective or a read waits for the stream). ZeRO-1 and ZeRO-2
send the same bytes: no reduce-scatter per micro-batch (as DeepSpeed's ZeRO-2 does; the
default runtime, which models the published systems, keeps that).
"""
from __future__ import annotations

from course_lib.planner.buckets import assign_buckets, bucket_copy, bucket_fill, foreach_copy, stage_params
from course_lib.planner.formulas import zero_rounds
from course_lib.planner.issue import run_chain

SHARD_DIMS = ("dp", "cp")


def zero_sync(model, hw, layout, k: dict, n_layers: int, first: bool, last: bool, calls: dict,
              collective, size, itemsize: int = 2, expert=None, cast: bool = False) -> tuple:
    """(seconds after the schedule, seconds of the step-start gather, kernels, seconds in the
    schedule, one chunk's reduce-scatters' seconds) of ZeRO-1/2 on one stage.
    ``collective(layout, hw, kind, nbytes, dims)`` and ``size(layout, dims)``: :mod:`.runtime`'s;
    ``calls`` gets the calls per dims; ``itemsize``: a gradient's bytes on the wire (the
    precision's reduce dtype, :mod:`.numerics`). ``expert``: (ranks, dims summed after,
    ``seconds(kind, nbytes)`` of a collective over the ranks, ``seconds(nbytes)`` of the
    all-reduce over the dims after and etp) of an expert's ZeRO group
    (``layout.expert_zero_group``), for the experts' buckets (w2's bias under etp, which each
    etp rank adds for its rows, is summed over etp too). ``cast``: the sums handed to fp32
    masters from a 16-bit reduce dtype. Reduced chunk by chunk
    (``layout.grad_reduce``, ``formulas.zero_rounds``: R reductions of each of the stage's c chunks): the last chunk's
    1/c of the chain after the schedule; the others' packing copies and the buffers made again
    for a next round run in the schedule, the collectives under it."""
    floor = max(hw.kernel_floor, 0.0)
    gather, finish, kernels, copies, sent = [0.0, 0.0], [0.0, 0.0], [0, 0], 0.0, 0.0
    total, per = 0, (zero_rounds(layout) or (1,))[0]
    for dims, n, sizes in assign_buckets(stage_params(model, layout, k["params"], n_layers, first, last)):
        total += n
        summed = None               # the slice's sum after, where not over ``rest``'s mesh dims alone
        if dims[0] == "edp":        # an expert's: its own ZeRO group (``expert``), its slice's sum after
            group, rest = expert[0], tuple(d for d in expert[1] if size(layout, (d,)) > 1)
            shard = ("edp",) if group > 1 else ()
            gather_s, scatter_s = (expert[2](kind, nbytes) for kind, nbytes in
                                   (("all_gather", n * 2), ("reduce_scatter", n * itemsize)))
            if dims == ("edp", "etp"):      # w2's bias under etp: added on etp rank 0, summed over etp too
                rest += ("etp",)
                summed = expert[3](-(-n // group) * itemsize)
        else:
            shard = tuple(d for d in dims if d in SHARD_DIMS and size(layout, (d,)) > 1)
            rest = tuple(d for d in dims if d not in SHARD_DIMS and size(layout, (d,)) > 1)
            group = size(layout, shard) if shard else 1
            gather_s, scatter_s = (collective(layout, hw, kind, nbytes, shard) for kind, nbytes in
                                   (("all_gather", n * 2), ("reduce_scatter", n * itemsize)))
        owned = -(-n // group)
        if summed is None:
            summed = collective(layout, hw, "all_reduce", owned * itemsize, rest) if rest else 0.0
        costs = {"ag": gather_s if shard else 0.0, "rs": scatter_s if shard else 0.0, "ar": summed}
        pack = bucket_copy(hw, owned).device            # the owned pieces packed by one cat
        # the sums handed out: one cast to the masters' dtype, or ZeRO-1's one foreach copy
        out = [bucket_copy(hw, owned).device] if cast else [foreach_copy(hw, owned).device] if layout.zero == 1 \
            else []
        seq_g = [pack, "ag"] + [bucket_copy(hw, n_i).device for n_i in sizes]
        seq_f = [bucket_fill(hw, sizes, group if shard else 1).device, floor, floor, "rs"] + (["ar"] if rest else []) \
            + [floor, "read"] + out
        run_chain(seq_g, gather, hw.launch_overhead, costs)
        run_chain(seq_f, finish, hw.launch_overhead, costs)
        copies += sum(x for x in seq_f if not isinstance(x, str)) + hw.launch_overhead * len(seq_f)
        sent += costs["rs"]
        kernels[0] += sum(not isinstance(x, str) for x in seq_g)
        kernels[1] += sum(not isinstance(x, str) for x in seq_f)
        for dims_, count in ((shard, 1 + round(per)), (rest, round(per))):   # a gather; a reduce-scatter a round
            if dims_:
                calls["+".join(dims_)] = calls.get("+".join(dims_), 0) + count
    rounds = zero_rounds(layout)
    if rounds is None:
        return finish[1], gather[1], sum(kernels), 0.0, 0.0
    chunks = rounds[2]
    # a round's end frees its chunk's sums; the next round's first backward finds zeros made
    # before it (a write: a third of a copy's bytes), (R - 1) times for each chunk
    again = (per - 1) * bucket_copy(hw, total, 4).device / 3 if per > 1 else 0.0
    return (finish[1] / chunks, gather[1], kernels[0] + round(kernels[1] * per),
            copies * (per * chunks - 1) / chunks + again, sent / chunks)


__all__ = ["zero_sync", "SHARD_DIMS"]
