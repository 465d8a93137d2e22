"""ZeRO-1 and ZeRO-2 inside :func:`~course_lib.parallel.compose.parallelize_nd`: chapter 4's
sharded optimizer (:mod:`course_lib.parallel.zero`'s buckets and owned slices) on a mesh.

    net = parallelize_nd(model, Mesh(dp=2, pp=2, tp=2), Layout(dp=2, pp=2, tp=2, zero=2, ...))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)   # the owned slices only
    loss = net.step(x, y); opt.step(); opt.zero_grad()

The ZeRO group of a parameter is the ranks that hold the same parameter and sum its gradient:
its reduce dims among "dp" and "cp" (the plan's, :func:`~course_lib.parallel.compose.data_dims`).
Its other reduce dims (a sequence-parallel norm weight's "tp") are summed after, on the slice.
Per step, as in a pipelined ZeRO run (torch's pipelining under FSDP2 with
``reshard_after_forward=False``, Llama 3's Sec. 3.3.2; Megatron-LM's distributed optimizer):

    step start   all-gather the parameters from the owned slices (the optimizer updated them)
    schedule     every micro-batch's backward accumulates the full local gradient in ``p.grad``
    after it     one reduce-scatter per bucket: each rank receives the sum of the slices it owns
                 (+ one "used" flag per parameter, as FSDP's), then the sum over the other dims

``stage=1`` keeps the full gradients to the next step (ZeRO-1: gradients not sharded; the owned
slices' sums are written into them, as :class:`~course_lib.parallel.zero.ShardedOptimizer`
does); ``stage=2`` frees them once reduced (only the owned slices' sums stay). The optimizer sees one
parameter per (parameter, owned slice): a parameter no rank used keeps no gradient.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from course_lib.parallel.grad_sync import assign_buckets
from course_lib.parallel.zero import ShardedBucket, all_gather_buckets, owned_gradient
from course_lib.precision.mixed import MainGrads, check_precision

SHARD_DIMS = ("dp", "cp")   # the dims the ZeRO group spans (the ranks holding the same parameters)


def rule_zero(cfg, layout):
    """ZeRO-1/2 in ``parallelize_nd``: dense parameters in one dtype (under a mixed precision the
    owned slices are the master weights), no experts split over ep."""
    if layout.zero not in (1, 2):
        return
    check_precision(layout.precision)
    if cfg.n_experts and layout.ep > 1:
        raise ValueError(f"zero={layout.zero} with experts split over ep={layout.ep}: an expert's ZeRO group "
                         f"is its EP slot's dp / ep ranks; not implemented, use zero=0 or ep=1")


class ZeroSync:
    """The gradient sums and parameter gathers of ZeRO-``stage`` (1 or 2) for ``params`` (this
    rank's model parameters, each once) on ``mesh``; ``dims``: {id(parameter): its reduce dims}.
    ``parameters()``: the owned slices, for the optimizer; ``begin_step()`` before a step's
    schedule, ``finish()`` after it (the runtime's gradient sum); ``gather()`` anytime on every
    rank (after the last ``opt.step()``: before reading the full parameters).

    Mixed precision (``compute``, ``reduce``: dtypes, :func:`~course_lib.precision.mixed.
    check_precision`'s): the owned slices, made in the parameters' dtype, are the master weights
    (fp32), the parameters are cast to ``compute`` and gathered in it; the gradients are
    reduce-scattered in ``reduce`` and handed to the slices in their dtype. ``accumulate``: each
    backward's gradient is added into a ``reduce``-dtype buffer as autograd produces it
    (:class:`~course_lib.precision.mixed.MainGrads`), which the reduce-scatter reads."""

    def __init__(self, params, mesh, dims, stage, bucket_cap_mb=25, compute=None, reduce=None, accumulate=False):
        if stage not in (1, 2):
            raise ValueError(f"ZeroSync: stage must be 1 or 2, got {stage!r}")
        self.stage, self.params, self.compute = stage, [q for q in params if q.requires_grad], compute
        key = {id(q): tuple(dims[id(q)]) for q in self.params}
        self.buckets = []
        for ids in assign_buckets(self.params, bucket_cap_mb * 2**20, key=lambda q: (q.dtype, q.device, key[id(q)])):
            d = key[id(self.params[ids[0]])]
            shard = tuple(x for x in d if x in SHARD_DIMS)
            rest = tuple(x for x in d if x not in SHARD_DIMS)
            if not shard:
                raise ValueError(f"ZeroSync: a parameter summed over {d} has no ZeRO group among {SHARD_DIMS}")
            comm = mesh.comm(shard)
            b = ShardedBucket(len(self.buckets), ids, self.params, comm.rank, comm.size)
            b.comm, b.rest = comm, (mesh.comm(rest) if rest else None)
            b.slices = [nn.Parameter(view.detach().clone()) for *_, view in b.pieces]
            b.reduce_dtype = reduce or compute or b.dtype
            if compute is not None:
                b.dtype = compute                       # gathered in the compute dtype
            self.buckets.append(b)
        if compute is not None:
            for q in self.params:
                q.data = q.data.to(compute)             # the model computes in 16 bits
        self.main_grads = MainGrads(self.params, reduce or compute) if accumulate else None
        self.all_reduce = False     # True: each bucket all-reduced, each rank keeping its slice (DeepSpeed's BF16_Optimizer)

    def parameters(self) -> list:
        """The owned slices (one per parameter piece this rank owns): what the optimizer updates."""
        return [q for b in self.buckets for q in b.slices]

    def shard_gradients(self) -> list:
        """Gradients held besides the parameters' own: ZeRO-2's once reduced, the owned slices'
        (ZeRO-1's are slices of ``p.grad``); ZeRO-1 summing in its own buffers (``accumulate``):
        those, kept to the next step as ZeRO-1 keeps the full gradients."""
        if self.stage == 2:
            return [q.grad for q in self.parameters() if q.grad is not None]
        return list(self.main_grads.grads.values()) if self.main_grads is not None else []

    def begin_step(self):
        """A step starts: the last step's local gradients go (ZeRO-1 kept them), the parameters
        are gathered from the slices the optimizer updated."""
        for q in self.params:
            q.grad = None
        if self.main_grads is not None:
            self.main_grads.clear()
        self.gather()

    @torch.no_grad()
    def gather(self):
        """All-gather every bucket's owned slices into the full parameters (two buckets in flight)."""
        all_gather_buckets(self.buckets, self.params, lambda b: [q.detach() for q in b.slices], lambda b: b.comm)

    @torch.no_grad()
    def finish(self):
        """Reduce-scatter each bucket's local gradients (with one "used" flag per parameter),
        sum the owned slice over the other dims, and give each owned slice its gradient (added
        to one not zeroed since the last step, as on one device). ZeRO-2 frees ``p.grad``."""
        for b in self.buckets:
            n, t = b.comm.size, len(b.param_ids)
            packed = torch.zeros(n * (b.shard + t), dtype=b.reduce_dtype, device=b.device).view(n, b.shard + t)
            flat = packed[:, :b.shard]
            main = self.main_grads
            grads = [self.params[i].grad if main is None else main.pop(self.params[i]) if self.stage == 2
                     else main.grads.get(id(self.params[i])) for i in b.param_ids]   # (ZeRO-1 keeps them)
            for i, g in zip(b.param_ids, grads):
                if g is not None:           # (the flat vector runs row after row of ``flat``)
                    _flat_range(flat, b.offsets[i], g.numel()).copy_(g.view(-1))
            had = [float(g is not None) for g in grads]
            packed[:, b.shard:].copy_(torch.tensor(had, dtype=b.reduce_dtype, device=b.device).expand(n, t))
            if self.all_reduce:         # the whole sum on every rank (twice a reduce-scatter's bytes), this rank's row kept
                b.comm.all_reduce(packed.view(-1), name=f"all-reduce b{b.index}")
                out = packed[b.comm.rank]
            else:
                out = torch.zeros(b.shard + t, dtype=b.reduce_dtype, device=b.device)
                b.comm.reduce_scatter_tensor(out, packed.view(-1), name=f"reduce-scatter b{b.index}")
            if b.rest is not None:
                b.rest.all_reduce(out, name=f"all-reduce b{b.index} over {b.rest.dim}")
            used = (out[b.shard:] > 0).tolist()
            for (i, lo, hi, at, _), q in zip(b.pieces, b.slices):
                if not used[b.param_ids.index(i)]:
                    continue
                g = out[at:at + hi - lo]
                if q.grad is not None:      # not zeroed since the last step: accumulate, as on one device
                    q.grad.add_(g)
                elif self.compute is not None:    # mixed precision: the master's gradient, in its dtype
                    q.grad = g.to(q.dtype)
                else:                       # ZeRO-1: the sum in the owned slice of the full gradient
                    q.grad = owned_gradient(self.params[i], lo, hi, g, self.stage)
            if self.stage == 2:
                for i in b.param_ids:
                    self.params[i].grad = None


def _flat_range(flat, start, size):
    """Elements [start, start + size) of ``flat`` (n, S) read row after row, as one tensor; the
    pieces are padded: only the last bucket slot is short, so a range crossing rows is a copy
    target made of row pieces (written through ``flat``'s storage, contiguous per row)."""
    n, s = flat.shape
    if start // s == (start + size - 1) // s:
        r = start // s
        return flat[r, start - r * s:start - r * s + size]
    return _RowSpan(flat, start, size)


class _RowSpan:
    """A range of ``flat`` that crosses rows: ``copy_`` writes it row piece by row piece."""

    def __init__(self, flat, start, size):
        self.flat, self.start, self.size = flat, start, size

    def copy_(self, src):
        n, s = self.flat.shape
        at, done = self.start, 0
        while done < self.size:
            r, c = divmod(at, s)
            k = min(s - c, self.size - done)
            self.flat[r, c:c + k].copy_(src[done:done + k])
            at, done = at + k, done + k
        return self


__all__ = ["ZeroSync", "rule_zero", "SHARD_DIMS"]
