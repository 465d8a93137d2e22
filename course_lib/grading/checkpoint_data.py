"""Chapter 12's fifth grader: resume so that the data order continues exactly.

    loader = ShardedBatches(n_samples=50, global_batch=10, dp=4, dp_rank=r, seed=3)
    rows = next(loader)                          # this rank's sample indices of one global batch
    check_resume_data(data_state, restore)       # data_state(loader) -> dict; restore(loader, state)

A run saves rank 0's ``data_state(loader)`` (course_lib.checkpoint keeps one, in extra.pt),
stops, and resumes on another number of data-parallel ranks: every new rank builds a fresh
loader and calls ``restore(loader, state)``. The global batches that follow (the ranks' rows
in rank order) must be exactly those of the uninterrupted run: no sample repeated, none
skipped, the next epochs in their own order. Checked in one process over seeded cases (mid-
epoch, at an epoch boundary, dp 4 -> 3 with uneven cuts, later epochs, dropped tails).
"""
from __future__ import annotations

import copy
import random

import torch

from course_lib.grading import Case, check, learner

# course_lib.checkpoint keeps data_state for you; the references below answer the exercise
LIBRARY = ("course_lib.checkpoint.plan:*", "course_lib.checkpoint.layout:*", "course_lib.checkpoint.store:*",
           "course_lib.checkpoint.load:*", "course_lib.grading.checkpoint_data:_global_batches",
           "course_lib.grading.checkpoint_data:_counters")

__all__ = ["ShardedBatches", "check_resume_data"]


class ShardedBatches:
    """This rank's rows of each global batch of a dataset of ``n_samples``, epoch after epoch.

    Epoch e visits the samples in the order ``order_of(e)`` (DistributedSampler's rule: a
    permutation seeded with seed + e); global batch s of an epoch is ``order[s B:(s + 1) B]``,
    an incomplete last batch dropped (``steps_per_epoch = n_samples // B``). Rank ``dp_rank``
    keeps rows ``rows = (lo, hi)`` of it, cut over dp like torch.chunk: ceil(B / dp) rows per
    rank, the last ranks fewer or none. State: ``epoch``, ``step`` (global batches taken this
    epoch), ``position`` (samples this rank took this epoch), ``order`` (this epoch's order).
    """

    def __init__(self, n_samples: int, global_batch: int, dp: int, dp_rank: int, seed: int = 0):
        if not 1 <= global_batch <= n_samples:
            raise ValueError(f"need 1 <= global_batch <= n_samples, got {global_batch}, {n_samples}")
        if not 0 <= dp_rank < dp:
            raise ValueError(f"need 0 <= dp_rank < dp, got dp_rank={dp_rank}, dp={dp}")
        self.n_samples, self.global_batch, self.dp, self.dp_rank, self.seed = \
            n_samples, global_batch, dp, dp_rank, seed
        self.steps_per_epoch = n_samples // global_batch
        chunk = -(-global_batch // dp)
        self.rows = (min(global_batch, dp_rank * chunk), min(global_batch, (dp_rank + 1) * chunk))
        self.epoch, self.step, self.position = 0, 0, 0
        self.order = self.order_of(0)

    def order_of(self, epoch: int) -> list[int]:
        """The order in which epoch ``epoch`` visits the samples."""
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.n_samples, generator=gen).tolist()

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        if self.step == self.steps_per_epoch:                  # the epoch is over: the next order
            self.epoch, self.step, self.position = self.epoch + 1, 0, 0
            self.order = self.order_of(self.epoch)
        start = self.step * self.global_batch
        batch = self.order[start:start + self.global_batch][self.rows[0]:self.rows[1]]
        self.step += 1
        self.position += len(batch)
        return batch


# ------------------------------------------------------------------ the grader's reference
def _global_batches(n_samples, global_batch, seed, count):
    """The uninterrupted run's first ``count`` global batches: one loader on dp = 1."""
    loader = ShardedBatches(n_samples, global_batch, 1, 0, seed)
    return [next(loader) for _ in range(count)]


def _counters(n_samples, global_batch, dp, dp_rank, steps):
    """(epoch, step, position) of an uninterrupted loader after ``steps`` global batches."""
    loader = ShardedBatches(n_samples, global_batch, dp, dp_rank)
    for _ in range(steps):
        next(loader)
    return loader.epoch, loader.step, loader.position


def _counters_differ(got, n, b, dp, r, steps, when):
    """None if ``got`` = (epoch, step, position) is an uninterrupted loader's after ``steps``
    global batches, or, at an epoch's end, its rolled-over form (epoch + 1, 0, 0); else a hint."""
    want = _counters(n, b, dp, r, steps)
    rolled = (want[0] + 1, 0, 0) if steps and want[1] == n // b else None
    if got in (want, rolled):
        return None
    hint = ""
    if got[:2] in (want[:2], (rolled or want)[:2]):
        hint = (": the position is this rank's samples taken this epoch on the NEW layout (its own rows "
                "per batch times the step), not the saved rank's")
    return f"rank {r}: (epoch, step, position) = {got} {when}, an uninterrupted loader of the new layout " \
           f"has {want}{hint}"


