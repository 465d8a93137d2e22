"""Graders of chapter 8: the pieces of expert parallelism a learner writes. While the learner's
function runs, the library's routing and expert-parallel layer are switched off; the expected
answers come from the library's routing (course_lib.moe), computed before.

    check_dispatch_split_sizes(split_sizes)   # (counts (ep, E), ep_rank) -> (input_splits, output_splits)
    check_switch_aux_loss(aux_loss)           # (logits (T, E), top_k) -> scalar tensor, with its gradient
    check_capacity_keep(keep_mask)            # (expert (T, k), weight (T, k), n_experts, capacity) -> keep
    check_expert_parallel_forward(moe_fwd)    # on ranks: tokens to their experts and back, by all-to-all
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.grading import Case, Mismatch, check, check_distributed, compare, reorder_tolerance
from course_lib.grading.traffic import counted_calls
from course_lib.grading.guard import learner
from course_lib.grading.harness import guarded
from course_lib.models import init_uniform_
from course_lib.moe import capacity_keep, load_balancing_loss, route
from course_lib.parallel.expert_parallel import dispatch_splits

SECONDS = 10   # a learner's function that runs longer (an endless loop) is stopped with a hint

ROUTING = ("course_lib.moe:route", "course_lib.moe:MoE",   # and where the expected answers come from
           "course_lib.moe:capacity_keep", "course_lib.moe:load_balancing_loss")
EXPERT_PARALLEL = ("course_lib.parallel.expert_parallel:*", "course_lib.parallel.expert_parallel:ExpertParallelMoE",
                   "course_lib.parallel.expert_parallel:AllToAll.forward")


def _counts(ep, n_experts, tokens, top_k, seed, skew, capacity_factor):
    """(ep, E) kept assignments per (source rank, expert) of the library's top-k routing
    (course_lib.moe.route) of random tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(ep):
        logits = torch.randn(tokens, n_experts, generator=g)
        logits[:, 0] += skew                                   # skew > 0: expert 0 is popular
        expert, _, keep, _, _ = route(logits, top_k, capacity_factor)
        rows.append(torch.bincount(expert[keep], minlength=n_experts))
    return torch.stack(rows)


def _as_ints(x, what):
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if not isinstance(x, (list, tuple)):
        raise Mismatch(f"{what}: expected a list of ints, got {type(x).__name__}")
    try:
        return [int(v) for v in x]
    except (TypeError, ValueError):
        raise Mismatch(f"{what}: expected a list of ints, got {x!r}") from None


# ----------------------------------------------------------------------------- 1. split sizes
def check_dispatch_split_sizes(split_sizes) -> bool:
    """``split_sizes(counts, ep_rank)``: ``counts[r, e]`` = kept assignments of EP rank r's
    tokens to expert e (E experts, E/ep consecutive ones per rank). Must return this rank's
    ``(input_split_sizes, output_split_sizes)`` for the dispatch ``all_to_all_single``:
    rows sent to each rank, rows received from each rank."""
    cases = [Case(dict(zip(("ep", "E", "T", "k", "seed", "skew", "cf"), row)), label=label) for *row, label in (
        (2, 4, 8, 2, 0, 0.0, 1.0, "ep=2, 4 experts, top-2"), (3, 6, 10, 1, 1, 0.0, 1.0, "ep=3, 6 experts, top-1"),
        (4, 4, 12, 2, 2, 0.0, 1.0, "ep=4, one expert per rank"),
        (2, 8, 16, 2, 3, 6.0, 0.5, "ep=2, 8 experts, skewed, tokens dropped"),
        (4, 8, 6, 1, 4, 9.0, 4.0, "ep=4: most ranks receive nothing"), (3, 9, 7, 3, 6, 0.0, 1.0, "ep=3, 9 experts, top-3"),
        (1, 3, 5, 2, 5, 0.0, 1.0, "ep=1: everything stays"))]

    answer = learner(split_sizes, EXPERT_PARALLEL, exercise="the dispatch's split sizes", seconds=SECONDS)

    def run(case):
        p = case.params
        ep, counts = p["ep"], _counts(p["ep"], p["E"], p["T"], p["k"], p["seed"], p["skew"], p["cf"])
        for r in range(ep):
            send, recv = dispatch_splits(counts[r], ep), [dispatch_splits(row, ep)[r] for row in counts]
            got = answer(counts.clone(), r)
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                return f"rank {r}: return (input_split_sizes, output_split_sizes), got {type(got).__name__}"
            got_send, got_recv = _as_ints(got[0], "input_split_sizes"), _as_ints(got[1], "output_split_sizes")
            if (got_send, got_recv) == (recv, send) and send != recv:
                return f"rank {r}: input and output split sizes are swapped (input = rows this rank SENDS)"
            if len(got_send) == p["E"] != ep:
                return f"rank {r}: {p['E']} split sizes, one per expert: the all-to-all needs one per RANK (ep={ep})"
            if got_send == send and got_recv != recv and sum(got_recv) == sum(recv):
                return (f"rank {r}: output_split_sizes {got_recv}, expected {recv}: one entry per SOURCE rank, "
                        f"the rows it sends to my experts (counts {counts.tolist()})")
            msg = (compare(got_send, send, what=f"rank {r} input_split_sizes (counts {counts.tolist()})")
                   or compare(got_recv, recv, what=f"rank {r} output_split_sizes (counts {counts.tolist()})"))
            if msg:
                return msg
        return None

    return check("dispatch_split_sizes", cases, run)


