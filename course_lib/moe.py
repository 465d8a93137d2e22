"""A mixture-of-experts MLP on one device: the reference expert parallelism is checked against.

    moe = MoE(hidden=16, ffn=32, n_experts=4, top_k=2, capacity_factor=1.25, seed=0)
    y, aux = moe(x, groups=2)        # x (T, h) -> y (T, h); aux: load-balancing loss

Each expert is an MLP h -> ffn -> h: ``mlp="gelu"`` (GPT-2's, with biases: Switch, GShard) or
``mlp="swiglu"`` (Llama's three matrices w2(silu(w1 x) * w3 x), no biases: Mixtral, Qwen-MoE,
DeepSeekMoE).

Routing (Switch Transformer / GShard): a linear router gives each token a softmax over the
E experts; the token goes to its top-k experts, its output is the sum of their outputs
weighted by their router probabilities (Switch's rule; with ``normalize_topk=True`` the k
weights are divided by their sum, GShard's and Mixtral's rule, so they add up to 1). Each expert takes at most
``capacity = ceil(capacity_factor * T_group * k / E)`` tokens of a group; assignments are
served first choices first, then in token order, and the rest are **dropped** (output 0
for that choice: the residual connection carries the token). ``capacity_factor=None``:
dropless (every assignment served, MegaBlocks / Megatron's default). ``n_shared``: DeepSeekMoE's
shared experts, applied to every token with weight 1 beside the routed ones (with many
small routed experts and top-k > 2: its "fine-grained" experts). ``groups``: the tokens are
routed in ``groups`` equal groups, capacity and auxiliary loss computed per group (GShard's
groups): with expert parallelism, a group is one rank's tokens.

Auxiliary loss (Switch, eq. 4): ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of the
group's assignments routed to expert e (before dropping) and ``P_e`` the mean router
probability of e; 1 when balanced, E when one expert takes everything. Averaged over groups.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.init import draw_device


EXPERT_MLPS = ("gelu", "swiglu")


class Expert(nn.Module):
    """One expert, h -> ffn -> h: ``"gelu"``, w2(gelu(w1 x)) with biases (GPT-2's MLP), or
    ``"swiglu"``, w2(silu(w1 x) * w3 x) without (Llama's; Mixtral's experts). Expert tensor
    parallelism cuts ffn: w1's (and w3's) rows, w2's columns."""

    def __init__(self, hidden, ffn, mlp="gelu"):
        super().__init__()
        if mlp not in EXPERT_MLPS:
            raise ValueError(f"an expert's mlp must be one of {EXPERT_MLPS}, got {mlp!r}")
        self.mlp, bias = mlp, mlp == "gelu"
        self.w1 = nn.Linear(hidden, ffn, bias=bias)
        if mlp == "swiglu":
            self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=bias)

    def inner(self, x):  # (n, h) -> (n, ffn): what w2 reads
        if self.mlp == "swiglu":
            return F.silu(self.w1(x)) * self.w3(x)
        return F.gelu(self.w1(x))

    def forward(self, x):  # (n, h) -> (n, h)
        return self.w2(self.inner(x))


def check_moe_config(n_experts, top_k, capacity_factor):
    if n_experts < 1:
        raise ValueError(f"n_experts must be >= 1, got {n_experts}")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({n_experts})")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None: dropless), got {capacity_factor}")


def capacity(tokens, n_experts, top_k, capacity_factor) -> int:
    """Most tokens an expert takes from a group of ``tokens`` (None: dropless, all of them)."""
    if capacity_factor is None:
        return tokens * top_k
    return math.ceil(capacity_factor * tokens * top_k / n_experts)


def shared_output(shared, x):
    """The shared experts' sum on tokens ``x`` (T, h) (zeros without shared experts)."""
    y = torch.zeros_like(x)
    for net in shared:
        y = y + net(x)
    return y


