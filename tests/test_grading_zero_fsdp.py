"""course_lib/grading/zero_fsdp.py (chapter 4): each grader fails the classic mistakes of
ZeRO and FSDP, an answer hard-coded to the lecture's case and a library shortcut, each with
a hint naming the mistake and within seconds, and passes a different right answer."""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import compat
from course_lib.grading import zero_fsdp as G
from grading_answers import passed, refused


# ----------------------------------------------------------------------------- ZeRO-1
def _zero1_all_reduce(flat, flat_grad, shard, opt):     # all-reduce the whole gradient, keep a slice
    r, N = dist.get_rank(), dist.get_world_size()
    dist.all_reduce(flat_grad)
    shard.grad = flat_grad[r * shard.numel():(r + 1) * shard.numel()] / N
    opt.step()
    compat.all_gather_into_tensor(flat, shard.detach())


def _zero1_broadcasts(flat, flat_grad, shard, opt):     # slices travel by broadcast
    r, N = dist.get_rank(), dist.get_world_size()
    grad = torch.empty_like(shard)
    compat.reduce_scatter_tensor(grad, flat_grad)
    shard.grad = grad / N
    opt.step()
    for q in range(N):
        piece = flat[q * shard.numel():(q + 1) * shard.numel()]
        if q == r:
            piece.copy_(shard.detach())
        dist.broadcast(piece, q)


def _zero1_sum(flat, flat_grad, shard, opt):            # the sum, not the mean
    grad = torch.empty_like(shard)
    compat.reduce_scatter_tensor(grad, flat_grad)
    shard.grad = grad
    opt.step()
    compat.all_gather_into_tensor(flat, shard.detach())


def _zero1_two_ranks(flat, flat_grad, shard, opt):     # hard-coded to 2 ranks
    grad = torch.empty_like(shard)
    compat.reduce_scatter_tensor(grad, flat_grad)
    shard.grad = grad / 2
    opt.step()
    compat.all_gather_into_tensor(flat, shard.detach())


def _zero1_gather_first(flat, flat_grad, shard, opt):  # gathers the slices before the step: one step stale
    grad = torch.empty_like(shard)
    compat.reduce_scatter_tensor(grad, flat_grad)
    shard.grad = grad / dist.get_world_size()
    compat.all_gather_into_tensor(flat, shard.detach())
    opt.step()


def _zero1_sum_cleared(flat, flat_grad, shard, opt):    # the sum, and shard.grad cleared after the step
    _zero1_sum(flat, flat_grad, shard, opt)
    opt.zero_grad()


def _zero1_two_steps(flat, flat_grad, shard, opt):      # steps twice (AdamW's bound in fp32 is ~lr a step)
    _zero1_two_ranks(flat, flat_grad, shard, opt)
    opt.step()
    compat.all_gather_into_tensor(flat, shard.detach())


def _zero1_library(flat, flat_grad, shard, opt):
    from course_lib.parallel.zero import ShardedOptimizer

    ShardedOptimizer([shard], torch.optim.AdamW, lr=1e-2)


@pytest.mark.parametrize("wrong, hints", [
    (_zero1_all_reduce, ["the gradients are all-reduced", "a reduce-scatter"]),
    (_zero1_broadcasts, ["broadcasts", "one all-gather"]),
    (_zero1_sum, ["case 1/", "shard.grad (the mean over ranks"]),
    (_zero1_library, ["write this yourself: the exercise is the ZeRO-1 step"]),
    (_zero1_two_ranks, ["case 2/", "world_size=3"]),
    (_zero1_gather_first, ["case 1/", "flat after the step"]),
    (_zero1_sum_cleared, ["case 1/", "shard.grad (the mean over ranks"]),
    (_zero1_two_steps, ["case 1/", "called 2 times"]),
], ids=["all-reduce", "broadcasts", "sum", "library", "two-ranks", "gather-first", "sum-cleared", "two-steps"])
def test_zero1_step_refuses(wrong, hints, capsys):
    refused(capsys, "zero1_step", G.check_zero1_step(wrong), *hints)


def test_zero1_step_accepts_async_collectives(capsys):
    def async_step(flat, flat_grad, shard, opt):
        grad = torch.empty_like(shard)
        compat.reduce_scatter_tensor(grad, flat_grad.div(dist.get_world_size()), async_op=True).wait()
        shard.grad = grad
        opt.step()
        work = compat.all_gather_into_tensor(flat, shard.detach().clone(), async_op=True)
        if work is not None:
            work.wait()
    passed(capsys, G.check_zero1_step(async_step), "zero1_step: 3/3 cases passed")


