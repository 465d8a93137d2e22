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
not divisible by N, non-contiguous tensors. Not supported: async_op (use torch's).

Rooms: core (group, counted send/recv, ops, the traced-call decorator), checks (agreement
check, each collective's argument rules), ring, tree (binomial tree, recursive doubling,
dissemination barrier), naive (through a root, linear scatter/gather), pairwise
(all-to-all by pairwise exchange), measure (timing).
"""
from __future__ import annotations

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


def all_reduce(tensor, op=ReduceOp.SUM, group=None, *, algorithm="ring", **kw):
    return _pick("all_reduce", algorithm)(tensor, op, group, **kw)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, *, algorithm="ring", **kw):
    return _pick("reduce_scatter_tensor", algorithm)(output, input, op, group, **kw)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, *, algorithm="ring", **kw):
    return _pick("all_gather_into_tensor", algorithm)(output_tensor, input_tensor, group, **kw)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, *, algorithm="ring", **kw):
    return _pick("reduce_scatter", algorithm)(output, input_list, op, group, **kw)


def all_gather(tensor_list, tensor, group=None, *, algorithm="ring", **kw):
    return _pick("all_gather", algorithm)(tensor_list, tensor, group, **kw)


def broadcast(tensor, src, group=None, *, algorithm="tree", **kw):
    return _pick("broadcast", algorithm)(tensor, src, group, **kw)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, *, algorithm="tree", **kw):
    return _pick("reduce", algorithm)(tensor, dst, op, group, **kw)


def all_to_all(output_tensor_list, input_tensor_list, group=None, *, algorithm="pairwise", **kw):
    return _pick("all_to_all", algorithm)(output_tensor_list, input_tensor_list, group, **kw)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, *,
                      algorithm="pairwise", **kw):
    return _pick("all_to_all_single", algorithm)(output, input, output_split_sizes, input_split_sizes, group, **kw)


def scatter(tensor, scatter_list=None, src=0, group=None, *, algorithm="linear", **kw):
    return _pick("scatter", algorithm)(tensor, scatter_list, src, group, **kw)


def gather(tensor, gather_list=None, dst=0, group=None, *, algorithm="linear", **kw):
    return _pick("gather", algorithm)(tensor, gather_list, dst, group, **kw)


def barrier(group=None, *, algorithm="dissemination", **kw):
    return _pick("barrier", algorithm)(group, **kw)


__all__ = ["ALGORITHMS", "ReduceOp", "TrafficCounter", "Comm", "SUPPORTED_DTYPES", "ring_schedule",
           "simulate_ring_all_reduce", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
           "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all", "all_to_all_single",
           "scatter", "gather", "barrier", "ring", "tree", "naive", "pairwise"]
