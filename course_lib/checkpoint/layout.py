"""Which global slice each local tensor of a layout holds: the one thing a checkpoint needs
to know about a parallel wrapper.

A :class:`Holding` is one local tensor (a parameter, an FSDP shard, a ZeRO flat slice of the
optimizer state) with the global tensor it belongs to, by its single-device name, and the
:class:`Part` s of that global tensor it holds: boxes (offsets and lengths per dim) and where
each starts in the local tensor's flat storage. A TP slice, an FSDP dim-0 shard of a TP
slice, a pipeline stage's whole tensor are one box; a ZeRO slice of a flattened parameter is
a few boxes (:func:`flat_range_boxes`). Replicas (DP, CP, a TP copy of K/V heads, a tied
weight on two stages) hold the same box: the plan writes it once.

    holdings = model_holdings(net)                 # {id(local tensor): Holding}
    opt_holdings, state = optimizer_holdings(opt, holdings)
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from course_lib.parallel.compose import NDParallel
from course_lib.parallel.data_parallel import DDP
from course_lib.parallel.fsdp import FSDP
from course_lib.parallel.pipeline import PipelineParallel
from course_lib.parallel.placement import Placement
from course_lib.parallel.zero import ShardedOptimizer

TIED = {"lm_head.weight": "tok_emb.weight"}   # TinyGPT(tie_embeddings=True): one weight, one name


class Part(NamedTuple):
    """A box of the global tensor held locally: global[offsets : offsets + lengths] is
    local.view(-1)[start : start + prod(lengths)].view(lengths)."""
    offsets: tuple
    lengths: tuple
    start: int = 0


class Holding(NamedTuple):
    name: str          # the single-device name ("blocks.0.attn.wq.weight")
    shape: tuple       # the global (single-device) shape
    tensor: object     # the local tensor (contiguous)
    parts: list        # [Part]: what of the global tensor it holds


def part_view(tensor, part: Part):
    """The local elements of ``part``, shaped like the box (a view: writes go to ``tensor``)."""
    flat = tensor.detach().view(-1)
    return flat[part.start:part.start + math.prod(part.lengths)].view(part.lengths)


def flat_range_boxes(shape, lo: int, hi: int) -> list[Part]:
    """Elements lo..hi-1 of a row-major tensor of ``shape`` as boxes (a ZeRO slice of a
    flattened (4, 3) weight, elements 2..8: row 0 cols 2..3, row 1, row 2 cols 0..2)."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [Part((lo,) if shape else (), (hi - lo,) if shape else (), 0)]
    inner, out, pos = math.prod(shape[1:]), [], lo
    while pos < hi:
        row, col = divmod(pos, inner)
        if col == 0 and hi - pos >= inner:          # whole rows: one box
            n = (hi - pos) // inner
            out.append(Part((row,) + (0,) * (len(shape) - 1), (n,) + shape[1:], pos - lo))
            pos += n * inner
        else:                                       # part of one row: recurse into it
            end = min(hi, (row + 1) * inner)
            for p in flat_range_boxes(shape[1:], col, end - row * inner):
                out.append(Part((row,) + p.offsets, (1,) + p.lengths, pos - lo + p.start))
            pos = end
    return out


def _box(q, placement=None):
    """(global shape, [Part]) of local parameter ``q``: where the plan's :class:`Placement`
    says it sits (its FSDP rows of its TP slice), or the whole tensor."""
    if placement is None:
        return tuple(q.shape), [Part((0,) * q.dim(), tuple(q.shape), 0)] if q.numel() else []
    offsets, lengths = placement.box(q.shape)
    return placement.shape, [Part(offsets, lengths, 0)] if q.numel() else []   # an FSDP rank may hold 0 rows


def _fsdp_placements(fsdp: FSDP) -> dict:
    """{id(shard parameter): Placement}: rank r holds rows r*c... of each parameter FSDP cut."""
    return {id(piece): Placement(tuple(slot.shape), shard=tuple(unit.dims), rows=(unit.rank * slot.chunk, slot.rows))
            for unit in fsdp.units for piece, slot in zip(unit.pieces, unit.slots)}