# ----------------------------------------------------------------------------- ZeRO-2 hooks
def _zero2(reduce_in_hook=True, keep_grads=False, use_all_reduce=False, divisor=None):
    def make(params, buckets, world):
        where = {i: b for b, ids in enumerate(buckets) for i in ids}
        left, flights = [len(ids) for ids in buckets], []

        def launch(b):
            ids = buckets[b]
            flat = torch.cat([params[j].grad.reshape(-1) for j in ids])
            size = math.ceil(flat.numel() / world)
            flat = F.pad(flat, (0, size * world - flat.numel()))
            shard = flat.new_empty(size)
            if use_all_reduce:
                dist.all_reduce(flat)
                shard.copy_(flat[dist.get_rank() * size:(dist.get_rank() + 1) * size])
                work = None
            else:
                work = compat.reduce_scatter_tensor(shard, flat, async_op=True)
            flights.append((b, shard, work))
            if not keep_grads:
                for j in ids:
                    params[j].grad = None

        def ready(i):
            left[where[i]] -= 1
            if left[where[i]] == 0 and reduce_in_hook:
                launch(where[i])

        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: ready(i))

        def finish():
            if not reduce_in_hook:
                for b in range(len(buckets)):
                    launch(b)
            shards = [None] * len(buckets)
            for b, shard, work in flights:
                if work is not None:
                    work.wait()
                shards[b] = shard / (divisor or world)
            flights.clear()
            left[:] = [len(ids) for ids in buckets]
            return shards
        return finish
    return make


