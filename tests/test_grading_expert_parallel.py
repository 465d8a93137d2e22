"""Chapter 8's graders (course_lib/grading/expert_parallel.py): the solution and a differently
written right answer pass; classic mistakes, an answer hard-coded to the exercise's printed
example and a library shortcut each fail with a hint that names the mistake."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.grading import expert_parallel as G
from grading_answers import fails_with, graded


# ----------------------------------------------------------------------------- split sizes
def split_sizes(counts, ep_rank):
    ep, E = counts.shape
    owner = torch.arange(E) // (E // ep)                    # the rank of each expert
    send = [int(counts[ep_rank][owner == j].sum()) for j in range(ep)]
    recv = [int(counts[j][owner == ep_rank].sum()) for j in range(ep)]
    return send, recv


def test_dispatch_split_sizes(capsys):
    assert graded(capsys, G.check_dispatch_split_sizes, split_sizes)[0]
    fails_with(capsys, G.check_dispatch_split_sizes, lambda c, r: split_sizes(c, r)[::-1], hint="swapped")
    fails_with(capsys, G.check_dispatch_split_sizes, lambda c, r: (c[r].tolist(), c[:, r].tolist()),
               hint="one per RANK")
    fails_with(capsys, G.check_dispatch_split_sizes,
               lambda c, r: (split_sizes(c, r)[0], c[:, r * (c.shape[1] // c.shape[0]):(r + 1) * (c.shape[1] // c.shape[0])]
                             .sum(0).tolist()), hint="SOURCE")
    fails_with(capsys, G.check_dispatch_split_sizes, lambda c, r: ([7, 8], [7, 6]), hint="input_split_sizes")

    def library(c, r):
        from course_lib.parallel.expert_parallel import dispatch_splits
        return dispatch_splits(c[r], c.shape[0]), split_sizes(c, r)[1]
    fails_with(capsys, G.check_dispatch_split_sizes, library, hint="write this yourself")


# ----------------------------------------------------------------------------- aux loss
def aux_loss(logits, top_k):
    T, E = logits.shape
    probs = logits.softmax(-1)
    mask = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, -1).indices, 1.0)    # (T, E) 0/1
    return (mask.mean(0) / top_k * probs.mean(0)).sum() * E


def over_tokens_only(logits, top_k):                    # f_e divided by T, not T*k
    return aux_loss(logits, top_k) * top_k


def differentiable_f(logits, top_k):                   # f_e carries a gradient
    probs = logits.softmax(-1)
    mask = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, -1).indices, 1.0)
    f = (mask * probs / probs.detach()).mean(0) / top_k
    return logits.shape[1] * (f * probs.mean(0)).sum()


def without_e(logits, top_k):
    return aux_loss(logits, top_k) / logits.shape[1]


def test_switch_aux_loss(capsys):
    assert graded(capsys, G.check_switch_aux_loss, aux_loss)[0]
    fails_with(capsys, G.check_switch_aux_loss, over_tokens_only, hint=("times too large", "aux loss"))
    fails_with(capsys, G.check_switch_aux_loss, differentiable_f, hint="no gradient through it")
    fails_with(capsys, G.check_switch_aux_loss, without_e, hint="aux loss")
    fails_with(capsys, G.check_switch_aux_loss, lambda logits, k: torch.tensor(1.0), hint="aux loss")

    def library(logits, k):
        from course_lib.moe import route
        return route(logits, k, 1.0)[4]
    fails_with(capsys, G.check_switch_aux_loss, library, hint="write this yourself")


def test_an_endless_loop_is_stopped_with_a_hint(capsys, monkeypatch):
    monkeypatch.setattr(G, "SECONDS", 2)

    def endless(logits, top_k):
        while True:
            pass
    fails_with(capsys, G.check_switch_aux_loss, endless, hint="ran for more than")


# ----------------------------------------------------------------------------- capacity (BPR)
def keep_mask(expert, weight, n_experts, capacity):
    """Python loops over a priority list: (choice, -weight, token)."""
    T, k = expert.shape
    keep = torch.zeros(T, k, dtype=torch.bool)
    used = [0] * n_experts
    for j, _, t in sorted((j, -float(weight[t, j]), t) for j in range(k) for t in range(T)):
        e = int(expert[t, j])
        keep[t, j] = used[e] < capacity
        used[e] += 1
    return keep


def token_order(expert, weight, n_experts, capacity):      # the lecture's rule: ignores the weights
    flat = expert.t().reshape(-1)
    slot = (F.one_hot(flat, n_experts).cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
    return (slot < capacity).view(expert.shape[1], expert.shape[0]).t()


def weight_over_all_choices(expert, weight, n_experts, capacity):   # a confident 2nd choice before a 1st
    T, k = expert.shape
    keep = torch.zeros(T, k, dtype=torch.bool)
    used = [0] * n_experts
    for _, t, j in sorted((-float(weight[t, j]), t, j) for j in range(k) for t in range(T)):
        e = int(expert[t, j])
        keep[t, j] = used[e] < capacity
        used[e] += 1
    return keep


def off_by_one(expert, weight, n_experts, capacity):
    return keep_mask(expert, weight, n_experts, capacity + 1)


def test_capacity_keep(capsys):
    assert graded(capsys, G.check_capacity_keep, keep_mask)[0]
    fails_with(capsys, G.check_capacity_keep, token_order, hint="highest router weight")
    fails_with(capsys, G.check_capacity_keep, weight_over_all_choices, hint="FIRST choices")
    fails_with(capsys, G.check_capacity_keep, off_by_one, hint="more than its capacity")

    def library(expert, weight, n_experts, capacity):
        from course_lib.moe import route
        return route(torch.zeros(expert.shape[0], n_experts), expert.shape[1], 1.0)[2]
    fails_with(capsys, G.check_capacity_keep, library, hint="write this yourself")


# ----------------------------------------------------------------------------- the EP layer
class Exchange(torch.autograd.Function):
    """all_to_all_single of rows; backward: the same with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.save = (in_splits, out_splits)
        out = x.new_empty(sum(out_splits), x.shape[1])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.save
        grad = g.new_empty(sum(out_splits), g.shape[1])
        dist.all_to_all_single(grad, g.contiguous(), out_splits, in_splits)
        return grad, None, None


