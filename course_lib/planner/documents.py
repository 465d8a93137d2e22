"""Packed documents under context parallelism, priced by counting (no tensors, no import of
the ranks' code): the (query, key) pairs each CP rank's queries see when attention never
crosses a document, for the three ways the ranks split the sequence (chapter 7):

* ``"contiguous"``: rank r holds tokens [r s/N, (r+1) s/N);
* ``"zigzag"``: rank r holds chunks r and 2N-1-r of 2N equal chunks of the whole sequence;
* ``"documents"``: chunks r and 2N-1-r of every document (each a multiple of 2N tokens).

A query at position q of a document that starts at d sees q - d + 1 keys (causal), so a run
of queries [a, b) inside one document sees the arithmetic series sum_{q=a}^{b-1} (q - d + 1).
That is the work an attention kernel that skips masked tiles (FlashAttention's varlen) cannot
avoid: the slowest rank's pairs set the layer's attention time (:func:`attention_scale`).
"""
from __future__ import annotations

LAYOUTS = ("zigzag", "contiguous", "documents")


def _pairs(a: int, b: int, d: int) -> int:
    """sum over queries q in [a, b) of (q - d + 1): their visible keys in a document from d."""
    n = b - a
    return 0 if n <= 0 else n * (a - d + 1) + n * (n - 1) // 2


def _runs_pairs(runs, documents) -> int:
    """Visible pairs of the query runs [a, b) of the sequence packed with ``documents``."""
    total, start = 0, 0
    for length in documents:
        for a, b in runs:
            total += _pairs(max(a, start), min(b, start + length), start)
        start += length
    return total


def rank_runs(seq_len: int, cp: int, rank: int, layout: str, documents=()) -> list[tuple[int, int]]:
    """The query runs [a, b) CP rank ``rank`` holds under ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"cp layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "contiguous":
        c = seq_len // cp
        return [(rank * c, (rank + 1) * c)]
    spans, start = ([(0, seq_len)] if layout == "zigzag" or not documents else []), 0
    for length in (documents if layout == "documents" else ()):
        spans.append((start, start + length))
        start += length
    runs = []
    for a, b in spans:
        c = (b - a) // (2 * cp)
        runs += [(a + rank * c, a + (rank + 1) * c), (a + (2 * cp - 1 - rank) * c, a + (2 * cp - rank) * c)]
    return runs


def work_per_rank(seq_len: int, cp: int, layout: str, documents=()) -> list[int]:
    """Visible (query, key) pairs of every CP rank's queries; ``documents`` (lengths, summing to
    ``seq_len``; () for one document)."""
    docs = tuple(documents) or (seq_len,)
    return [_runs_pairs(rank_runs(seq_len, cp, r, layout, docs), docs) for r in range(cp)]


def attention_scale(seq_len: int, cp: int, layout: str, documents=()) -> float:
    """The slowest CP rank's attention work against a balanced causal sequence's share
    (s (s + 1) / 2 / N pairs): below 1 when short documents leave little to attend to, above
    their own mean when the split leaves one rank most of it."""
    return max(work_per_rank(seq_len, cp, layout, documents)) * cp / (seq_len * (seq_len + 1) / 2)


__all__ = ["LAYOUTS", "rank_runs", "work_per_rank", "attention_scale"]
