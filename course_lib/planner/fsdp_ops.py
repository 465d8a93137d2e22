"""The kernels the course's FSDP (``parallel/fsdp.py``, ``fsdp_params.py``) runs around one
unit per micro-batch, counted: the planner's ``runtime="course"`` prices them as it prices the
model's own kernels (:class:`~course_lib.planner.kernels.KernelCounter`, the clock's cost model).

The planner sits below ``parallel/`` and imports none of it: the ops below are the FSDP
program's, written again on meta tensors of the unit's shapes (N = the FSDP group's size;
a parameter of d0 rows keeps ceil(d0 / N) rows per rank, padded):

- forward: the gathered unit ``(N * S,)``, rank after rank, copied out parameter after
  parameter (``copy_out``: one ``copy_`` per parameter);
- backward: the unit gathered and copied out again (not the root: it stays gathered); each
  parameter's gradient through its view (``slice_backward``) and the split (one ``cat``);
  the gradients packed rank after rank for the reduce-scatter (one ``copy_`` per parameter,
  one for the "used" flags); after it, the flags tested (``gt``, an ``|`` after the first
  micro-batch), the shard divided by N and, after the first micro-batch, added to the
  shard's gradient.

The all-gathers and reduce-scatters themselves are collectives (:mod:`.runtime`), exposed as
the course's FSDP orders and prefetches them (:func:`fsdp_exposed`); a stage's units are its
blocks and the root (:func:`fsdp_units`). The kernels above go through the host's issue chain
in their places among the model's (:func:`fsdp_chain`): over one rank the copies are
contiguous and stream, shorter than the host's issue of them. Checked
against the dry run, which runs the real FSDP: ``tests/test_planner_fsdp.py``.
"""
from __future__ import annotations

import functools
import math

import torch

from course_lib.planner.issue import pass_time
from course_lib.planner.kernels import KernelCounter, Kernels
from course_lib.schedules import V_SCHEDULES, schedule_order


@functools.lru_cache(maxsize=256)
def fsdp_unit_kernels(hw, shapes: tuple, world: int, itemsize: int = 2) -> dict:
    """{"fwd", "regather", "bwd_first", "bwd_later"}: :class:`Kernels` of FSDP's own ops on one
    unit of parameters ``shapes`` over ``world`` ranks, per micro-batch: the forward's copy
    out; the backward's gather copied out again ("regather": every unit but the root); the
    rest of the backward on the first micro-batch of the step and on a later one. Under
    "order": the same four, each a tuple of its kernels' device seconds in issue order (the
    host's issue chain, :func:`fsdp_pieces`)."""
    rows = [math.ceil(s[0] / world) for s in shapes]
    widths = [math.prod(s[1:]) for s in shapes]
    padded = [r * w for r, w in zip(rows, widths)]
    S, T = sum(padded), len(shapes)

    def copy_out(gathered):
        by_rank = gathered.view(world, S)
        full = torch.empty_like(gathered)
        off = 0
        for n in padded:
            full[world * off:world * (off + n)].view(world, n).copy_(by_rank[:, off:off + n])
            off += n
        return full

    with torch.device("meta"):
        gathered = torch.empty(world * S)
        with KernelCounter(hw, itemsize, record=True) as fwd:
            full = copy_out(gathered)
        grads = [torch.empty(s) for s in shapes]
        out, order = {"fwd": fwd.total}, {"fwd": _devices(fwd)}
        for name, first in (("bwd_first", True), ("bwd_later", False)):
            with KernelCounter(hw, itemsize, record=True) as bwd:
                pieces = [torch.ops.aten.slice_backward(g.reshape(-1), [world * n], 0, 0, g.numel(), 1)
                          for g, n in zip(grads, padded)]
                grad_full = torch.cat(pieces)
                packed = grad_full.new_empty(world, S + T)
                packed[:, S:].copy_(torch.empty(T))
                off = 0
                for n in padded:
                    packed[:, off:off + n].copy_(grad_full[world * off:world * (off + n)].view(world, n))
                    off += n
                shard = packed.new_empty(S + T)
                used = shard[S:] > 0
                if not first:
                    used = used | used
                mine = shard[:S].div(world)
                if not first:
                    mine.add_(mine)
            out[name], order[name] = bwd.total, _devices(bwd)
        with KernelCounter(hw, itemsize, record=True) as again:
            copy_out(gathered)
        out["regather"], order["regather"] = again.total, _devices(again)
    del full
    out["order"] = order
    return out


def _devices(counter) -> tuple:
    """The device seconds of each kernel ``counter`` recorded, in order."""
    return tuple(k.device for _, k in counter.ops if k is not None)


