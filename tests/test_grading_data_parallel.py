"""course_lib/grading/data_parallel.py (chapter 3): each grader fails the classic mistakes of
data parallelism, an answer hard-coded to the lecture's case and a library shortcut, each
with a hint naming the mistake and within seconds, and passes a different right answer."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib.grading import data_parallel as G
from grading_answers import passed, refused


# ----------------------------------------------------------------------------- the DDP hook
def _hook_sum(param, world, handles):                  # all-reduce without dividing: N x the mean
    handles.append(dist.all_reduce(param.grad, async_op=True))


def _hook_blocking(param, world, handles):             # synchronous: no handle to wait for
    dist.all_reduce(param.grad)
    param.grad /= world


def _hook_two_ranks(param, world, handles):            # hard-coded to the lecture's 2 ranks
    param.grad /= 2
    handles.append(dist.all_reduce(param.grad, async_op=True))


def _hook_library(param, world, handles):              # course_lib's DDP does the work
    from course_lib.parallel.data_parallel import average_gradients

    average_gradients(torch.nn.Linear(1, 1), None)


@pytest.mark.parametrize("wrong, hints", [
    (_hook_sum, ["case 1/", "parameters after training"]),
    (_hook_blocking, ["one async all-reduce handle per parameter"]),
    (_hook_two_ranks, ["case 2/", "world_size=3", "parameters after training"]),
    (_hook_library, ["write this yourself: the exercise is the DDP hook"]),
], ids=["sum", "blocking", "two-ranks", "library"])
def test_ddp_hook_refuses(wrong, hints, capsys):
    refused(capsys, "ddp_hook", G.check_ddp_hook(wrong), *hints)


def test_ddp_hook_accepts_dividing_after(capsys):
    def divide_after(param, world, handles):
        work = dist.all_reduce(param.grad, async_op=True)

        class Then:
            def wait(self):
                work.wait()
                param.grad /= world
        handles.append(Then())
    passed(capsys, G.check_ddp_hook(divide_after), "ddp_hook: 3/3 cases passed")


# ----------------------------------------------------------------------------- buckets
def _greedy(indices, nbytes, cap):                      # fill a bucket up to cap, in the order given
    out, cur, size = [], [], 0
    for i in indices:
        if cur and size + nbytes(i) > cap:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes(i)
    return out + ([cur] if cur else [])


def _buckets_forward(params, cap):                     # first to last: the last bucket is ready first
    return _greedy(range(len(params)), lambda i: params[i].numel() * params[i].element_size(), cap)


def _buckets_numel_times_4(params, cap):               # every element 4 bytes, one dtype
    return _greedy(reversed(range(len(params))), lambda i: params[i].numel() * 4, cap)


def _buckets_library(params, cap):
    from course_lib.parallel.grad_sync import assign_buckets

    return assign_buckets(params, cap)


@pytest.mark.parametrize("wrong, hints", [
    (_buckets_forward, ["case 1/", "walk from the last parameter to the first"]),
    (_buckets_numel_times_4, ["float64 at [1, 3]"]),
    (_buckets_library, ["write this yourself: the exercise is bucketing"]),
], ids=["forward-order", "one-dtype", "library"])
def test_assign_buckets_refuses(wrong, hints, capsys):
    refused(capsys, "assign_buckets", G.check_assign_buckets(wrong), *hints)


def test_assign_buckets_accepts_a_per_dtype_walk(capsys):
    def per_dtype(params, cap):
        order, open_, closed = [], {}, []
        for i in range(len(params) - 1, -1, -1):
            p = params[i]
            ids, size = open_.get(p.dtype, ([], 0))
            n = p.numel() * p.element_size()
            if ids and size + n > cap:
                closed.append(ids)
                ids, size = [], 0
            if p.dtype not in open_ or not open_[p.dtype][0] or ids is not open_[p.dtype][0]:
                if p.dtype in open_ and open_[p.dtype][0] and ids is not open_[p.dtype][0]:
                    order.remove(p.dtype)
                if p.dtype not in order:
                    order.append(p.dtype)
            open_[p.dtype] = (ids + [i], size + n)
        return closed + [open_[d][0] for d in order]
    passed(capsys, G.check_assign_buckets(per_dtype), "assign_buckets: 6/6 cases passed")


# ----------------------------------------------------------------------------- bucketed hooks
def _hooks_in_finish(params, buckets, world):          # every all-reduce after backward: no overlap
    def finish():
        for b in buckets:
            flat = torch.cat([params[i].grad.reshape(-1) for i in b]) / world
            dist.all_reduce(flat)
            offset = 0
            for i in b:
                params[i].grad.copy_(flat[offset:offset + params[i].numel()].view_as(params[i]))
                offset += params[i].numel()
    return finish


def _hooks_per_param(params, buckets, world):          # one all-reduce per parameter, not per bucket
    works = []

    def hook(p):
        p.grad /= world
        works.append(dist.all_reduce(p.grad, async_op=True))
    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for w in works:
            w.wait()
        works.clear()
    return finish


def _hooks_one_bucket(params, buckets, world):         # hard-coded to one bucket: everything at the end
    works = []

    def hook(p):
        if p is params[0]:                                  # the last gradient of backward
            flat = torch.cat([q.grad.reshape(-1) for q in params]) / world
            works.append((dist.all_reduce(flat, async_op=True), flat))
    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for work, flat in works:
            work.wait()
            for q, g in zip(params, flat.split([q.numel() for q in params])):
                q.grad.copy_(g.view_as(q))
        works.clear()
    return finish


def _hooks_library(params, buckets, world):
    from course_lib.parallel.grad_sync import OverlappedGradSync

    OverlappedGradSync(params, None)
    return lambda: None


@pytest.mark.parametrize("wrong, hints", [
    (_hooks_in_finish, ["no bucket's all-reduce had started"]),
    (_hooks_per_param, ["all-reduces for", "one flat all-reduce per bucket"]),
    (_hooks_library, ["write this yourself"]),
    (_hooks_one_bucket, ["case 1/", "1 all-reduces for"]),
], ids=["in-finish", "per-parameter", "library", "one-bucket"])
def test_bucket_hooks_refuses(wrong, hints, capsys):
    refused(capsys, "bucket_hooks", G.check_bucket_hooks(wrong), *hints)


def test_bucket_hooks_accepts_counters_and_views(capsys):
    def counters(params, buckets, world):
        left = [len(b) for b in buckets]
        where = {i: k for k, b in enumerate(buckets) for i in b}
        flights = []

        def ready(i):
            k = where[i]
            left[k] -= 1
            if left[k] == 0:                    # this bucket's last gradient: launch it now
                flat = torch.cat([params[j].grad.reshape(-1) for j in buckets[k]])
                flights.append((k, flat, dist.all_reduce(flat, async_op=True)))

        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: ready(i))

        def finish():
            for k, flat, work in flights:
                work.wait()
                for j, piece in zip(buckets[k], flat.split([params[j].numel() for j in buckets[k]])):
                    params[j].grad = piece.view_as(params[j]) / world
            flights.clear()
            left[:] = [len(b) for b in buckets]
        return finish
    passed(capsys, G.check_bucket_hooks(counters), "bucket_hooks: 6/6 cases passed")


# ----------------------------------------------------------------------------- uneven last batch
def _uneven_divide_by_world(model, n_local):           # the chapter's averaging
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def _uneven_skip_empty(model, n_local):                # weighted, but a rank without rows sits out
    total = torch.tensor([float(n_local)])
    dist.all_reduce(total)
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= n_local
            dist.all_reduce(p.grad)
            p.grad /= total.item()


def _uneven_gather(model, n_local):                    # all-gather every rank's gradients
    world = dist.get_world_size()
    counts = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([float(n_local)]))
    for p in model.parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(out, g)
        p.grad = sum(c * o for c, o in zip(counts, out)) / sum(counts)


def _uneven_ddp(model, n_local):
    torch.nn.parallel.DistributedDataParallel(model)


@pytest.mark.parametrize("wrong, hints", [
    (_uneven_divide_by_world, ["case 2/", "7 rows on 2 ranks"]),
    (_uneven_skip_empty, ["case 4/", "(1, 1, 0)", "hang"]),
    (_uneven_gather, ["only all-reduces are needed"]),
    (_uneven_ddp, ["write this yourself", "DistributedDataParallel"]),
], ids=["divide-by-world", "empty-rank-sits-out", "all-gather", "torch-ddp"])
def test_uneven_batches_refuses(wrong, hints, capsys):
    # the answer that would hang (case 4) is caught before the collective a rank skips, not by the
    # timeout (grading.p2p.SameCollectives)
    refused(capsys, "uneven_batches", G.check_uneven_batches(wrong), *hints)


def test_uneven_batches_accepts_one_flat_buffer(capsys):
    def flat(model, n_local):
        params = list(model.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        buf = torch.cat([g.reshape(-1).double() * n_local for g in grads] + [torch.tensor([float(n_local)]).double()])
        dist.all_reduce(buf)
        total, offset = buf[-1], 0
        for p in params:
            p.grad = (buf[offset:offset + p.numel()] / total).to(p.dtype).view_as(p)
            offset += p.numel()
    passed(capsys, G.check_uneven_batches(flat), "uneven_batches: 6/6 cases passed")


def test_ddp_hook_refuses_waiting_inside_the_hook(capsys):
    """Issue 34: a hook that waits for its own all-reduce (no overlap at all) scored 3/3: the
    grader counted handles and compared the trained parameters, never the overlap."""
    def wait_inside(param, world, handles):
        param.grad /= world
        work = dist.all_reduce(param.grad, async_op=True)
        work.wait()
        handles.append(work)
    refused(capsys, "ddp_hook", G.check_ddp_hook(wait_inside), "no overlap", "waited inside the hook")

    def blocking_with_a_handle(param, world, handles):
        param.grad /= world
        dist.all_reduce(param.grad)

        class Done:
            def wait(self):
                return True
        handles.append(Done())
    refused(capsys, "ddp_hook", G.check_ddp_hook(blocking_with_a_handle), "no overlap", "synchronous")


def test_ddp_hook_accepts_a_bounded_number_in_flight(capsys):
    """A right answer written differently: the hook waits for the handle before the previous
    one (at most two in flight), so some all-reduces still overlap the backward."""
    def two_in_flight(param, world, handles):
        param.grad /= world
        handles.append(dist.all_reduce(param.grad, async_op=True))
        if len(handles) > 2:
            handles[-3].wait()
    passed(capsys, G.check_ddp_hook(two_in_flight), "ddp_hook: 3/3 cases passed")