def _plain(value) -> bool:
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _cases():
    # (n_samples, global_batch, seed, dp before, dp after, saved after k global batches, then m)
    fixed = [(48, 12, 0, 4, 4, 2, 6, "mid-epoch, same dp"),
             (48, 12, 1, 4, 3, 3, 5, "mid-epoch"),
             (50, 10, 2, 4, 3, 2, 8, "uneven cuts 3,3,3,1 -> 4,4,2, into epoch 1"),
             (50, 10, 3, 2, 3, 5, 3, "at the end of epoch 0"),
             (45, 8, 4, 3, 3, 8, 5, "in epoch 1, 5 samples dropped per epoch, same dp"),
             (45, 8, 7, 3, 2, 9, 5, "in epoch 1, 5 samples dropped per epoch"),
             (36, 12, 5, 1, 4, 13, 4, "in epoch 4"),
             (30, 7, 6, 3, 1, 0, 5, "before the first step"),
             (48, 12, 8, 4, 3, 1, 2, "inside epoch 0 throughout")]
    rng = random.Random(27)
    for i in range(4):
        n = rng.randint(20, 60)
        b = rng.randint(3, min(13, n))
        per_epoch = n // b
        fixed.append((n, b, 100 + i, rng.randint(1, 5), rng.randint(1, 5), rng.randint(1, 3 * per_epoch),
                      per_epoch + 1, "random"))
    return [Case(dict(args=a[:7]), label=f"{a[7]}; {a[0]} samples, global batch {a[1]}, dp {a[3]} -> {a[4]}, "
                                         f"saved after {a[5]} batches") for a in fixed]


def _hint(got, k, reference, per_epoch, same_dp):
    """Why the first resumed global batch differs: where it comes from in the uninterrupted run."""
    if got in reference:
        j = reference.index(got)
        where = f"the run resumed at global batch {j}, not {k}"
        if j % per_epoch == k % per_epoch:
            return where + f" (the right step of epoch {j // per_epoch}: the order of another epoch)"
        if not same_dp and j % per_epoch != 0:
            return where + " (a count of this rank's rows is another number of batches on another dp size: " \
                           "count global batches)"
        if abs(j - k) == 1:
            return where + " (one batch off)"
        return where + (" (the epoch restarted)" if j % per_epoch == 0 else "")
    if len(got) != len(reference[k]):
        return f"the ranks' rows make {len(got)} samples, a global batch has {len(reference[k])} (a per-rank " \
               f"position reused with another dp size?)"
    taken = set(sum(reference[k - k % per_epoch:k], []))
    if len(set(got)) < len(got) or set(got) & taken:
        return "samples repeated that this epoch already took (a per-rank position reused with another dp size?)"
    return "not a batch of the uninterrupted order (the permutation of another epoch?)"


def check_resume_data(data_state, restore):
    """data_state(loader) -> a dict of plain values saved with the checkpoint (rank 0's);
    restore(loader, state): position a fresh ShardedBatches of the NEW layout, in place, so
    that the global batches continue exactly as in the uninterrupted run."""
    save_fn = learner(data_state, LIBRARY, exercise="resuming the data order", seconds=10)
    restore_fn = learner(restore, LIBRARY, exercise="resuming the data order", seconds=10)

    def run(case):
        n, b, seed, dp_old, dp_new, k, m = case.params["args"]
        per_epoch = n // b
        reference = _global_batches(n, b, seed, k + m + 2 * per_epoch)     # more: to say where a batch is from
        old = [ShardedBatches(n, b, dp_old, r, seed) for r in range(dp_old)]
        for _ in range(k):
            for loader in old:
                next(loader)
        state = save_fn(old[0])
        if not isinstance(state, dict) or not _plain(state):
            what = "a dict holding other objects" if isinstance(state, dict) else f"a {type(state).__name__}"
            return f"data_state must return a dict of plain values (ints, lists), got {what}: it is pickled " \
                   f"into the checkpoint, without the loader"
        new = [ShardedBatches(n, b, dp_new, r, seed) for r in range(dp_new)]
        for r, loader in enumerate(new):
            other = restore_fn(loader, copy.deepcopy(state))
            new[r] = other if isinstance(other, ShardedBatches) else loader      # in place, or a new one
        # the counters right after restore, compared after the batches (whose hints say more):
        # later, an epoch's rollover resets position and hides a wrong one
        restored = [(loader.epoch, loader.step, loader.position) for loader in new]
        for i in range(m):
            got = sum((next(loader) for loader in new), [])
            if got != reference[k + i]:
                hint = _hint(got, k, reference, per_epoch, dp_old == dp_new) if i == 0 else \
                    "the first batches were right, a later one differs (the next epoch's order?)"
                return f"resumed global batch {k + i} starts {got[:3]}, expected {reference[k + i][:3]}: {hint}"
        after = [(loader.epoch, loader.step, loader.position) for loader in new]
        return next(filter(None, [_counters_differ(c, n, b, dp_new, r, steps, when) for counters, steps, when in (
            (restored, k, "right after restore"), (after, k + m, f"after {m} resumed batches"))
            for r, c in enumerate(counters)]), None)

    return check("resume_data", _cases(), run)
