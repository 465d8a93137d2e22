"""The two plans of a resharding checkpoint, in global coordinates (torch DCP's idea).

Save: every rank lists the boxes it holds; a box held by several ranks (DP / CP replicas, a
tied weight on two stages, AdamW's scalar 'step') is written once, by the lowest rank that
holds it; the written boxes of each tensor must tile it exactly.
Load: a rank of the NEW layout reads, for each box it holds, the saved boxes that overlap it,
and from each only the overlap.

    overlap((0, 0), (4, 8), (2, 4), (4, 4))   # rows 0..3 vs rows 2..5, cols 4..7
    -> ((2, 4), (2, 4))                       # rows 2..3, cols 4..7
"""
from __future__ import annotations

import math


def overlap(a_offsets, a_lengths, b_offsets, b_lengths):
    """The box two boxes share, (offsets, lengths), or None: per dim the later start and
    the earlier end (ends exclusive). Two 0-d boxes (scalars) share the scalar."""
    offsets, lengths = [], []
    for a0, an, b0, bn in zip(a_offsets, a_lengths, b_offsets, b_lengths):
        lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return tuple(offsets), tuple(lengths)


def read_plan(offsets, lengths, saved):
    """[(index in ``saved``, overlap box)]: the saved boxes [(offsets, lengths)] the local box
    needs, and the part of each; ValueError unless they cover it (a box missing from the
    checkpoint never leaves stale values behind)."""
    plan = [(i, box) for i, (o, n) in enumerate(saved) if (box := overlap(offsets, lengths, o, n)) is not None]
    got = sum(math.prod(n) for _, (_, n) in plan)       # saved boxes are disjoint: no double count
    if got != math.prod(lengths):
        raise ValueError(f"the saved slices cover {got} of the {math.prod(lengths)} elements of the box at "
                         f"{tuple(offsets)} of lengths {tuple(lengths)}")
    return plan


def local_index(box, origin):
    """Slices selecting global ``box`` = (offsets, lengths) inside a tensor that holds the box
    starting at global ``origin``."""
    offsets, lengths = box
    return tuple(slice(o - s, o - s + n) for o, n, s in zip(offsets, lengths, origin))


def assign_writers(per_rank):
    """``per_rank``: [[(key, shape, dtype, offsets, lengths)] of every rank] -> [[index of the
    items rank r writes]]: each distinct box once, by the lowest rank that holds it. The written
    boxes of a key must tile its global shape (disjoint, every element): ValueError otherwise."""
    writer, meta = {}, {}
    for rank, items in enumerate(per_rank):
        for j, (key, shape, dtype, offsets, lengths) in enumerate(items):
            if meta.setdefault(key, (shape, dtype)) != (shape, dtype):
                raise ValueError(f"{key}: rank {rank} holds it as {dtype} {tuple(shape)}, another rank as "
                                 f"{meta[key][1]} {tuple(meta[key][0])}")
            writer.setdefault((key, tuple(offsets), tuple(lengths)), (rank, j))
    writes, boxes = [[] for _ in per_rank], {}
    for (key, offsets, lengths), (rank, j) in writer.items():
        writes[rank].append(j)
        boxes.setdefault(key, []).append((offsets, lengths))
    for key, bs in boxes.items():
        check_tiling(key, meta[key][0], bs)
    return writes


def check_tiling(key, shape, boxes):
    """The boxes are disjoint and hold every element of ``shape``."""
    for i, (o, n) in enumerate(boxes):
        for o2, n2 in boxes[i + 1:]:
            if overlap(o, n, o2, n2) is not None:
                raise ValueError(f"{key}: two ranks hold different but overlapping slices {o}+{n} and {o2}+{n2}")
    got = sum(math.prod(n) for _, n in boxes)
    if got != math.prod(shape):
        raise ValueError(f"{key}: the ranks hold {got} of its {math.prod(shape)} elements {tuple(shape)}")


__all__ = ["overlap", "read_plan", "local_index", "assign_writers", "check_tiling"]
