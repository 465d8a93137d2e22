"""Running the course's program on the meta device (shapes, no data), where a few values
must still exist: what the planner's kernel count and the virtual clock's dry run share.

* :func:`round_robin` / :func:`balanced_topk`: an MoE router's top-k has no values on meta;
  both take balanced routing (row r picks experts r*k .. r*k + k-1, mod n: every expert
  T*k/E of T tokens) and keep the indices on the host, where routing's bookkeeping reads them.
* :func:`mixed_devices` / :func:`to_meta`: index arithmetic that keeps values on the host
  (CP's positions, routing indices) meeting meta activations is moved to meta for that op.
"""
from __future__ import annotations

import torch


def round_robin(rows: int, n: int, k: int, device="cpu") -> torch.Tensor:
    """(rows, k) int64: row r picks r*k, r*k + 1, ..., r*k + k-1 (mod n): every one of the n
    choices picked rows*k/n times when n divides rows*k (balanced routing)."""
    return (torch.arange(rows, device=device)[:, None] * k + torch.arange(k, device=device)) % n


def balanced_topk(x, k, dim=-1, largest=True, sorted=True):
    """A top-k of meta values (an MoE router's): the values on meta, the indices on the host,
    :func:`round_robin`."""
    if dim not in (-1, x.dim() - 1):
        raise NotImplementedError("on meta: a top-k along another dimension than the last")
    n = x.shape[-1]
    idx = round_robin(x.numel() // max(n, 1), n, k).view(*x.shape[:-1], k)
    return torch.empty(idx.shape, dtype=x.dtype, device="meta"), idx


def mixed_devices(args) -> bool:
    """Whether an op's arguments mix meta tensors with tensors that have values."""
    meta = host = False
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor):
                meta, host = meta or t.is_meta, host or not t.is_meta
    return meta and host


def to_meta(a):
    """``a`` (a tensor, or a list / tuple of them) on the meta device."""
    if isinstance(a, torch.Tensor):
        return a if a.is_meta else a.to("meta")
    if isinstance(a, (list, tuple)):
        return type(a)(to_meta(t) for t in a)
    return a


__all__ = ["round_robin", "balanced_topk", "mixed_devices", "to_meta"]
