"""Graders of chapter 7: the pieces of ring attention a learner writes. While the learner's
function runs, the library's context-parallel code and attention are switched off; the
expected answers come from the grader's own attention, computed before.

    check_merge_partial(merge)              # (out1, lse1, out2, lse2) -> (out, lse): online softmax
    check_zigzag_positions(positions)       # (seq_len, cp_size, cp_rank) -> int64 positions
    check_block_attention(block_attention)  # (q, k, v, q_pos, k_pos) -> (out, lse) over one key block
    check_ring_attention(ring_attention)    # on ranks: K/V around the ring, blocks merged

Each prints one line (``merge_partial: 5/5 cases passed`` or the first failing case with a
hint) and returns True/False; a learner's exception becomes the hint, never a traceback.
"""
from __future__ import annotations

import math

import torch

from course_lib.grading import Case, Mismatch, check, check_distributed, compare
from course_lib.grading.guard import TORCH_COLLECTIVES, switched_off

CONTEXT_PARALLEL = ("course_lib.parallel.context_parallel:*", "course_lib.attention:causal_attention",
                    "course_lib.attention:attention_scores",      # and the grader's own answers
                    "course_lib.grading.context_parallel:_attend", "course_lib.grading.context_parallel:_zigzag")


def _attend(q, k, v, q_pos, k_pos):
    """The grader's own block attention in float64: (out, lse), out = 0 and lse = -inf for a
    query that sees no key (key position > query position is hidden)."""
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])     # (b, a, s_q, s_k)
    hidden = k_pos[None, :] > q_pos[:, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                              # (b, a, s_q)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = (scores - safe[..., None]).exp() @ v.double()
    return out.to(q.dtype), lse.to(q.dtype)


def _qkv(seq, heads, seed, scale, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, seq, 8, generator=g, dtype=dtype) for _ in range(3))
    return q * scale, k, v


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- 1. merge
def check_merge_partial(merge) -> bool:
    """``merge(out1, lse1, out2, lse2)`` must return the attention over both key blocks and
    its log-sum-exp; the cases include queries that see no key of one block (lse = -inf),
    queries that see no key of either (out stays 0, lse -inf, no NaN), and scores large
    enough to overflow a naive exp."""
    cases = [Case(dict(seq=6, cut=3, heads=2, seed=0, scale=1.0), label="6 tokens, cut at 3 (rows 0-2 see no key of block 2)"),
             Case(dict(seq=8, cut=1, heads=1, seed=1, scale=1.0), label="8 tokens, cut at 1"),
             Case(dict(seq=8, cut=7, heads=3, seed=2, scale=1.0, dtype=torch.float64), label="8 tokens, cut at 7, float64"),
             Case(dict(seq=5, cut=2, heads=2, seed=3, scale=200.0), label="large scores (exp overflows without the max)"),
             Case(dict(seq=6, cut=3, heads=2, seed=4, scale=1.0, swap=True), label="blocks given in the other order"),
             Case(dict(seq=8, cut=6, heads=2, seed=5, scale=1.0, late=4),
                  label="keys at positions 4-7: queries 0-3 see no key of either block")]

    def run(case):
        p = dict(case.params)
        q, k, v = _qkv(p["seq"], p["heads"], p["seed"], p["scale"], p.get("dtype", torch.float32))
        pos = torch.arange(p["seq"])
        late = p.get("late", 0)                  # keys from position `late` on: the first queries see none
        cut = p["cut"]
        first = _attend(q, k[:, :, late:cut], v[:, :, late:cut], pos, pos[late:cut])
        second = _attend(q, k[:, :, cut:], v[:, :, cut:], pos, pos[cut:])
        want = _attend(q, k[:, :, late:], v[:, :, late:], pos, pos[late:])
        if p.get("swap"):
            first, second = second, first
        with switched_off(CONTEXT_PARALLEL, "the online-softmax merge"):
            got = merge(first[0].clone(), first[1].clone(), second[0].clone(), second[1].clone())
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise Mismatch(f"return (out, lse), got {type(got).__name__}")
        out, lse = got
        if isinstance(out, torch.Tensor) and torch.isnan(out).any():
            return ("NaN in out: where a query sees no key of either block both lse are -inf, and "
                    "exp(-inf - (-inf)) is NaN; its output must stay 0" if late else
                    "NaN in out: exp overflowed or -inf - -inf; subtract the larger lse first")
        tol = _tol(q.dtype)
        return compare(out, want[0], what="out", **tol) or compare(lse, want[1], what="lse", **tol)

    return check("merge_partial", cases, run)


