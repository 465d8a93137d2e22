"""course_lib/grading/fsdp.py (chapter 4's FSDP questions): each grader fails the classic
mistakes, an answer hard-coded to the lecture's case and a library shortcut, each with a hint
naming the mistake and within seconds, and passes a different right answer."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib import compat
from course_lib.grading import fsdp as G
from grading_answers import passed, refused


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
