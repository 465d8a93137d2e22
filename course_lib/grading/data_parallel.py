"""Graders of chapter 3 (data parallelism), trained on real ranks and compared with
single-device training on the full batch (the harness: :mod:`course_lib.grading.training`).

    check_ddp_hook(hook)                   # hook(param, world_size, handles): async all-reduce
    check_assign_buckets(assign_buckets)   # (params, cap_bytes) -> [[indexes]], reverse order
    check_bucket_hooks(make_bucket_hooks)  # one async all-reduce per bucket, launched from hooks
    check_uneven_batches(sync_gradients)   # find the bug: a last batch the ranks split unevenly

While the learner's code runs, course_lib's data parallelism and torch's DDP are switched off.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

from course_lib.grading import Case, Mismatch, check_distributed, compare, learner
from course_lib.grading import training as T
from course_lib.grading.guard import COURSE_DATA_PARALLEL, TORCH_DATA_PARALLEL
from course_lib.grading.harness import check_answers, on_ranks
from course_lib.grading.p2p import SameCollectives

# what would do chapter 3's exercises for the learner
DP_LIBRARY = (COURSE_DATA_PARALLEL, "course_lib.grading.training:single_device", TORCH_DATA_PARALLEL)


# ----------------------------------------------------------------------------- 1. DDP hook
def _ddp_hook_harness(hook):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = T.mlp(rank)  # different on every rank: broadcast rank 0's first
    for p in model.parameters():
        dist.broadcast(p.detach(), 0)
    handles = []
    hook = learner(hook, DP_LIBRARY, exercise="the DDP hook")
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: hook(p, world, handles))
    for batch in T.data():
        x, y = T.local(batch, rank, world)
        with _Completions() as seen:
            F.mse_loss(model(x), y).backward()
            pending = seen.pending()                  # all-reduces still in flight when backward ended
            if len(handles) != len(list(model.parameters())):
                return f"expected one async all-reduce handle per parameter in `handles`, got {len(handles)}"
            if seen.issued and not pending:
                return (f"every all-reduce had finished when backward ended ({seen.issued} issued, "
                        f"{seen.sync} synchronous, {seen.waited} waited inside the hook): no overlap. Start it "
                        f"with async_op=True, append the handle and return: the caller waits after backward")
            for h in handles:
                h.wait()
        handles.clear()
        T.sgd(model.parameters())
        model.zero_grad()
    return T.compare_params(list(model.parameters()), T.single_device(T.sgd))


class _Completions:
    """Inside a rank: each ``dist.all_reduce`` call's completion as the caller sees it, a
    synchronous call at once, an async one when its handle's wait() first returns (the learner
    gets a thin proxy of the handle). ``pending()``: issued and not yet waited."""

    def __init__(self):
        self.issued = self.sync = self.waited = 0

    def pending(self) -> int:
        return self.issued - self.sync - self.waited

    def __enter__(self):
        self._saved = original = dist.all_reduce

        def all_reduce(*args, **kwargs):
            work = original(*args, **kwargs)
            self.issued, self.sync = self.issued + 1, self.sync + (work is None)
            return None if work is None else _Waited(work, self)
        for module in (dist, c10d):
            module.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        for module in (dist, c10d):
            module.all_reduce = self._saved
        return False


class _Waited:
    """An async all-reduce's handle that counts its first wait() in ``seen.waited``."""

    def __init__(self, work, seen):
        self._work, self._seen, self._done = work, seen, False

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        self._seen.waited += not self._done
        self._done = True
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def check_ddp_hook(hook):
    """hook(param, world_size, handles) runs when param.grad is complete: it must start an
    async all-reduce that leaves the *mean* in param.grad, and append the work handle."""
    return on_ranks("ddp_hook", _ddp_hook_harness, (2, 3, 1), f"MLP {T.SIZES}, {T.STEPS} SGD steps", hook=hook)


# ----------------------------------------------------------------------------- 2. buckets
def check_assign_buckets(assign_buckets):
    """Compare with course_lib's bucketing on a few parameter lists and caps."""
    from course_lib.parallel.grad_sync import assign_buckets as course_buckets

    lists = {  # name: (numel of each parameter, cap in bytes, indexes of the float64 ones)
        "5 params, cap 130 B": ([10, 20, 30, 5, 5], 130, ()),
        "cap 0: one bucket each": ([3, 4, 5], 0, ()),
        "everything fits": ([3, 4, 5], 10**6, ()),
        "one param larger than the cap": ([100, 2, 2], 40, ()),
        "MLP(16, 64, 8), 1 KiB": ([16 * 64, 64, 64 * 8, 8], 1024, ()),
        "float32 and float64 mixed": ([4, 4, 4, 4, 8], 48, (1, 3)),
    }

    def params(sizes, cap, doubles):
        dtypes = [torch.float64 if i in doubles else torch.float32 for i in range(len(sizes))]
        return [torch.zeros(n, dtype=dt) for n, dt in zip(sizes, dtypes)], cap

    def read(got, *args):
        if not isinstance(got, list) or any(not isinstance(b, list) for b in got):
            raise Mismatch(f"expected a list of lists of parameter indexes, got {got!r}")
        return got

    def differ(got, want, sizes, cap, doubles):
        if got != want:
            kinds = f"float64 at {list(doubles)}, float32 elsewhere" if doubles else "4-byte floats"
            why = (": walk from the last parameter to the first (backward completes the last layer's "
                   "gradients first)" if got and got[0] and got[0][0] == 0 and len(sizes) > 1 else "")
            return f"sizes {sizes} ({kinds}), cap {cap} bytes: got {got}, expected {want}{why}"
    return check_answers("assign_buckets", assign_buckets, [Case(dict(args=v), label=k) for k, v in lists.items()],
                         lambda *a: course_buckets(*params(*a)), guard=DP_LIBRARY, exercise="bucketing",
                         given=params, read=read, differ=differ)