# ----------------------------------------------------------------------------- 2. zigzag
def _zigzag(seq, n, r):
    c = seq // (2 * n)
    return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c)])


def check_zigzag_positions(positions) -> bool:
    """``positions(seq_len, cp_size, cp_rank)``: rank i's tokens are chunks i and 2N-1-i of
    2N, as an int64 tensor in increasing order; a length not divisible by 2N raises ValueError."""
    cases = [Case(dict(seq=8, n=2), label="seq_len=8, cp=2"), Case(dict(seq=12, n=3), label="seq_len=12, cp=3"),
             Case(dict(seq=32, n=4), label="seq_len=32, cp=4"), Case(dict(seq=6, n=1), label="seq_len=6, cp=1"),
             Case(dict(seq=30, n=5), label="seq_len=30, cp=5"),
             Case(dict(seq=10, n=2, bad=True), label="seq_len=10, cp=2: must raise ValueError"),
             Case(dict(seq=12, n=4, bad=True), label="seq_len=12, cp=4: must raise ValueError")]

    def run(case):
        p = case.params
        wants = [] if p.get("bad") else [_zigzag(p["seq"], p["n"], r) for r in range(p["n"])]
        with switched_off(CONTEXT_PARALLEL, "the zigzag layout"):
            if p.get("bad"):
                try:
                    positions(p["seq"], p["n"], 0)
                except ValueError:
                    return None
                except Exception as e:  # noqa: BLE001 - the wrong exception is a hint
                    return f"raised {type(e).__name__}: {e}, expected ValueError"
                return f"returned positions, expected ValueError ({p['seq']} tokens do not cut into {2 * p['n']} chunks)"
            for r in range(p["n"]):
                got, want = positions(p["seq"], p["n"], r), wants[r]
                if isinstance(got, torch.Tensor) and got.dtype == torch.int64 and got.shape == want.shape:
                    c = p["seq"] // p["n"]
                    if torch.equal(got, torch.arange(r * c, (r + 1) * c)) and p["n"] > 1:
                        return f"rank {r}: a contiguous slice; the zigzag takes chunks {r} and {2 * p['n'] - 1 - r}"
                msg = compare(got, want, what=f"rank {r}")
                if msg:
                    return msg
        return None

    return check("zigzag_positions", cases, run)


