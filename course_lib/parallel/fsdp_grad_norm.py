"""Gradient clipping for FSDP: the norm of the whole model's gradient, as one device computes
it, from the rows each rank holds (summed over FSDP's dims, the dims a gradient is also
reduced over and the TP ranks, each copy counted once)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib.parallel.mesh import EXPERT_DIMS
from course_lib.parallel.tp_plan import tp_slice_of


class FSDPGradNorm:
    """``clip_grad_norm_`` over sharded gradients, and which rank counts which parameter.

    A part of :class:`~course_lib.parallel.fsdp.FSDP`: its methods read the state FSDP's ``__init__`` builds."""

    def _grad_norm_dims(self, extra, unit_dims=()):
        """The mesh dims ``clip_grad_norm_`` sums over: FSDP's, the dims some gradient is also
        reduced over and "tp" if the mesh has it (TP slices differ between TP ranks); the expert
        mesh's dims (a unit sharded over "edp", a bias summed over "etp") as the stage dims
        they fold over."""
        others = set().union(*extra.values(), *unit_dims) - set(self.dims)
        if others & set(EXPERT_DIMS):
            others = (others - set(EXPERT_DIMS)) | set(self.mesh.fold)
        if self.mesh.sizes.get("tp", 1) > 1 and "tp" not in self.dims:
            others.add("tp")
        return self.dims + tuple(sorted(others - set(self.dims)))

    def _counted_in_norm(self, p, extra_dims, unit_dims=None):
        """Does this rank count (original, unsharded) parameter p in the norm? A copy held by
        several ranks of the norm's extra dims counts once: on their coordinate 0. A unit
        sharded over dims of its own (an expert) holds rows no other rank of the stage holds,
        except along the dims its gradient is also summed over: counted on their coordinate 0."""
        coord = getattr(self.mesh, "coord", {})
        if unit_dims is not None and tuple(unit_dims) != tuple(self.dims):
            return all(coord[d] == 0 for d in extra_dims)
        where, copies = tp_slice_of(p)
        for d in self._norm_dims[len(self.dims):]:
            tp_slice = d == "tp" and where is not None
            replicated = d in extra_dims or d == "cp" or (d == "tp" and not tp_slice)
            if replicated and coord[d] != 0:
                return False
            if tp_slice and coord[d] % copies:  # a TP slice held by `copies` ranks
                return False
        return True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """``torch.nn.utils.clip_grad_norm_`` for the sharded gradients: returns the total
        ``norm_type`` norm of the gradients of the whole (unsharded) model, as one device
        computes it, and scales every gradient shard by min(1, max_norm / (norm + 1e-6)).

        Each rank holds rows of each gradient (padding excluded), so: inf norm = a MAX
        all-reduce of the local max |g|; p-norm = (SUM all-reduce of sum |g|^p)^(1/p). The sum
        runs over FSDP's dims, plus any dim a gradient is also reduced over (a sequence-
        parallel weight, replicated there: counted once) and, when the mesh has "tp", over
        the TP ranks: a weight TP cut (``tp_shard``, as course_lib's TP layers tag it) counts
        its slice on each TP rank, any other parameter (replicated over tp) counts once; so
        every rank gets the same norm, that of the single-device model, as torch's DTensor
        gradients give. Pipeline stages are not summed: each stage's FSDP clips by its own norm.
        Call it after ``finish_gradient_synchronization()``, on every rank (a collective).
        """
        if self._reducing or self._replicating or any(u.grad_shard is not None for u in self.units):
            raise RuntimeError("FSDP.clip_grad_norm_: gradient reduce-scatters are still pending: call "
                               "finish_gradient_synchronization() after backward, before clipping")
        number, order = _number(max_norm), _number(norm_type)  # as torch: "inf", 0-d tensors
        if number is None or not number >= 0:
            raise ValueError(f"FSDP.clip_grad_norm_: max_norm must be a number >= 0, got {max_norm!r}")
        if order is None or not order > 0:
            raise ValueError(f"FSDP.clip_grad_norm_: norm_type must be a number > 0 or inf, got {norm_type!r}")
        max_norm, norm_type = number, order
        first = self.replicate is None or self.replicate.rank == 0  # HSDP: one replica counts its shards
        grads = [(p.grad, counted and first) for p, counted in self._norm_params if p.grad is not None]
        local = self.units[0].flat_shard.new_zeros((), dtype=torch.float64)  # float64: no overflow
        for g, counted in grads:
            if counted and g.numel():
                a = g.detach().abs()  # (rows, ...): this rank's rows, no padding
                local = torch.maximum(local, a.max().double()) if norm_type == math.inf \
                    else local + a.double().pow(norm_type).sum()
        comm = self.mesh.comm(self._norm_dims)
        if norm_type == math.inf:  # [max |g|, NaN seen]: a MAX may drop a NaN, a flag does not
            stats = torch.stack([local.nan_to_num(nan=0.0), local.isnan().double()])
            comm.all_reduce(stats, op=dist.ReduceOp.MAX, name="all-reduce grad norm")
            total = stats[0] if stats[1] == 0 else stats[1] * math.nan
        else:  # sum over ranks of sum |g|^p
            comm.all_reduce(local, name="all-reduce grad norm")
            total = local.pow(1.0 / norm_type)
        total = total.to(self.master_dtype)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it "
                               f"cannot be clipped. To disable this error and scale the gradients by the "
                               f"non-finite norm anyway, set `error_if_nonfinite=False`")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g, _ in grads:  # every shard, counted here or not: replicas stay equal
            g.mul_(coef.to(g.dtype))
        return total


def _number(x):
    """float(x) for a real number, "inf" or a one-element tensor; None for anything else."""
    if isinstance(x, bool) or (torch.is_tensor(x) and x.numel() != 1):
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


__all__ = ["FSDPGradNorm"]