def _named_local(model):
    """[(single-device name, local parameter, Placement or None)]."""
    if isinstance(model, NDParallel):                        # the plan's record
        return [(n, q, model.placements[n]) for n, q in model.named_parameters().items()]
    if isinstance(model, PipelineParallel):                  # whole tensors, by stage
        return [(n, q, None) for st in model.stages.values() for n, q in st.named_in_model().items()]
    module = model.module if isinstance(model, DDP) else model
    if isinstance(module, FSDP):
        if getattr(module.mesh, "sizes", {}).get("tp", 1) > 1:
            raise ValueError("checkpoint: an FSDP over a tensor-parallel model loses its TP tags: "
                             "build the layout with parallelize_nd(..., data='fsdp')")
        where = _fsdp_placements(module)
        return [(n, q, where.get(id(q))) for n, q in module.module.named_parameters(remove_duplicate=False)]
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"checkpoint: expected an nn.Module, DDP, FSDP or NDParallel, got {type(model).__name__}")
    where = getattr(getattr(module, "tensor_parallel", None), "placements", {})   # parallelize's record
    return [(n, q, where.get(n)) for n, q in module.named_parameters(remove_duplicate=False)]


def _config(model):
    """The TinyGPT config behind any wrapper (None for other models)."""
    for m in (model, getattr(model, "module", None)):
        cfg = getattr(m, "cfg", None) or getattr(m, "config", None)
        if cfg is not None:
            return cfg
    stages = getattr(model, "stages", None)
    return getattr(next(iter(stages.values())).part, "config", None) if stages else None


def model_holdings(model) -> dict:
    """{id(local parameter): Holding}: every parameter this rank holds, under one name (a
    weight tied under two names is saved under the first; TinyGPT's head under the
    embedding's, also where two pipeline stages hold it as two copies)."""
    tied = TIED if getattr(_config(model), "tie_embeddings", False) else {}
    out = {}
    for name, q, where in _named_local(model):
        if id(q) in out:
            continue                                   # the second name of a tied weight
        if not q.is_contiguous():
            raise ValueError(f"checkpoint: parameter {name!r} is not contiguous: a shard is read as flat bytes")
        shape, parts = _box(q, where)
        out[id(q)] = Holding(tied.get(name, name), shape, q, parts)
    return out


def optimizer_holdings(optimizer, holdings: dict):
    """([(key tensor, Holding)], the optimizer's state dict {key tensor: {name: value}}): the
    tensors the optimizer keys its state by and what each holds. ZeRO keys a flat slice
    [lo, hi) of a parameter: its boxes; any other optimizer keys the parameter itself."""
    if optimizer is None:
        return [], {}
    if isinstance(optimizer, ShardedOptimizer):
        out = []
        for bucket in optimizer.buckets:
            for i, lo, hi, _, view in bucket.pieces:   # ZeRO's owned slice of parameter i
                h = holdings[id(optimizer._params[i])]
                (whole,) = h.parts                     # ZeRO runs on whole (replicated) parameters
                parts = [Part(tuple(a + b for a, b in zip(whole.offsets, p.offsets)), p.lengths, p.start)
                         for p in flat_range_boxes(whole.lengths, lo, hi)]
                out.append((view, Holding(h.name, h.shape, view, parts)))
        return out, optimizer.local.state
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in holdings:
                raise ValueError(f"checkpoint: the optimizer holds a tensor of shape {tuple(p.shape)} that is "
                                 f"not a parameter of the model")
            out.append((p, holdings[id(p)]))
    return out, optimizer.state


def state_parts(holding: Holding, value):
    """The parts of one optimizer-state tensor of ``holding``'s key tensor: the key's own
    (exp_avg, exp_avg_sq: one value per element) or, for a 0-d one ('step'), the whole scalar,
    the same on every replica. Returns (global shape, parts)."""
    if tuple(value.shape) == tuple(holding.tensor.shape):
        return holding.shape, holding.parts
    if value.dim() == 0:
        return (), [Part((), (), 0)]
    raise ValueError(f"checkpoint: optimizer state of {holding.name!r} has shape {tuple(value.shape)}, neither "
                     f"the parameter's {tuple(holding.tensor.shape)} nor a scalar")


__all__ = ["Part", "Holding", "part_view", "flat_range_boxes", "model_holdings", "optimizer_holdings",
           "state_parts", "TIED"]
