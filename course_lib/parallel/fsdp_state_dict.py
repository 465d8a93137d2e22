"""FSDP's checkpoints in the single-device form: the full state dict gathered from the shards
(:meth:`full_state_dict`), and a single-device state dict loaded into them, each rank keeping
its rows (:meth:`load_full_state_dict`). ``state_dict()`` (``nn.Module``'s) is the shards."""
from __future__ import annotations

from collections import OrderedDict

import torch


class FSDPStateDict:
    """The full (single-device) state dict, gathered and loaded.

    - ``state_dict()`` (``nn.Module``'s own) is this rank's shards: keys ``module.<name>``
      (the single-device names behind the ``module.`` prefix, a tied weight under each of its
      names), each parameter a plain tensor in the master dtype holding rows
      ``[r * c, r * c + rows)`` of dim 0 (c = ceil(d0 / N); shape (rows, ...), maybe 0 rows:
      nothing marks it as a shard), buffers whole (in compute_dtype if given).
      ``load_state_dict`` takes such a dict back on the same rank of the same FSDP layout.
    - ``full_state_dict()``: the single-device state dict (no prefix, full shapes, master
      dtype; buffers as held), gathered: what ``model.load_state_dict`` on one device takes.
    - ``load_full_state_dict(sd)``: each rank keeps its rows of a single-device state dict.

    A part of :class:`~course_lib.parallel.fsdp.FSDP`: its methods read the state FSDP's ``__init__`` builds."""

    @torch.no_grad()
    def gather_full_params(self):
        """The full state dict (original names, full shapes, master dtype) on every rank."""
        full = {}
        for u in self.units:
            gathered = u.flat_shard.new_empty(u.world * u.numel)
            u.comm.all_gather_into_tensor(gathered, u.flat_shard, name=f"all-gather {u.name}")
            for piece, view in zip(u.pieces, u.full_views(u.copy_out(gathered))):
                full[id(piece)] = view.clone()
        return OrderedDict((name, full.get(id(t), t.detach()))
                           for name, t in self.module.state_dict(keep_vars=True).items())

    def full_state_dict(self, rank0_only=False):
        """The single-device state dict (``module.state_dict()`` of the unwrapped model: same
        keys, full shapes, master dtype), gathered; a collective: every rank calls it. With
        ``rank0_only`` the other ranks get ``{}`` (they still take part in the all-gathers)."""
        full = self.gather_full_params()
        return full if not rank0_only or self.comm.rank == 0 else OrderedDict()

    @torch.no_grad()
    def load_full_state_dict(self, state_dict):
        """Load a single-device state dict (the unwrapped model's keys and full shapes): each
        rank copies its rows of every parameter into its shard, and the buffers whole. No
        communication: every rank must be given the same dict."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"FSDP.load_full_state_dict takes a dict, got {type(state_dict).__name__}")
        where = {id(piece): (u, i) for u in self.units for i, piece in enumerate(u.pieces)}
        targets = self.module.state_dict(keep_vars=True)  # name -> shard Parameter or buffer
        missing = [k for k in targets if k not in state_dict]
        unexpected = [k for k in state_dict if k not in targets]
        if missing or unexpected:
            prefixed = [k for k in unexpected if k.startswith("module.")]
            hint = (" (keys start with 'module.': that is FSDP.state_dict()'s sharded dict; use "
                    "load_state_dict for it)") if prefixed else ""
            raise ValueError(f"FSDP.load_full_state_dict: the state dict does not match the model: "
                             f"missing keys {missing}, unexpected keys {unexpected}{hint}")
        plan = []
        for name, t in targets.items():
            value, u_i = state_dict[name], where.get(id(t))
            full_shape = t.shape if u_i is None else u_i[0].slots[u_i[1]].shape
            if not torch.is_tensor(value):
                raise TypeError(f"FSDP.load_full_state_dict: {name!r} is a {type(value).__name__}, not a tensor")
            if tuple(value.shape) != tuple(full_shape):
                raise ValueError(f"FSDP.load_full_state_dict: {name!r} has shape {tuple(value.shape)}, the "
                                 f"single-device model's is {tuple(full_shape)} (a full, unsharded tensor)")
            plan.append((name, t, value, u_i))
        for name, t, value, u_i in plan:  # checked everything first: all or nothing
            if u_i is None:
                t.copy_(value)
            else:
                u, i = u_i
                s = u.slots[i]
                start = u.rank * s.chunk
                t.copy_(value[start:start + s.rows])  # (rows, *trailing): my rows, maybe none


__all__ = ["FSDPStateDict"]