def route(logits, top_k, capacity_factor, normalize=False):
    """logits (T, E) -> expert (T, k), weight (T, k), keep (T, k) bool, counts (E,), aux.

    weight: the chosen experts' router probabilities; ``normalize``: divided by their sum
    over the k choices (GShard, Mixtral: a token's weights add up to 1; Switch's top-1 keeps p).
    keep: the assignment fits in its expert's capacity (first choices first, then by token);
    counts: assignments per expert before dropping."""
    T, E = logits.shape
    probs = F.softmax(logits, dim=-1)                              # (T, E)
    weight, expert = probs.topk(top_k, dim=-1)                     # (T, k)
    if normalize:
        weight = weight / weight.sum(-1, keepdim=True)             # before dropping, as GShard does
    flat = expert.t().reshape(-1)                                  # (k*T,): all 1st choices, then 2nd...
    one_hot = F.one_hot(flat, E)                                   # (k*T, E)
    slot = (one_hot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)  # place in its expert's queue
    keep = (slot < capacity(T, E, top_k, capacity_factor)).view(top_k, T).t()   # (T, k)
    counts = one_hot.sum(0)                                        # (E,)
    aux = E * ((counts.float() / (T * top_k)) * probs.mean(0)).sum()
    return expert, weight, keep, counts, aux


def capacity_keep(expert, n_experts, capacity, weight=None):
    """expert (T, k) -> keep (T, k) bool: the assignment fits in its expert's ``capacity``.
    All first choices are served before any second one; within a choice, in token order (as
    :func:`route` keeps), or with ``weight`` (T, k) the highest router weight first, ties by
    token (Batch Prioritized Routing, Riquelme et al. 2021)."""
    T, k = expert.shape
    order = torch.arange(T).expand(k, T)                           # (k, T): who is served first
    if weight is not None:
        order = torch.stack([torch.sort(-weight[:, j], stable=True).indices for j in range(k)])
    flat = expert.t().gather(1, order).reshape(-1)                 # (k*T,): all 1st choices, then 2nd...
    one_hot = F.one_hot(flat, n_experts)                           # (k*T, E)
    slot = (one_hot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)  # place in its expert's queue
    served = (slot < capacity).view(k, T)
    return torch.zeros_like(served).scatter_(1, order, served).t()


def load_balancing_loss(probs, counts, top_k):
    """Switch Transformer's eq. 4 (top-k as in GShard): E * sum_e f_e P_e, f_e = counts / (T k)
    the fraction of the assignments that chose e (a count: no gradient), P_e the mean router
    probability of e (probs (T, E)); :func:`route`'s aux, in the probabilities' dtype (at least fp32)."""
    T, E = probs.shape
    f = counts.to(torch.promote_types(probs.dtype, torch.float32)) / (T * top_k)
    return E * (f * probs.mean(0)).sum()


class MoE(nn.Module):
    """Router + E experts on one device (see the module docstring)."""

    def __init__(self, hidden, ffn, n_experts, top_k=1, capacity_factor=1.25, seed=0, normalize_topk=False,
                 n_shared=0, mlp="gelu"):
        super().__init__()
        check_moe_config(n_experts, top_k, capacity_factor)
        if n_shared < 0:
            raise ValueError(f"n_shared (shared experts) must be >= 0, got {n_shared}")
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.normalize_topk = normalize_topk
        g = torch.Generator().manual_seed(seed)
        self.router = nn.Linear(hidden, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, ffn, mlp) for _ in range(n_experts))
        self.shared = nn.ModuleList(Expert(hidden, ffn, mlp) for _ in range(n_shared))   # every token, weight 1
        with torch.no_grad():  # one generator, in registration order: the same on every rank
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, device=draw_device(p)) * (0.5 / math.sqrt(p.shape[-1])))

    def forward(self, x, groups: int = 1):  # x (T, h) -> (T, h), aux loss
        if x.shape[0] % groups:
            raise ValueError(f"{x.shape[0]} tokens do not cut into {groups} equal groups")
        ys, auxes = [], []
        for xg in x.chunk(groups):
            expert, weight, keep, _, aux = route(self.router(xg), self.top_k, self.capacity_factor,
                                                 self.normalize_topk)
            y = shared_output(self.shared, xg)
            for e, net in enumerate(self.experts):
                tok, j = torch.nonzero((expert == e) & keep, as_tuple=True)
                y = y.index_add(0, tok, net(xg[tok]) * weight[tok, j, None])
            ys.append(y)
            auxes.append(aux)
        return torch.cat(ys), torch.stack(auxes).mean()


__all__ = ["Expert", "EXPERT_MLPS", "MoE", "route", "capacity", "capacity_keep", "load_balancing_loss",
           "check_moe_config"]
