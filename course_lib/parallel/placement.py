"""Where a parameter sits on this rank: one record per single-device name, kept by the plan.

torchtitan's DTensor placements as plain data. ``parallelize_nd`` (and ``parallelize`` alone,
chapter 5) writes one :class:`Placement` per parameter name; checkpoints, assembly, bisection
and the graders read it instead of tags on the tensors or the wrappers' internals.

    net.placements["blocks.0.attn.wq.weight"]
    # Placement(shape=(24, 24), tp=(0, 0, 12, 24), shard=('dp', 'cp'), rows=(0, 6), reduce=('dp', 'cp'), ...)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """One parameter of the single-device model, as this rank holds it.

    ``tp``: its tensor-parallel slice ``(dim, start, stop, full size)`` (None: whole along tp),
    held by ``tp_copies`` TP ranks alike (a K/V head copied); ``shard``: the mesh dims FSDP
    shards that slice over along dim 0, ``rows`` = (first row, rows held) of it here;
    ``reduce``: the mesh dims its gradient is summed over; ``replicated``: the mesh dims whose
    other ranks hold the same values."""
    shape: tuple
    tp: tuple | None = None
    tp_copies: int = 1
    shard: tuple = ()
    rows: tuple | None = None
    reduce: tuple = ()
    replicated: tuple = ()

    def box(self, local_shape) -> tuple:
        """(offsets, lengths): the box of the single-device tensor a local tensor of
        ``local_shape`` holds (its FSDP rows of its TP slice)."""
        offsets = [0] * len(self.shape)
        if self.rows is not None:
            offsets[0] = self.rows[0]
        if self.tp is not None:
            offsets[self.tp[0]] += self.tp[1]
        return tuple(offsets), tuple(local_shape)


def tp_placement(full_shape, tp=None, copies=1, reduce=(), tp_size=1) -> Placement:
    """The record of a parameter cut by tensor parallelism only (``parallelize`` alone)."""
    replicated = tuple(d for d in reduce if d != "tp") + (("tp",) if tp_size > 1 and tp is None else ())
    return Placement(tuple(full_shape), tp, copies, reduce=tuple(reduce), replicated=replicated)


def assemble_tp(pieces) -> object:
    """One tensor from its TP slices: [(value, Placement or None: whole)] of every TP rank (any order)."""
    value, first = pieces[0]
    if first is None or first.tp is None:
        return value
    dim = first.tp[0]
    out = value.new_zeros([first.tp[3] if i == dim else n for i, n in enumerate(value.shape)])
    for value, where in pieces:
        _, start, stop, _ = where.tp
        out.narrow(dim, start, stop - start).copy_(value)
    return out


__all__ = ["Placement", "tp_placement", "assemble_tp"]
