"""FSDP's controls, by torch's names (FSDP2's ``fully_shard``): ``reshard_after_forward``
(free, keep, or keep 1/k of a unit's gathered parameters between forward and backward),
``set_requires_gradient_sync`` (gradient accumulation without reduce-scatters), explicit
prefetch lists, and the peak bytes FSDP held at once (``FSDP.peak``)."""
from __future__ import annotations

import torch

from course_lib.parallel.hsdp import every_group, reshard_comm

PEAKS = ("gathered parameters", "unsharded gradients")  # FSDP.peak's keys: bytes held at once


class FSDPControls:
    """reshard_after_forward, gradient sync on or off, explicit prefetch, the memory peaks.

    A part of :class:`~course_lib.parallel.fsdp.FSDP`: its methods read the state FSDP's ``__init__`` builds."""

    def _reshard_policy(self, value):
        """(True / False / k, the Comm of this rank's block of k) as torch's ``fully_shard``
        takes ``reshard_after_forward``: k must divide the shard group; k = shard group is
        True, k = 1 is False."""
        if value is None or isinstance(value, bool):
            return value is not False, None
        n = self.comm.size
        if not isinstance(value, int) or value < 1 or n % value:
            raise ValueError(f"FSDP: reshard_after_forward must be True, False or an int dividing the "
                             f"shard group's {n} ranks, got {value!r}")
        if value in (1, n):
            return value == n, None
        sets = self.shard_sets or every_group(self.mesh, self.dims, self.comm)
        return value, reshard_comm(sets, value, self.comm.dim, self.mesh.impl, self.mesh)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool):
        """torch's ``FSDPModule.set_requires_gradient_sync``: False on all but the last
        micro-batch of gradient accumulation (full gradients summed locally, no reduce-scatter)."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"set_requires_gradient_sync takes a bool, got {requires_gradient_sync!r}")
        self.requires_gradient_sync = requires_gradient_sync

    def set_modules_to_forward_prefetch(self, module, modules):
        """When ``module``'s unit starts its forward, start the all-gathers of ``modules``'
        units (torch: ``block.set_modules_to_forward_prefetch([...])``)."""
        self._explicit["forward"][self._unit_of(module)] = [self._unit_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, module, modules):
        """When ``module``'s unit starts its backward, start the all-gathers of ``modules``'."""
        self._explicit["backward"][self._unit_of(module)] = [self._unit_of(m) for m in modules]

    def _unit_of(self, module):
        for u in self.units:
            if u.module is module:
                return u.index
        raise ValueError(f"FSDP: {type(module).__name__} is not one of this FSDP's units "
                         f"{[u.name for u in self.units]}")

    def _note_memory(self):
        """Track the peaks: gathered parameters (in flight, gathered, kept 1/k after forward)
        and accumulated unsharded gradients, in bytes."""
        b = torch.empty((), dtype=self.compute_dtype, device="cpu").element_size()   # bytes, never sent
        held = sum(u.numel * u.world * ((u.full is not None) + (u.gather is not None)) +
                   (u.post.numel() if u.post is not None else 0) for u in self.units) * b
        grads = sum(u.accumulated.numel() * u.accumulated.element_size()
                    for u in self.units if u.accumulated is not None)
        for key, now in zip(PEAKS, (held, grads)):
            self.peak[key] = max(self.peak[key], now)


__all__ = ["FSDPControls", "PEAKS"]
