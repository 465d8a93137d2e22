"""FSDP, i.e. ZeRO-3, from scratch: parameters, gradients and optimizer state all sharded.

The model is cut into *units* (by default each child of an ``nn.ModuleList``, e.g. every
TinyGPT block, plus the root for what is left: embeddings, final norm, head). Each unit's
parameters are one flat vector, padded to a multiple of N; rank r keeps only the r-th slice
(the fp32 master weights the optimizer updates). Around each unit:

    forward    all-gather the unit's parameters (in ``compute_dtype``) -> run it -> free them
               (while it runs, the next unit's all-gather is already in flight: prefetch)
    backward   all-gather them again when backward first needs them (prefetching the next
               unit of backward) -> compute -> reduce-scatter the gradient, free the parameters

so a rank holds 1/N of the model plus about two gathered units at any time (Rajbhandari et
al. 2020, Zhao et al. 2023 "PyTorch FSDP"). Freed parameters that autograd saved for
backward are stored as (unit, offset, shape) tokens by ``saved_tensors_hooks`` and
re-gathered on use. The model is built once from one seed and rank 0's values are
broadcast *before* sharding: no rank draws its own shard.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.nn as nn

from course_lib import trace
from course_lib.parallel.data_parallel import Collectives, broadcast_module_states, check_module

MAX_IN_FLIGHT = 1  # gradient reduce-scatters in flight (each keeps a full-size gradient alive)


class _Saved(NamedTuple):
    """What autograd keeps instead of a saved view of freed, gathered parameters."""
    unit: int
    offset: int
    size: tuple
    stride: tuple


class _Unit:
    """One FSDP unit: its parameters as a flat vector, this rank's slice, and per-step state."""

    def __init__(self, index, name, module, params, owners, rank, world):
        self.index, self.name, self.module, self.owners = index, name, module, owners
        self.shapes = [p.shape for p in params]
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.shard = math.ceil(self.numel / world)  # padded: world * shard >= numel
        full = torch.cat([p.detach().reshape(-1) for p in params])
        full = torch.cat([full, full.new_zeros(world * self.shard - self.numel)])
        self.flat_shard = full[rank * self.shard:(rank + 1) * self.shard].clone()  # master weights
        self.pieces, self.ranges = [], []  # one Parameter per original parameter (maybe empty)
        offset, lo = 0, rank * self.shard
        for p in params:
            a = min(max(offset, lo), lo + self.shard) - lo
            b = min(max(offset + p.numel(), lo), lo + self.shard) - lo
            self.pieces.append(nn.Parameter(self.flat_shard[a:b], requires_grad=p.requires_grad))
            self.ranges.append((a, b))
            offset += p.numel()
        self.trainable = [q for q in self.pieces if q.requires_grad]
        self.grad_shard = None        # (shard,) fp32 mean gradient of this slice
        self.full = None              # (world * shard,) gathered parameters in compute dtype
        self.gather = None            # in-flight all-gather (work, send buffer)
        self.used = [False] * len(params)
        self.reset_step()

    def reset_step(self):
        self.forward_ran = self.backward_started = self.reduced = False


class _UnshardFn(torch.autograd.Function):
    """Forward: hand out the unit's gathered parameters. Backward: reduce-scatter their
    gradient (all uses summed by autograd: the flat (world * shard,) gradient)."""

    @staticmethod
    def forward(ctx, fsdp, unit, *pieces):
        ctx.fsdp, ctx.unit = fsdp, unit
        return unit.full.view_as(unit.full)

    @staticmethod
    def backward(ctx, grad_full):
        ctx.fsdp._reduce_scatter(ctx.unit, grad_full)
        return (None, None) + (None,) * len(ctx.unit.trainable)


def default_units(module):
    """Every child of an ``nn.ModuleList`` (e.g. each transformer block) becomes a unit."""
    return [child for m in module.modules() if isinstance(m, nn.ModuleList) for child in m]


