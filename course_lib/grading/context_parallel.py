"""Graders of chapter 7: the pieces of ring attention a learner writes, in FlashAttention's
running form (acc, m, l) where the lecture shows the log-sum-exp form (out, lse): the lecture's
code does not answer them. While the learner's function runs, the library's context-parallel
code and attention are switched off; the expected answers come from the library's running
form (``running_block_attention``), computed before.

    check_merge_running(merge)              # (acc1, m1, l1, acc2, m2, l2) -> (acc, m, l): online softmax
    check_zigzag_unshard(unshard)           # [rank r's zigzag tokens] -> the sequence in order
    check_block_attention(block_attention)  # (q, k, v, q_pos, k_pos) -> (acc, m, l) over one key block
    check_ring_attention(ring_attention)    # on ranks: K/V around the ring, blocks merged
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib.attention import causal_attention
from course_lib.grading import Case, Mismatch, check, check_distributed, compare, reorder_tolerance
from course_lib.grading.traffic import counted_calls
from course_lib.grading.guard import TORCH_COLLECTIVES, Shortcut, Tampered, TimeLimit, learner
from course_lib.grading.harness import check_answers
from course_lib.parallel.context_parallel import running_block_attention as _running, zigzag_positions

SECONDS = 10   # a learner's function that runs longer (an endless loop) is stopped with a hint

CONTEXT_PARALLEL = ("course_lib.parallel.context_parallel:*", "course_lib.attention:*",
                    "course_lib.attention:BlockwiseCausalAttention.forward")


def _qkv(seq, heads, seed, scale, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, seq, 8, generator=g, dtype=dtype) for _ in range(3))
    return q * scale, k, v


# ----------------------------------------------------------------------------- 1. merge
def _as_triple(got, *args):
    if not isinstance(got, (tuple, list)) or len(got) != 3 or not all(isinstance(t, torch.Tensor) for t in got):
        raise Mismatch(f"return (acc, m, l) as three tensors, got {type(got).__name__}")
    return got


def _compare_running(got, want, tol):
    acc, m, l = got
    if torch.isnan(acc).any() or torch.isnan(l).any() or torch.isnan(m).any():
        return None   # the caller names the NaN
    return (compare(m, want[1], what="m", **tol) or compare(l, want[2], what="l", **tol)
            or compare(acc, want[0], what="acc", **tol))


def _merge_case(seq, cut, heads, seed, scale, dtype=torch.float32, swap=False, late=0):
    """The running forms of keys late..cut and cut.. (the learner's inputs) and of both together."""
    q, k, v = _qkv(seq, heads, seed, scale, dtype)
    pos = torch.arange(seq)      # keys from position `late` on: the first queries see none
    first = _running(q, k[:, :, late:cut], v[:, :, late:cut], pos, pos[late:cut])
    second = _running(q, k[:, :, cut:], v[:, :, cut:], pos, pos[cut:])
    return dict(args=(*second, *first) if swap else (*first, *second),
                want=_running(q, k[:, :, late:], v[:, :, late:], pos, pos[late:]))


def _merge_differ(got, want, *args):
    acc, m, l = got
    if torch.isnan(acc).any() or torch.isnan(l).any():
        return ("NaN: where a query sees no key of either block both m are -inf, and exp(-inf - (-inf)) "
                "is NaN; its acc and l must stay 0" if torch.isinf(want[1]).any() else
                "NaN: exp overflowed or -inf - -inf; rescale both sides to the larger m")
    msg = _compare_running((acc, m, l), want, reorder_tolerance(want[0].dtype, *want))
    normalised = want[0] / want[2].clamp_min(1e-300)[..., None]
    if msg and compare(acc / l.clamp_min(1e-300)[..., None], normalised,
                       **reorder_tolerance(want[0].dtype, normalised)) is None:
        return (f"{msg}: the normalised output is right, but keep the running form: m the larger max, l and acc "
                f"rescaled to it")
    return msg


def check_merge_running(merge) -> bool:
    """``merge(acc1, m1, l1, acc2, m2, l2)`` must return the running form (acc, m, l) of the
    attention over both key blocks (m the larger max, both sides rescaled to it); the cases
    include queries that see no key of one block (m = -inf, l = 0), queries that see no key of
    either (all stays -inf / 0, no NaN), and scores large enough to overflow a naive exp."""
    cases = [Case(_merge_case(**p), label=label) for p, label in (
        (dict(seq=6, cut=3, heads=2, seed=0, scale=1.0), "6 tokens, cut at 3 (rows 0-2 see no key of block 2)"),
        (dict(seq=8, cut=1, heads=1, seed=1, scale=1.0), "8 tokens, cut at 1"),
        (dict(seq=8, cut=7, heads=3, seed=2, scale=1.0, dtype=torch.float64), "8 tokens, cut at 7, float64"),
        (dict(seq=5, cut=2, heads=2, seed=3, scale=200.0), "large scores (exp overflows without the max)"),
        (dict(seq=6, cut=3, heads=2, seed=4, scale=1.0, swap=True), "blocks given in the other order"),
        (dict(seq=8, cut=6, heads=2, seed=5, scale=1.0, late=4),
         "keys at positions 4-7: queries 0-3 see no key of either block"))]
    return check_answers("merge_running", merge, cases, None, guard=CONTEXT_PARALLEL, seconds=SECONDS,
                         exercise="the online-softmax merge", read=_as_triple, differ=_merge_differ)


# ----------------------------------------------------------------------------- 2. zigzag
def check_zigzag_unshard(unshard) -> bool:
    """``unshard(parts)``: parts[r] (b, s/cp, ...) = rank r's tokens in the zigzag layout (its
    chunks r and 2cp-1-r of 2cp, in that order, along dim 1); returns (b, s, ...), the tokens
    in sequence order. Parts of unequal or odd length raise ValueError."""
    cases = [Case(dict(seq=s, n=n, feat=f, bad=bad), label=label) for s, n, f, bad, label in (
        (8, 2, 0, "", "seq_len=8, cp=2"), (12, 3, 3, "", "seq_len=12, cp=3, (b, s, 3)"), (32, 4, 0, "", "seq_len=32, cp=4"),
        (6, 1, 0, "", "seq_len=6, cp=1"), (30, 5, 2, "", "seq_len=30, cp=5"),
        (10, 2, 0, "odd", "parts of 5 tokens: must raise ValueError"),
        (12, 2, 0, "unequal", "parts of 6 and 4 tokens: must raise ValueError"))]
    answer = learner(unshard, CONTEXT_PARALLEL, exercise="the zigzag layout", seconds=SECONDS)

    def run(case):
        p = case.params
        shape = (2, p["seq"]) + ((p["feat"],) if p["feat"] else ())
        full = torch.randn(*shape, generator=torch.Generator().manual_seed(p["seq"]))
        parts = ([full[:, zigzag_positions(p["seq"], p["n"], r)] for r in range(p["n"])] if not p["bad"] else
                 list(full.chunk(p["n"], 1)) if p["bad"] == "odd" else [full[:, :6], full[:, 6:10]])
        if p["bad"]:
            try:
                answer([t.clone() for t in parts])
            except ValueError:
                return None
            except (Shortcut, TimeLimit, Tampered):
                raise
            except Exception as e:  # noqa: BLE001 - the wrong exception is a hint
                return f"raised {type(e).__name__}: {e}, expected ValueError"
            return "returned a sequence, expected ValueError (each part holds two equal chunks, all parts alike)"
        got = answer([t.clone() for t in parts])
        if isinstance(got, torch.Tensor) and got.shape == full.shape and p["n"] > 1 and \
                torch.equal(got, torch.cat(parts, 1)):
            return "the parts concatenated: each rank holds two chunks, r and 2cp-1-r, not one contiguous slice"
        return compare(got, full, what="sequence")

    return check("zigzag_unshard", cases, run)


# ----------------------------------------------------------------------------- 3. block attention
def check_block_attention(block_attention) -> bool:
    """``block_attention(q, k, v, q_pos, k_pos)``: q (b, a, s_q, d), k and v (b, a, s_k, d),
    positions int64; causal by POSITION (a key is visible when k_pos <= q_pos), scale
    1/sqrt(d); returns the running form (acc (b, a, s_q, d), m (b, a, s_q), l (b, a, s_q)):
    m the largest visible score, l = sum exp(s - m), acc = sum exp(s - m) v; for a query that
    sees no key, m = -inf and l = acc = 0."""
    def inputs(qp, kp, scale=1.0, dtype=torch.float32):
        g = torch.Generator().manual_seed(len(qp) * 10 + len(kp))
        q = torch.randn(1, 2, len(qp), 8, generator=g, dtype=dtype) * scale
        k, v = (torch.randn(1, 2, len(kp), 8, generator=g, dtype=dtype) for _ in range(2))
        return dict(args=(q, k, v, torch.tensor(qp), torch.tensor(kp)))

    cases = [Case(inputs(*p), label=label) for p, label in (
        ((list(range(6)), list(range(6))), "one block, causal"),
        (([0, 1, 6, 7], [2, 3, 4, 5]), "zigzag rank 0's queries, keys 2-5 (rows 0-1 see none)"),
        (([2, 3, 4, 5], [0, 1, 6, 7]), "queries 2-5, keys 0, 1, 6, 7 (positions, not indexes)"),
        (([0, 1], [4, 5, 6], 1.0), "no query sees a key"), ((list(range(5)), list(range(5)), 300.0), "large scores"),
        (([3, 9, 10], [1, 2, 9, 11, 12], 1.0, torch.float64), "float64, uneven blocks"))]

    def differ(got, want, q, k, v, q_pos, k_pos):
        acc, m, l = got
        if torch.isnan(acc).any() or torch.isnan(l).any() or torch.isnan(m).any():
            return "NaN: a query that sees no key has m = -inf and l = acc = 0 (exp(s - m) is NaN there)"
        tol = reorder_tolerance(q.dtype, *want)
        msg = _compare_running((acc, m, l), want, tol)
        if msg and acc.shape == want[0].shape and m.shape == want[1].shape:
            by_index = _running(q, k, v, torch.arange(len(q_pos)), torch.arange(len(k_pos)))
            if compare(m, by_index[1], **tol) is None:
                return "masked by index, not by position: a key is visible when k_pos <= q_pos"
            unscaled = _running(q * math.sqrt(q.shape[-1]), k, v, q_pos, k_pos)
            if compare(m, unscaled[1], **tol) is None:
                return "scores are not scaled by 1/sqrt(d)"
        return msg
    return check_answers("block_attention", block_attention, cases, _running, guard=CONTEXT_PARALLEL,
                         seconds=SECONDS, exercise="attention over one key block", read=_as_triple, differ=differ)


# ----------------------------------------------------------------------------- 4. ring attention
def _ring_harness(fn, seq, heads, scale):
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(1, heads, seq, 4, generator=g, dtype=torch.float64) for _ in range(3))
    q = q * scale
    pos = torch.arange(seq)
    want = causal_attention(q, k, v, pos, pos)                   # one device, float64
    mine = zigzag_positions(seq, n, r)
    args = [t[:, :, mine].clone() for t in (q, k, v)] + [mine.clone()]
    with counted_calls() as calls:
        out = learner(fn, CONTEXT_PARALLEL, TORCH_COLLECTIVES, exercise="the ring", seconds=SECONDS)(*args)
    if not isinstance(out, torch.Tensor) or out.shape != args[0].shape:
        return f"return this rank's output {tuple(args[0].shape)}, got " + (
            f"{tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__)
    msg = compare(out, want[:, :, mine], what=f"positions {mine.tolist()}", **reorder_tolerance(torch.float64, want))
    if msg:
        return msg
    sent = calls.of("send", "isend")
    want_elements = (n - 1) * (args[1].numel() + args[2].numel())
    positions = (n - 1) * args[1].numel() // args[1].shape[-1]     # the block's positions may travel with it
    got_elements = calls.elements("send", "isend")
    if n > 1 and (calls.peers("send", "isend") != {(r + 1) % n} or
                  not want_elements <= got_elements <= want_elements + positions):
        return (f"rank {r} sent {got_elements} values in {len(sent)} messages to ranks "
                f"{sorted(calls.peers('send', 'isend'))}; the ring sends its K and V block to the next rank "
                f"({(r + 1) % n}) cp-1 = {n - 1} times: {want_elements} values")
    return None


def check_ring_attention(ring_attention) -> bool:
    """ring_attention(q, k, v, positions) on each of cp ranks: q, k, v (b, a, s/cp, d), this
    rank's zigzag tokens at ``positions``; returns this rank's causal attention output over
    the whole sequence (acc / l), K/V blocks passed to the next rank (send/recv) cp-1 times and merged."""
    shapes = [(2, 8, 2, 1.0), (3, 12, 1, 1.0), (4, 16, 2, 1.0), (1, 6, 2, 1.0), (3, 6, 2, 100.0)]
    cases = [Case({"fn": ring_attention, "seq": s, "heads": a, "scale": sc}, world_size=n,
                  label=f"cp={n}, seq_len={s}" + (", large scores" if sc > 1 else "")) for n, s, a, sc in shapes]
    return check_distributed("ring_attention", _ring_harness, cases, timeout=15.0)


__all__ = ["check_merge_running", "check_zigzag_unshard", "check_block_attention", "check_ring_attention"]
