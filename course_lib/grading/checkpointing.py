"""Chapter 12's graders: the global boxes a resharding checkpoint is made of.

    check_owned_box(owned_box)        # the box of a weight one rank holds under TP + FSDP
    check_read_plan(read_plan)        # which saved boxes a new box needs, and which part of each
    check_writers(writers)            # each distinct box written once, by the lowest rank
    check_zero_boxes(zero_boxes)      # a ZeRO flat slice of a flattened weight, as boxes
    check_resume_data(data_state, restore)   # the data order after a resume on another dp size
                                             # (grading.checkpoint_data, with its ShardedBatches)

Each check runs seeded random cases (uneven FSDP cuts, ranks holding nothing, boxes that only
touch, 0-d tensors) against the library's own (course_lib.checkpoint, computed outside the
learner's call). While the learner's function runs,
course_lib.checkpoint (which answers every one of these), FSDP's row cut and the grader's
references are switched off.
"""
from __future__ import annotations

import math
import random

from course_lib.checkpoint.layout import flat_range_boxes
from course_lib.checkpoint import plan
from course_lib.grading import Case, Mismatch
from course_lib.grading.harness import check_answers, table
from course_lib.parallel.fsdp_params import dim0_rows
from course_lib.parallel.placement import Placement

__all__ = ["check_owned_box", "check_read_plan", "check_writers", "check_zero_boxes", "check_resume_data",
           "ShardedBatches"]

LIBRARY = ("course_lib.checkpoint.plan:*", "course_lib.checkpoint.layout:*", "course_lib.checkpoint.store:*",
           "course_lib.checkpoint.load:*", "course_lib.parallel.fsdp_params:dim0_rows",
           # the grader's references
           *(f"course_lib.grading.checkpointing:{f}" for f in ("_owned_box", "_writers", "_zero_boxes")))


# ------------------------------------------------------------------ the references: the library's
def _owned_box(shape, tp_dim, tp, tp_rank, fsdp, fsdp_rank):
    """TP's even slice, then FSDP's row cut of it (``dim0_rows``), as a Placement's box."""
    tp_slice = None if tp_dim is None else (tp_dim, tp_rank * shape[tp_dim] // tp, (tp_rank + 1) * shape[tp_dim] // tp,
                                            shape[tp_dim])
    local = [n // tp if d == tp_dim else n for d, n in enumerate(shape)]
    chunk, rows = dim0_rows(local[0], fsdp, fsdp_rank)
    if rows == 0:
        return None
    return Placement(tuple(shape), tp_slice, rows=(fsdp_rank * chunk, rows)).box([rows] + local[1:])


def _writers(per_rank):
    """``assign_writers`` on boxes of tensors whose shape is the boxes' extent."""
    extent = {}
    for items in per_rank:
        for name, o, n in items:
            extent[name] = tuple(max(a, b + c) for a, b, c in zip(extent.get(name, (0,) * len(o)), o, n))
    return [sorted(w) for w in plan.assign_writers([[(name, extent[name], None, o, n) for name, o, n in items]
                                               for items in per_rank])]


def _zero_boxes(shape, lo, hi):
    return [(tuple(b.offsets), tuple(b.lengths), b.start) for b in flat_range_boxes(shape, lo, hi)]


def _as_box(x, *args):
    """A learner's (offsets, lengths) with lists or tuples -> tuples, or the value as is."""
    if isinstance(x, (tuple, list)) and len(x) == 2 and all(isinstance(v, (tuple, list)) for v in x):
        return tuple(int(v) for v in x[0]), tuple(int(v) for v in x[1])
    return x


# ------------------------------------------------------------------ 1. the box a rank holds
def _owned_rows():
    rng = random.Random(12)
    fixed = [((96, 32), 0, 2, 1, 2, 1), ((32, 96), 1, 2, 0, 3, 2), ((5, 4), None, 1, 0, 3, 2),
             ((2, 6), None, 1, 0, 3, 2), ((7,), None, 1, 0, 4, 3), ((8, 6), 1, 3, 2, 3, 1)]
    for _ in range(8):
        shape = (rng.randint(1, 9) * rng.choice([1, 2, 4]), rng.randint(1, 5) * 2)
        tp_dim = rng.choice([None, 0, 1])
        tp = 1 if tp_dim is None else rng.choice([t for t in (1, 2, 4) if shape[tp_dim] % t == 0])
        fsdp = rng.randint(1, 5)
        fixed.append((shape, tp_dim, tp, rng.randrange(tp), fsdp, rng.randrange(fsdp)))
    return fixed


def check_owned_box(owned_box):
    """owned_box(shape, tp_dim, tp, tp_rank, fsdp, fsdp_rank) -> (offsets, lengths) of the
    global weight this rank holds (TP's even split of dim tp_dim, then FSDP's torch.chunk cut of
    dim 0 of the TP slice), or None if the rank holds no row."""
    return check_answers(
        "owned_box", owned_box, table(_owned_rows(), "shape={}, tp_dim={}, tp={}, tp_rank={}, fsdp={}, fsdp_rank={}"),
        _owned_box, guard=LIBRARY, exercise="the box a rank holds", read=_as_box,
        hint=lambda got, want, *a: " (FSDP cuts like torch.chunk: ceil(rows / fsdp) rows per rank, the last ones "
                                   "fewer or none)" if a[4] > 1 else "")


# ------------------------------------------------------------------ 2. the read plan
def _random_tiling(rng, shape):
    """A random cut of ``shape`` into boxes: each dim cut at random points (a grid)."""
    cuts = []
    for n in shape:
        points = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3)))) if n > 1 else []
        cuts.append([0] + points + [n])
    boxes = [((), ())]
    for c in cuts:
        boxes = [(o + (a,), l + (b - a,)) for o, l in boxes for a, b in zip(c, c[1:])]
    return boxes