# ----------------------------------------------------------------------------- 3. block attention
def check_block_attention(block_attention) -> bool:
    """``block_attention(q, k, v, q_pos, k_pos)``: q (b, a, s_q, d), k and v (b, a, s_k, d),
    positions int64; causal by POSITION (a key is visible when k_pos <= q_pos), scale
    1/sqrt(d); returns (out (b, a, s_q, d), lse (b, a, s_q)): out normalised within the block,
    0 where a query sees no key, and lse -inf there."""
    cases = [Case(dict(qp=list(range(6)), kp=list(range(6))), label="one block, causal"),
             Case(dict(qp=[0, 1, 6, 7], kp=[2, 3, 4, 5]), label="zigzag rank 0's queries, keys 2-5 (rows 0-1 see none)"),
             Case(dict(qp=[2, 3, 4, 5], kp=[0, 1, 6, 7]), label="queries 2-5, keys 0, 1, 6, 7 (positions, not indexes)"),
             Case(dict(qp=[0, 1], kp=[4, 5, 6], scale=1.0), label="no query sees a key"),
             Case(dict(qp=list(range(5)), kp=list(range(5)), scale=300.0), label="large scores"),
             Case(dict(qp=[3, 9, 10], kp=[1, 2, 9, 11, 12], dtype=torch.float64), label="float64, uneven blocks")]

    def run(case):
        p = case.params
        q_pos, k_pos = torch.tensor(p["qp"]), torch.tensor(p["kp"])
        dtype = p.get("dtype", torch.float32)
        g = torch.Generator().manual_seed(len(p["qp"]) * 10 + len(p["kp"]))
        q = torch.randn(1, 2, len(q_pos), 8, generator=g, dtype=dtype) * p.get("scale", 1.0)
        k, v = (torch.randn(1, 2, len(k_pos), 8, generator=g, dtype=dtype) for _ in range(2))
        want = _attend(q, k, v, q_pos, k_pos)
        with switched_off(CONTEXT_PARALLEL, "attention over one key block"):
            got = block_attention(q.clone(), k.clone(), v.clone(), q_pos.clone(), k_pos.clone())
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            return f"return (out, lse), got {type(got).__name__}"
        out, lse = got
        if isinstance(out, torch.Tensor) and torch.isnan(out).any():
            return "NaN in out: a query that sees no key has output 0 (a softmax over nothing is not defined)"
        if isinstance(lse, torch.Tensor) and lse.shape == want[1].shape and torch.isnan(lse).any():
            return "NaN in lse: a query that sees no key has lse -inf"
        tol = _tol(dtype)
        msg = compare(out, want[0], what="out", **tol) or compare(lse, want[1], what="lse", **tol)
        if msg and isinstance(out, torch.Tensor) and out.shape == want[0].shape:
            by_index = _attend(q, k, v, torch.arange(len(q_pos)), torch.arange(len(k_pos)))
            if compare(out, by_index[0], **tol) is None:
                return "masked by index, not by position: a key is visible when k_pos <= q_pos"
            unscaled = _attend(q * math.sqrt(q.shape[-1]), k, v, q_pos, k_pos)
            if compare(out, unscaled[0], **tol) is None:
                return "scores are not scaled by 1/sqrt(d)"
        return msg

    return check("block_attention", cases, run)


# ----------------------------------------------------------------------------- 4. ring attention
def _ring_harness(fn, seq, heads, scale):
    import torch.distributed as dist

    from course_lib.grading.traffic import counted_calls

    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seq)
    q, k, v = (torch.randn(1, heads, seq, 4, generator=g, dtype=torch.float64) for _ in range(3))
    q = q * scale
    pos = torch.arange(seq)
    want = _attend(q, k, v, pos, pos)[0]
    mine = _zigzag(seq, n, r)
    args = [t[:, :, mine].clone() for t in (q, k, v)] + [mine.clone()]
    with counted_calls() as calls, switched_off(CONTEXT_PARALLEL + TORCH_COLLECTIVES, "the ring"):
        out = fn(*args)
    if not isinstance(out, torch.Tensor) or out.shape != args[0].shape:
        return f"return this rank's output {tuple(args[0].shape)}, got " + (
            f"{tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__)
    msg = compare(out, want[:, :, mine], rtol=1e-10, atol=1e-12, what=f"positions {mine.tolist()}")
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
    the whole sequence, K/V blocks passed to the next rank (send/recv) cp-1 times and merged."""
    shapes = [(2, 8, 2, 1.0), (3, 12, 1, 1.0), (4, 16, 2, 1.0), (1, 6, 2, 1.0), (3, 6, 2, 100.0)]
    cases = [Case({"fn": ring_attention, "seq": s, "heads": a, "scale": sc}, world_size=n,
                  label=f"cp={n}, seq_len={s}" + (", large scores" if sc > 1 else "")) for n, s, a, sc in shapes]
    return check_distributed("ring_attention", _ring_harness, cases, timeout=20.0)


__all__ = ["check_merge_partial", "check_zigzag_positions", "check_block_attention", "check_ring_attention"]