def fsdp_step_kernels(hw, units: list, world: int, m: int, itemsize: int = 2, experts=None) -> tuple:
    """(forward, backward) :class:`Kernels` per micro-batch (averaged over the step's ``m``) of
    FSDP's own ops on ``units`` (each a tuple of parameter shapes; the last is the root,
    which the backward does not gather again). ``experts``: (shapes, ranks, n) of the units of
    a block's experts sharded over their own group (:func:`fsdp_expert_unit`), n of them."""
    fwd, bwd = Kernels(), Kernels()
    every = [(shapes, world, i < len(units) - 1) for i, shapes in enumerate(units)]
    if experts is not None:
        every += [(experts[0], experts[1], True)] * experts[2]
    for shapes, ranks, again in every:
        k = fsdp_unit_kernels(hw, tuple(shapes), ranks, itemsize)
        fwd = fwd + k["fwd"]
        b = k["bwd_first"] if m == 1 else _mix(k["bwd_first"], k["bwd_later"], 1 / m)
        bwd = bwd + b + (k["regather"] if again else Kernels())
    return fwd, bwd


def fsdp_chain(hw, units: list, world: int, n_layers: int, pieces: dict, phase: str, first: bool, last: bool,
               m: int, costs: dict, experts=None) -> float:
    """Seconds of one pass (``phase``, per micro-batch: averaged over the step's ``m``) through the
    host's issue chain (:func:`.issue.pass_time`) with FSDP's own kernels in the places the
    course's FSDP issues them: forward, the root's copy out before anything, each block's before
    the block; backward, each block's gather copied out again before the block's backward, its
    gradients packed and folded after it, the root's after the pass. ``pieces``: the rank's
    traced order (:func:`~.kernels.trace_step`'s "sequence"); ``units`` as :func:`fsdp_units`.
    Each such kernel is issued one ``launch_overhead`` after the last, as every kernel is: where
    they are short (a unit's many small parameters; contiguous copies at the streaming rate, as
    over one rank), the host paces them, not the device. ``experts`` (shapes, ranks, n): each
    block's experts a unit of their own, their kernels with the block's."""
    root = units[-1] if len(units) > n_layers else None
    block = fsdp_unit_kernels(hw, tuple(units[0]), world)["order"] if n_layers else None
    if block and experts is not None:
        own = fsdp_unit_kernels(hw, tuple(experts[0]), experts[1])["order"]
        block = {key: tuple(block[key]) + tuple(own[key]) for key in block}
    mine = fsdp_unit_kernels(hw, tuple(root), world)["order"] if root else None
    order = (("embedding",) if first else ()) + ("layer",) + (("head",) if last else ())

    def run(name):
        out = dict(pieces)
        if phase == "fwd":
            out["layer"] = list(block["fwd"]) + list(pieces.get("layer", ())) if block else pieces.get("layer", ())
            out["fsdp root"] = mine["fwd"] if mine else ()
            return pass_time(out, ("fsdp root",) + order, n_layers, hw.launch_overhead, costs)
        if block:
            out["layer"] = list(block["regather"]) + list(pieces.get("layer", ())) + list(block[name])
        out["fsdp root"] = mine[name] if mine else ()
        return pass_time(out, order[::-1] + ("fsdp root",), n_layers, hw.launch_overhead, costs)

    if phase == "fwd" or m == 1:
        return run("bwd_first")
    return run("bwd_first") / m + run("bwd_later") * (1 - 1 / m)


