"""FSDP's bookkeeping: which unit a parameter belongs to, and one unit's parameters, each
sharded along dim 0, all packed for one collective.

A parameter of shape (d0, *trailing) on N ranks is cut like ``torch.chunk`` and torch's
``fully_shard``: chunk = ceil(d0 / N) rows, rank r holds rows [r*chunk, min((r+1)*chunk, d0))
(maybe none). Padded to ``chunk`` rows, every rank's shard of p has the same size
``chunk * t`` (t = prod(trailing)), so one collective moves all of a unit's parameters:

    shard buffer  (S,)       this rank's padded shards, p after p (S = sum_p chunk_p t_p):
                             the fp32 master weights; each Parameter is a view of its rows
    gathered      (N * S,)   what all_gather_into_tensor returns: rank after rank
    full          (N * S,)   parameter after parameter: p = full[N off_p : N off_p + d0_p t_p]

Gradients take the reverse path: the full gradient (N * S,), p after p, is packed rank
after rank, trainable parameters only, (N * S_grad,), and reduce-scattered: each rank
receives its (S_grad,) slice, summed over ranks.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn

from course_lib.parallel import data_parallel


class Slot(NamedTuple):
    """Where one parameter lives in its unit's buffers."""
    shape: tuple      # the full (d0, *trailing) shape
    chunk: int        # rows per rank (padded): ceil(d0 / N)
    rows: int         # rows this rank really holds (chunk, fewer on the last ranks, maybe 0)
    width: int        # elements per row: prod(trailing)
    offset: int       # start of its padded shard in the shard buffer (S,)
    grad_offset: int  # start in the gradient shard (S_grad,); -1 if frozen

    @property
    def padded(self) -> int:
        return self.chunk * self.width  # elements of one rank's padded shard


def dim0_rows(d0: int, world: int, rank: int) -> tuple[int, int]:
    """(chunk, rows): torch.chunk's cut of d0 rows over ``world`` ranks, seen from ``rank``."""
    chunk = math.ceil(d0 / world)
    return chunk, max(0, min(chunk, d0 - rank * chunk))


def default_units(module):
    """Every child of an ``nn.ModuleList`` (e.g. each transformer block) becomes a unit."""
    return [child for m in module.modules() if isinstance(m, nn.ModuleList) for child in m]


def check_fsdp_module(module):
    """The inputs FSDP refuses, with the constraint named: DDP's (``data_parallel.check_module``),
    plus one master dtype and no 0-d parameter (a shard is a range of dim 0)."""
    data_parallel.check_module(module, "FSDP")
    named = list(module.named_parameters())
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) > 1:
        raise ValueError(f"FSDP: all parameters must share one dtype (the master dtype), got {dtypes}")
    for name, p in named:
        if p.dim() == 0:
            raise ValueError(f"FSDP shards every parameter along dim 0: {name!r} is 0-dimensional "
                             f"(make it shape (1,))")


def assign_units(module, unit_modules):
    """[(unit module, name, parameters, [(owner module, attribute, parameter index)])], the
    root first. A parameter belongs to the innermost unit around every module that owns it
    (a weight tied across two units belongs to the root); units without parameters drop out."""
    unit_modules = [module] + [m for m in unit_modules if m is not module]
    index = {id(m): k for k, m in enumerate(unit_modules)}
    enclosing = {}  # module -> units it sits in (innermost)

    def visit(m, current):
        current = index.get(id(m), current)
        enclosing.setdefault(id(m), set()).add(current)
        for child in m.children():
            visit(child, current)

    visit(module, 0)
    owners, unit_of = {}, {}  # parameter -> (module, attribute name) pairs, its unit
    for m in module.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                owners.setdefault(p, []).append((m, attr))
                units = set().union(*(enclosing[id(m)] for m, _ in owners[p]))
                unit_of[p] = units.pop() if len(units) == 1 else 0  # shared: the root
    out = []
    for k, m in enumerate(unit_modules):
        params = [p for p in owners if unit_of[p] == k]
        if params:
            where = [(mod, attr, j) for j, p in enumerate(params) for mod, attr in owners[p]]
            name = "root" if k == 0 else next(n for n, sub in module.named_modules() if sub is m)
            out.append((m, name, params, where))
    return out