# ----------------------------------------------------------------------------- 2. auxiliary loss
def check_switch_aux_loss(aux_loss) -> bool:
    """``aux_loss(logits, top_k)`` = E * sum_e f_e * P_e (Switch Transformer eq. 4, top-k as
    in GShard): f_e the fraction of the T*k top-k assignments that chose expert e (before any
    dropping; no gradient), P_e the mean router probability of e. Value and gradient, in the
    logits' dtype."""
    def logits_of(kind, T, E, seed=0, dtype=torch.float32):
        if kind == "balanced":                                 # token t -> expert t mod E
            return torch.full((T, E), -4.0).index_put_((torch.arange(T), torch.arange(T) % E), torch.tensor(4.0))
        if kind == "collapsed":                                # everyone -> expert 0
            return torch.zeros(T, E).index_fill_(1, torch.tensor([0]), 20.0)
        return torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 2

    cases = [Case(dict(logits=logits, k=k), label=label) for logits, k, label in (
        (("random", 16, 4, 0), 1, "16 tokens, 4 experts, top-1"), (("random", 12, 6, 1), 2, "12 tokens, 6 experts, top-2"),
        (("balanced", 8, 4), 1, "balanced routing: the loss is 1"),
        (("collapsed", 8, 4), 1, "every token to expert 0: the loss is about E = 4"),
        (("random", 5, 8, 2), 3, "5 tokens, 8 experts, top-3"),
        (("random", 7, 5, 4, torch.float64), 2, "float64 logits, top-2"), (("random", 1, 2, 3), 2, "1 token, top-k = E = 2"))]

    answer = learner(aux_loss, ROUTING, exercise="the load-balancing loss", seconds=SECONDS)

    def run(case):
        logits, k = logits_of(*case.params["logits"]), case.params["k"]
        mine, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        expected = load_balancing_loss(ref.softmax(-1), route(ref, k, 1.0)[3], k)   # the library's, in ref's dtype
        expected.backward()
        got = answer(mine, k)
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            return f"return a scalar tensor, got {type(got).__name__}" + (
                f" of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else "")
        got = got.reshape(())
        if k > 1 and abs(got.item() - k * expected.item()) < 1e-5 * k * abs(expected.item()):
            return f"the loss is {k} times too large (top-{k}): f_e is the fraction of the T*k assignments"
        tol = reorder_tolerance(logits.dtype, expected, ref.grad)
        msg = compare(got.detach(), expected.detach(), what="aux loss", **tol)
        if msg:
            return msg
        if not got.requires_grad:
            return "the loss carries no gradient: P_e (the mean router probability) must stay differentiable"
        got.backward()
        msg = compare(mine.grad, ref.grad, what="d aux / d logits", **tol)
        if msg:
            return msg + " (f_e counts top-k choices: no gradient through it; only P_e carries one)"
        return None

    return check("switch_aux_loss", cases, run)


# ----------------------------------------------------------------------------- 3. capacity
def check_capacity_keep(keep_mask) -> bool:
    """``keep_mask(expert, weight, n_experts, capacity)``: expert (T, k) int64, the top-k
    choices of T tokens (column 0 the first choice), weight (T, k) their router probabilities;
    returns (T, k) bool: the assignment fits in its expert's ``capacity``. Batch Prioritized
    Routing (Riquelme et al. 2021): all first choices before any second one, and within a
    choice the highest weight first (ties: the earlier token)."""
    def routed(T, E, k=None, seed=None, skew=0.0, ties=False):
        """Given (expert, weight) as lists or tensors, or top-k routing of T random tokens over E experts."""
        if not isinstance(T, int):
            return tuple(x if isinstance(x, torch.Tensor) else torch.tensor(x) for x in (T, E))
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(T, E, generator=g)
        logits[:, 0] += skew
        if ties:
            logits = logits.round()                                   # equal weights: token order decides
        weight, expert = logits.softmax(-1).topk(k, dim=-1)
        return expert, weight

    cases = [Case(dict(routed=r, E=E, cap=cap), label=label) for r, E, cap, label in (
        ((8, 4, 1, 0), 4, 2, "8 tokens, top-1, capacity 2"),
        ((10, 4, 2, 1, 3.0), 4, 4, "10 tokens, top-2, expert 0 popular, capacity 4"),
        ((6, 3, 2, 2), 3, 1, "top-2, capacity 1"), ((9, 3, 1, 5, 0.0, True), 3, 2, "equal weights, capacity 2"),
        (([[0], [0], [0], [1]], [[0.5], [0.5], [0.5], [0.9]]), 2, 2,
         "tokens 0-2 tied for expert 0, capacity 2: the earlier tokens stay"),
        (([[1, 0], [0, 2], [2, 1]], [[0.45, 0.44], [0.40, 0.35], [0.50, 0.30]]), 3, 1,
         "a confident second choice against a first choice, capacity 1"),
        ((5, 4, 3, 3), 4, 0, "capacity 0: everything dropped"), ((7, 5, 2, 4), 5, 14, "capacity larger than the tokens"),
        ((torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)), 3, 2, "no tokens"))]

    answer = learner(keep_mask, ROUTING, exercise="the capacity rule", seconds=SECONDS)

    def run(case):
        (expert, weight), E, cap = routed(*case.params["routed"]), case.params["E"], case.params["cap"]
        want, by_token = capacity_keep(expert, E, cap, weight), capacity_keep(expert, E, cap)
        got = answer(expert.clone(), weight.clone(), E, cap)
        if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or got.shape != want.shape:
            return f"return a bool tensor of shape {tuple(want.shape)}, got " + (
                f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__)
        if torch.equal(got, want):
            return None
        if torch.equal(got, by_token):
            return "you served the tokens in order: within a choice, the highest router weight goes first"
        if weight.numel() and torch.equal(got, capacity_keep(expert.flip(0), E, cap, weight.flip(0)).flip(0)):
            return "equal weights: the EARLIER token goes first (a stable sort by weight keeps token order)"
        kept = torch.bincount(expert[got], minlength=E) if got.any() else torch.zeros(E, dtype=torch.int64)
        if (kept > cap).any():
            return f"expert {int(kept.argmax())} keeps {int(kept.max())} assignments, more than its capacity {cap}"
        firsts_dropped = (~got[:, 0] & want[:, 0]).any() if expert.shape[1] > 1 else False
        if firsts_dropped:
            return "a first choice was dropped for a second one: all FIRST choices go first, then the second ones"
        return (f"kept {got.int().tolist()}, expected {want.int().tolist()} (experts {expert.tolist()}): "
                f"an expert serves assignments first choices first, the highest weight first, until it is full")

    return check("capacity_keep", cases, run)


