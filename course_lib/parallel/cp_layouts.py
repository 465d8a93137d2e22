"""Which tokens a context-parallel rank holds, and how much attention work that gives it.

    pos = shard_positions(seq_len, cp, rank, "zigzag")                 # chunks i and 2N-1-i
    pos = shard_positions(seq_len, cp, rank, "documents", doc_ids=ids)  # the zigzag of each document
    work_per_rank(seq_len, cp, "zigzag", ids)    # visible (query, key) pairs each rank computes

Causal attention makes a contiguous split unfair: rank N-1 sees every key, rank 0 only its
own. The zigzag gives rank i chunks i and 2N-1-i of the sequence, equal work everywhere,
for ONE causal triangle. A packed batch holds many documents, each its own triangle (no
attention across documents), so the work sits where the long documents are and the
sequence-wide zigzag is unfair again. The ``"documents"`` layout zigzags every document
separately (rank i: chunks i and 2N-1-i of each document; Transformer Engine's THD format
with CP, which pads each document to a multiple of 2N): equal tokens and equal work on
every rank, whatever the documents' lengths.
"""
from __future__ import annotations

import torch

LAYOUTS = ("zigzag", "contiguous", "documents")


def zigzag_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2N) that rank i holds: i and 2N-1-i (one early, one late)."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def sequence_chunks(seq_len: int, cp_size: int, layout: str = "zigzag") -> int:
    """How many equal chunks CP cuts the sequence into: N (contiguous), 2N (zigzag: two per rank;
    "documents": two per rank of every document)."""
    if layout == "contiguous":
        if seq_len % cp_size:
            raise ValueError(f"sequence length {seq_len} must be divisible by CP={cp_size}")
        return cp_size
    if seq_len % (2 * cp_size):
        raise ValueError(f"{layout}: sequence length {seq_len} must be divisible by 2*CP={2 * cp_size} "
                         f"(2N equal chunks, two per rank)")
    return 2 * cp_size


def document_spans(doc_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, stop)] of each document of a packed sequence (doc_ids (s,), one run per document)."""
    if doc_ids is None or doc_ids.dim() != 1:
        raise ValueError("a document layout needs doc_ids of shape (s,): one packing shared by the "
                         f"batch's rows, got {None if doc_ids is None else tuple(doc_ids.shape)}")
    cuts = (torch.nonzero(doc_ids[1:] != doc_ids[:-1]).flatten() + 1).tolist()
    bounds = [0] + cuts + [doc_ids.numel()]
    return list(zip(bounds[:-1], bounds[1:]))


def check_documents(doc_ids, cp_size: int):
    """The "documents" layout's rule: every document's length a multiple of 2N (pad them)."""
    for start, stop in document_spans(doc_ids):
        if (stop - start) % (2 * cp_size):
            raise ValueError(f"cp_layout='documents': the document at tokens {start}..{stop - 1} has "
                             f"{stop - start} tokens, not a multiple of 2*CP={2 * cp_size}; pad each document "
                             f"to a multiple of 2*CP (as Transformer Engine's THD format with CP requires)")


def shard_positions(seq_len: int, cp_size: int, cp_rank: int, layout: str = "zigzag",
                    device="cpu", doc_ids=None) -> torch.Tensor:
    """Absolute positions (int64, (seq_len / N,), on ``device``) of the tokens rank ``cp_rank``
    holds. ``"documents"`` needs ``doc_ids`` (s,): chunks i and 2N-1-i of every document."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside 0..{cp_size - 1}")
    c = seq_len // sequence_chunks(seq_len, cp_size, layout)
    if layout == "contiguous":
        return torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    first, second = zigzag_chunks(cp_size, cp_rank)
    if layout == "zigzag":
        return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                          torch.arange(second * c, (second + 1) * c, device=device)])
    if doc_ids.numel() != seq_len:
        raise ValueError(f"doc_ids covers {doc_ids.numel()} tokens, the sequence {seq_len}")
    check_documents(doc_ids, cp_size)
    pieces = []
    for start, stop in document_spans(doc_ids):                  # the zigzag of each document
        c = (stop - start) // (2 * cp_size)
        pieces += [torch.arange(start + first * c, start + (first + 1) * c, device=device),
                   torch.arange(start + second * c, start + (second + 1) * c, device=device)]
    return torch.cat(pieces)


def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    return shard_positions(seq_len, cp_size, cp_rank, "zigzag")


def check_shard_positions(positions, seq_len: int, cp_size: int, cp_rank: int, layout: str = "zigzag",
                          doc_ids=None, who: str = "context-parallel attention") -> None:
    """``positions`` must be this rank's shard (:func:`shard_positions`): every rank knows which
    tokens the others hold from the layout alone, so nothing about positions is sent."""
    if doc_ids is not None and doc_ids.shape != (seq_len,):
        raise ValueError(f"{who}: doc_ids must be the whole sequence's, shape ({seq_len},) (one "
                         f"packing for the batch's rows), got {tuple(doc_ids.shape)}")
    expected = shard_positions(seq_len, cp_size, cp_rank, layout, positions.device, doc_ids)
    if not torch.equal(positions, expected):
        raise ValueError(f"{who}: positions must be this rank's {layout} shard of a sequence of "
                         f"{seq_len} tokens ({expected.tolist()[:4]}...), got {positions.tolist()[:4]}...")


def shard_sequence(x: torch.Tensor, positions: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` (the full sequence along ``dim``)."""
    return x.index_select(dim, positions)


def visible_pairs(positions: torch.Tensor, doc_ids=None) -> int:
    """The (query, key) pairs these queries see: each query the keys at or before it in its
    document (the whole sequence is one document without ``doc_ids``). The work an attention
    kernel that skips what the mask hides (FlashAttention's varlen, causal) cannot avoid."""
    if doc_ids is None:
        return int((positions + 1).sum())
    start = torch.zeros_like(doc_ids)
    for a, _ in document_spans(doc_ids):
        start[a:] = a                                            # each token's document start
    return int((positions - start[positions] + 1).sum())


def work_per_rank(seq_len: int, cp_size: int, layout: str, doc_ids=None) -> list[int]:
    """Visible (query, key) pairs of every CP rank's queries under ``layout``."""
    return [visible_pairs(shard_positions(seq_len, cp_size, r, layout, doc_ids=doc_ids), doc_ids)
            for r in range(cp_size)]


def imbalance(work: list[int]) -> float:
    """max / mean: how long the slowest rank runs against a perfect split (1.0)."""
    return max(work) * len(work) / sum(work)


__all__ = ["LAYOUTS", "zigzag_chunks", "sequence_chunks", "document_spans", "check_documents",
           "shard_positions", "check_shard_positions", "zigzag_positions", "shard_sequence", "visible_pairs", "work_per_rank",
           "imbalance"]
