"""Graders of chapter 7: the pieces of ring attention a learner writes.

    check_merge_partial(merge)           # (out1, lse1, out2, lse2) -> (out, lse): online softmax
    check_zigzag_positions(positions)    # (seq_len, cp_size, cp_rank) -> int64 positions

Each prints one line (``merge_partial: 5/5 cases passed`` or the first failing case with a
hint) and returns True/False; a learner's exception becomes the hint, never a traceback.
"""
from __future__ import annotations

import torch

from course_lib.grading import Case, Mismatch, check, compare


def _qkv(seq, heads, seed, scale):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, heads, seq, 8, generator=g) for _ in range(3))
    return q * scale, k, v


def _two_blocks(q, k, v, cut):
    """The partial attentions (out, lse) of all queries over keys [:cut] and over keys [cut:]."""
    from course_lib.parallel.context_parallel import block_attention

    pos = torch.arange(q.shape[2])
    return (block_attention(q, k[:, :, :cut], v[:, :, :cut], pos, pos[:cut]),
            block_attention(q, k[:, :, cut:], v[:, :, cut:], pos, pos[cut:]))


def check_merge_partial(merge) -> bool:
    """``merge(out1, lse1, out2, lse2)`` must return the attention over both key blocks and
    its log-sum-exp; the cases include queries that see no key of one block (lse = -inf)
    and scores large enough to overflow a naive exp."""
    from course_lib.attention import causal_attention

    cases = [Case(dict(seq=6, cut=3, heads=2, seed=0, scale=1.0), label="6 tokens, cut at 3 (rows 0-2 see no key of block 2)"),
             Case(dict(seq=8, cut=1, heads=1, seed=1, scale=1.0), label="8 tokens, cut at 1"),
             Case(dict(seq=8, cut=7, heads=3, seed=2, scale=1.0), label="8 tokens, cut at 7"),
             Case(dict(seq=5, cut=2, heads=2, seed=3, scale=200.0), label="large scores (exp overflows without the max)"),
             Case(dict(seq=6, cut=3, heads=2, seed=4, scale=1.0, swap=True), label="blocks given in the other order")]

    def run(case):
        p = dict(case.params)
        swap = p.pop("swap", False)
        q, k, v = _qkv(p["seq"], p["heads"], p["seed"], p["scale"])
        first, second = _two_blocks(q, k, v, p["cut"])
        if swap:
            first, second = second, first
        got = merge(first[0].clone(), first[1].clone(), second[0].clone(), second[1].clone())
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise Mismatch(f"return (out, lse), got {type(got).__name__}")
        out, lse = got
        expected_lse = torch.logsumexp(torch.stack([first[1], second[1]]), dim=0)
        msg = compare(out, causal_attention(q, k, v), rtol=1e-4, atol=1e-5, what="out")
        return msg or compare(lse, expected_lse, rtol=1e-4, atol=1e-5, what="lse")

    return check("merge_partial", cases, run)


def check_zigzag_positions(positions) -> bool:
    """``positions(seq_len, cp_size, cp_rank)``: rank i's tokens are chunks i and 2N-1-i of
    2N, as an int64 tensor in increasing order; a length not divisible by 2N raises ValueError."""
    from course_lib.parallel.context_parallel import zigzag_positions

    cases = [Case(dict(seq=8, n=2), label="seq_len=8, cp=2"), Case(dict(seq=12, n=3), label="seq_len=12, cp=3"),
             Case(dict(seq=32, n=4), label="seq_len=32, cp=4"), Case(dict(seq=6, n=1), label="seq_len=6, cp=1"),
             Case(dict(seq=10, n=2, bad=True), label="seq_len=10, cp=2: must raise ValueError")]

    def run(case):
        p = case.params
        if p.get("bad"):
            try:
                positions(p["seq"], p["n"], 0)
            except ValueError:
                return None
            except Exception as e:  # noqa: BLE001 - the wrong exception is a hint
                return f"raised {type(e).__name__}, expected ValueError"
            return "returned positions, expected ValueError (10 tokens do not cut into 4 chunks)"
        for r in range(p["n"]):
            msg = compare(positions(p["seq"], p["n"], r), zigzag_positions(p["seq"], p["n"], r), what=f"rank {r}")
            if msg:
                return msg
        return None

    return check("zigzag_positions", cases, run)


__all__ = ["check_merge_partial", "check_zigzag_positions"]
