"""Grader of chapter 7's packed-documents question: a balanced split of packed documents.

    check_document_split(split)   # (doc_lengths, cp) -> [positions of rank 0, ..., rank cp-1]

The learner's split must put every token on exactly one rank, the same number on each (the
ring sends equal blocks), and give every rank the same attention work: the (query, key)
pairs it computes inside its documents, counted by the library's
:func:`course_lib.parallel.cp_layouts.visible_pairs`. While the function runs, the library's
layouts are switched off. Documents whose length is not a multiple of 2 * cp must be refused.
"""
from __future__ import annotations

import torch

from course_lib.grading import Case, check
from course_lib.grading.guard import learner
from course_lib.parallel.cp_layouts import imbalance, shard_positions, visible_pairs

LAYOUTS = ("course_lib.parallel.cp_layouts:*", "course_lib.parallel.context_parallel:*")
SECONDS = 10

CASES = [Case(dict(lengths=(8, 24, 16), cp=2), label="documents of 8, 24, 16 tokens, cp=2"),
         Case(dict(lengths=(48, 12, 12, 24), cp=3), label="documents of 48, 12, 12, 24 tokens, cp=3"),
         Case(dict(lengths=(16, 64, 8, 8), cp=4), label="documents of 16, 64, 8, 8 tokens, cp=4"),
         Case(dict(lengths=(40,), cp=4), label="one document of 40 tokens, cp=4"),
         Case(dict(lengths=(6, 10), cp=1), label="cp=1: one rank holds everything"),
         Case(dict(lengths=(8, 10), cp=2), label="a document of 10 tokens, cp=2: must raise ValueError")]


def _doc_ids(lengths):
    return torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])


def _as_positions(got, cp, seq):
    if not isinstance(got, (list, tuple)) or len(got) != cp:
        return None, f"return a list of {cp} position lists, one per rank, got {type(got).__name__}"
    try:
        parts = [torch.as_tensor(p, dtype=torch.long).flatten() for p in got]
    except (TypeError, ValueError, RuntimeError):
        return None, "each rank's positions must be a list or tensor of integers"
    every = sorted(torch.cat(parts).tolist()) if parts else []
    if every != list(range(seq)):
        return None, f"every token 0..{seq - 1} must sit on exactly one rank"
    return parts, None


def _like(parts, seq, cp):
    """The hint for a known unbalanced split: the same tokens on every rank as one of these."""
    mine = [sorted(p.tolist()) for p in parts]
    for layout, hint in (("zigzag", "the zigzag of the whole sequence balances ONE causal triangle; each "
                                    "packed document is a triangle of its own: zigzag every document"),
                         ("contiguous", "contiguous slices: the rank holding a document's end sees the most keys")):
        if mine == [shard_positions(seq, cp, r, layout).tolist() for r in range(cp)]:
            return hint
    return ""


def _run(split, case):
    lengths, cp = case.params["lengths"], case.params["cp"]
    refuse = any(n % (2 * cp) for n in lengths)
    try:   # the layouts off, the grader pinned (an answer that rebinds it scores 0), a time limit
        got = learner(split, LAYOUTS, exercise="a balanced split of packed documents",
                      seconds=SECONDS)(list(lengths), cp)
    except ValueError:
        return None if refuse else "raised ValueError for documents that can be split evenly"
    if refuse:
        return "returned a split, expected ValueError: a document of a length not a multiple of 2*cp cannot be " \
               "cut into 2*cp equal chunks (pad it)"
    seq, docs = sum(lengths), _doc_ids(lengths)
    parts, problem = _as_positions(got, cp, seq)
    if problem:
        return problem
    sizes = [len(p) for p in parts]
    if len(set(sizes)) > 1:
        return f"ranks hold {sizes} tokens: each must hold {seq // cp} (the ring sends equal blocks)"
    work = [visible_pairs(p, docs) for p in parts]
    if len(set(work)) > 1:
        hint = _like(parts, seq, cp)
        return (f"work per rank {work} (visible query-key pairs), max/mean = {imbalance(work):.2f}, "
                f"not 1" + (f": {hint}" if hint else ""))
    return None


def check_document_split(split) -> bool:
    """``split(doc_lengths, cp)`` -> a list of ``cp`` position lists: a partition of the packed
    sequence's tokens, equal counts, equal attention work per rank; ValueError for documents
    that do not cut into 2 * cp equal chunks."""
    return check("document_split", CASES, lambda case: _run(split, case))


__all__ = ["check_document_split"]
