"""An expert-parallel rank's MoE layer as the ranks run it, written again on the planner's
side: the kernels ``runtime="course"`` traces for an EP rank
(:func:`course_lib.planner.kernels.trace_step`, its ``ep``).

The ranks' code (``parallel/expert_parallel.py``: ``ExpertParallelMoE`` with the all-to-all
dispatch) is not one device's MoE with fewer experts. One device loops over all E experts,
each on the T k / E rows routed to it (their indices, a gather, the expert, the router
weight, an ``index_add`` per expert). An EP rank sorts its kept assignments by expert,
exchanges the counts, sends each rank the rows of its experts, and runs its E / ep experts
each on the rows every one of the ep ranks routed to it, ep T k / E under balanced routing:
fewer and larger GEMMs, and its own bookkeeping around them (the rows sorted by expert,
concatenated, put back in the received order, one ``index_add`` of the combined rows).
Priced as one device's loop with the other experts' launches taken away, as the planner
did before, the sweep's EP 4 layouts of the GPT 1.3B MoE were 7.7-8.6% over the dry run
(``benchmarks/dry_run_vs_planner.py``); traced as the rank runs, its 11 EP rows are within
-2.7% to +0.3% (2026-11-30), the one across two nodes once its all-to-all was priced per link
(now as NCCL posts it, :func:`~course_lib.planner.async_tp.nccl_all_to_all`); with each MoE
layout again beside tp 2 + SP and cp 2, none of the sweep's 108 rows is over 10%.

Here: either dispatch (the model's ``moe_dispatch``: the all-to-all, or the all-gather of the
ep x etp group's tokens), any ``etp``, the routing group
the rank's own tokens or those of its cp x tp ranks (sequence parallelism: each TP rank routes
its own s / tp tokens, traced on them: :func:`install_ep`'s ``shard``): the layouts the
planner traces this way (:func:`traced_ep`). The planner sits below ``parallel/`` and imports
none of it: the ops below are the ranks', written again, so traced on the meta device they are
the kernels the ranks launch, op for op (``tests/test_planner_ep_ops.py`` checks it against
the code). A message is an empty buffer here (its time is the runtime's
:func:`~.runtime.ep_call_costs`); the counts' exchange is balanced routing's, as the dry run
folds it: every rank of the ep group sends this one what this one sends each of them (the
running rank is ep rank 0, its experts the first E / ep, the busiest when E does not divide
T k). With ``etp`` > 1 it is etp rank 0 too: its experts' first 1/etp of the width (w1's and
w3's rows, w2's columns, w2's bias added here), the rows of its etp peers all-gathered after
their counts (a host read) and the partial outputs reduce-scattered back, as the ranks'
``_run_experts``. Traced as one device's loop with the other experts' launches taken away, an
etp 2 rank beside tp 2 or cp 2 was planned 16-22% slow against the dry run (GPT 1.3B MoE on
H100s): the issue chain walked all E experts' kernels between the blocking calls.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from course_lib.moe import route, shared_output


def traced_ep(model, layout) -> int:
    """The ep of ``layout`` whose rank :class:`EPRankMoE` traces for ``model``; 0 where the ranks
    run one device's MoE (no experts; ep, etp, cp and tp all 1: nothing folded). With ep 1
    beside cp or tp the ranks still run the folded layer (its routing group across them):
    traced, ep 1. Its etp and dispatch are the layout's and the model's (:class:`EPRankMoE`'s
    ``etp``, ``dispatch``)."""
    folded = layout.ep * layout.etp * layout.cp * layout.tp > 1
    if model.n_experts <= 1 or not folded:
        return 0
    return layout.ep


def _unmarked(name):
    """A mark nobody records (a rank traced without its issue order)."""


class _Message(torch.autograd.Function):
    """An all-to-all of rows (``AllToAll``'s): ``out_rows`` rows arrive for the ``in_rows`` sent;
    backward, the same exchange the other way. Empty buffers: nothing moves here. ``mark(name)``
    where the ranks' blocking call is (the host waits for the stream there)."""

    @staticmethod
    def forward(ctx, x, out_rows, in_rows, name, mark):
        ctx.in_rows, ctx.name, ctx.mark = in_rows, name, mark
        out = x.new_empty((out_rows,) + tuple(x.shape[1:]))
        x.contiguous()
        mark(name)
        return out

    @staticmethod
    def backward(ctx, g):
        grad = g.new_empty((ctx.in_rows,) + tuple(g.shape[1:]))
        g.contiguous()
        ctx.mark(ctx.name + " (backward)")
        return grad, None, None, None, None


def _slice(net, etp: int):
    """Expert ``net`` as etp rank 0 of ``etp`` holds it: the first f / etp of its width (w1's and
    w3's rows with their bias, w2's columns; w2's bias whole), new parameters (copies: contiguous)."""
    out = copy.deepcopy(net)
    f = out.w1.out_features
    n = f // etp
    columns = [out.w1] + ([out.w3] if hasattr(out, "w3") else [])
    cuts = [(lin, 0, name) for lin in columns for name in ("weight", "bias") if getattr(lin, name) is not None]
    for lin, dim, name in cuts + [(out.w2, 1, "weight")]:
        p = getattr(lin, name)
        setattr(lin, name, nn.Parameter(p.detach().narrow(dim, 0, n).clone(), requires_grad=p.requires_grad))
    for lin in columns:
        lin.out_features = n
    out.w2.in_features = n
    return out


class EPRankMoE(nn.Module):
    """EP rank 0 of ``ep`` of ``moe`` (a ``course_lib.moe.MoE``): the router and the shared
    experts whole, the first E / ep experts (``etp`` > 1: etp rank 0's slice of each);
    ``forward(x) -> (y, aux)`` as ``MoE.forward``.
    ``group``: the ranks its routing group spans (cp x tp with sequence parallelism), which
    all-gather every member's token places and router logits and route the group's tokens in
    the single-device order, this rank (group rank 0) keeping its own rows. ``mark(name)`` is
    called where the ranks make a blocking call ("routing: token places", "routing: logits"
    on the group; "expert counts", "dispatch", "combine", and the last two's "(backward)" on
    the ep group; with etp > 1 "ETP row counts", "ETP all-gather", "ETP expert ids", "ETP
    reduce-scatter", and the second and fourth's "(backward)" on the etp group). ``dispatch``
    "all_gather": the model's other dispatch instead, on the ep x etp group ("dispatch",
    "router weights", "expert ids", "combine", and all but the ids' "(backward)")."""

    def __init__(self, moe, ep: int, mark=_unmarked, group: int = 1, etp: int = 1, dispatch: str = "all_to_all"):
        super().__init__()
        if moe.n_experts % ep:
            raise ValueError(f"the number of experts ({moe.n_experts}) must be divisible by ep={ep}")
        if dispatch not in ("all_to_all", "all_gather"):
            raise ValueError(f"dispatch must be 'all_to_all' or 'all_gather', got {dispatch!r}")
        width = moe.experts[0].w1.out_features
        if width % etp:
            raise ValueError(f"the experts' width {width} must be divisible by etp={etp}")
        self.ep, self.n_experts, self.local, self.group = ep, moe.n_experts, moe.n_experts // ep, group
        self.top_k, self.capacity_factor, self.normalize_topk = moe.top_k, moe.capacity_factor, moe.normalize_topk
        self.router, self.shared, self.etp, self.dispatch = moe.router, moe.shared, etp, dispatch
        self.experts = nn.ModuleList([net if etp == 1 else _slice(net, etp) for net in moe.experts[:self.local]])
        self.mark = mark

    def forward(self, x):
        expert, weight, keep, _, aux = self.route(x)
        y = shared_output(self.shared, x)
        if self.dispatch == "all_gather":
            return y + self._all_gathered(x, expert, weight, keep), aux
        return y + self._all_to_all(x, expert, weight, keep), aux

    def route(self, x):
        logits = self.router(x)
        args = (self.top_k, self.capacity_factor, self.normalize_topk)
        if self.group == 1:
            out = route(logits, *args)
            (~out[2]).nonzero()                 # the ranks keep the dropped pairs (their bookkeeping)
            return out
        T, g = x.shape[0], self.group
        # the members' places: balanced routing's, as the dry run folds them (each member sends
        # every expert as many tokens as the others), here the group's order itself
        with _disable_current_modes():         # (the plan sets them, outside the layer)
            places, group_places = torch.arange(T), torch.arange(g * T)
        index = self._gathered(places, "routing: token places", group_places)
        table = self._gathered(logits.detach(), "routing: logits")
        rows = list(table.split(T))
        rows[0] = logits                        # my rows live, the others' fixed
        order = torch.argsort(index)
        expert, weight, keep, counts, aux = route(torch.cat(rows)[order], *args)
        (~keep).nonzero()
        mine = torch.argsort(order).view(g, T)[0]
        return expert[mine], weight[mine], keep[mine], counts, aux

    def _gathered(self, x, name, values=None, n=None):
        """``gather_along(comm, x, 0, name)`` of the ranks: x's rows from every member of the
        routing group (or of a group of ``n``), in group order; a host tensor gets ``values``,
        or without them what its folded twins hold, its own rows ``n`` times; a blocking call."""
        n = self.group if n is None else n
        x = x.movedim(0, 0).contiguous()
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        if not out.is_meta:
            with _disable_current_modes():
                out.copy_(x.expand(n, *x.shape).reshape(out.shape) if values is None else values)
        self.mark(name)
        return out.movedim(0, 0).contiguous()

    def _gather_rows(self, x, sizes, name):
        """The ranks' ``gather_rows`` over the etp group: every peer's rows (a piece each,
        padded to the largest), then cut."""
        pad = max(sizes)
        if pad == 0:
            return x.new_zeros((0,) + tuple(x.shape[1:]))
        out = self._gathered(torch.cat([x, x.new_zeros((pad - len(x),) + tuple(x.shape[1:]))]), name, n=len(sizes))
        return torch.cat([piece[:n] for piece, n in zip(out.split(pad), sizes)])

    def _scatter_rows(self, x, sizes, name):
        """The ranks' ``scatter_rows`` over the etp group: each peer's rows (padded) reduce-
        scattered, this rank (etp rank 0) keeping its own."""
        pad = max(sizes)
        if pad == 0:
            return x.new_zeros((0,) + tuple(x.shape[1:]))
        pieces = [torch.cat([p, p.new_zeros((pad - len(p),) + tuple(p.shape[1:]))]) for p in x.split(sizes)]
        out = x.new_empty((pad,) + tuple(x.shape[1:]))
        torch.cat(pieces).contiguous()
        self.mark(name)
        return out[:sizes[0]]

    def _run_experts(self, rows, local_e):
        """The ranks' ``_run_experts``: my experts on their rows; with etp the etp group's rows
        joined first and the partial outputs summed back."""
        if self.etp > 1:
            count = torch.tensor([len(rows)], device=local_e.device)
            sizes = self._gathered(count, "ETP row counts", n=self.etp).tolist()
            rows = _Rows.apply(rows, self, sizes, "ETP all-gather", True)
            local_e = self._gather_rows(local_e, sizes, "ETP expert ids")
        by_expert = torch.sort(local_e, stable=True).indices
        per_expert = torch.bincount(local_e, minlength=self.local).tolist()
        outs = [self._one(net, chunk) for net, chunk in zip(self.experts, rows[by_expert].split(per_expert))]
        done = torch.cat(outs)[torch.argsort(by_expert)]
        if self.etp > 1:
            done = _Rows.apply(done, self, sizes, "ETP reduce-scatter", False)
        return done

    def _all_gathered(self, x, expert, weight, keep):
        """The ranks' all-gather dispatch (``ExpertParallelMoE._gathered``): the ep x etp group's
        tokens, router weights and expert ids gathered (every member routes as this one does:
        balanced routing's twins), my experts on the rows routed to them, the weighted sums
        reduce-scattered back."""
        n = self.ep * self.etp
        sizes = [x.shape[0]] * n
        xs = _Rows.apply(x, self, sizes, "dispatch", True)
        ws = _Rows.apply(weight * keep, self, sizes, "router weights", True)
        es = self._gather_rows(torch.where(keep, expert, -1), sizes, "expert ids")
        out = torch.zeros_like(xs)
        picks = [torch.nonzero(es == i, as_tuple=True) for i in range(self.local)]
        rows = [xs[tok] for tok, _ in picks]
        for (tok, j), y in zip(picks, [self._one(net, r) for net, r in zip(self.experts, rows)]):
            out = out.index_add(0, tok, y * ws[tok, j, None])
        return _Rows.apply(out, self, sizes, "combine", False)

    def _one(self, net, rows):
        """``LocalExperts._one``: an etp slice's partial output, w2's bias added on etp rank 0."""
        if self.etp == 1:
            return net(rows)
        out = F.linear(net.inner(rows), net.w2.weight)
        return out + net.w2.bias if net.w2.bias is not None else out

    def _all_to_all(self, x, expert, weight, keep):
        tok, j = torch.nonzero(keep, as_tuple=True)
        e = expert[tok, j]
        order = torch.sort(e, stable=True).indices
        tok, j, e = tok[order], j[order], e[order]
        counts = torch.bincount(e, minlength=self.n_experts)
        recv_counts = torch.empty_like(counts)
        with _disable_current_modes():         # the counts' exchange: balanced, what this rank sends
            recv_counts.view(self.ep, -1).copy_(counts.reshape(self.ep, -1)[0].expand(self.ep, -1))
        self.mark("expert counts")
        send_splits = counts.view(self.ep, -1).sum(1).tolist()
        recv_counts = recv_counts.view(self.ep, self.local)
        recv_splits = recv_counts.sum(1).tolist()
        rows = _Message.apply(x[tok], sum(recv_splits), sum(send_splits), "dispatch", self.mark)
        local_e = torch.arange(self.local, device=counts.device)
        local_e = local_e.repeat(self.ep).repeat_interleave(recv_counts.flatten())
        done = self._run_experts(rows, local_e)
        back = _Message.apply(done, sum(send_splits), sum(recv_splits), "combine", self.mark)
        return torch.zeros_like(x).index_add(0, tok, back * weight[tok, j, None])


class _Rows(torch.autograd.Function):
    """The ranks' ``GatherRows`` (``gather=True``: all-gather forward, reduce-scatter backward)
    or ``ScatterRows`` (the other way) over ``layer``'s etp group, marked by ``name`` (the
    backward's by ``name + " (backward)"``)."""

    @staticmethod
    def forward(ctx, x, layer, sizes, name, gather):
        ctx.layer, ctx.sizes, ctx.name, ctx.gather = layer, sizes, name, gather
        return layer._gather_rows(x, sizes, name) if gather else layer._scatter_rows(x, sizes, name)

    @staticmethod
    def backward(ctx, g):
        layer, name = ctx.layer, ctx.name + " (backward)"
        out = layer._scatter_rows(g, ctx.sizes, name) if ctx.gather else layer._gather_rows(g.contiguous(), ctx.sizes,
                                                                                           name)
        return out, None, None, None, None


class _Shard(torch.autograd.Function):
    """(b, s, h) -> its first s / t positions, a TP rank's sequence shard under SP; backward the
    gradient put back in place. The trace runs the whole sequence where a TP rank holds its
    shard: these copies stand in for that, not for the ranks' program, so the counter does not
    see them."""

    @staticmethod
    def forward(ctx, x, t):
        ctx.shape, ctx.n = x.shape, x.shape[1] // t
        with _disable_current_modes():
            return x[:, :ctx.n].clone()

    @staticmethod
    def backward(ctx, g):
        with _disable_current_modes():
            out = g.new_zeros(ctx.shape)
            out[:, :ctx.n] = g
        return out, None


class _Unshard(torch.autograd.Function):
    """The shard's result back at its place in the whole sequence (the inverse of :class:`_Shard`,
    unseen by the counter as it is)."""

    @staticmethod
    def forward(ctx, y, shape):
        ctx.n = y.shape[1]
        with _disable_current_modes():
            out = y.new_zeros(shape)
            out[:, :ctx.n] = y
        return out

    @staticmethod
    def backward(ctx, g):
        with _disable_current_modes():
            return g[:, :ctx.n].clone(), None


def install_ep(net, ep: int, mark=_unmarked, group: int = 1, shard: int = 1, etp: int = 1,
               dispatch: str = "all_to_all") -> None:
    """Every MoE layer of ``net`` (a TinyGPT) as EP rank 0 of ``ep`` runs it (``mark``,
    ``group``, ``etp``, ``dispatch``: see :class:`EPRankMoE`); ``shard`` > 1: on a TP rank's trace under SP, each MoE
    layer runs on the rank's s / shard tokens, as the ranks' MoE does (its GEMMs at their own
    shape, not the whole sequence's divided by tp)."""
    for block in net.blocks:
        mlp = getattr(block, "mlp", None)
        if mlp is not None and hasattr(mlp, "moe"):
            mlp.moe = EPRankMoE(mlp.moe, ep, mark, group, etp, dispatch)
            mlp.groups = 1
            if shard > 1:
                whole = mlp.forward
                mlp.forward = lambda x, whole=whole: _Unshard.apply(whole(_Shard.apply(x, shard)), x.shape)


__all__ = ["EPRankMoE", "install_ep", "traced_ep"]