class FSDP(nn.Module):
    """Fully sharded data parallel (ZeRO-3) over ``group``.

    compute_dtype: dtype of the gathered parameters, the buffers and the floating inputs
        (None: the parameters' own); master weights, gradients and optimizer stay in the
        parameters' dtype. reduce_dtype: dtype of the gradient reduce-scatter (None:
        compute_dtype). units: submodules that get their own all-gather (default
        :func:`default_units`); the root always is one. A parameter shared by two units
        (tied weights) belongs to the root. Every rank must run the same units in forward.

    Call ``finish_gradient_synchronization()`` after the last backward, before
    ``optimizer.step()``; several forward/backward passes before it accumulate gradients.
    """

    def __init__(self, module, compute_dtype=None, *, reduce_dtype=None, units=None, group=None,
                 prefetch=True):
        super().__init__()
        check_module(module, "FSDP")
        master = {p.dtype for p in module.parameters()}
        if len(master) > 1:
            raise ValueError(f"FSDP: all parameters must share one dtype (the master dtype), got {master}")
        for dt in (compute_dtype, reduce_dtype):
            if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                raise TypeError(f"FSDP: compute_dtype / reduce_dtype must be floating torch dtypes, got {dt!r}")
        unit_modules = default_units(module) if units is None else list(units)
        inside = {id(m) for m in module.modules()}
        if any(id(m) not in inside for m in unit_modules):
            raise ValueError("FSDP: every unit must be a submodule of the wrapped module")
        self.module, self.comm, self.prefetch = module, Collectives(group), prefetch
        self.master_dtype = master.pop()
        self.compute_dtype = compute_dtype or self.master_dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        broadcast_module_states(module, self.comm)  # one model, rank 0's values, then shard
        self.comm.reset()
        if compute_dtype is not None:  # buffers (rotary tables...) computed with, in compute_dtype
            for buf in module.buffers():
                if buf.is_floating_point():
                    buf.data = buf.data.to(compute_dtype)
        self.units = self._build_units(module, unit_modules)
        self._fwd_order = [u.index for u in self.units]  # refined after each forward
        self._pre_order, self._post_order, self._reducing, self._where = [], [], [], {}
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._pre_forward(u))
            u.module.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u))

    def _build_units(self, module, unit_modules):
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
        built, rank, world = [], self.comm.rank, self.comm.world_size
        for k, m in enumerate(unit_modules):
            params = [p for p in owners if unit_of[p] == k]
            if not params:
                continue
            where = [(mod, attr, j) for j, p in enumerate(params) for mod, attr in owners[p]]
            name = "root" if k == 0 else next(n for n, sub in module.named_modules() if sub is m)
            unit = _Unit(len(built), name, m, params, where, rank, world)
            unit.is_root = k == 0
            for mod, attr, i in where:
                mod._parameters[attr] = unit.pieces[i]  # the module now holds its slice only
            built.append(unit)
        return built

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        while self._reducing:  # an earlier backward of this step (gradient accumulation)
            self._fold_oldest()
        for u in self.units:   # nothing stays gathered from a forward that had no backward
            self._reshard(u)
        if self.compute_dtype != self.master_dtype:  # inputs in the compute dtype, like the weights
            args = [self._cast(a) for a in args]
            kwargs = {k: self._cast(v) for k, v in kwargs.items()}
        for u in self.units:
            u.reset_step()
        self._pre_order, self._post_order = [], []
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = self.module(*args, **kwargs)
        self._fwd_order = self._pre_order  # prefetch order for the next forward
        return out

    def _cast(self, t):
        return t.to(self.compute_dtype) if torch.is_tensor(t) and t.is_floating_point() else t

    def _pre_forward(self, u):
        u.forward_ran = torch.is_grad_enabled()
        self._pre_order.append(u.index)
        self._unshard(u)
        if self.prefetch:  # the next unit's all-gather overlaps this unit's compute
            self._prefetch_after(u, self._fwd_order)
        full = u.full
        if torch.is_grad_enabled() and u.trainable:
            full = _UnshardFn.apply(self, u, *u.trainable)  # its backward reduce-scatters
        views = [v.view(shape) for v, shape in zip(full[:u.numel].split(u.sizes), u.shapes)]
        for i, piece in enumerate(u.pieces):
            if not piece.requires_grad:
                views[i] = views[i].detach()  # frozen: same storage, no gradient
            elif torch.is_grad_enabled():  # which parameters this rank actually used
                views[i].register_hook(lambda g, u=u, i=i: u.used.__setitem__(i, True))
        for mod, attr, i in u.owners:
            mod._parameters[attr] = views[i]
        u.t_forward = trace.now()

    def _post_forward(self, u):
        for mod, attr, i in u.owners:
            mod._parameters[attr] = u.pieces[i]  # back to the slice
        if not u.is_root:
            trace.recorder().add(f"forward {u.name}", "compute", u.t_forward, trace.now())
        self._post_order.append(u.index)
        if not (u.is_root and torch.is_grad_enabled()):  # the root is needed first in backward
            self._reshard(u)

    def _prefetch_after(self, u, order):
        k = order.index(u.index) + 1 if u.index in order else len(order)
        for j in order[k:]:
            nxt = self.units[j]
            if nxt.full is None and not (nxt.reduced or nxt is u):
                self._start_gather(nxt)
                return

    # ------------------------------------------------------------------ gather / free
    def _start_gather(self, u):
        """Launch the all-gather of u's parameters (compute dtype) into a new full buffer."""
        send = u.flat_shard.to(self.compute_dtype)  # (shard,) a copy only when casting
        u.full = torch.empty(u.shard * self.comm.world_size, dtype=self.compute_dtype,
                             device=send.device)
        self._where[_key(u.full)] = u.index
        u.gather = (self.comm.all_gather(u.full, send, async_op=True, name=f"all-gather {u.name}"), send)

    def _unshard(self, u):
        if u.full is None:
            self._start_gather(u)
        if u.gather is not None:
            u.gather[0].wait()
            u.gather = None

    def _reshard(self, u):
        if u.full is not None:
            if u.gather is not None:
                u.gather[0].wait()
                u.gather = None
            self._where.pop(_key(u.full), None)
            u.full = None  # the last reference: the gathered parameters are freed

    def _pack(self, t):
        """Autograd saves a tensor: a view of gathered parameters becomes a token."""
        unit = self._where.get(_key(t)) if t.numel() else None
        if unit is None:
            return t
        return _Saved(unit, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        u = self.units[saved.unit]
        if not u.backward_started:
            u.backward_started, u.t_backward = True, trace.now()
            self._unshard(u)
            if self.prefetch:  # backward runs the units in reverse order of their forward end
                self._prefetch_after(u, self._post_order[::-1])
        self._unshard(u)
        return u.full.as_strided(saved.size, saved.stride, saved.offset)

    # ------------------------------------------------------------------ gradients
    def _reduce_scatter(self, u, grad_full):
        """u's flat gradient (world * shard,) -> this rank's slice, summed over ranks."""
        grad_full = grad_full.to(self.reduce_dtype).contiguous()
        out = torch.empty(u.shard, dtype=self.reduce_dtype, device=grad_full.device)
        work = self.comm.reduce_scatter(out, grad_full, async_op=True, name=f"reduce-scatter {u.name}")
        self._reducing.append((u, out, work, grad_full))
        u.reduced = True
        if not u.is_root and u.backward_started:
            trace.recorder().add(f"backward {u.name}", "compute", u.t_backward, trace.now())
        self._reshard(u)
        while len(self._reducing) > MAX_IN_FLIGHT:
            self._fold_oldest()

    def _fold_oldest(self):
        u, out, work, _ = self._reducing.pop(0)
        work.wait()
        out = out.to(self.master_dtype).div_(self.comm.world_size)  # mean over ranks
        if u.grad_shard is None:
            u.grad_shard = out
        else:  # several backward passes: accumulate
            u.grad_shard.add_(out)

    def finish_gradient_synchronization(self):
        """Wait for the reduce-scatters; give each parameter slice its mean gradient."""
        for u in self.units:  # a unit that ran forward but got no gradient: reduce zeros
            if u.forward_ran and u.trainable and not u.reduced:
                zeros = torch.zeros(u.shard * self.comm.world_size, dtype=self.reduce_dtype,
                                    device=u.flat_shard.device)
                self._reduce_scatter(u, zeros)
        while self._reducing:
            self._fold_oldest()
        flags = [f for u in self.units for f in u.used]
        used = torch.tensor(flags, dtype=torch.int32, device=self.units[0].flat_shard.device)
        self.comm.all_reduce(used, name="all-reduce used")  # parameters no rank used: grad None
        used, k = used.tolist(), 0
        for u in self.units:
            for i, piece in enumerate(u.pieces):
                a, b = u.ranges[i]
                if piece.requires_grad and used[k] and u.grad_shard is not None:
                    if piece.grad is None:
                        piece.grad = u.grad_shard[a:b]  # a view: the slice's storage is the gradient
                    else:  # not zeroed since the last step: accumulate, as on one device
                        piece.grad.add_(u.grad_shard[a:b])
                k += 1
            u.grad_shard, u.used = None, [False] * len(u.pieces)
            self._reshard(u)

    # ------------------------------------------------------------------ checkpoints
    @torch.no_grad()
    def gather_full_params(self):
        """The full state dict (original names, full shapes, master dtype) on every rank."""
        full = {}
        for u in self.units:
            out = torch.empty(u.shard * self.comm.world_size, dtype=self.master_dtype,
                              device=u.flat_shard.device)
            self.comm.all_gather(out, u.flat_shard, name=f"all-gather {u.name}")
            for piece, v, shape in zip(u.pieces, out[:u.numel].split(u.sizes), u.shapes):
                full[id(piece)] = v.view(shape).clone()
        return OrderedDict((name, full.get(id(t), t.detach()))
                           for name, t in self.module.state_dict(keep_vars=True).items())


def _key(t):
    return (t.device, t.untyped_storage().data_ptr())


__all__ = ["FSDP", "default_units"]
