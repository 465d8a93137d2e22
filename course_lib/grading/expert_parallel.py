"""Graders of chapter 8: the pieces of expert parallelism a learner writes.

    check_dispatch_split_sizes(split_sizes)   # (counts (ep, E), ep_rank) -> (input_splits, output_splits)
    check_switch_aux_loss(aux_loss)           # (logits (T, E), top_k) -> scalar tensor, with its gradient

Each prints one line (``dispatch_split_sizes: 6/6 cases passed`` or the first failing case
with a hint) and returns True/False; a learner's exception becomes the hint, never a traceback.
Both run on one process: nothing to hang on.
"""
from __future__ import annotations

import torch

from course_lib.grading import Case, Mismatch, check, compare


def _counts(ep, n_experts, tokens, top_k, seed, skew=0.0, capacity_factor=1.0):
    """(ep, E) kept assignments per (source rank, expert) of a real routing of random tokens."""
    from course_lib.moe import route

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(ep):
        logits = torch.randn(tokens, n_experts, generator=g)
        logits[:, 0] += skew                                   # skew > 0: expert 0 is popular
        expert, _, keep, _, _ = route(logits, top_k, capacity_factor)
        rows.append(torch.bincount(expert[keep], minlength=n_experts))
    return torch.stack(rows)


def _expected_splits(counts, ep_rank):
    from course_lib.parallel.expert_parallel import dispatch_splits

    ep, n_experts = counts.shape
    local = n_experts // ep
    send = dispatch_splits(counts[ep_rank], ep)
    recv = counts[:, ep_rank * local:(ep_rank + 1) * local].sum(1).tolist()
    return send, recv


def _as_ints(x, what):
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if not isinstance(x, (list, tuple)):
        raise Mismatch(f"{what}: expected a list of ints, got {type(x).__name__}")
    try:
        return [int(v) for v in x]
    except (TypeError, ValueError):
        raise Mismatch(f"{what}: expected a list of ints, got {x!r}") from None


def check_dispatch_split_sizes(split_sizes) -> bool:
    """``split_sizes(counts, ep_rank)``: ``counts[r, e]`` = kept assignments of EP rank r's
    tokens to expert e (E experts, E/ep consecutive ones per rank). Must return this rank's
    ``(input_split_sizes, output_split_sizes)`` for the dispatch ``all_to_all_single``:
    rows sent to each rank, rows received from each rank."""
    cases = [Case(dict(ep=2, E=4, T=8, k=2, seed=0), label="ep=2, 4 experts, top-2"),
             Case(dict(ep=3, E=6, T=10, k=1, seed=1), label="ep=3, 6 experts, top-1"),
             Case(dict(ep=4, E=4, T=12, k=2, seed=2), label="ep=4, one expert per rank"),
             Case(dict(ep=2, E=8, T=16, k=2, seed=3, skew=6.0, cf=0.5), label="ep=2, 8 experts, skewed, tokens dropped"),
             Case(dict(ep=4, E=8, T=6, k=1, seed=4, skew=9.0, cf=4.0), label="ep=4: most ranks receive nothing"),
             Case(dict(ep=1, E=3, T=5, k=2, seed=5), label="ep=1: everything stays")]

    def run(case):
        p = case.params
        counts = _counts(p["ep"], p["E"], p["T"], p["k"], p["seed"], p.get("skew", 0.0), p.get("cf", 1.0))
        for r in range(p["ep"]):
            send, recv = _expected_splits(counts, r)
            got = split_sizes(counts.clone(), r)
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                return f"rank {r}: return (input_split_sizes, output_split_sizes), got {type(got).__name__}"
            got_send, got_recv = _as_ints(got[0], "input_split_sizes"), _as_ints(got[1], "output_split_sizes")
            if (got_send, got_recv) == (recv, send) and send != recv:
                return f"rank {r}: input and output split sizes are swapped (input = rows this rank SENDS)"
            if len(got_send) == p["E"] != p["ep"]:
                return f"rank {r}: {p['E']} split sizes, one per expert: the all-to-all needs one per RANK (ep={p['ep']})"
            msg = (compare(got_send, send, what=f"rank {r} input_split_sizes (counts {counts.tolist()})")
                   or compare(got_recv, recv, what=f"rank {r} output_split_sizes (counts {counts.tolist()})"))
            if msg:
                return msg
        return None

    return check("dispatch_split_sizes", cases, run)


def check_switch_aux_loss(aux_loss) -> bool:
    """``aux_loss(logits, top_k)`` = E * sum_e f_e * P_e (Switch Transformer eq. 4, top-k as
    in GShard): f_e the fraction of the T*k top-k assignments that chose expert e (before any
    dropping; no gradient), P_e the mean router probability of e. Value and gradient are
    compared with ``course_lib.moe.route``'s."""
    from course_lib.moe import route

    def balanced(T, E):
        logits = torch.full((T, E), -4.0)
        logits[torch.arange(T), torch.arange(T) % E] = 4.0     # token t -> expert t mod E
        return logits

    def collapsed(T, E):
        logits = torch.zeros(T, E)
        logits[:, 0] = 20.0                                    # everyone -> expert 0
        return logits

    def random(T, E, seed):
        return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * 2

    cases = [Case(dict(logits=lambda: random(16, 4, 0), k=1), label="16 tokens, 4 experts, top-1"),
             Case(dict(logits=lambda: random(12, 6, 1), k=2), label="12 tokens, 6 experts, top-2"),
             Case(dict(logits=lambda: balanced(8, 4), k=1), label="balanced routing: the loss is 1"),
             Case(dict(logits=lambda: collapsed(8, 4), k=1), label="every token to expert 0: the loss is about E = 4"),
             Case(dict(logits=lambda: random(5, 8, 2), k=3), label="5 tokens, 8 experts, top-3"),
             Case(dict(logits=lambda: random(1, 2, 3), k=2), label="1 token, top-k = E = 2")]

    def run(case):
        logits = case.params["logits"]()
        k = case.params["k"]
        mine, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        expected = route(ref, k, 1.0)[4]
        expected.backward()
        got = aux_loss(mine, k)
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            return f"return a scalar tensor, got {type(got).__name__}" + (
                f" of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else "")
        msg = compare(got.detach().reshape(()).float(), expected.detach(), rtol=1e-5, atol=1e-6, what="aux loss")
        if msg:
            return msg
        if not got.requires_grad:
            return "the loss carries no gradient: P_e (the mean router probability) must stay differentiable"
        got.reshape(()).backward()
        msg = compare(mine.grad, ref.grad, rtol=1e-4, atol=1e-6, what="d aux / d logits")
        if msg:
            return msg + " (f_e counts top-k choices: no gradient through it; only P_e carries one)"
        return None

    return check("switch_aux_loss", cases, run)


__all__ = ["check_dispatch_split_sizes", "check_switch_aux_loss"]