def _plan_cases():
    rng = random.Random(7)
    cases = table([(((2, 4), (2, 4)), [((0, 0), (2, 8)), ((2, 0), (2, 8))])],
                  "rows 2..3 of cols 4..7 against two row blocks that only touch it")
    cases += table([(((), ()), [((), ())])], "a 0-d tensor (AdamW's step)")
    for _ in range(6):
        shape = tuple(rng.randint(2, 9) for _ in range(rng.randint(1, 3)))
        saved = _random_tiling(rng, shape)
        offsets = tuple(rng.randrange(n) for n in shape)
        lengths = tuple(rng.randint(1, n - o) for n, o in zip(shape, offsets))
        cases += table([((offsets, lengths), saved)],
                       f"shape {shape}, {len(saved)} saved boxes, new box {offsets}+{lengths}")
    return cases


def _as_plan(got, *args):
    if not isinstance(got, (list, tuple)) or not all(isinstance(g, (list, tuple)) and len(g) == 2 for g in got):
        raise Mismatch(f"expected a list of (i, (offsets, lengths)), got {got!r}")
    return [(int(i), _as_box(b)) for i, b in got]


def check_read_plan(read_plan):
    """read_plan(box, saved) -> [(i, (offsets, lengths))]: for the new box (offsets, lengths),
    every saved box i it overlaps (in the order of ``saved``) and the overlap, in global
    coordinates; ends are exclusive: boxes that only touch share nothing."""
    return check_answers(
        "read_plan", read_plan, _plan_cases(), lambda box, saved: plan.read_plan(*box, saved), guard=LIBRARY,
        exercise="the read plan", read=_as_plan,
        hint=lambda got, want, *a: " (a box that ends where another starts does not overlap it: ends are "
                                   "exclusive)" if any(g not in want for g in got) else "")


