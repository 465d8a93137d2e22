"""course_lib/grading/hsdp.py (chapter 4): each grader fails the classic mistakes (the shard
all-reduced over the whole dp, the whole gradient all-reduced, a reduce-scatter per
micro-batch), a hard-coded answer and a library shortcut, and passes a right answer written
differently."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib import compat
from course_lib.grading import hsdp as G
from grading_answers import passed, refused


def _shard_of(grad, group):
    out = grad.new_empty(grad.numel() // dist.get_world_size(group))
    compat.reduce_scatter_tensor(out, grad, group=group)
    return out


# ----------------------------------------------------------------------------- HSDP gradient path
def _all_reduce_over_whole_dp(grad, shard_group, replicate_group):      # the shard over every rank
    shard = _shard_of(grad, shard_group)
    dist.all_reduce(shard)                                               # mixes other rows
    return shard / dist.get_world_size()


def _whole_gradient_across(grad, shard_group, replicate_group):         # all-reduce, then slice
    dist.all_reduce(grad)
    S, r = dist.get_world_size(shard_group), dist.get_rank(shard_group)
    part = grad.numel() // S
    return grad[r * part:(r + 1) * part] / dist.get_world_size()


def _divide_by_shard_only(grad, shard_group, replicate_group):          # the replicas' sum kept
    shard = _shard_of(grad, shard_group)
    dist.all_reduce(shard, group=replicate_group)
    return shard / dist.get_world_size(shard_group)


def _hard_coded(grad, shard_group, replicate_group):                    # the first case's shape
    return torch.zeros(6, dtype=torch.float64)


def _torch_shortcut(grad, shard_group, replicate_group):                # torch's HSDP does it
    from torch.distributed.fsdp import fully_shard
    fully_shard(torch.nn.Linear(2, 2))
    return grad


def _library_shortcut(grad, shard_group, replicate_group):              # course_lib's groups
    from course_lib.parallel.hsdp import block_sets
    block_sets([[0]], 1)
    return grad


@pytest.mark.parametrize("wrong, hints", [
    (_all_reduce_over_whole_dp, ["your shard"]),
    (_whole_gradient_across, ["only the shard travels", "one reduce-scatter"]),
    (_divide_by_shard_only, ["your shard"]),
    (_hard_coded, ["shape (6,)", "your shard", "one reduce-scatter"]),
    (_torch_shortcut, ["fully_shard"]),
    (_library_shortcut, ["block_sets"]),
])
def test_hsdp_gradient_refuses(wrong, hints, capsys):
    outcome = G.check_hsdp_gradient(wrong)
    line = capsys.readouterr().out
    assert outcome is False and "hsdp_gradient: FAILED" in line, line
    assert any(h in line for h in hints), line


def test_hsdp_gradient_accepts_an_async_answer_divided_first(capsys):
    def right(grad, shard_group, replicate_group):
        grad = grad / dist.get_world_size()                              # divide first
        shard = grad.new_empty(grad.numel() // dist.get_world_size(shard_group))
        work = compat.reduce_scatter_tensor(shard, grad, group=shard_group, async_op=True)
        work.wait()
        dist.all_reduce(shard, group=replicate_group, async_op=True).wait()
        return shard
    passed(capsys, G.check_hsdp_gradient(right), "hsdp_gradient: 3/3 cases passed")


# ----------------------------------------------------------------------------- accumulation without sync
def _reduce_scatter_each(micro_grads):                                   # sync on every micro-batch
    N = dist.get_world_size()
    return sum(_shard_of(g, None) for g in micro_grads) / N


def _all_reduce_sum(micro_grads):                                        # the whole sum all-reduced
    total = torch.stack(micro_grads).sum(0)
    dist.all_reduce(total)
    N, r = dist.get_world_size(), dist.get_rank()
    part = total.numel() // N
    return total[r * part:(r + 1) * part] / N


def _mean_of_micro(micro_grads):                                         # divided by k as well
    return _shard_of(torch.stack(micro_grads).mean(0), None) / dist.get_world_size()


def _no_sync_hard_coded(micro_grads):
    return torch.zeros(4, dtype=torch.float64)


def _no_sync_shortcut(micro_grads):
    from course_lib.parallel.fsdp import FSDP
    FSDP(torch.nn.Linear(2, 2))
    return micro_grads[0]


@pytest.mark.parametrize("wrong, hints", [
    (_reduce_scatter_each, ["ONE reduce-scatter"]),
    (_all_reduce_sum, ["ONE reduce-scatter"]),
    (_mean_of_micro, ["your shard"]),
    (_no_sync_hard_coded, ["shape (4,)", "your shard", "ONE reduce-scatter"]),
    (_no_sync_shortcut, ["write this yourself"]),
])
def test_accumulate_no_sync_refuses(wrong, hints, capsys):
    outcome = G.check_accumulate_no_sync(wrong)
    line = capsys.readouterr().out
    assert outcome is False and "accumulate_no_sync: FAILED" in line, line
    assert any(h in line for h in hints), line


def test_accumulate_no_sync_accepts_a_loop(capsys):
    def right(micro_grads):
        total = micro_grads[0].clone()
        for g in micro_grads[1:]:
            total += g
        N = dist.get_world_size()
        out = total.new_empty(total.numel() // N)
        compat.reduce_scatter_tensor(out, total)
        return out.div_(N)
    passed(capsys, G.check_accumulate_no_sync(right), "accumulate_no_sync: 3/3 cases passed")