def moe_forward(x, expert, gate, local_experts, n_experts, **bug):
    """Rows grouped by destination rank with argsort, counts exchanged with all_gather."""
    ep, r = dist.get_world_size(), dist.get_rank()
    local = n_experts // ep
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=n_experts)
    every = [torch.empty_like(counts) for _ in range(ep)]
    dist.all_gather(every, counts)
    every = torch.stack(every)                                  # (ep sources, E)
    send = counts.view(ep, local).sum(1).tolist()
    mine = every[:, r * local:(r + 1) * local]                  # (ep sources, local experts)
    recv = mine.sum(1).tolist()
    rows = (lambda t, o, i: t.clone()) if bug.get("plain") else Exchange.apply
    got = rows(x[order], recv, send) if not bug.get("plain") else _plain(x[order], recv, send)
    ids = torch.cat([torch.arange(local).repeat_interleave(mine[s]) for s in range(ep)])
    out = torch.stack([local_experts[int(i)](row) for i, row in zip(ids, got)]) if len(ids) else got * 0
    back = Exchange.apply(out, send, recv) if not bug.get("plain") else _plain(out, send, recv)
    if bug.get("unsorted"):
        return back * gate[:, None]
    y = torch.empty_like(back)
    y = y.index_copy(0, order, back)
    return y if bug.get("no_gate") else y * gate[:, None]


def _plain(x, out_splits, in_splits):
    out = x.new_empty(sum(out_splits), x.shape[1])
    dist.all_to_all_single(out, x.detach().contiguous(), out_splits, in_splits)
    return out


class GatherAll(torch.autograd.Function):
    """all_gather forward; backward: the sum of every rank's gradient of my rows."""

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g)
        return g.view(dist.get_world_size(), -1, g.shape[1])[dist.get_rank()]


class SumAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g)
        return g


def all_gathered(x, expert, gate, local_experts, n_experts):
    """Right values and gradients, the wrong traffic: every rank gets every token, runs its
    experts on those routed to them, and the outputs are summed over all ranks (O(ep T h))."""
    ep, r = dist.get_world_size(), dist.get_rank()
    local = n_experts // ep
    es = [torch.empty_like(expert) for _ in range(ep)]
    dist.all_gather(es, expert)
    allx, alle = GatherAll.apply(x), torch.cat(es)
    out = torch.zeros_like(allx)
    for i, net in enumerate(local_experts):
        idx = (alle == r * local + i).nonzero().squeeze(1)
        out = out.index_add(0, idx, net(allx[idx]))
    return SumAll.apply(out).view(ep, *x.shape)[r] * gate[:, None]


def test_expert_parallel_forward(capsys):
    assert graded(capsys, G.check_expert_parallel_forward, moe_forward)[0]
    fails_with(capsys, G.check_expert_parallel_forward, lambda *a: moe_forward(*a, no_gate=True), hint="gate")
    fails_with(capsys, G.check_expert_parallel_forward, lambda *a: moe_forward(*a, unsorted=True), hint="own row")
    fails_with(capsys, G.check_expert_parallel_forward, lambda *a: moe_forward(*a, plain=True),
               hint="no gradient")
    fails_with(capsys, G.check_expert_parallel_forward, all_gathered, hint="travel only")

    def library(x, expert, gate, local_experts, n_experts):
        from course_lib.moe import MoE
        return MoE(4, 4, n_experts)(x)[0]
    fails_with(capsys, G.check_expert_parallel_forward, library, hint="write this yourself")


def test_capacity_keep_refuses_the_later_token_on_a_tie(capsys):
    """Issue 34: breaking equal-weight ties by keeping the LATER token passed, because the tied
    tokens of the "equal weights" case sat behind stronger ones."""
    def later_first(expert, weight, n_experts, capacity):
        T, k = expert.shape
        keep = torch.zeros(T, k, dtype=torch.bool)
        used = [0] * n_experts
        for j, _, neg_t in sorted((j, -float(weight[t, j]), -t) for j in range(k) for t in range(T)):
            e = int(expert[-neg_t, j])
            keep[-neg_t, j] = used[e] < capacity
            used[e] += 1
        return keep
    fails_with(capsys, G.check_capacity_keep, later_first, hint=["EARLIER token", "tied"])


def test_expert_parallel_forward_refuses_the_gate_inside_and_an_all_gather_by_all_to_all(capsys):
    """Issue 34: expert(gate * x) passed with bias-free linear experts, and an all-gather written
    with all_to_all_single (equal splits) passed because only the forward was counted."""
    def gate_inside(x, expert, gate, local_experts, n_experts):
        return moe_forward(x * gate[:, None], expert, torch.ones_like(gate), local_experts, n_experts)
    fails_with(capsys, G.check_expert_parallel_forward, gate_inside, hint="gate * expert(x)")

    def everyone_everything(x, expert, gate, local_experts, n_experts):
        """Every rank's tokens to every rank by all_to_all_single with equal splits: right values."""
        ep, r = dist.get_world_size(), dist.get_rank()
        local, T = n_experts // ep, x.shape[0]
        ids = torch.empty(ep * T, dtype=expert.dtype)
        dist.all_to_all_single(ids, expert.repeat(ep))
        rows = Exchange.apply(x.repeat(ep, 1), [T] * ep, [T] * ep)          # (ep T, h): all tokens
        out = torch.zeros_like(rows)
        for i, net in enumerate(local_experts):
            idx = (ids == r * local + i).nonzero().squeeze(1)
            out = out.index_add(0, idx, net(rows[idx]))
        back = Exchange.apply(out, [T] * ep, [T] * ep)                      # (ep T, h): one block per rank
        return back.view(ep, T, -1).sum(0) * gate[:, None]
    fails_with(capsys, G.check_expert_parallel_forward, everyone_everything, hint="travel only")
