"""The few torch.distributed differences between torch versions, in one place.

Nothing else in course_lib branches on a torch version; it calls these instead.

* ``all_gather_into_tensor`` / ``reduce_scatter_tensor``: torch 2.13 renamed
  them ``all_gather_single`` / ``reduce_scatter_single`` (the old names warn);
  before 2.0 only the private ``_all_gather_base`` / ``_reduce_scatter_base``
  existed. Same arguments in every version: (output, input, ...).
* ``global_rank`` / ``group_rank``: translate ranks of a subgroup (``new_group``)
  to ranks of the default group, which is what ``dist.send``'s ``dst`` means.
* ``backend_device``: NCCL moves CUDA tensors only, gloo CPU tensors: a metadata
  exchange is allocated where the group's backend can send it.
* ``all_reduce_avg``: ``ReduceOp.AVG`` is refused by gloo in some versions
  ("Cannot use ReduceOp.AVG with Gloo"); fall back to SUM then divide.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _first(*names):
    for name in names:
        fn = getattr(dist, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"this torch ({torch.__version__}) has none of torch.distributed.{'/'.join(names)}")


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Concatenate every rank's ``input_tensor`` (dim 0) into ``output_tensor``, on any torch."""
    fn = _first("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
    return fn(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """Reduce ``input`` over ranks; rank r keeps the r-th of N equal pieces in ``output``."""
    fn = _first("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")
    return fn(output, input, op=op, group=group, async_op=async_op)


def backend_device(group=None) -> torch.device:
    """Where a small exchange (metadata, a token, a header) must live to travel over
    ``group``: NCCL carries CUDA tensors only (this rank's current GPU), gloo CPU tensors."""
    name = str(dist.get_backend(group)).lower()
    if "nccl" in name and "gloo" not in name:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank(group, group_rank: int) -> int:
    """The default-group rank of ``group_rank`` in ``group`` (identity for the default group)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    fn = getattr(dist, "get_global_rank", None) or getattr(dist.distributed_c10d, "_get_global_rank")
    return fn(group, group_rank)


def group_rank(group, global_rank: int) -> int:
    """The rank inside ``group`` of default-group rank ``global_rank``."""
    if group is None or group is dist.group.WORLD:
        return global_rank
    fn = getattr(dist, "get_group_rank", None) or getattr(dist.distributed_c10d, "_get_group_rank")
    return fn(group, global_rank)


def avg_supported(group=None) -> bool:
    """Does this backend accept ReduceOp.AVG in all_reduce? (NCCL: yes; gloo: only newer torch).

    A probe on a one-element tensor: every rank takes the same branch, so it
    never hangs. Costs one tiny all-reduce.
    """
    try:
        dist.all_reduce(torch.zeros(1, device=backend_device(group)), op=dist.ReduceOp.AVG, group=group)
        return True
    except (RuntimeError, ValueError) as exc:
        if "AVG" in str(exc) or "not supported" in str(exc).lower():
            return False
        raise


def all_reduce_avg(tensor, group=None):
    """Mean over ranks, in place: ReduceOp.AVG where supported, else SUM then divide."""
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)
    except (RuntimeError, ValueError) as exc:
        if "AVG" not in str(exc):
            raise
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        if tensor.is_floating_point():
            tensor.div_(dist.get_world_size(group))
        else:
            tensor.floor_divide_(dist.get_world_size(group))
    return tensor


__all__ = ["all_gather_into_tensor", "reduce_scatter_tensor", "global_rank", "group_rank",
           "avg_supported", "all_reduce_avg"]
