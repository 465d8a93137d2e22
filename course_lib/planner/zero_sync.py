"""ZeRO-1 and ZeRO-2 as the course's ranks run them (``parallel/zero_nd.py``), priced for the
planner's ``runtime="course"``; the planner sits below ``parallel/`` and imports none of it.

Per step, on GradSync's buckets (:mod:`.buckets`: the same 25 MiB rule, one bucket per set of
reduce dims), the ZeRO group being a bucket's dims among (dp, cp), N ranks (an expert's: the
ranks holding it, ``layout.expert_zero_group``):

- step start: each bucket's owned slice packed (one ``cat`` of its pieces, a parameter's part
  each, into a buffer made empty), all-gathered over the group, copied into the parameters (a
  copy per parameter), two buckets' all-gathers in flight (:func:`.issue.gather_chain`);
- after the schedule: the bucket's gradients packed by one foreach copy into a buffer made
  empty (FSDP2's way: no zeroing pass over it), its padding zeroed where the group does not
  divide it, the "used" flags copied in, the bucket reduce-scattered (blocking: the host waits
  for it), the owned slice then all-reduced over the bucket's other dims (the SP norms' tp),
  the flags tested and read by the host; the sums handed out: cast once to the masters' dtype
  (a mixed precision reducing in 16 bits), or written into the full gradients by one foreach
  copy (ZeRO-1), or kept (ZeRO-2). One kernel per step whatever the pieces: every rank of the
  group does the same work (what lets the dry run fold them).

Every op through the host's issue chain (:func:`.issue.run_chain`: one op per
``launch_overhead``, a blocking collective or a read waits for the stream). ZeRO-1 and ZeRO-2
send the same bytes: no reduce-scatter per micro-batch (as DeepSpeed's ZeRO-2 does; the
default runtime, which models the published systems, keeps that).
"""
from __future__ import annotations

from course_lib.planner.buckets import (add_into, assign_buckets, bucket_copy, bucket_fill, foreach_copy,
                                       stage_params, zeros_write)
from course_lib.planner.formulas import zero_rounds
from course_lib.planner.layout import layers_per_chunk
from course_lib.planner.issue import gather_chain, run_chain
from course_lib.schedules import V_SCHEDULES, stage_rank

SHARD_DIMS = ("dp", "cp")


def chunk_params(model, layout, params, stage: int) -> list:
    """[((reduce dims, chunk), elements)] of pipeline rank ``stage``'s parameters, chunk by chunk
    (its virtual stages in order, :func:`~course_lib.planner.layout.layers_per_chunk`): the
    program reducing in the schedule keeps a chunk's buckets apart; a tied embedding and head
    (summed over the pipeline after the schedule) belong to no chunk (None)."""
    placement = "v" if layout.schedule in V_SCHEDULES else "loop"
    per_chunk = layers_per_chunk(model, layout)
    out = []
    for c, n in enumerate(per_chunk):
        if stage_rank(c, layout.pp, placement) == stage:
            for name, dims, size in stage_params(model, layout, params, n, c == 0, c == len(per_chunk) - 1, names=True):
                tied = model.tied and name in ("tok_emb.weight", "lm_head.weight")
                out.append(((dims, None if tied else c), size))
    return out


