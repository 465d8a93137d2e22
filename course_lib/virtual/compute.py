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
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
# ops that launch no kernel: allocation, metadata, host reads
FREE = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
        aten._unsafe_view, aten.lift_fresh, aten.scalar_tensor, aten.resize_, aten.set_,
        aten._local_scalar_dense, aten.is_same_size, aten.sym_size, aten.sym_stride, aten.sym_numel,
        aten.sym_storage_offset, aten._has_compatible_shallow_copy_type, aten.is_nonzero, aten.detach}


def _elements(t: torch.Tensor) -> int:
    """Elements the op really touches: a broadcast (stride 0) dimension is read once."""
    if 0 not in t.stride():
        return t.numel()
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


def _tensors(values):
    """The tensors among an op's arguments or results (one level of lists: foreach ops)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, torch.Tensor))


_KINDS: dict = {}   # OpOverload -> (launches a kernel, its FLOP formula or None): a memo of the two lookups


def _kind(func):
    kind = _KINDS.get(func)
    if kind is None:
        priced = (isinstance(func, torch._ops.OpOverload) and func.namespace == "aten" and not func.is_view
                  and func.overloadpacket not in FREE)
        kind = _KINDS[func] = (priced, flop_registry.get(func.overloadpacket) if priced else None)
    return kind


def op_time(cluster, func, args, kwargs, out) -> float:
    """Seconds of one aten op on the virtual GPU (0 for views and metadata)."""
    priced, formula = _kind(func)
    if not priced:
        return 0.0
    outs = out if isinstance(out, (list, tuple)) else (out,)
    kw = [v for k, v in kwargs.items() if k != "out"] if kwargs else ()
    nbytes, itemsize = 0, cluster.dtype.itemsize
    for t in _tensors((*args, *kw, *outs)):
        nbytes += _elements(t) * (itemsize if t.is_floating_point() else t.element_size())
    flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
    return cluster.kernel_time(flops, nbytes)


class ComputeStream(TorchDispatchMode):
    """Advances ``clock.t`` (the rank's compute stream) by every op's price, unless the
    clock is muted (inside a communication call, or the clock's own bookkeeping)."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False      # no torch.compile under the virtual clock: skip the per-op dynamo guard (~10 us)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.clock.muted_depth:
            cost = op_time(self.clock.cluster, func, args, kwargs, out)
            if cost:
                self.clock.t += cost
                self.clock.kernels += 1
        return out


__all__ = ["op_time", "op_flops", "tensor_bytes", "ComputeStream", "FREE"]