def fsdp_units(shapes, t: int, first: bool, last: bool, n_layers: int, experts_apart: bool = False) -> list:
    """The FSDP units of a stage's GPU, each a tuple of parameter shapes: its ``n_layers``
    blocks, then the root (the embedding on the first stage; the final norm and the head on
    the last). ``shapes``: the one-block model's ((name, shape), ...) (:func:`trace_step`); a
    matrix cut by TP keeps 1/t of its rows (or columns: the same bytes), not an MoE's router
    or shared experts (replicated over tp). ``experts_apart``: a block's experts are a unit of their own
    (:func:`fsdp_expert_unit`), not in the block's."""
    def cut(name, shape):
        if len(shape) < 2 or t == 1 or ".moe.router." in name or ".moe.shared." in name:
            return shape
        return (shape[0] // t, *shape[1:]) if shape[0] % t == 0 else (shape[0], shape[1] // t, *shape[2:])
    block = tuple(cut(name, x) for name, x in shapes if name.startswith("blocks.")
                  and not (experts_apart and ".moe.experts." in name))
    # (a tied head is the embedding: FSDP refuses it on two stages, so pp = 1 holds it once)
    outside = [(name, x) for name, x in shapes if not name.startswith("blocks.")]
    root = tuple(cut(name, x) for name, x in outside if (first and name.startswith(("tok_emb", "pos_emb")))
                 or (last and name.startswith(("norm", "lm_head"))))
    return [block] * n_layers + ([root] if root else [])


def fsdp_expert_unit(shapes, local: int, etp: int = 1) -> tuple:
    """The shapes of one block's experts on a GPU, the unit the course's FSDP shards over the
    ranks holding them (``compose.expert_units``): its ``local`` = E / ep experts, each cut
    over etp (``slice_expert``: w1's and w3's rows, w2's columns; w2's bias whole)."""
    def cut(name, shape):
        if etp == 1 or name.endswith("w2.bias"):
            return shape
        return (shape[0], shape[1] // etp) if name.endswith("w2.weight") else (shape[0] // etp, *shape[1:])
    one = [(name, x) for name, x in shapes if ".moe.experts.0." in name]
    return tuple(cut(name, x) for name, x in one) * local


def fsdp_exposed(ag: list, rs: list, c_f: float, c_b: float, n_layers: int, root: bool) -> tuple:
    """Seconds per micro-batch (forward, backward) that FSDP's collectives add to a stage, the
    gathers ``ag`` and reduce-scatters ``rs`` of its units (blocks, then the root), as the
    course's FSDP orders them on its one communication stream: forward, the root's gather and
    the first block's are waited for (nothing prefetches them), each later block's gather runs
    while the block before it computes (``c_f``: issued after that block's copy out, so beside
    the rest of its forward); backward, the last block's gather waits (the root stays
    gathered), then while block i's backward runs (``c_b``), the stream carries block
    i + 1's reduce-scatter and block i - 1's gather (one reduce-scatter in flight); the first
    block's reduce-scatter is waited for. The root's is issued as the pass ends and not waited
    for in it: the caller places it (:mod:`.runtime`)."""
    blocks_ag, blocks_rs = ag[:n_layers], rs[:n_layers]
    f = (ag[-1] if root else 0.0) + (blocks_ag[0] if blocks_ag else 0.0) + \
        sum(max(0.0, a - c_f) for a in blocks_ag[1:])
    b = (blocks_ag[-1] if blocks_ag else 0.0) + (blocks_rs[0] if blocks_rs else 0.0) + \
        sum(max(0.0, a + r - c_b) for a, r in zip(blocks_ag[:-1], blocks_rs[1:]))
    return f, b


TP_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "loss")   # a TP rank's blocking collectives


def _lane_wait(seq, costs: dict, busy: float, gather: float = 0.0, copy: float = 0.0,
               lanes: dict | None = None) -> float:
    """Seconds one block's pass (``seq``: its traced kernels' device seconds and its blocking
    collectives' names, :func:`course_lib.planner.kernels.trace_step`'s "sequence") waits for an
    FSDP collective on the GPU's links: one in flight for ``busy`` seconds as the pass starts;
    ``gather`` (the next unit's all-gather) issued at the pass's first kernel, after ``copy``
    seconds of its own unit's copy out (the backward's: it waits for the unit's first use). A TP
    collective shares the links with it: two transfers splitting the bandwidth, it is slowed by
    at most its own bytes' time (``lanes``: seconds per collective on the link, alpha left out;
    default its whole time), never more than waiting for the links to be free would; its bytes
    join theirs on the link."""
    lanes = costs if lanes is None else lanes
    t, lane, issued, base = 0.0, busy, gather <= 0.0, copy * (gather > 0.0)
    for x in seq:
        if isinstance(x, str):
            if x not in TP_COLLECTIVES:          # a host read: no link
                continue
            own = lanes.get(x, 0.0)
            start = t + min(max(0.0, lane - t), own)
            lane = max(lane, t) + own
            t, base = start + costs.get(x, 0.0), base + costs.get(x, 0.0)
            continue
        if not issued:
            t, issued = t + copy, True
            lane = max(lane, t) + gather
        t, base = t + x, base + x
    return max(0.0, t - base)


def fsdp_exposed_tp(ag: list, rs: list, seq_f, seq_b, costs: dict, copy_b: float, n_layers: int,
                    root: bool, lanes: dict | None = None) -> tuple:
    """:func:`fsdp_exposed` where the FSDP group's collectives and TP's blocking ones cross the
    same links (the clock's lanes: NVLink or the network, shared by every collective of the
    GPU): a block's prefetched gather slows the block's next TP collectives, which share the
    links with it (:func:`_lane_wait`; forward: issued as the block starts, its first collective comes after a
    norm; backward: the reduce-scatter of the block after it holds the links as it starts, the
    gather of the block before it is issued after its own copy out, ``copy_b``). Per
    micro-batch: the waits as :func:`_lane_wait` runs them on the layer's traced order (``seq_f``,
    ``seq_b``), plus what nothing prefetches (as :func:`fsdp_exposed`)."""
    blocks_ag, blocks_rs = ag[:n_layers], rs[:n_layers]
    f = (ag[-1] if root else 0.0) + (blocks_ag[0] if blocks_ag else 0.0) + \
        sum(_lane_wait(seq_f, costs, a, lanes=lanes) for a in blocks_ag[1:])
    b = (blocks_ag[-1] if blocks_ag else 0.0) + (blocks_rs[0] if blocks_rs else 0.0) + \
        sum(_lane_wait(seq_b, costs, r, a, copy_b, lanes) for a, r in zip(blocks_ag[:-1], blocks_rs[1:]))
    return f, b


def fsdp_exposed_unprefetched(ag: list, rs: list, n_layers: int) -> float:
    """Seconds per micro-batch a backward adds where the course's FSDP prefetches nothing: it
    prefetches the block before from a unit's first use in a backward, once per forward of the
    stage (a second backward in a row, as 1F1B's and GPipe's after their forwards, finds the
    units marked started). Each block then gathers when its backward needs it, on the group's
    one stream behind the reduce-scatter of the block after it: the top block's gather, every
    other block's reduce-scatter + gather, the first block's reduce-scatter (the root's comes after
    the pass)."""
    blocks_ag, blocks_rs = ag[:n_layers], rs[:n_layers]
    if not blocks_ag:
        return 0.0
    return blocks_ag[-1] + sum(r + a for a, r in zip(blocks_ag[:-1], blocks_rs[1:])) + blocks_rs[0]


def prefetched_share(order) -> float:
    """The share of a stage's backward passes the course's FSDP prefetches in: ``order`` its
    (phase, micro-batch, chunk) actions (:func:`course_lib.schedules.schedule_order`); a
    backward of a chunk prefetches when a forward of that chunk ran since its last backward."""
    fresh, n, hit = {}, 0, 0
    for phase, _, chunk in order:
        if phase == "F":
            fresh[chunk] = True
        elif phase == "B":
            n, hit = n + 1, hit + fresh.get(chunk, False)
            fresh[chunk] = False
    return hit / n if n else 1.0


def fsdp_order(hw, layout, stage: int, units: list, n_layers: int, world: int, ag: list, rs: list, c_f: float,
               c_b: float, sequence, costs: dict, lanes: dict | None = None) -> tuple:
    """(forward, backward) seconds per micro-batch that FSDP's collectives add to ``stage`` (its
    ``units``: ``n_layers`` blocks, then the root if any, over ``world`` ranks), and the seconds
    after its last backward, as the course's FSDP issues them: prefetched beside the blocks
    (:func:`fsdp_exposed`), or, where TP's blocking collectives cross the same links
    (``sequence``: the TP rank's traced order, :func:`~.kernels.trace_step`'s; None otherwise),
    slowing them (:func:`fsdp_exposed_tp`; ``lanes``: their seconds on the links). A backward after a backward prefetches nothing
    (:func:`prefetched_share`, :func:`fsdp_exposed_unprefetched`) and, on the last stage,
    gathers the head's root again behind its reduce-scatter. The root's reduce-scatter, issued
    as a backward ends, runs while the stage waits, except the last one: the step waits for it."""
    root = len(units) > n_layers
    f, b = fsdp_exposed(ag, rs, c_f, c_b, n_layers, root)
    if sequence and n_layers:
        copy_b = fsdp_unit_kernels(hw, tuple(units[0]), world)["regather"].device
        f, b = fsdp_exposed_tp(ag, rs, sequence["fwd"]["layer"], sequence["bwd"]["layer"], costs, copy_b,
                               n_layers, root, lanes)
    p, m = layout.pp, layout.microbatches
    share = prefetched_share(schedule_order(p, m, layout.schedule, layout.chunks, stage)) \
        if p > 1 and layout.schedule not in V_SCHEDULES else 1.0
    b = share * b + (1 - share) * fsdp_exposed_unprefetched(ag, rs, n_layers)
    if stage == p - 1 and root:
        b += (1 - share) * (rs[-1] + ag[-1])
    return f, b, (rs[-1] if root else 0.0)


def _mix(first: Kernels, later: Kernels, share: float) -> Kernels:
    """``share`` of ``first`` and the rest of ``later`` (kernel counts rounded)."""
    rest = 1 - share
    return Kernels(round(first.count * share + later.count * rest), first.flops * share + later.flops * rest,
                   first.bytes * share + later.bytes * rest, first.time * share + later.time * rest,
                   first.device * share + later.device * rest)


__all__ = ["fsdp_unit_kernels", "fsdp_step_kernels", "fsdp_chain", "fsdp_units", "fsdp_expert_unit", "fsdp_exposed",
           "fsdp_exposed_tp",
           "fsdp_exposed_unprefetched", "fsdp_order",
           "prefetched_share", "TP_COLLECTIVES"]
