"""FSDP's gradients: each unit's full gradient reduce-scattered in backward (one collective,
``MAX_IN_FLIGHT`` at once), divided by the divisor, all-reduced over the replicas (HSDP) and
over any other dimension a gradient is summed on, then handed to each parameter shard as its
``.grad`` by :meth:`finish_gradient_synchronization`."""
from __future__ import annotations

import torch

from course_lib import trace
from course_lib.parallel.zeropp import quantized_reduce_scatter

MAX_IN_FLIGHT = 1  # gradient reduce-scatters in flight (each keeps a full-size gradient alive)


class FSDPGradients:
    """Reduce-scatter, fold and hand out the gradient shards.

    A part of :class:`~course_lib.parallel.fsdp.FSDP`: its methods read the state FSDP's ``__init__`` builds."""

    # ------------------------------------------------------------------ gradients
    def _reduce_scatter(self, u, grad_full, sync=None):
        """u's full gradients (N * S,) -> this rank's (S_grad,) shard, summed over ranks;
        without gradient sync, added to its unsharded gradient instead (nothing sent)."""
        if not (self.requires_gradient_sync if sync is None else sync):
            if u.accumulated is None:  # (N * S,): the unit's full gradient, kept to the last one
                u.accumulated = grad_full.to(self.reduce_dtype, copy=True)
            else:
                u.accumulated.add_(grad_full)
            u.reduced = True
            self._note_memory()
            self._reshard(u)
            return
        if u.accumulated is not None:  # the earlier micro-batches' sum, never reduced
            grad_full, u.accumulated = u.accumulated.add_(grad_full), None
        packed = u.pack_gradients(grad_full, self.reduce_dtype)  # (N, S_grad + T) rank after rank
        out = packed.new_empty(packed.shape[1])                   # (S_grad + T,): my shard, summed
        if self.qgz is None:
            work = u.comm.reduce_scatter_tensor(out, packed.view(-1), async_op=True,
                                                   name=f"reduce-scatter {u.name}")
        else:   # qgZ: gradients as int8 all-to-alls; the "used" flags exact, apart
            work = quantized_reduce_scatter(*self.qgz, out[:u.grad_numel], packed[:, :u.grad_numel],
                                            name=f"reduce-scatter {u.name}")
            self.comm.reduce_scatter_tensor(out[u.grad_numel:], packed[:, u.grad_numel:].contiguous().view(-1),
                                            name=f"reduce-scatter {u.name} flags")
        self._reducing.append((u, out, work, packed))
        u.reduced = True
        if not u.is_root and u.backward_started:
            trace.recorder().add(f"backward {u.name}", "compute", u.t_backward, trace.now())
        self._reshard(u)
        self._drain(MAX_IN_FLIGHT)

    def _drain(self, in_flight):
        """Finish reduce-scatters until ``in_flight`` are left; under HSDP each then starts the
        all-reduce of its shard over the replicas (as many left in flight)."""
        while len(self._reducing) > in_flight:
            u, out, work, _ = self._reducing.pop(0)
            work.wait()
            if self.replicate is None or self.replicate.size == 1:
                self._fold(u, out)
            else:  # (S_grad + T,): the shard only, 1/S of the gradient, crosses the replicas
                self._replicating.append((u, out, self.replicate.all_reduce(
                    out, async_op=True, name=f"all-reduce {u.name} over replicas")))
        while len(self._replicating) > in_flight:
            u, out, work = self._replicating.pop(0)
            work.wait()
            self._fold(u, out)

    def _fold(self, u, out):
        used = out[u.grad_numel:] > 0                      # some rank's backward reached it
        u.used_anywhere = used if u.used_anywhere is None else u.used_anywhere | used
        out = out[:u.grad_numel].to(self.master_dtype).div(self.divisor)  # e.g. mean over dp
        for comm, indexes in u.extra:  # e.g. a sequence-parallel weight: sum over tp too
            rows = u.gradient_rows(indexes, out)
            flat = torch.cat(rows)
            if flat.numel():
                comm.all_reduce(flat, name=f"all-reduce {u.name} over {comm.dim}")
                for r, summed in zip(rows, flat.split([r.numel() for r in rows])):
                    r.copy_(summed)
        if u.grad_shard is None:
            u.grad_shard = out
        else:  # several backward passes: accumulate
            u.grad_shard.add_(out)

    def finish_gradient_synchronization(self):
        """Wait for the reduce-scatters; give each parameter shard its gradient."""
        for u in self.units:  # a unit that ran forward but got no gradient: reduce zeros (+ its sum
            if u.trainable and (u.accumulated is not None or (u.forward_ran and not u.reduced)):  # unsynced)
                self._reduce_scatter(u, u.flat_shard.new_zeros(u.world * u.numel, dtype=self.reduce_dtype),
                                     sync=True)
        self._drain(0)
        for u in self.units:
            if u.grad_shard is not None:
                for j, i in enumerate(u.trainable_slots):
                    if not u.used_anywhere[j]:
                        continue  # no rank used it: grad stays None, as on one device
                    grad, piece = u.gradient_view(i, u.grad_shard), u.pieces[i]  # a view: no copy
                    if piece.grad is None:
                        piece.grad = grad
                    else:  # not zeroed since the last step: accumulate, as on one device
                        piece.grad.add_(grad)
            u.grad_shard, u.used_anywhere, u.used = None, None, [False] * len(u.pieces)
            self._reshard(u)


__all__ = ["FSDPGradients", "MAX_IN_FLIGHT"]
