"""Expert parallelism on the folded expert mesh: the experts of an MoE layer split over "ep"
(and each expert's matrices over "etp"), tokens sent to their experts and back.

    layer = ExpertParallelMoE(MoE(h, f, n_experts=8, top_k=2), mesh)   # this rank keeps E/ep experts
    y, aux = layer(x)                                                  # x: this rank's tokens (T, h)

One forward, on every rank (GShard's dispatch / combine):
1. **route** its tokens (router replicated). A routing group (capacity, load-balancing loss)
   is one micro-batch of one DP rank, as on one device with ``MoE(groups=dp * m)``; with CP
   or sequence-parallel TP its tokens lie on the cp x tp ranks, so they all-gather the
   (token index, chosen experts) table and decide the drops over the whole group in the
   single-device order: the same tokens dropped as on one device;
2. **dispatch** ``"all_to_all"``: the kept (token, expert) rows sorted by expert, rank j of
   the "ep" group getting those of its experts j*E/ep ... (the counts exchanged first: the
   splits are uneven); ``"all_gather"``: every rank of the ep x etp group gathers all the
   group's tokens and runs its own experts on the ones routed to them;
3. with ``etp`` > 1, the rows an expert gets are all-gathered over "etp", each etp rank runs
   its slice of the expert's hidden width (w1's and w3's rows, w2's columns), and the partial
   outputs are reduce-scattered back (w2's bias added once, on etp rank 0);
4. **combine**: the inverse all-to-all (or a reduce-scatter of the gathered tokens' sums),
   each result times its router weight added to its token.
Every exchange is an autograd function whose backward is its transpose. An expert's gradient
is summed over the ranks holding it (:meth:`~course_lib.parallel.mesh.MeshShape.expert_replicas`),
the router's over the attention's dims (dp, cp, and tp with sequence parallelism).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import trace
from course_lib.moe import MoE, route, shared_output
from course_lib.parallel.comm_ops import gather_along
from course_lib.parallel.mesh import expert_fold, set_reduce_dims
from course_lib.parallel.tensor_parallel import slice_parameter

DISPATCH = ("all_to_all", "all_gather")


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


def gather_rows(x, comm, sizes, name):
    """(sizes[me], ...) on each rank -> (sum(sizes), ...): every rank's rows in group-rank order
    (padded to the largest piece for the all-gather, then cut)."""
    pad = max(sizes)
    if pad == 0:                                                  # nothing anywhere: no call
        return x.new_zeros((0,) + tuple(x.shape[1:]))
    out = gather_along(comm, torch.cat([x, x.new_zeros((pad - len(x),) + tuple(x.shape[1:]))]), 0, name)
    return torch.cat([piece[:n] for piece, n in zip(out.split(pad), sizes)])


def scatter_rows(x, comm, sizes, name):
    """(sum(sizes), ...) on each rank -> (sizes[me], ...): the sum over ranks of my rows."""
    pad = max(sizes)
    if pad == 0:
        return x.new_zeros((0,) + tuple(x.shape[1:]))
    pieces = [torch.cat([p, p.new_zeros((pad - len(p),) + tuple(p.shape[1:]))]) for p in x.split(sizes)]
    out = x.new_empty((pad,) + tuple(x.shape[1:]))
    comm.reduce_scatter_tensor(out, torch.cat(pieces).contiguous(), name=name)
    return out[:sizes[comm.rank]]


class GatherRows(torch.autograd.Function):
    """All-gather rows forward (uneven pieces), reduce-scatter backward (every rank used them)."""

    @staticmethod
    def forward(ctx, x, comm, sizes, name):
        ctx.comm, ctx.sizes, ctx.name = comm, sizes, name
        return gather_rows(x, comm, sizes, name)

    @staticmethod
    def backward(ctx, g):
        return scatter_rows(g, ctx.comm, ctx.sizes, ctx.name + " (backward)"), None, None, None


class ScatterRows(torch.autograd.Function):
    """Reduce-scatter rows forward (sum the partial outputs), all-gather backward."""

    @staticmethod
    def forward(ctx, x, comm, sizes, name):
        ctx.comm, ctx.sizes, ctx.name = comm, sizes, name
        return scatter_rows(x, comm, sizes, name)

    @staticmethod
    def backward(ctx, g):
        return gather_rows(g.contiguous(), ctx.comm, ctx.sizes, ctx.name + " (backward)"), None, None, None


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
    """EP's rules for a TinyGPT config: experts to split evenly over ep; an expert mesh
    (ep x etp) that tiles one stage's dp x cp x tp ranks; the expert width split over etp;
    sequence parallelism with TP (each TP rank routes its own s / tp tokens, Megatron's rule);
    not HSDP or ZeRO++ on a folded expert mesh (one shard group; FSDP's experts have their own)."""
    ep, etp, tp = layout.ep, layout.etp, layout.tp
    if not cfg.n_experts:
        if ep * etp > 1:
            raise ValueError(f"ep={ep}, etp={etp} split experts, but the model has none (GPTConfig(n_experts=...))")
        return
    experts_per_rank(cfg.n_experts, ep)
    expert_fold({"dp": layout.dp, "cp": layout.cp, "tp": tp}, ep, etp, layout.fold_order)
    if cfg.ffn_hidden % etp:
        raise ValueError(f"expert tensor parallelism splits each expert's width {cfg.ffn_hidden} over "
                         f"etp={etp}: not divisible")
    if tp > 1 and not layout.sp:
        raise ValueError(f"experts with tp={tp} need sequence_parallel=True: each TP rank routes its own "
                         f"s / tp tokens (without SP every TP rank would send the same tokens)")
    # FSDP shards each block's experts as a unit of their own (compose.expert_units); HSDP and
    # ZeRO++ assume one shard group
    folded = f"experts on a folded expert mesh (ep={ep}, etp={etp}, cp={layout.cp}, tp={tp})"
    if layout.data == "hsdp" and ep * etp * layout.cp * tp > 1:
        raise ValueError(f"{folded} under HSDP: its one shard group is dp x cp's, an expert lives on its "
                         f"expert mesh; use data='fsdp' (each block's experts a unit of their own) or data='ddp'")
    if layout.zeropp and ep * etp * layout.cp * tp > 1:
        raise ValueError(f"{folded} with zeropp={tuple(layout.zeropp)}: ZeRO++'s groups are one shard group's, an "
                         f"expert's FSDP unit shards over the ranks holding it; drop zeropp")


def token_index(rows: int, seq_len: int, positions, tp: int = 1, tp_rank: int = 0):
    """(rows * s_local / tp,): the index of each token this rank's MoE sees in its routing group
    (one micro-batch, flattened (row, position)): its CP ``positions`` (s_local,), then its
    sequence-parallel chunk of them."""
    pos = positions.chunk(tp)[tp_rank]
    return (torch.arange(rows, device=pos.device)[:, None] * seq_len + pos[None, :]).flatten()


def expert_tp_plan(plan: dict) -> dict:
    """The tensor-parallel plan of an MoE model: the experts keep their own mesh (untouched by
    TP); the router and shared experts are used on each rank's s / tp tokens, like a norm."""
    mine = {"blocks.*.mlp": "experts", "blocks.*.mlp.moe": "experts", "blocks.*.mlp.moe.router": "norm",
            "blocks.*.mlp.moe.shared.*": "norm", "blocks.*.mlp.moe.experts*": "experts"}
    return {**mine, **{k: v for k, v in plan.items() if k not in mine}}     # the first match wins


def slice_expert(net, etp: int, rank: int):
    """Expert tensor parallelism: slice ``rank`` of ``etp`` of the expert's width, w1's (and a
    SwiGLU expert's w3's) rows with their bias, w2's columns (w2's bias whole)."""
    f = net.w1.out_features
    a, b = rank * f // etp, (rank + 1) * f // etp
    out = copy.deepcopy(net)
    columns = [out.w1] + ([out.w3] if hasattr(out, "w3") else [])     # column parallel: w1, w3
    cuts = [(lin, 0, name) for lin in columns for name in ("weight", "bias") if getattr(lin, name) is not None]
    for lin, dim, name in cuts + [(out.w2, 1, "weight")]:
        setattr(lin, name, slice_parameter(getattr(lin, name), dim, a, b))   # tagged: the plan's Placement
    for lin in columns:
        lin.out_features = b - a
    out.w2.in_features = b - a
    return out


class LocalExperts(nn.ModuleList):
    """This rank's experts (or their etp slices), run by one call: each expert on its own rows.
    One module, so a hook around it sees all of them at once (FSDP's unit of a block's experts,
    as torchtitan's ``GroupedExperts``); the parameters keep their names ``experts.<j>.*``."""

    def __init__(self, nets, etp: int = 1, bias_here: bool = True):
        super().__init__(nets)
        self.etp, self.bias_here = etp, bias_here

    def forward(self, rows):
        """[rows (R_j, h) of local expert j] -> [their outputs (R_j, h)]; an etp slice gives a
        partial output, w2's bias added on etp rank 0 only."""
        return [self._one(net, x) for net, x in zip(self, rows)]

    def _one(self, net, rows):
        if self.etp == 1:
            return net(rows)
        out = F.linear(net.inner(rows), net.w2.weight)                # (R, h): my slice's share
        return out + net.w2.bias if self.bias_here and net.w2.bias is not None else out


class ExpertParallelMoE(nn.Module):
    """``moe``'s router and shared experts (replicated) and this rank's part of its experts
    (E/ep experts, 1/etp of each one's width) on ``mesh``'s expert mesh. Every rank builds it
    from the same ``MoE`` (same seed): it keeps its share. ``token_index`` (set per step by
    the plan): where this rank's tokens sit in their routing group, when that group spans the
    cp x tp ranks."""

    def __init__(self, moe: MoE, mesh, impl=None, dispatch="all_to_all"):
        super().__init__()
        if dispatch not in DISPATCH:
            raise ValueError(f"dispatch must be one of {DISPATCH}, got {dispatch!r}")
        ep, etp = mesh.size("ep"), mesh.size("etp") if hasattr(mesh, "etp") else 1
        experts_per_rank(moe.n_experts, ep)
        self.comm = mesh.comm("ep", impl=impl)
        self.etp_comm = mesh.comm("etp", impl=impl) if etp > 1 else None
        self.group_comm = mesh.comm(("ep", "etp") if etp > 1 else "ep", impl=impl)   # all-gather dispatch
        sizes = getattr(mesh, "sizes", {})
        token_dims = tuple(d for d in ("cp", "tp") if sizes.get(d, 1) > 1)
        self.token_comm = mesh.comm(token_dims, impl=impl) if token_dims else None
        self.token_index, self.dropped = None, None
        self.ep, self.etp, self.dispatch = ep, etp, dispatch
        self.n_experts, self.local = moe.n_experts, moe.n_experts // ep
        self.top_k, self.capacity_factor = moe.top_k, moe.capacity_factor
        self.normalize_topk = moe.normalize_topk    # renormalise the k weights as one device does
        self.first = self.comm.rank * self.local
        self.router, self.shared = moe.router, moe.shared
        etp_rank = self.etp_comm.rank if etp > 1 else 0
        self.bias_here = etp_rank == 0                                # w2's bias: once per row
        self.experts = LocalExperts([net if etp == 1 else slice_expert(net, etp, etp_rank)
                                     for net in moe.experts[self.first:self.first + self.local]], etp, self.bias_here)
        replicas = mesh.expert_replicas() if hasattr(mesh, "expert_replicas") else ("edp",)
        set_reduce_dims(self.experts, replicas)      # the ranks holding the same experts
        if etp > 1:                                  # the bias: added on etp rank 0 for the rows of all
            set_reduce_dims([net.w2.bias for net in self.experts if net.w2.bias is not None], replicas + ("etp",))

    def route(self, x):
        """x (T, h) -> expert (T, k), weight (T, k), keep (T, k), counts (E,), aux: as
        :func:`course_lib.moe.route` on this rank's routing group. Over cp x tp, the group's
        router logits are all-gathered with each token's place in the group, and every rank
        routes the whole group in the single-device order, its own rows live (their gradient:
        the weights, and the load-balancing loss through the group's mean probabilities)."""
        logits = self.router(x)                                       # (T, E)
        args = (self.top_k, self.capacity_factor, self.normalize_topk)
        if self.token_comm is None:                                   # the group: my tokens
            out = route(logits, *args)
            self.dropped = (~out[2]).nonzero()                        # (token, choice) pairs dropped
            return out
        T, g, me = x.shape[0], self.token_comm.size, self.token_comm.rank
        if self.token_index is None or len(self.token_index) != T:
            raise ValueError(f"ExpertParallelMoE over cp x tp needs token_index (set by parallelize_nd's step) "
                             f"for its {T} tokens, got {None if self.token_index is None else len(self.token_index)}")
        index = gather_along(self.token_comm, self.token_index, 0, "routing: token places")      # (g*T,)
        table = gather_along(self.token_comm, logits.detach(), 0, "routing: logits")           # (g*T, E)
        rows = list(table.split(T))
        rows[me] = logits                                             # my rows live, the others' fixed
        order = torch.argsort(index)                                  # the single-device token order
        expert, weight, keep, counts, aux = route(torch.cat(rows)[order], *args)
        self.dropped = (~keep).nonzero()                              # in the group's token order
        mine = torch.argsort(order).view(g, T)[me]                    # my tokens' places in that order
        return expert[mine], weight[mine], keep[mine], counts, aux

    def forward(self, x):  # x (T, h): this rank's tokens -> (T, h), aux loss of its routing group
        expert, weight, keep, _, aux = self.route(x)
        y = shared_output(self.shared, x)
        if self.dispatch == "all_gather":
            return y + self._gathered(x, expert, weight, keep), aux
        return y + self._all_to_all(x, expert, weight, keep), aux

    def _run_experts(self, rows, local_e):
        """rows (R, h) for my experts ``local_e`` (R,) -> their outputs (R, h); with etp the
        rows of my etp peers join (all-gather) and the partial sums go back (reduce-scatter)."""
        if self.etp > 1:
            count = torch.tensor([len(rows)], device=local_e.device)
            sizes = gather_along(self.etp_comm, count, 0, "ETP row counts").tolist()
            rows = GatherRows.apply(rows, self.etp_comm, sizes, "ETP all-gather")
            local_e = gather_rows(local_e, self.etp_comm, sizes, "ETP expert ids")
        with trace.span("experts", kind="compute"):
            by_expert = torch.sort(local_e, stable=True).indices      # rows of expert 0, 1, ...
            counts = torch.bincount(local_e, minlength=self.local).tolist()
            outs = self.experts(rows[by_expert].split(counts))
            done = torch.cat(outs)[torch.argsort(by_expert)]          # back to the received order
        if self.etp > 1:
            done = ScatterRows.apply(done, self.etp_comm, sizes, "ETP reduce-scatter")
        return done

    def _all_to_all(self, x, expert, weight, keep):
        tok, j = torch.nonzero(keep, as_tuple=True)                   # kept assignments (M,)
        e = expert[tok, j]
        order = torch.sort(e, stable=True).indices                    # grouped by expert
        tok, j, e = tok[order], j[order], e[order]
        counts = torch.bincount(e, minlength=self.n_experts)          # (E,) rows per expert
        recv_counts = torch.empty_like(counts)                        # (ep * E/ep,): [source][my expert]
        self.comm.all_to_all_single(recv_counts, counts, name="expert counts")
        send_splits = dispatch_splits(counts, self.ep)
        recv_counts = recv_counts.view(self.ep, self.local)           # (ep sources, E/ep local experts)
        recv_splits = recv_counts.sum(1).tolist()
        rows = AllToAll.apply(x[tok], self.comm, recv_splits, send_splits, "dispatch")    # (R, h)
        local_e = torch.arange(self.local, device=counts.device)
        local_e = local_e.repeat(self.ep).repeat_interleave(recv_counts.flatten())
        done = self._run_experts(rows, local_e)
        back = AllToAll.apply(done, self.comm, send_splits, recv_splits, "combine")      # (M, h)
        return torch.zeros_like(x).index_add(0, tok, back * weight[tok, j, None])

    def _gathered(self, x, expert, weight, keep):
        """All-gather dispatch: the ep x etp group's tokens on every rank, my experts run on the
        ones routed to them, the weighted sums reduce-scattered back to their ranks."""
        n = self.group_comm.size
        sizes = [x.shape[0]] * n
        xs = GatherRows.apply(x, self.group_comm, sizes, "dispatch")                    # (n*T, h)
        ws = GatherRows.apply(weight * keep, self.group_comm, sizes, "router weights")  # (n*T, k)
        es = gather_rows(torch.where(keep, expert, -1), self.group_comm, sizes, "expert ids")   # -1: dropped
        out = torch.zeros_like(xs)
        with trace.span("experts", kind="compute"):
            picks = [torch.nonzero(es == self.first + i, as_tuple=True) for i in range(self.local)]
            for (tok, j), y in zip(picks, self.experts([xs[tok] for tok, _ in picks])):
                out = out.index_add(0, tok, y * ws[tok, j, None])
        return ScatterRows.apply(out, self.group_comm, sizes, "combine")                 # (T, h)

    def tokens_per_expert(self, x):
        """Assignments per expert (E,) of this rank's routing group, before dropping."""
        return self.route(x)[3]


__all__ = ["AllToAll", "GatherRows", "ScatterRows", "ExpertParallelMoE", "LocalExperts", "DISPATCH", "dispatch_splits",
           "experts_per_rank", "rule_experts", "token_index", "expert_tp_plan", "slice_expert", "gather_rows",
           "scatter_rows"]
