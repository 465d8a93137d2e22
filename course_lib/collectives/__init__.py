"""Collectives from scratch on point-to-point messages, with torch.distributed's semantics.

    from course_lib import collectives as C
    C.all_reduce(t)                                  # ring (default), in place, like dist.all_reduce
    C.all_reduce(t, op=C.ReduceOp.MAX, group=g, algorithm="recursive_doubling")
    C.broadcast(t, src=0, algorithm="tree")          # src is a global rank, as in torch
    C.reduce_scatter_tensor(out, inp); C.all_gather_into_tensor(out, inp)
    C.all_gather(tensor_list, t); C.reduce_scatter(out, input_list)   # pieces may differ in size
    C.all_to_all(outs, ins); C.all_to_all_single(out, inp, out_splits, in_splits)
    C.scatter(t, scatter_list, src); C.gather(t, gather_list, dst); C.barrier()

Every function takes torch's arguments plus keywords:
  algorithm  which implementation (ALGORITHMS lists them per collective)
  validate   True: first all-gather a small metadata row (dtype, shape, op, root) so
             ranks that disagree get a ValueError naming them, not a hang; False skips
             it (benchmarks)
  counter    a TrafficCounter that adds up the payload bytes this rank sends/receives
Supported: dtypes float16/bfloat16/float32/float64/(u)int8/16/32/64; ReduceOp SUM, AVG
(floating point), PRODUCT, MIN, MAX, BAND/BOR/BXOR (integers); world sizes 1..N, sizes
not divisible by N, non-contiguous tensors. ``async_op=True`` returns a :class:`Work` whose
``wait()`` returns True at once: the algorithms are blocking, so the collective has finished
when the call returns (``Comm(impl="course")`` runs them on a communication thread to
overlap them). ``src``/``dst`` are global ranks, ``group_src``/``group_dst`` ranks of the
group, as in torch; the root of scatter and gather defaults to global rank 0.

Rooms: core (group, counted send/recv, ops, the traced-call decorator), checks (agreement
check, each collective's argument rules), ring, tree (binomial tree, recursive doubling,
dissemination barrier), naive (through a root, linear scatter/gather), pairwise
(all-to-all by pairwise exchange), measure (timing).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.collectives import comm as _comm
from course_lib.collectives import naive, pairwise, ring, tree
from course_lib.collectives.core import SUPPORTED_DTYPES, Comm, ReduceOp, TrafficCounter
from course_lib.collectives.ring import ring_schedule, simulate_ring_all_reduce

ALGORITHMS = {
    "all_reduce": {"ring": ring.all_reduce, "recursive_doubling": tree.all_reduce,
                   "naive": naive.all_reduce, "serialized_ring": ring.serialized_ring_all_reduce},
    "reduce_scatter_tensor": {"ring": ring.reduce_scatter_tensor, "naive": naive.reduce_scatter_tensor},
    "all_gather_into_tensor": {"ring": ring.all_gather_into_tensor, "naive": naive.all_gather_into_tensor},
    "reduce_scatter": {"ring": ring.reduce_scatter},
    "all_gather": {"ring": ring.all_gather},
    "broadcast": {"tree": tree.broadcast, "naive": naive.broadcast},
    "reduce": {"tree": tree.reduce, "naive": naive.reduce},
    "all_to_all": {"pairwise": pairwise.all_to_all},
    "all_to_all_single": {"pairwise": pairwise.all_to_all_single},
    "scatter": {"linear": naive.scatter},
    "gather": {"linear": naive.gather},
    "barrier": {"dissemination": tree.barrier},
}


def _pick(collective, algorithm):
    table = ALGORITHMS[collective]
    if algorithm is None:
        return next(iter(table.values()))
    try:
        return table[algorithm]
    except KeyError:
        raise ValueError(f"{collective}: unknown algorithm {algorithm!r}; choose one of {list(table)}") from None


class Work:
    """What a collective returns with ``async_op=True``: torch's handle API (``wait``,
    ``is_completed``, ``is_success``, ``exception``, ``get_future``, ``result``). Our
    algorithms are blocking, so the work is complete when the handle is returned."""

    def __init__(self, outputs):
        self._outputs = list(outputs)
        self._future = torch.futures.Future()
        self._future.set_result(self._outputs)

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def get_future(self):
        return self._future

    def result(self):
        return self._outputs

    def __repr__(self):
        return "Work(completed)"


def _finish(result, outputs, async_op):
    if not isinstance(async_op, bool):
        raise TypeError(f"async_op must be True or False, got {async_op!r}")
    return Work(outputs) if async_op else result


def _root(name, what, group, global_rank, group_rank, default=None):
    """The global rank of a collective's root from torch's two spellings: ``src``/``dst``
    (a global rank) or ``group_src``/``group_dst`` (a rank of ``group``)."""
    if group_rank is None:
        if global_rank is None:
            if default is None:
                raise ValueError(f"{name}: give {what} (a global rank) or group_{what} (a rank of the group)")
            return default
        return global_rank
    if global_rank is not None:
        raise ValueError(f"{name}: give {what} (a global rank) or group_{what} (a rank of the group), not both "
                         f"(got {what}={global_rank}, group_{what}={group_rank})")
    size = dist.get_world_size(group)
    if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < size:
        raise ValueError(f"{name}: group_{what}={group_rank!r} is not a rank of the group (0..{size - 1})")
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="ring", **kw):
    return _finish(_pick("all_reduce", algorithm)(tensor, op, group, **kw), [tensor], async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="ring", **kw):
    return _finish(_pick("reduce_scatter_tensor", algorithm)(output, input, op, group, **kw), [output], async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False, *, algorithm="ring", **kw):
    return _finish(_pick("all_gather_into_tensor", algorithm)(output_tensor, input_tensor, group, **kw),
                   [output_tensor], async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, *, algorithm="ring", **kw):
    return _finish(_pick("reduce_scatter", algorithm)(output, input_list, op, group, **kw), [output], async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False, *, algorithm="ring", **kw):
    return _finish(_pick("all_gather", algorithm)(tensor_list, tensor, group, **kw), tensor_list, async_op)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None, *, algorithm="tree", **kw):
    src = _root("broadcast", "src", group, src, group_src)
    return _finish(_pick("broadcast", algorithm)(tensor, src, group, **kw), [tensor], async_op)


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None, *, algorithm="tree",
           **kw):
    dst = _root("reduce", "dst", group, dst, group_dst)
    return _finish(_pick("reduce", algorithm)(tensor, dst, op, group, **kw), [tensor], async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False, *, algorithm="pairwise", **kw):
    return _finish(_pick("all_to_all", algorithm)(output_tensor_list, input_tensor_list, group, **kw),
                   output_tensor_list, async_op)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False,
                      *, algorithm="pairwise", **kw):
    return _finish(_pick("all_to_all_single", algorithm)(output, input, output_split_sizes, input_split_sizes,
                                                         group, **kw), [output], async_op)


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None, *, algorithm="linear",
            **kw):
    src = _root("scatter", "src", group, src, group_src, default=0)
    return _finish(_pick("scatter", algorithm)(tensor, scatter_list, src, group, **kw), [tensor], async_op)


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None, *, algorithm="linear",
           **kw):
    dst = _root("gather", "dst", group, dst, group_dst, default=0)
    return _finish(_pick("gather", algorithm)(tensor, gather_list, dst, group, **kw), gather_list or [], async_op)


def barrier(group=None, async_op=False, device_ids=None, *, algorithm="dissemination", **kw):
    return _finish(_pick("barrier", algorithm)(group, **kw), [], async_op)


# Comm(impl="course") runs these (registered here: comm.py does not import its own package)
_comm.COURSE_ALGORITHMS.update(all_reduce=all_reduce, reduce_scatter_tensor=reduce_scatter_tensor,
                               all_gather_into_tensor=all_gather_into_tensor, broadcast=broadcast,
                               all_to_all_single=all_to_all_single)

__all__ = ["ALGORITHMS", "ReduceOp", "Work", "TrafficCounter", "Comm", "SUPPORTED_DTYPES", "ring_schedule",
           "simulate_ring_all_reduce", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
           "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all", "all_to_all_single",
           "scatter", "gather", "barrier", "ring", "tree", "naive", "pairwise"]