class ShardedUnit:
    """One unit: its parameters as dim-0 shards of one padded buffer, and per-step state."""

    def __init__(self, index, name, module, params, owners, rank, world):
        self.index, self.name, self.module, self.owners = index, name, module, owners
        self.world = world
        self.slots, offset, grad_offset = [], 0, 0
        for p in params:
            chunk, rows = dim0_rows(p.shape[0], world, rank)
            width = math.prod(p.shape[1:])
            g = grad_offset if p.requires_grad else -1
            self.slots.append(Slot(tuple(p.shape), chunk, rows, width, offset, g))
            offset += chunk * width
            grad_offset += chunk * width if p.requires_grad else 0
        self.numel, self.grad_numel = offset, grad_offset   # S and S_grad
        self.flat_shard = params[0].new_zeros(self.numel)    # (S,) master weights, zero padding
        self.pieces = []                                      # the Parameters the module shows
        for p, s in zip(params, self.slots):
            mine = p.detach()[rank * s.chunk:rank * s.chunk + s.rows]  # (rows, *trailing)
            view = self.flat_shard[s.offset:s.offset + s.rows * s.width].view(s.rows, *s.shape[1:])
            view.copy_(mine)
            self.pieces.append(nn.Parameter(view, requires_grad=p.requires_grad))
        self.trainable = [q for q in self.pieces if q.requires_grad]
        self.trainable_slots = [i for i, s in enumerate(self.slots) if s.grad_offset >= 0]
        self.grad_shard = None   # (S_grad,) master dtype: this rank's gradient, accumulated
        self.used_anywhere = None  # (trainable,) bool: did some rank's backward reach it
        self.full = None         # (N * S,) compute dtype: the gathered parameters
        self.gather = None       # in flight: (work, send buffer, gathered buffer)
        self.post = None         # (N * S / k,) kept after forward by reshard_after_forward=k
        self.accumulated = None  # (N * S,) unsynced gradient sum (set_requires_gradient_sync(False))
        self.used = [False] * len(params)
        self.extra = []          # [(Comm, [slot indexes])]: gradients reduced over more dims
        self.reset_step()

    def reset_step(self):
        self.forward_ran = self.backward_started = self.reduced = False

    # ------------------------------------------------------------------ parameters
    def copy_out(self, gathered):
        """(N * S,) rank after rank -> (N * S,) parameter after parameter."""
        by_rank = gathered.view(self.world, self.numel)
        full = torch.empty_like(gathered)
        for s in self.slots:
            start = self.world * s.offset
            full[start:start + self.world * s.padded].view(self.world, s.padded).copy_(
                by_rank[:, s.offset:s.offset + s.padded])
        return full

    def by_rank(self, full):
        """The inverse of :meth:`copy_out`: (N * S,) parameter after parameter -> rank after rank."""
        out = torch.empty_like(full)
        by_rank = out.view(self.world, self.numel)
        for s in self.slots:
            start = self.world * s.offset
            by_rank[:, s.offset:s.offset + s.padded].copy_(
                full[start:start + self.world * s.padded].view(self.world, s.padded))
        return out

    def full_views(self, full):
        """Every parameter, full shape, as a view of ``full`` (one split: one backward node)."""
        parts = full.split([self.world * s.padded for s in self.slots])
        return [part[:s.shape[0] * s.width].view(s.shape) for part, s in zip(parts, self.slots)]

    # ------------------------------------------------------------------ gradients
    def pack_gradients(self, grad_full, dtype):
        """(N * S,) parameter after parameter -> (N, S_grad + T) rank after rank, trainable
        only, then T flags "this rank used trainable parameter j" in every rank's chunk: summed
        by the same reduce-scatter, they say which parameters some rank used."""
        packed = grad_full.new_empty(self.world, self.grad_numel + len(self.trainable_slots), dtype=dtype)
        used = [float(self.used[i]) for i in self.trainable_slots]
        packed[:, self.grad_numel:] = torch.tensor(used, device=packed.device)
        for s in self.slots:
            if s.grad_offset >= 0:
                start = self.world * s.offset
                packed[:, s.grad_offset:s.grad_offset + s.padded].copy_(
                    grad_full[start:start + self.world * s.padded].view(self.world, s.padded))
        return packed

    def gradient_view(self, i, grad_shard):
        """Parameter i's gradient: its rows of the (S_grad,) gradient shard."""
        s = self.slots[i]
        return grad_shard[s.grad_offset:s.grad_offset + s.rows * s.width].view(s.rows, *s.shape[1:])

    def gradient_rows(self, indexes, grad_shard):
        """The real (unpadded) elements of parameters ``indexes`` in the gradient shard."""
        return [self.gradient_view(i, grad_shard).view(-1) for i in indexes]


__all__ = ["Slot", "ShardedUnit", "dim0_rows", "default_units", "check_fsdp_module",
           "assign_units"]
