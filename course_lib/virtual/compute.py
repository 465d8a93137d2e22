"""Compute on the virtual GPU: a dispatch mode that prices every aten op a rank runs.

``op_time(cluster, func, args, kwargs, out)`` is one kernel's roofline: FLOPs from torch's
own FLOP-counter registry (``torch.utils.flop_counter``: mm, addmm, bmm, baddbmm,
convolutions, attention kernels; 0 for the others, which are memory bound), bytes = every
tensor the op reads and writes at the virtual dtype, plus the launch overhead. Views and
metadata (``func.is_view``, allocation, ``.item()``) launch no kernel: free.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
# ops that launch no kernel: allocation, metadata, host reads
FREE = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
        aten._unsafe_view, aten.lift_fresh, aten.scalar_tensor, aten.resize_, aten.set_,
        aten._local_scalar_dense, aten.is_same_size, aten.sym_size, aten.sym_stride, aten.sym_numel,
        aten.sym_storage_offset, aten._has_compatible_shallow_copy_type, aten.is_nonzero, aten.detach}


def _elements(t: torch.Tensor) -> int:
    """Elements the op really touches: a broadcast (stride 0) dimension is read once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n


def tensor_bytes(cluster, tensors) -> int:
    """Bytes of ``tensors`` on the virtual GPU (floating tensors at the virtual dtype)."""
    return sum(_elements(t) * cluster.itemsize(t) for t in tensors)


def op_flops(func, args, kwargs, out) -> int:
    formula = flop_registry.get(func.overloadpacket)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


def op_time(cluster, func, args, kwargs, out) -> float:
    """Seconds of one aten op on the virtual GPU (0 for views and metadata)."""
    if func.is_view or func.overloadpacket in FREE:
        return 0.0
    inputs = [t for t in tree_leaves((args, {k: v for k, v in kwargs.items() if k != "out"}))
              if isinstance(t, torch.Tensor)]
    outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return cluster.kernel_time(op_flops(func, args, kwargs, out), tensor_bytes(cluster, inputs + outputs))


class ComputeStream(TorchDispatchMode):
    """Advances ``clock.t`` (the rank's compute stream) by every op's price, unless the
    clock is muted (inside a communication call, or the clock's own bookkeeping)."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.clock.muted_depth and isinstance(func, torch._ops.OpOverload) and func.namespace == "aten":
            self.clock.t += op_time(self.clock.cluster, func, args, kwargs, out)
        return out


__all__ = ["op_time", "op_flops", "tensor_bytes", "ComputeStream", "FREE"]