def _zero2_library(params, buckets, world):
    from course_lib.parallel.zero import ShardedOptimizer

    ShardedOptimizer(params, torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("wrong, hints", [
    (_zero2(use_all_reduce=True), ["an all-reduce", "one reduce-scatter per bucket"]),
    (_zero2(keep_grads=True), ["still hold their full-size gradient"]),
    (_zero2(reduce_in_hook=False), ["no bucket's reduce-scatter had started"]),
    (_zero2_library, ["write this yourself"]),
    (_zero2(divisor=2), ["case 2/", "world_size=3"]),
], ids=["all-reduce", "keeps-grads", "in-finish", "library", "two-ranks"])
def test_zero2_hooks_refuses(wrong, hints, capsys):
    refused(capsys, "zero2_hooks", G.check_zero2_hooks(wrong), *hints)


def test_zero2_hooks_accepts_a_different_right_answer(capsys):
    passed(capsys, G.check_zero2_hooks(_zero2()), "zero2_hooks: 6/6 cases passed")


# ----------------------------------------------------------------------------- clipping (find the bug)
def _clip_local_norm(shard, max_norm):                 # each rank clips by its own slice's norm
    return shard.mul_(min(1.0, max_norm / (shard.norm().item() + 1e-6)))


def _clip_sum_of_norms(shard, max_norm):               # all-reduces norms, not squares
    n = shard.double().norm().reshape(1)
    dist.all_reduce(n)
    return shard.mul_(min(1.0, max_norm / (n.item() + 1e-6)))


def _clip_early_return(shard, max_norm):               # a rank without elements skips the collective
    if shard.numel() == 0:
        return shard
    sq = (shard.double() ** 2).sum()
    dist.all_reduce(sq)
    return shard.mul_(min(1.0, max_norm / (sq.sqrt().item() + 1e-6)))


def _clip_torch(shard, max_norm):
    torch.nn.utils.clip_grad_norm_([shard], max_norm)
    return shard


@pytest.mark.parametrize("wrong, hints", [
    (_clip_local_norm, ["case 1/", "global norm"]),
    (_clip_sum_of_norms, ["case 1/", "global norm"]),
    (_clip_early_return, ["one rank owns none", "hang"]),
    (_clip_torch, ["write this yourself", "clip_grad_norm_"]),
], ids=["local-norm", "sum-of-norms", "early-return", "torch-clip"])
def test_clip_sharded_refuses(wrong, hints, capsys):
    # the answer that would hang is caught before the collective a rank skips, not by the timeout
    # (grading.p2p.SameCollectives)
    refused(capsys, "clip_sharded", G.check_clip_sharded(wrong), *hints)


def test_clip_sharded_accepts_a_float32_sum_of_squares(capsys):
    def fp32(shard, max_norm):
        sq = shard.pow(2).sum().reshape(1)
        dist.all_reduce(sq)
        return shard * min(1.0, max_norm / (math.sqrt(sq.item()) + 1e-6))
    passed(capsys, G.check_clip_sharded(fp32), "clip_sharded: 5/5 cases passed")


# ----------------------------------------------------------------------------- bytes per step
def _bytes_paper(n, root, stage, world, impl):         # the ZeRO paper: 2 Psi, ZeRO-3 3 Psi, in fp16
    return (3 if stage == 3 else 2) * 2 * n


def _bytes_no_root(n, root, stage, world, impl):       # ZeRO-3 gathers every unit twice
    part = (world - 1) / world
    scatter = 4 * n * part * (2 if impl == "gloo" else 1)
    if stage == 0:
        return 8 * n * part
    return scatter + 4 * n * part * (2 if stage == 3 else 1)


def _bytes_ring_only(n, root, stage, world, impl):     # gloo's reduce-scatter assumed a ring
    part = (world - 1) / world
    if stage == 0:
        return 8 * n * part
    gather = 4 * n * part * ((2 * n - root) / n if stage == 3 else 1)
    return 4 * n * part + gather


def _bytes_table(n, root, stage, world, impl):     # looks the measured table up: no counting at all
    from course_lib.lab.zero_measurements import MEASURED_SENT

    return MEASURED_SENT[impl, stage, world]


def _bytes_library(n, root, stage, world, impl):
    from course_lib.planner.formulas import zero_memory_bytes

    return zero_memory_bytes(n, stage, world)["total"]


@pytest.mark.parametrize("wrong, hints", [
    (_bytes_paper, ["case 2/", "DDP"]),
    (_bytes_no_root, ["ZeRO-3", "root unit"]),
    (_bytes_ring_only, ["ZeRO-1, 2 ranks, gloo"]),
    (_bytes_library, ["write this yourself", "formulas"]),
    (_bytes_table, ["case 17/", "P = 10,000,000"]),
], ids=["paper", "no-root", "ring-only", "library", "table-lookup"])
def test_bytes_per_step_refuses(wrong, hints, capsys):
    refused(capsys, "bytes_per_step", G.check_bytes_per_step(wrong), *hints)


def test_bytes_per_step_accepts_counting_collectives(capsys):
    def by_collective(n, root, stage, world, impl):
        ring = lambda nbytes: nbytes * (world - 1) / world    # noqa: E731 - one collective's share
        all_reduce, all_gather = 2 * ring(4 * n), ring(4 * n)
        reduce_scatter = all_reduce if impl == "gloo" else ring(4 * n)
        if stage == 0:
            return all_reduce
        if stage in (1, 2):
            return reduce_scatter + all_gather
        return reduce_scatter + all_gather + ring(4 * (n - root))   # non-root units gathered again for backward
    passed(capsys, G.check_bytes_per_step(by_collective), "bytes_per_step: 20/20 cases passed")


# ----------------------------------------------------------------------------- the FSDP unit
def _unit(backward):
    class Unit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, shard):
            full = shard.new_empty(shard.numel() * dist.get_world_size())
            compat.all_gather_into_tensor(full, shard.detach())
            return full

    Unit.backward = staticmethod(backward)
    return Unit


def _bwd_all_reduce(ctx, g):                           # all-reduce the full gradient, keep a slice
    N, r = dist.get_world_size(), dist.get_rank()
    g = g.contiguous()
    dist.all_reduce(g)
    return g.view(N, -1)[r] / N


def _bwd_sum(ctx, g):                                  # the sum over ranks, not the mean
    out = g.new_empty(g.numel() // dist.get_world_size())
    compat.reduce_scatter_tensor(out, g.contiguous())
    return out


def _bwd_local(ctx, g):                                # the hard-coded one-rank case: no reduction
    return g.view(dist.get_world_size(), -1)[dist.get_rank()].clone()


class _UnitLibrary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard):
        from course_lib.parallel.fsdp import _UnshardFn
        return _UnshardFn.forward(ctx, shard)

    @staticmethod
    def backward(ctx, g):
        return g