# ----------------------------------------------------------------------------- 4. the EP layer on ranks
HID = 4


def _expert(e):
    """A small MLP with biases: expert(gate * x) differs from gate * expert(x) (for a bias-free
    linear map the two are equal, and the wrong order passed)."""
    mlp = torch.nn.Sequential(torch.nn.Linear(HID, 2 * HID), torch.nn.Tanh(), torch.nn.Linear(2 * HID, HID))
    return init_uniform_(mlp.double(), 50 + e)


def _tokens(r, T, E, skew, seed=0):
    """Rank r's tokens (T, h), their expert (T,) and gate weight (T,), and the output gradient."""
    g = torch.Generator().manual_seed(seed * 100 + r)
    x = torch.randn(T, HID, generator=g, dtype=torch.float64)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    logits[:, E - 1] += skew
    gate, expert = logits.softmax(-1).max(-1)
    return x, expert, gate, torch.randn(T, HID, generator=g, dtype=torch.float64)


def _ep_harness(fn, T, E, skew):
    r, ep = dist.get_rank(), dist.get_world_size()
    local = E // ep
    experts, everyone = [_expert(e) for e in range(E)], []   # every rank's tokens' experts
    for s in range(ep):                       # one device: every rank's tokens (an expert's gradient sums them)
        xs, es, gs, Cs = _tokens(s, T, E, skew)
        xs.requires_grad_()
        ys = torch.stack([gs[t] * experts[int(es[t])](xs[t]) for t in range(T)])
        (ys * Cs).sum().backward()
        everyone.append(es)
        if s == r:
            want_x, want, expert, gate, C = xs, ys, es, gs, Cs
    mine = [_expert(e) for e in range(r * local, (r + 1) * local)]          # my block of experts
    everyone = torch.cat(everyone)
    routed_here = int(((everyone // local) == r).sum())       # rows a right dispatch brings to my experts
    xr = want_x.detach().clone().requires_grad_()
    run = guarded(ROUTING, EXPERT_PARALLEL, exercise="expert parallelism's all-to-alls", seconds=SECONDS)
    with counted_calls() as calls:             # forward AND backward: both move the rows
        y = run(fn, xr, expert.clone(), gate.clone(), torch.nn.ModuleList(mine), E)
        if not isinstance(y, torch.Tensor) or y.shape != xr.shape:
            return f"return this rank's outputs ({T}, {HID}), got " + (
                f"{tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__)
        grads = [p.grad for e in experts for p in e.parameters() if p.grad is not None]
        tol = reorder_tolerance(torch.float64, want, want_x.grad, *grads)
        msg = compare(y.detach(), want.detach(), what="output", **tol)
        if msg:
            return f"{msg}: each token comes back to its own row, times its gate weight (gate * expert(x))"
        if not y.requires_grad:
            return ("the output carries no gradient back to the tokens: the all-to-all must be an autograd "
                    "function whose backward is the all-to-all the other way")
        run(lambda: (y * C).sum().backward())
    if xr.grad is None:
        return "the tokens got no gradient: the all-to-all's backward is the all-to-all the other way"
    msg = compare(xr.grad, want_x.grad, what="tokens' gradient", **tol)
    if msg:
        return f"{msg}: the all-to-all's backward sends each row's gradient back where the row came from"
    for i, net in enumerate(mine):
        e = r * local + i
        for (name, p), ref in zip(net.named_parameters(), experts[e].parameters()):
            if p.grad is None:
                if (everyone == e).any():
                    return f"expert {e}'s {name} got no gradient"
                continue
            msg = compare(p.grad, ref.grad if ref.grad is not None else torch.zeros_like(p),
                          what=f"expert {e}'s {name} gradient", **tol)
            if msg:
                return msg
    # a right layer moves max(T, rows routed here) rows per all-to-all, four of them (dispatch and
    # combine, forward and backward), plus the counts (at most ep * E values, twice)
    moved = calls.elements()
    limit = 4 * max(T, routed_here) * HID + 2 * ep * E
    if moved > limit:
        return (f"this rank moved {moved} values over forward and backward ({sorted(calls.ops())}); a row "
                f"should travel only to its expert's rank and back: 4 x max(T = {T}, rows routed here = "
                f"{routed_here}) rows of {HID}, plus the counts, at most {limit}")
    return None


def check_expert_parallel_forward(moe_forward) -> bool:
    """moe_forward(x, expert, gate, local_experts, n_experts) on each of ep ranks: x (T, h)
    this rank's tokens, expert (T,) each token's (top-1) expert, gate (T,) its weight,
    local_experts this rank's E/ep experts (rank j holds experts j*E/ep ...); returns
    y (T, h), y[t] = gate[t] * expert_{expert[t]}(x[t]), differentiable. Compared with one
    device, values and gradients; the rows must travel by all-to-all, each only to its expert."""
    shapes = [(2, 4, 6, 0.0), (3, 3, 5, 0.0), (4, 8, 4, 6.0), (1, 2, 3, 0.0), (2, 2, 1, 9.0)]
    cases = [Case({"fn": moe_forward, "T": T, "E": E, "skew": skew}, world_size=ep,
                  label=f"ep={ep}, {E} experts, {T} tokens per rank" + (", one expert takes most" if skew else ""))
             for ep, E, T, skew in shapes]
    return check_distributed("expert_parallel_forward", _ep_harness, cases, timeout=15.0)


__all__ = ["check_dispatch_split_sizes", "check_switch_aux_loss", "check_capacity_keep",
           "check_expert_parallel_forward"]