def zero_sync(model, hw, layout, k: dict, n_layers: int, first: bool, last: bool, calls: dict,
              collective, size, itemsize: int = 2, expert=None, cast: bool = False,
              grad_itemsize: int | None = None, *, stage: int) -> tuple:
    """(seconds after the schedule, seconds of the step-start gather, kernels, seconds in the
    schedule, one chunk's reduce-scatters' seconds) of ZeRO-1/2 on one stage.
    ``collective(layout, hw, kind, nbytes, dims)`` and ``size(layout, dims)``: :mod:`.runtime`'s;
    ``calls`` gets the calls per dims; ``itemsize``: a gradient's bytes on the wire (the
    precision's reduce dtype, :mod:`.numerics`); ``grad_itemsize``: of the gradients' sums the
    pack reads (default ``itemsize``); ``stage``: the pipeline rank. ``expert``: (ranks, dims summed after,
    ``seconds(kind, nbytes)`` of a collective over the ranks, ``seconds(nbytes)`` of the
    all-reduce over the dims after and etp) of an expert's ZeRO group
    (``layout.expert_zero_group``), for the experts' buckets (w2's bias under etp, which each
    etp rank adds for its rows, is summed over etp too). ``cast``: the sums handed to fp32
    masters from a 16-bit reduce dtype.

    Reduced chunk by chunk (``layout.grad_reduce``, ``formulas.zero_rounds``: R reductions of
    each of the stage's chunks), as the program does it, its buckets a chunk's each
    (:func:`chunk_params`): every reduction's pack is launched in the schedule, the last one
    (the stage's first chunk's, whose backward is the stage's last) as it ends, so the tail
    holds its packs and reduce-scatters; each arrival after a chunk's first adds into the sums
    before it (the last chunk's last one in the tail); a round's end makes the chunk's buffers
    again, zeros, one per parameter, (R - 1) times. Those kernels run on the stream under the
    backwards, their device time in the schedule (the host, ahead of a backward's GEMMs,
    issues them meanwhile). A bucket of no chunk (a tied embedding) is reduced after the
    schedule, and every bucket's sums are handed out there."""
    floor = max(hw.kernel_floor, 0.0)
    grad_itemsize = grad_itemsize or itemsize
    rounds = zero_rounds(layout)
    per = rounds[0] if rounds else 1
    if rounds is None:          # one set of buckets over the stage, reduced after the schedule
        entries = [((dims, None), n) for dims, n in stage_params(model, layout, k["params"], n_layers, first, last)]
    else:
        entries = chunk_params(model, layout, k["params"], stage)
    lowest = min((c for (_, c), _ in entries if c is not None), default=None)
    gather, gathers, finals = [0.0, 0.0, 0.0], [], []
    kernels, sent, in_schedule = 0, 0.0, 0.0
    for (dims, chunk), n, sizes in assign_buckets(entries):
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
        gathers.append((pack, costs["ag"], [bucket_copy(hw, n_i).device for n_i in sizes]))
        # a reduction's launch: the gradients packed by one foreach copy into a buffer made
        # empty, its padding zeroed (when the group does not divide it), the flags copied in
        launch = [bucket_fill(hw, sizes, group if shard else 1, itemsize, grad_itemsize).device] \
            + ([floor] if n % group else []) + [floor]
        hand = (["ar"] if rest else []) + [floor, "read"] + out     # the flags tested and read
        rounds_here = per if chunk is not None else 1       # (a bucket of no chunk: once, after)
        add = add_into(hw, owned + len(sizes), itemsize).device if chunk is not None and per > 1 else 0.0
        if chunk is not None:
            last_here = chunk == lowest
            in_schedule += sum(launch) * (per - last_here) + add * (per - 1 - last_here) \
                + (per - 1) * sum(zeros_write(hw, n_i, grad_itemsize).device for n_i in sizes)
            kernels += round(per - 1) * (1 + len(sizes))      # the adds and the buffers made again
        finals.append((chunk, launch, hand, costs, add))
        sent += costs["rs"]
        kernels += 1 + len(sizes) + sum(not isinstance(x, str) for x in hand) + round(rounds_here * len(launch))
        for dims_, count in ((shard, 1 + round(rounds_here)), (rest, 1)):   # a gather; a reduce-scatter a round
            if dims_:
                calls["+".join(dims_)] = calls.get("+".join(dims_), 0) + count
    gather_chain(gathers, gather, hw.launch_overhead)     # two buckets' gathers in flight
    tail, issue = [0.0, 0.0], hw.launch_overhead
    if rounds is not None:      # the stage's last launches (its first chunk's) and their arrivals
        for chunk, launch, hand, costs, add in finals:
            if chunk == lowest:
                run_chain(launch + ["rs"], tail, issue, costs)
        run_chain([add for chunk, _, _, _, add in finals if chunk == lowest and add], tail, issue)
    for chunk, launch, hand, costs, add in finals:     # (in bucket order, as finish runs them)
        run_chain((launch + ["rs"] if chunk is None else []) + hand, tail, issue, costs)
    return tail[1], gather[1], kernels, in_schedule, (sent / rounds[2] if rounds else 0.0)


__all__ = ["zero_sync", "chunk_params", "SHARD_DIMS"]