@pytest.mark.parametrize("wrong, hints", [
    (_unit(_bwd_all_reduce), ["backward should reduce-scatter"]),
    (_unit(_bwd_sum), ["case 1/", "parameters after training"]),
    (_unit(_bwd_local), ["backward should reduce-scatter"]),
    (_UnitLibrary, ["write this yourself: the exercise is the FSDP unit's gather"]),
], ids=["all-reduce", "sum", "no-reduction", "library"])
def test_fsdp_unit_refuses(wrong, hints, capsys):
    refused(capsys, "fsdp_unit", G.check_fsdp_unit(wrong), *hints)


def test_fsdp_unit_accepts_dividing_before(capsys):
    def divide_first(ctx, g):
        out = g.new_empty(g.numel() // dist.get_world_size())
        compat.reduce_scatter_tensor(out, (g / dist.get_world_size()).contiguous())
        return out
    passed(capsys, G.check_fsdp_unit(_unit(divide_first)), "fsdp_unit: 3/3 cases passed")


# ----------------------------------------------------------------------------- prefetch
def _run_no_prefetch(order, start_gather, compute, free):
    for k in order:
        compute(k, start_gather(k).wait())
        free(k)


def _run_gather_all_first(order, start_gather, compute, free):   # everything gathered at once
    handles = [start_gather(k) for k in order]
    for k, h in zip(order, handles):
        compute(k, h.wait())
        free(k)


def _run_prefetching(units, start_gather, compute, free=None):   # the next gather before this compute
    pending = start_gather(units[0])
    for i, k in enumerate(units):
        full = pending.wait()
        if i + 1 < len(units):
            pending = start_gather(units[i + 1])
        compute(k, full)
        if free is not None:
            free(k)


def _run_never_free(order, start_gather, compute, free):
    _run_prefetching(order, start_gather, compute)


def _run_fixed_order(order, start_gather, compute, free):   # the lecture's forward order, whatever order says
    _run_prefetching(sorted(order), start_gather, compute, free)


def _run_library(order, start_gather, compute, free):
    from course_lib.parallel.fsdp import FSDP

    FSDP(torch.nn.Linear(2, 2), None)


@pytest.mark.parametrize("wrong, hints", [
    (_run_no_prefetch, ["started after unit 0 computed", "prefetch"]),
    (_run_gather_all_first, ["3 units gathered at once"]),
    (_run_never_free, ["units gathered at once: free each unit"]),
    (_run_library, ["write this yourself: the exercise is FSDP's prefetch"]),
    (_run_fixed_order, ["compute(0) called when unit 2 was due", "order given"]),
], ids=["no-prefetch", "all-at-once", "never-free", "library", "fixed-order"])
def test_fsdp_prefetch_refuses(wrong, hints, capsys):
    refused(capsys, "fsdp_prefetch", G.check_fsdp_prefetch(wrong), *hints)


def test_fsdp_prefetch_accepts_a_queue(capsys):
    def queue(order, start_gather, compute, free):
        waiting = [(order[0], start_gather(order[0]))] if order else []
        for i in range(len(order)):
            k, handle = waiting.pop(0)
            full = handle.wait()
            if i + 1 < len(order):
                waiting.append((order[i + 1], start_gather(order[i + 1])))
            compute(k, full)
            free(k)
    passed(capsys, G.check_fsdp_prefetch(queue), "fsdp_prefetch: 3/3 cases passed")


def test_fsdp_unit_refuses_a_broadcast_from_every_rank(capsys):
    """Issue 34: a forward that broadcasts every rank's shard in turn (N broadcasts instead of one
    all-gather) passed: only the backward's collectives were watched."""
    class Broadcasts(torch.autograd.Function):
        @staticmethod
        def forward(ctx, shard):
            N = dist.get_world_size()
            parts = [shard.detach().clone() if q == dist.get_rank() else torch.empty_like(shard) for q in range(N)]
            for q in range(N):
                dist.broadcast(parts[q], q)
            return torch.cat(parts)

        @staticmethod
        def backward(ctx, g):
            out = g.new_empty(g.numel() // dist.get_world_size())
            compat.reduce_scatter_tensor(out, g.contiguous())
            return out / dist.get_world_size()
    refused(capsys, "fsdp_unit", G.check_fsdp_unit(Broadcasts), "forward should all-gather", "broadcast")
