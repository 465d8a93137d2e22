"""Chapter 12's graders (course_lib/grading/checkpointing.py): the solutions' answers and
answers written differently pass; classic mistakes (a floor instead of torch.chunk's ceil,
touching boxes counted as overlapping, replicas written on every rank, boxes that are not row
by row), answers hard-coded to the lecture's printed case and calls to course_lib.checkpoint
fail with a hint that names the mistake."""
from __future__ import annotations

import math

from course_lib.grading import checkpointing as G
from grading_answers import fails_with, graded


# ----------------------------------------------------------------------------- 1. owned box
def owned_box(shape, tp_dim, tp, tp_rank, fsdp, fsdp_rank):
    """Written with torch.chunk's arithmetic on a list of rows."""
    offsets, lengths = [0] * len(shape), list(shape)
    if tp_dim is not None:
        lengths[tp_dim] //= tp
        offsets[tp_dim] = tp_rank * lengths[tp_dim]
    rows = list(range(offsets[0], offsets[0] + lengths[0]))
    chunk = -(-len(rows) // fsdp)
    mine = rows[fsdp_rank * chunk:(fsdp_rank + 1) * chunk]
    if not mine:
        return None
    offsets[0], lengths[0] = mine[0], len(mine)
    return offsets, lengths


def owned_box_floor(shape, tp_dim, tp, tp_rank, fsdp, fsdp_rank):
    offsets, lengths = [0] * len(shape), list(shape)
    if tp_dim is not None:
        lengths[tp_dim] //= tp
        offsets[tp_dim] = tp_rank * lengths[tp_dim]
    chunk = lengths[0] // fsdp                      # floor: the last rows are lost
    if chunk == 0:
        return None
    offsets[0] += fsdp_rank * chunk
    lengths[0] = chunk
    return tuple(offsets), tuple(lengths)


def owned_box_hard_coded(*args):
    return (48, 0), (48, 32)                        # the lecture's (96, 32) weight, tp rank 1 of 2, FSDP rank 1


def owned_box_library(shape, tp_dim, tp, tp_rank, fsdp, fsdp_rank):
    from course_lib.parallel.fsdp_params import dim0_rows
    d0 = shape[0] // (tp if tp_dim == 0 else 1)
    dim0_rows(d0, fsdp, fsdp_rank)                  # the library's row cut: switched off by the guard
    return owned_box(shape, tp_dim, tp, tp_rank, fsdp, fsdp_rank)


def test_owned_box(capsys):
    assert graded(capsys, G.check_owned_box, owned_box)[0]
    fails_with(capsys, G.check_owned_box, owned_box_floor, hint="ceil(rows / fsdp)")
    fails_with(capsys, G.check_owned_box, owned_box_hard_coded, hint="expected")
    fails_with(capsys, G.check_owned_box, owned_box_library, hint="write this yourself")


# ----------------------------------------------------------------------------- 2. read plan
def read_plan(box, saved):
    """Element sets per dim, intersected (a different route from max/min)."""
    out = []
    for i, (o, n) in enumerate(saved):
        ranges = [set(range(a, a + m)) & set(range(b, b + k)) for a, m, b, k in zip(box[0], box[1], o, n)]
        if all(ranges):
            out.append((i, ([min(r) for r in ranges], [len(r) for r in ranges])))
    return out


def read_plan_touching(box, saved):
    out = []
    for i, (o, n) in enumerate(saved):
        lo = [max(a, b) for a, b in zip(box[0], o)]
        hi = [min(a + m, b + k) for a, m, b, k in zip(box[0], box[1], o, n)]
        if all(h >= l for l, h in zip(lo, hi)):     # <=: boxes that only touch counted
            out.append((i, (lo, [h - l for l, h in zip(lo, hi)])))
    return out


def read_plan_local(box, saved):
    """The overlap in the saved box's own coordinates, not global ones."""
    out = []
    for i, (o, n) in enumerate(saved):
        lo = [max(a, b) for a, b in zip(box[0], o)]
        hi = [min(a + m, b + k) for a, m, b, k in zip(box[0], box[1], o, n)]
        if all(h > l for l, h in zip(lo, hi)):
            out.append((i, ([l - b for l, b in zip(lo, o)], [h - l for l, h in zip(lo, hi)])))
    return out


def read_plan_hard_coded(box, saved):
    return [(1, ((2, 4), (2, 4)))]


def read_plan_library(box, saved):
    from course_lib.checkpoint import read_plan as plan
    return plan(box[0], box[1], saved)


def test_read_plan(capsys):
    assert graded(capsys, G.check_read_plan, read_plan)[0]
    fails_with(capsys, G.check_read_plan, read_plan_touching, hint="ends are exclusive")
    fails_with(capsys, G.check_read_plan, read_plan_local, hint="expected")
    fails_with(capsys, G.check_read_plan, read_plan_hard_coded, hint="expected")
    fails_with(capsys, G.check_read_plan, read_plan_library, hint="write this yourself")


# ----------------------------------------------------------------------------- 3. writers
def writers(per_rank):
    """For each item, the lowest rank holding the same box: does it equal mine?"""
    return [[j for j, item in enumerate(items)
             if next(r for r, other in enumerate(per_rank) if item in other) == rank]
            for rank, items in enumerate(per_rank)]


def writers_everyone(per_rank):
    return [list(range(len(items))) for items in per_rank]


def writers_rank0_only(per_rank):
    return [list(range(len(per_rank[0])))] + [[] for _ in per_rank[1:]]


def writers_by_name(per_rank):
    """Deduplicated by name only: a second rank's other rows are never written."""
    seen, out = set(), []
    for items in per_rank:
        out.append([j for j, (name, *_) in enumerate(items) if not (name in seen or seen.add(name))])
    return out


def writers_library(per_rank):
    from course_lib.checkpoint import assign_writers
    return assign_writers([[(n, (), "f", o, l) for n, o, l in items] for items in per_rank])


def test_writers(capsys):
    assert graded(capsys, G.check_writers, writers)[0]
    fails_with(capsys, G.check_writers, writers_everyone, hint="multiplies the checkpoint")
    fails_with(capsys, G.check_writers, writers_rank0_only, hint="expected")
    fails_with(capsys, G.check_writers, writers_by_name, hint="expected")
    fails_with(capsys, G.check_writers, writers_library, hint="write this yourself")


# ----------------------------------------------------------------------------- 4. ZeRO boxes
def zero_boxes(shape, lo, hi):
    """Greedy: from each position, the largest box that starts there and stays inside lo..hi."""
    out, pos = [], lo
    while pos < hi:
        index = []
        rest = pos
        for k in range(len(shape)):
            inner = math.prod(shape[k + 1:])
            index.append(rest // inner)
            rest %= inner
        # the deepest dim k from which index[k+1:] are all 0: take whole sub-blocks along k
        for k in range(len(shape)):
            if all(i == 0 for i in index[k + 1:]):
                inner = math.prod(shape[k + 1:])
                n = min(shape[k] - index[k], (hi - pos) // inner)
                if n > 0:
                    out.append((tuple(index[:k + 1]) + (0,) * (len(shape) - k - 1),
                                (1,) * k + (n,) + tuple(shape[k + 1:]), pos - lo))
                    pos += n * inner
                    break
    return out


def zero_boxes_one_per_row(shape, lo, hi):
    """Every row its own box: right elements, not the fewest boxes."""
    inner = math.prod(shape[1:])
    out, pos = [], lo
    while pos < hi:
        row, col = divmod(pos, inner)
        end = min(hi, (row + 1) * inner)
        if len(shape) == 1:
            return [((lo,), (hi - lo,), 0)]
        out.append(((row, col) + (0,) * (len(shape) - 2), (1, end - pos) + (1,) * (len(shape) - 2), pos - lo))
        pos = end
    return out


def zero_boxes_off_by_one(shape, lo, hi):
    from test_grading_checkpointing import zero_boxes as right
    return right(shape, lo, hi + 1) if hi < math.prod(shape) else right(shape, lo, hi)


def zero_boxes_hard_coded(shape, lo, hi):
    return [((0, 2), (1, 1), 0), ((1, 0), (2, 3), 1)]


def zero_boxes_library(shape, lo, hi):
    from course_lib.checkpoint import flat_range_boxes
    return [tuple(p) for p in flat_range_boxes(shape, lo, hi)]


def test_zero_boxes(capsys):
    assert graded(capsys, G.check_zero_boxes, zero_boxes)[0]
    fails_with(capsys, G.check_zero_boxes, zero_boxes_one_per_row, hint="expected")
    fails_with(capsys, G.check_zero_boxes, zero_boxes_off_by_one, hint="they hold")
    fails_with(capsys, G.check_zero_boxes, zero_boxes_hard_coded, hint="expected")
    fails_with(capsys, G.check_zero_boxes, zero_boxes_library, hint="write this yourself")


# ----------------------------------------------------------------------------- 5. resume the data order
# (course_lib/grading/checkpoint_data.py, re-exported by grading.checkpointing)
def data_state(loader):
    """Global batches since the start: one number, whatever the dp size."""
    return {"batches_seen": loader.epoch * loader.steps_per_epoch + loader.step}


def restore(loader, state):
    """Fast-forward a fresh loader (a different route from the solution's epoch + step)."""
    for _ in range(state["batches_seen"]):
        next(loader)


def state_epoch_step(loader):
    return {"epoch": loader.epoch, "step": loader.step}


def restore_epoch_step(loader, state, step_shift=0):
    loader.epoch, loader.step = state["epoch"], state["step"] + step_shift
    loader.order = loader.order_of(loader.epoch)
    loader.position = loader.step * (loader.rows[1] - loader.rows[0])


def restore_restarting_the_epoch(loader, state):
    restore_epoch_step(loader, {"epoch": state["epoch"], "step": 0})


def restore_one_step_on(loader, state):
    restore_epoch_step(loader, state, step_shift=1)   # "step" read as the last batch taken


def restore_old_order(loader, state):
    loader.epoch, loader.step = state["epoch"], state["step"]      # order stays epoch 0's permutation
    loader.position = loader.step * (loader.rows[1] - loader.rows[0])


def state_rank_position(loader):
    return {"epoch": loader.epoch, "position": loader.position}    # this rank's rows: depends on dp


def restore_rank_position(loader, state):
    rows = max(1, loader.rows[1] - loader.rows[0])
    restore_epoch_step(loader, {"epoch": state["epoch"], "step": state["position"] // rows})


def state_samples_seen(loader):
    return {"seen": (loader.epoch * loader.steps_per_epoch + loader.step) * loader.global_batch}


def restore_samples_seen(loader, state):
    epoch, rest = divmod(state["seen"], loader.n_samples)           # forgets the dropped tail of each epoch
    restore_epoch_step(loader, {"epoch": epoch, "step": rest // loader.global_batch})


def state_hard_coded(loader):
    return {"epoch": 0, "step": 2}                                   # the first case's save point


def state_whole_loader(loader):
    return {"loader": loader}


def state_library(loader):
    import tempfile

    import torch

    from course_lib.checkpoint import save
    path = tempfile.mkdtemp() + "/ckpt"
    save(path, torch.nn.Linear(1, 1), data_state=state_epoch_step(loader))
    return {"path": path}


def state_reference(loader):
    from course_lib.grading.checkpoint_data import _counters
    return dict(zip(("epoch", "step"), _counters(loader.n_samples, loader.global_batch, 1, 0, 0)))


def test_resume_data(capsys):
    assert graded(capsys, G.check_resume_data, state_epoch_step, restore_epoch_step)[0]
    assert graded(capsys, G.check_resume_data, data_state, restore)[0]
    fails_with(capsys, G.check_resume_data, state_epoch_step, restore_restarting_the_epoch,
               hint="the epoch restarted")
    fails_with(capsys, G.check_resume_data, state_epoch_step, restore_one_step_on, hint="one batch off")
    fails_with(capsys, G.check_resume_data, state_epoch_step, restore_old_order, hint="order of another epoch")
    fails_with(capsys, G.check_resume_data, state_rank_position, restore_rank_position,
               hint="another dp size")
    fails_with(capsys, G.check_resume_data, state_samples_seen, restore_samples_seen, hint="global batch 7, not 8")
    fails_with(capsys, G.check_resume_data, state_hard_coded, restore_epoch_step, hint="expected")
    fails_with(capsys, G.check_resume_data, state_whole_loader, restore_epoch_step, hint="plain values")
    fails_with(capsys, G.check_resume_data, state_library, restore_epoch_step, hint="write this yourself")
    fails_with(capsys, G.check_resume_data, state_reference, restore_epoch_step, hint="write this yourself")


def owned_box_reference(*args):
    from course_lib.grading.checkpointing import _owned_box
    return _owned_box(*args)


def test_references_switched_off(capsys):
    """The graders' private references are guard targets too (named one by one)."""
    fails_with(capsys, G.check_owned_box, owned_box_reference, hint="write this yourself")


def test_resume_data_refuses_rank_0s_old_position(capsys):
    """Issue 34: copying rank 0's old position onto every new rank (dp 4 -> 3: (0, 3, 9) where
    an uninterrupted loader holds (0, 3, 12)) passed, because every case ran past an epoch
    boundary, where the loader resets position, before the counters were compared."""
    def state_with_position(loader):
        return {"epoch": loader.epoch, "step": loader.step, "position": loader.position}

    def restore_copied_position(loader, state):
        restore_epoch_step(loader, state)
        loader.position = state["position"]

    line = fails_with(capsys, G.check_resume_data, state_with_position, restore_copied_position,
                      hint="right after restore")
    assert "(0, 3, 9) right after restore" in line and "has (0, 3, 12)" in line and "NEW layout" in line, line
