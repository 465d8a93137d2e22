"""Compute on the virtual GPU: a dispatch mode that prices every aten op a rank runs.

``op_time(cluster, func, args, kwargs, out)`` is one kernel's roofline: FLOPs from torch's
own FLOP-counter registry (``torch.utils.flop_counter``: mm, addmm, bmm, baddbmm,
convolutions, attention kernels; 0 for the others, which are memory bound), bytes = every
tensor the op reads and writes at the virtual dtype, plus the launch overhead. Views and
metadata (``func.is_view``, allocation, ``.item()``) launch no kernel: free.
"""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.planner.kernels import _FREE_OP, _KINDS, FREE, _add_bytes, op_cost  # one implementation: the planner's


def tensor_bytes(cluster, tensors) -> int:
    """Bytes of ``tensors`` on the virtual GPU (floating tensors at the virtual dtype)."""
    return sum(_add_bytes(t, cluster.dtype.itemsize) for t in tensors)


def op_flops(func, args, kwargs, out) -> int:
    cost = op_cost(func, args, kwargs, out, 2)
    return cost[0] if cost else 0


def op_time(cluster, func, args, kwargs, out) -> float:
    """Seconds of one aten op on the virtual GPU (0 for views and metadata): the roofline of
    its FLOPs and bytes (:func:`course_lib.planner.kernels.op_cost`, which the planner counts
    too) plus the launch."""
    cost = op_cost(func, args, kwargs, out, cluster.dtype.itemsize)
    return 0.0 if cost is None else cluster.kernel_time(*cost)


class ComputeStream(TorchDispatchMode):
    """Advances ``clock.t`` (the rank's compute stream) by every op's price, unless the
    clock is muted (inside a communication call, or the clock's own bookkeeping)."""

    def __init__(self, clock):
        super().__init__()
        self.clock, self.itemsize = clock, clock.cluster.dtype.itemsize

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False      # no torch.compile under the virtual clock: skip the per-op dynamo guard (~10 us)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = getattr(func, "_op", func)     # an OpOverload's C++ operator: one Python frame less per op
        out = op(*args, **kwargs) if kwargs else op(*args)
        if _KINDS.get(func) is _FREE_OP:    # a view or metadata (most ops seen before): free
            return out
        clock = self.clock
        if not clock.muted_depth:           # op_time, inlined: one call less per op
            cost = op_cost(func, args, kwargs, out, self.itemsize)
            if cost is not None:
                clock.t += clock.cluster.kernel_time(*cost)
                clock.kernels += 1
        return out


__all__ = ["op_time", "op_flops", "tensor_bytes", "ComputeStream", "FREE"]