# ----------------------------------------------------------------------------- 2b. overlapped buckets
BUCKET_CAPS = {"one bucket per parameter": 0, "two buckets": 240, "one bucket": 10**6}   # (ZeRO-2's too)


def _bucket_hooks_harness(make_hooks, cap):
    """Train with the learner's hooks; per step check: one all-reduce per bucket, the first
    buckets launched before backward produced its last gradient (overlap), the result."""
    steps = T.hooked_steps(make_hooks, cap, "make_bucket_hooks", DP_LIBRARY, "bucketed, overlapped all-reduces")
    first = next(steps)
    if isinstance(first, str):
        return first
    params, buckets = first
    for step, _, calls, overlapped in steps:
        reduces = [c for c in calls if c[0] == "all_reduce"]
        if len(reduces) != len(buckets):
            return (f"step {step}: {len(reduces)} all-reduces for {len(buckets)} buckets: one flat "
                    f"all-reduce per bucket")
        if not overlapped:
            return T.not_overlapped(step, "all-reduce")
        T.sgd(params)
    return T.compare_params(params, T.single_device(T.sgd))


def check_bucket_hooks(make_bucket_hooks):
    """make_bucket_hooks(params, buckets, world_size) registers gradient hooks and returns
    finish(); each bucket is one async all-reduce, launched when its last gradient is ready,
    and after finish() every p.grad holds the mean over ranks."""
    cases = [Case({"make_hooks": make_bucket_hooks, "cap": cap}, world_size=n, label=name)
             for name, cap in BUCKET_CAPS.items() for n in (2, 3)]
    return check_distributed("bucket_hooks", _bucket_hooks_harness, cases)


# ----------------------------------------------------------------------------- 4. find the bug: uneven batches
# (global rows, world size, dtype): the last batch of an epoch rarely divides by the world size
_UNEVEN_CASES = [(12, 2, "float32"), (7, 2, "float32"), (7, 3, "float64"), (2, 3, "float32"), (5, 1, "float32"),
                 (11, 4, "float64")]


def _uneven_harness(sync_gradients, rows, dtype):
    """Rank r computes the mean loss over its rows (torch.tensor_split: sizes differ by one, a
    rank may have none, and then its grads are None); after sync_gradients(model, n_local)
    every p.grad must be the gradient of the mean loss over all rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dt = getattr(torch, dtype)
    x, y = (t[:rows].to(dt) for t in T.data()[0])
    ref, model = T.mlp(0).to(dt), T.mlp(0).to(dt)
    F.mse_loss(ref(x), y).backward()
    mine_x, mine_y = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
    if len(mine_x):
        F.mse_loss(model(mine_x), mine_y).backward()
    with SameCollectives(), T.CollectiveWatch() as watch:
        learner(sync_gradients, DP_LIBRARY, exercise="gradient averaging")(model, len(mine_x))
    moved = [k for k, _ in watch.calls if k != "all_reduce"]
    if moved:
        return f"only all-reduces are needed here (saw {sorted(set(moved))}): sum what each rank has, then divide"
    n_params = len(list(model.parameters()))
    if len(watch.calls) > n_params + 2:
        return (f"{len(watch.calls)} all-reduces for {n_params} parameters: one per parameter (or one flat "
                f"buffer) and one for the row count")
    largest = max(float(q.grad.abs().max()) for q in ref.parameters())   # one scale for all grads
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.grad is None:
            return f"{name}.grad is None on rank {rank} ({len(mine_x)} rows here): one device has a gradient"
        # one step's gradients: the one-step bound of course_lib.tolerance in this dtype
        msg = compare(p.grad, q.grad, dtype=dt, scale=largest,
                      what=f"{name}.grad ({len(mine_x)} of {rows} rows on this rank)")
        if msg:
            return msg
    return None


def check_uneven_batches(sync_gradients, timeout: float = 15.0) -> bool:
    """sync_gradients(model, n_local) on every rank, after backward of the mean loss over this
    rank's n_local rows (0 rows: no backward, grads None): afterwards each p.grad is the
    gradient of the mean over ALL rows, as on one device."""
    cases = [Case({"sync_gradients": sync_gradients, "rows": r, "dtype": dt}, w,
                  f"{r} rows on {w} ranks ({', '.join(str(len(c)) for c in torch.arange(r).tensor_split(w))}), {dt}")
             for r, w, dt in _UNEVEN_CASES]
    return check_distributed("uneven_batches", _uneven_harness, cases, timeout=timeout)


__all__ = ["check_ddp_hook", "check_assign_buckets", "check_bucket_hooks", "check_uneven_batches"]
