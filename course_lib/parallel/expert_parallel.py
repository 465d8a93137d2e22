"""Expert parallelism: the experts of an MoE layer sharded over the "ep" ranks, tokens sent to
their experts and back by all-to-all.

    layer = ExpertParallelMoE(MoE(h, f, n_experts=8, top_k=2), mesh)   # this rank keeps E/ep experts
    y, aux = layer(x)                                                  # x: this rank's tokens (T, h)

One forward, on every rank (GShard's dispatch / combine):
1. route its own tokens (router replicated; capacity and dropping per rank, as ``MoE(groups=)``);
2. sort the kept (token, expert) assignments by expert: destination rank j gets the block of
   experts j*E/ep ... (j+1)*E/ep - 1; exchange the counts (an all-to-all of E integers) so
   every rank knows how many rows it will receive: the split sizes are uneven;
3. **dispatch**: ``all_to_all_single`` with those splits; run each local expert on its rows;
4. **combine**: the inverse all-to-all; add each result, times its router weight, to its token.
Both all-to-alls are one autograd function whose backward is the all-to-all the other way.
Expert weights live on one EP rank each: their gradients are summed over "edp" (the ranks
holding the same experts) only; the router's over "dp".
"""
from __future__ import annotations

import torch
import torch.nn as nn

from course_lib import trace
from course_lib.moe import MoE, route
from course_lib.parallel.mesh import set_reduce_dims


class AllToAll(torch.autograd.Function):
    """rows (sum(in_splits), h) -> (sum(out_splits), h): in_splits[j] rows go to rank j,
    out_splits[j] rows come from rank j. Backward: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, comm, out_splits, in_splits, name):
        ctx.comm, ctx.splits, ctx.name = comm, (out_splits, in_splits), name
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, name=name)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        grad = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
        ctx.comm.all_to_all_single(grad, g.contiguous(), in_splits, out_splits, name=ctx.name + " (backward)")
        return grad, None, None, None, None


def dispatch_splits(counts, ep):
    """Rows to send to each EP rank: the assignments of its block of experts. counts (E,)."""
    return counts.view(ep, -1).sum(1).tolist()


def experts_per_rank(n_experts: int, ep: int) -> int:
    """Every EP rank holds n_experts / ep of them."""
    if n_experts % ep:
        raise ValueError(f"the number of experts ({n_experts}) must be divisible by ep={ep} (every "
                         f"expert-parallel rank holds n_experts / ep of them)")
    return n_experts // ep


def rule_experts(cfg, layout):
    """EP's rules for a TinyGPT config: experts to split, evenly."""
    if layout.ep == 1:
        return
    if not cfg.n_experts:
        raise ValueError(f"ep={layout.ep} splits experts, but the model has none (GPTConfig(n_experts=...))")
    experts_per_rank(cfg.n_experts, layout.ep)


class ExpertParallelMoE(nn.Module):
    """``moe``'s router (replicated) and this EP rank's block of its experts, over ``mesh``'s
    "ep" group. Every rank builds it from the same ``MoE`` (same seed): it keeps its share."""

    def __init__(self, moe: MoE, mesh, impl=None):
        super().__init__()
        ep = mesh.size("ep")
        experts_per_rank(moe.n_experts, ep)
        self.comm = mesh.comm("ep", impl=impl)
        self.ep, self.n_experts, self.local = ep, moe.n_experts, moe.n_experts // ep
        self.top_k, self.capacity_factor = moe.top_k, moe.capacity_factor
        self.normalize_topk = moe.normalize_topk    # renormalise the k weights as one device does
        first = self.comm.rank * self.local
        self.router = moe.router
        self.experts = nn.ModuleList(moe.experts[first:first + self.local])   # (E/ep experts)
        set_reduce_dims(self.experts, ("edp",))    # each expert lives on one rank of every EP group

    def forward(self, x):  # x (T, h): this rank's tokens -> (T, h), aux loss of this rank's group
        T, h = x.shape
        expert, weight, keep, _, aux = route(self.router(x), self.top_k, self.capacity_factor,
                                             self.normalize_topk)
        tok, j = torch.nonzero(keep, as_tuple=True)                 # kept assignments (M,)
        e = expert[tok, j]
        order = torch.sort(e, stable=True).indices                  # grouped by expert
        tok, j, e = tok[order], j[order], e[order]
        counts = torch.bincount(e, minlength=self.n_experts)        # (E,) rows per expert
        recv_counts = torch.empty_like(counts)                      # (ep * E/ep,): [source][my expert]
        self.comm.all_to_all_single(recv_counts, counts, name="expert counts")
        send_splits = dispatch_splits(counts, self.ep)
        recv_counts = recv_counts.view(self.ep, self.local)         # (ep sources, E/ep local experts)
        recv_splits = recv_counts.sum(1).tolist()
        rows = AllToAll.apply(x[tok], self.comm, recv_splits, send_splits, "dispatch")   # (R, h)
        with trace.span("experts", kind="compute"):
            local_e = torch.arange(self.local, device=x.device).repeat(self.ep).repeat_interleave(recv_counts.flatten())  # (R,)
            by_expert = torch.sort(local_e, stable=True).indices    # rows of expert 0, 1, ...
            sizes = torch.bincount(local_e, minlength=self.local).tolist()
            outs = [net(chunk) for net, chunk in zip(self.experts, rows[by_expert].split(sizes))]
            done = torch.cat(outs)[torch.argsort(by_expert)]        # back to the received order
        back = AllToAll.apply(done, self.comm, send_splits, recv_splits, "combine")     # (M, h)
        y = torch.zeros_like(x).index_add(0, tok, back * weight[tok, j, None])
        return y, aux

    def tokens_per_expert(self, x):
        """Assignments per expert (E,) of this rank's tokens, before dropping."""
        return route(self.router(x), self.top_k, self.capacity_factor, self.normalize_topk)[3]


__all__ = ["AllToAll", "ExpertParallelMoE", "dispatch_splits", "experts_per_rank", "rule_experts"]