# ------------------------------------------------------------------ 3. who writes
def _writer_cases():
    w = ("w", (0, 0), (4, 8))
    norm = ("norm", (0,), (8,))
    step = ("w.step", (), ())
    dp2_tp2 = [[("w", (0, 0), (2, 8)), norm, step], [("w", (2, 0), (2, 8)), norm, step],
               [("w", (0, 0), (2, 8)), norm, step], [("w", (2, 0), (2, 8)), norm, step]]
    fsdp = [[("w", (0, 0), (2, 8)), ("norm", (0,), (4,)), step], [("w", (2, 0), (2, 8)), ("norm", (4,), (4,)), step]]
    pp = [[w, ("tok_emb", (0, 0), (6, 8))], [("head", (0, 0), (6, 8)), ("tok_emb", (0, 0), (6, 8))]]
    return [Case(dict(args=(p,)), label=label) for p, label in (
        ([[w, norm, step]] * 3, "3 DP replicas"),
        (dp2_tp2, "tp2 x dp2: a TP slice on two DP ranks, a norm on all four"),
        (fsdp, "FSDP: disjoint rows, one 'step' scalar on both ranks"),
        (pp, "a tied embedding held by the first and last stage"), ([[], [norm, w], [w]], "rank 0 holds nothing"))]


def _as_writers(got, per_rank):
    if not isinstance(got, (list, tuple)) or len(got) != len(per_rank):
        raise Mismatch(f"expected one list of indexes per rank ({len(per_rank)}), got {got!r}")
    return [sorted(int(j) for j in g) for g in got]


def check_writers(writers):
    """writers(per_rank) -> for every rank, the indexes (into its own list) of the items it
    writes. per_rank[r] = [(name, offsets, lengths)]: the boxes rank r holds. Every distinct
    (name, offsets, lengths) is written exactly once, by the lowest rank that holds it."""
    def hint(got, want, per_rank):
        n_got, n_want = sum(map(len, got)), sum(map(len, want))
        return (f": {n_got} boxes written, {n_want} distinct ones (a replica written on every rank multiplies "
                f"the checkpoint)" if n_got > n_want else "")
    return check_answers("writers", writers, _writer_cases(), _writers, guard=LIBRARY,
                         exercise="who writes a replicated box", read=_as_writers, hint=hint)


# ------------------------------------------------------------------ 4. a ZeRO slice as boxes
def _zero_rows():
    rng = random.Random(3)
    rows = [((4, 3), 2, 9), ((4, 3), 0, 12), ((5,), 1, 4), ((2, 3, 4), 5, 19), ((3, 4), 4, 8), ((3, 4), 6, 7)]
    for _ in range(6):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        n = math.prod(shape)
        lo = rng.randrange(n)
        rows.append((shape, lo, rng.randint(lo + 1, n)))
    return rows


def _as_boxes(got, *args):
    try:
        return [(tuple(map(int, o)), tuple(map(int, n)), int(s)) for o, n, s in got]
    except (TypeError, ValueError):
        raise Mismatch(f"expected a list of (offsets, lengths, start), got {got!r}") from None


def check_zero_boxes(zero_boxes):
    """zero_boxes(shape, lo, hi) -> [(offsets, lengths, start)]: elements lo..hi-1 of a
    row-major tensor of ``shape`` (ZeRO's owned slice of a flattened weight) as the fewest
    boxes read row by row: a partial first row, whole rows as one box, a partial last row
    (recursively in more dims); start = where the box's elements begin within lo..hi-1."""
    def hint(got, want, shape, lo, hi):
        covered = sum(math.prod(n) for _, n, _ in got)
        return f" (they hold {covered} elements, the slice {hi - lo})" if covered != hi - lo else ""
    return check_answers("zero_boxes", zero_boxes, table(_zero_rows(), "shape={}, lo={}, hi={}"), _zero_boxes,
                         guard=LIBRARY, exercise="a ZeRO slice as boxes", read=_as_boxes, hint=hint)


# ------------------------------------------------------------------ 5. the data order (its own module)
from course_lib.grading.checkpoint_data import ShardedBatches, check_resume_data  # noqa: E402
