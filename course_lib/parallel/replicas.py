"""One check that every rank of a group holds the same model, before a wrapper trusts it.

DDP, ZeRO and FSDP broadcast rank 0's tensors, so they need the same *layout* (count,
shapes, dtypes, order) on every rank: a broadcast of mismatched sizes aborts or hangs.
Tensor parallelism cuts the model each rank holds, so it also needs the same *values*:
slices of two different models are no model at all. One function checks both, with one
all-gather of a few numbers; names travel only when something differs."""
from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist

from course_lib import compat


def _who(comm, r: int) -> str:
    """Group rank r, with its global rank when they differ."""
    return f"rank {r}" if comm.ranks[r] == r else f"group rank {r} (global rank {comm.ranks[r]})"


def _first_difference(mine, theirs, who, ref="rank 0"):
    """What differs between two replicas' [(name, shape, dtype)], in words."""
    label = lambda name: f"tensor {name}" if name.isdigit() else repr(name)  # (a ParameterList's names)
    for (name, shape, dtype), (name0, shape0, dtype0) in zip(mine, theirs):
        if shape != shape0:
            return f"{who}'s {label(name)} has shape {shape}, {ref}'s {label(name0)} has shape {shape0}"
        if dtype != dtype0:
            return f"{who}'s {label(name)} is {dtype}, {ref}'s {label(name0)} is {dtype0}"
    if len(mine) != len(theirs):
        extra = (mine if len(mine) > len(theirs) else theirs)[min(len(mine), len(theirs))][0]
        return (f"{who} has {len(mine)} parameters and buffers, {ref} has {len(theirs)} (the first one "
                f"only {who if len(mine) > len(theirs) else ref} has: {label(extra)})")
    return f"{who} and {ref} differ"


def _digest(named_tensors, values: bool, device) -> torch.Tensor:
    """(count, elements, CRC-32 of the shapes and dtypes[, sum, sum of squares]) in float64:
    every number below 2**53 is exact, and the CRC is the same in every process."""
    layout = [(tuple(t.shape), str(t.dtype)) for _, t in named_tensors]
    numbers = [len(layout), sum(math.prod(shape) for shape, _ in layout), zlib.crc32(repr(layout).encode())]
    if values:  # the same values in the same order give bitwise the same sums on every rank
        ts = [t.detach().double() for _, t in named_tensors]
        numbers += [sum(t.sum().item() for t in ts), sum(t.square().sum().item() for t in ts)]
    return torch.tensor(numbers, dtype=torch.float64, device=device)


def check_replicas(named_tensors, comm, what: str = "broadcast_module_states", *, values: bool = False,
                   traced: bool = True, model: str | None = None):
    """Refuse replicas that differ across the ranks of ``comm``: a ValueError on every rank
    naming the ranks and the first difference, instead of a broadcast of mismatched sizes
    (which aborts or hangs) or slices of different models.

    ``named_tensors``: [(name, tensor)] in the order the caller will use them.
    ``values``: also the values (tensor parallelism cuts what each rank holds, so every rank
    must hold the same model); else only count, shapes, dtypes and order (a data-parallel
    wrapper broadcasts rank 0's values anyway). ``traced``: the all-gather goes through
    ``comm`` (in ``comm.log``, counted as the wrapper's traffic) or around it (a check
    outside the model's traffic). ``model``: the model's name for the error message.
    Cost: ONE all-gather of 3 (or 5) float64 per rank."""
    if comm.size == 1 or not getattr(comm, "moves_data", True):   # (the dry run's Comms: one model by
        return                                                      # construction, and no values)
    device = named_tensors[0][1].device if named_tensors else torch.device("cpu")
    mine = _digest(named_tensors, values, device)
    everyone = mine.new_empty(comm.size * mine.numel())
    if traced:
        comm.all_gather_into_tensor(everyone, mine, name="all-gather replica digest")
    else:
        compat.all_gather_into_tensor(everyone, mine, group=comm.group)
    digests = everyone.view(comm.size, -1).tolist()
    differ = [r for r in range(1, comm.size) if digests[r] != digests[0]]
    if not differ:
        return
    layout = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named_tensors]
    shape_differ = [r for r in differ if digests[r][:3] != digests[0][:3]]
    details = ""
    if shape_differ:  # the error path only: every rank is here, with the same digests
        layouts = [None] * comm.size
        dist.all_gather_object(layouts, layout, group=comm.group)
        details = "; ".join(_first_difference(layouts[r], layouts[0], _who(comm, r), _who(comm, 0))
                            for r in shape_differ)
    if values:  # (only a group that cuts the model checks values: tensor parallelism)
        raise ValueError(f"{what}: the ranks of the tensor-parallel group hold "
                         f"different models (ranks {differ} differ from rank 0's {model or 'model'}"
                         f"{': ' + details if details else ''}): build the same single-device model "
                         f"(same config, same seed) on every rank, each keeps a slice of it")
    raise ValueError(f"{what}: the replicas differ across ranks: " + details +
                     ". Every rank must build the same model (same parameters and buffers, same shapes, "
                     "same order) before it is wrapped")


__all__ = ["check_replicas"]
