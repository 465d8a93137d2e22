"""FSDP, i.e. ZeRO-3, from scratch: parameters, gradients and optimizer state all sharded.

Every parameter is sharded along dim 0, as torch's ``fully_shard`` (FSDP2) does: on N
ranks rank r keeps rows [r*c, (r+1)*c) of a (d0, ...) weight, c = ceil(d0 / N), as an
``nn.Parameter`` of shape (rows, ...) under its own name: the fp32 master weights the
optimizer updates (:mod:`course_lib.parallel.fsdp_params` holds the layout). A weight that
tensor parallelism already cut is just a smaller weight: FSDP cuts it again (2-D).

The model is cut into *units* (by default each child of an ``nn.ModuleList``, e.g. every
TinyGPT block, plus the root for what is left: embeddings, final norm, head). Around each:

    forward    all-gather the unit's shards (one collective, compute dtype) -> copy them out
               to full parameters -> run -> free them (meanwhile the next unit's all-gather
               is in flight: prefetch)
    backward   all-gather again when backward first needs them (prefetching the next unit
               of backward) -> compute -> reduce-scatter the gradients (one collective),
               free the parameters

so a rank holds 1/N of the model plus about two gathered units (Rajbhandari et al. 2020;
Zhao et al. 2023). Freed parameters that autograd saved for backward are kept as
(unit, offset, shape) tokens by ``saved_tensors_hooks`` and re-gathered on use.

Gradients: the reduce-scatter sums over the FSDP ranks, then FSDP divides by ``divisor``
(default their number: each rank's loss is the mean over its own batch; 1 when the loss is
already divided by the global token count), as ``grad_sync.GradSync`` does for DDP. A
parameter whose gradient is reduced over more mesh dimensions (``get_reduce_dims``, e.g.
("dp", "tp") for a sequence-parallel norm weight) is then all-reduced (summed) over the
others. The reduce-scatter also carries one flag per parameter, "used on this rank": a
parameter no rank used keeps ``grad = None``, as on one device. Rank 0's values are
broadcast before sharding: no rank draws its own shard.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.nn as nn

from course_lib import trace
from course_lib.parallel.data_parallel import broadcast_module_states
from course_lib.parallel.fsdp_params import ShardedUnit, assign_units, check_module, default_units
from course_lib.parallel.mesh import as_mesh, get_reduce_dims

MAX_IN_FLIGHT = 1  # gradient reduce-scatters in flight (each keeps a full-size gradient alive)


class _Saved(NamedTuple):
    """What autograd keeps instead of a saved view of freed, gathered parameters."""
    unit: int
    offset: int
    size: tuple
    stride: tuple


class _UnshardFn(torch.autograd.Function):
    """Forward: hand out the unit's gathered parameters. Backward: reduce-scatter their
    gradient (every use summed by autograd: the (N * S,) gradient of ``unit.full``)."""

    @staticmethod
    def forward(ctx, fsdp, unit, *trainable):
        ctx.fsdp, ctx.unit = fsdp, unit
        return unit.full.view_as(unit.full)

    @staticmethod
    def backward(ctx, grad_full):
        ctx.fsdp._reduce_scatter(ctx.unit, grad_full)
        return (None, None) + (None,) * len(ctx.unit.trainable)


class FSDP(nn.Module):
    """Fully sharded data parallel (ZeRO-3) over mesh dimension(s) ``dims``.

    mesh / group: a :class:`~course_lib.parallel.mesh.Mesh`, or one process group (None:
        the world) named ``dims``; every collective goes through ``mesh.comm(...)``.
    compute_dtype: dtype of the gathered parameters, the buffers and the floating inputs
        (None: the parameters' own); master weights, gradients and optimizer stay in the
        parameters' dtype. reduce_dtype: dtype of the reduce-scatter (None: compute_dtype).
    dims: the mesh dimension(s) FSDP shards over ("dp"; ("dp", "cp") needs ``mesh``).
    divisor: the summed gradients are divided by it (None: the number of FSDP ranks).
    units: submodules that get their own all-gather (default :func:`default_units`); the
        root always is one; a parameter shared by two units (tied weights) is the root's.

    Call ``finish_gradient_synchronization()`` after the last backward, before
    ``optimizer.step()``; several forward/backward passes before it accumulate gradients.
    Every rank must run the same units in forward.
    """

    def __init__(self, module, compute_dtype=None, *, reduce_dtype=None, units=None, mesh=None, group=None,
                 dims="dp", divisor=None, prefetch=True):
        super().__init__()
        check_module(module)
        for dt in (compute_dtype, reduce_dtype):
            if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                raise TypeError(f"FSDP: compute_dtype / reduce_dtype must be floating torch dtypes, got {dt!r}")
        self.dims = (dims,) if isinstance(dims, str) else tuple(dims)
        if mesh is None and len(self.dims) != 1:
            raise ValueError(f"FSDP over several dimensions {self.dims} needs mesh=Mesh(...), not a group")
        unit_modules = default_units(module) if units is None else list(units)
        inside = {id(m) for m in module.modules()}
        if any(id(m) not in inside for m in unit_modules):
            raise ValueError("FSDP: every unit must be a submodule of the wrapped module")
        self.mesh = as_mesh(mesh, group, dim=self.dims[0])
        self.module, self.comm, self.prefetch = module, self.mesh.comm(self.dims), prefetch
        self.divisor = self.comm.size if divisor is None else divisor
        if isinstance(self.divisor, bool) or not isinstance(self.divisor, (int, float)) or self.divisor <= 0:
            raise ValueError(f"FSDP: divisor must be a positive number, got {divisor!r}")
        self.master_dtype = next(module.parameters()).dtype
        self.compute_dtype = compute_dtype or self.master_dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        extra = self._extra_reduce_dims(module)
        # one model: rank 0's values (over all the dims a parameter is replicated on), then shard
        broadcast_module_states(module, self.comm, lambda p: self.mesh.comm(self.dims + extra.get(p, ())))
        self.comm.reset()
        if compute_dtype is not None:  # buffers (rotary tables...) computed with, in compute_dtype
            for buf in module.buffers():
                if buf.is_floating_point():
                    buf.data = buf.data.to(compute_dtype)
        self.units = self._build_units(module, unit_modules, extra)
        self._fwd_order = [u.index for u in self.units]  # refined after each forward
        self._pre_order, self._post_order, self._reducing, self._where = [], [], [], {}
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._pre_forward(u))
            u.module.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u))

    def _extra_reduce_dims(self, module):
        """{parameter: dims its gradient is summed over besides FSDP's} for the trainable ones."""
        extra = {}
        for name, p in module.named_parameters():
            dims = get_reduce_dims(p, default=self.dims)
            if not p.requires_grad:
                continue
            if not set(self.dims) <= set(dims):
                raise ValueError(f"FSDP shards {name!r} over {self.dims}, but its gradient is reduced over "
                                 f"{dims} (set_reduce_dims): a sharded parameter's gradient must be "
                                 f"reduced over the dimensions it is sharded on")
            rest = tuple(d for d in dims if d not in self.dims)
            if rest:
                extra[p] = rest
                self.mesh.comm(rest)  # a clear error now if the mesh lacks them
        return extra

    def _build_units(self, module, unit_modules, extra):
        built = []
        for m, name, params, where in assign_units(module, unit_modules):
            unit = ShardedUnit(len(built), name, m, params, where, self.comm.rank, self.comm.size)
            unit.is_root = m is module
            groups = {}  # parameters whose gradients are summed over more dims, by those dims
            for j, p in enumerate(params):
                if p in extra:
                    groups.setdefault(extra[p], []).append(j)
            unit.extra = [(self.mesh.comm(dims), js) for dims, js in groups.items()]
            for mod, attr, i in where:
                mod._parameters[attr] = unit.pieces[i]  # the module now holds its shard only
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
        views = u.full_views(full)  # (d0, ...) each, views of the unit's one gathered buffer
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
            mod._parameters[attr] = u.pieces[i]  # back to the shard
        if not u.is_root:
            trace.recorder().add(f"forward {u.name}", "compute", u.t_forward, trace.now())
        self._post_order.append(u.index)
        if not (u.is_root and torch.is_grad_enabled()):  # the root is needed first in backward
            self._reshard(u)

    def _prefetch_after(self, u, order):
        k = order.index(u.index) + 1 if u.index in order else len(order)
        for j in order[k:]:
            nxt = self.units[j]
            if nxt.full is None and nxt.gather is None and not (nxt.reduced or nxt is u):
                self._start_gather(nxt)
                return

    # ------------------------------------------------------------------ gather / free
    def _start_gather(self, u):
        """Launch one all-gather of all of u's shards: (S,) per rank -> (N * S,)."""
        send = u.flat_shard.to(self.compute_dtype)  # a copy only when casting
        gathered = send.new_empty(self.comm.size * u.numel)
        work = self.comm.all_gather_into_tensor(gathered, send, async_op=True, name=f"all-gather {u.name}")
        u.gather = (work, send, gathered)

    def _unshard(self, u):
        """Wait for u's all-gather (start it if nobody did) and copy it out to full parameters."""
        if u.full is not None:
            return
        if u.gather is None:
            self._start_gather(u)
        work, _, gathered = u.gather
        work.wait()
        u.gather, u.full = None, u.copy_out(gathered)  # rank after rank -> parameter after parameter
        self._where[_key(u.full)] = u.index

    def _reshard(self, u):
        if u.gather is not None:  # a prefetch nobody used
            u.gather[0].wait()
            u.gather = None
        if u.full is not None:
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
        """u's full gradients (N * S,) -> this rank's (S_grad,) shard, summed over ranks."""
        packed = u.pack_gradients(grad_full, self.reduce_dtype)  # (N, S_grad + T) rank after rank
        out = packed.new_empty(packed.shape[1])                   # (S_grad + T,): my shard, summed
        work = self.comm.reduce_scatter_tensor(out, packed.view(-1), async_op=True,
                                               name=f"reduce-scatter {u.name}")
        self._reducing.append((u, out, work, packed))
        u.reduced = True
        if not u.is_root and u.backward_started:
            trace.recorder().add(f"backward {u.name}", "compute", u.t_backward, trace.now())
        self._reshard(u)
        while len(self._reducing) > MAX_IN_FLIGHT:
            self._fold_oldest()

    def _fold_oldest(self):
        u, out, work, _ = self._reducing.pop(0)
        work.wait()
        used = out[u.grad_numel:] > 0                      # some rank's backward reached it
        u.used_anywhere = used if u.used_anywhere is None else u.used_anywhere | used
        out = out[:u.grad_numel].to(self.master_dtype).div(self.divisor)  # e.g. mean over dp
        for comm, indexes in u.extra:  # e.g. a sequence-parallel weight: sum over tp too
            rows = u.gradient_rows(indexes, out)
            flat = torch.cat(rows)
            if flat.numel():
                comm.all_reduce(flat, name=f"all-reduce {u.name} over {comm.dim}")
                for r, summed in zip(rows, flat.split([r.numel() for r in rows])):
                    r.copy_(summed)
        if u.grad_shard is None:
            u.grad_shard = out
        else:  # several backward passes: accumulate
            u.grad_shard.add_(out)

    def finish_gradient_synchronization(self):
        """Wait for the reduce-scatters; give each parameter shard its gradient."""
        for u in self.units:  # a unit that ran forward but got no gradient: reduce zeros
            if u.forward_ran and u.trainable and not u.reduced:
                self._reduce_scatter(u, u.flat_shard.new_zeros(self.comm.size * u.numel))
        while self._reducing:
            self._fold_oldest()
        for u in self.units:
            if u.grad_shard is not None:
                for j, i in enumerate(u.trainable_slots):
                    if not u.used_anywhere[j]:
                        continue  # no rank used it: grad stays None, as on one device
                    grad, piece = u.gradient_view(i, u.grad_shard), u.pieces[i]  # a view: no copy
                    if piece.grad is None:
                        piece.grad = grad
                    else:  # not zeroed since the last step: accumulate, as on one device
                        piece.grad.add_(grad)
            u.grad_shard, u.used_anywhere, u.used = None, None, [False] * len(u.pieces)
            self._reshard(u)

    # ------------------------------------------------------------------ checkpoints
    @torch.no_grad()
    def gather_full_params(self):
        """The full state dict (original names, full shapes, master dtype) on every rank."""
        full = {}
        for u in self.units:
            gathered = u.flat_shard.new_empty(self.comm.size * u.numel)
            self.comm.all_gather_into_tensor(gathered, u.flat_shard, name=f"all-gather {u.name}")
            for piece, view in zip(u.pieces, u.full_views(u.copy_out(gathered))):
                full[id(piece)] = view.clone()
        return OrderedDict((name, full.get(id(t), t.detach()))
                           for name, t in self.module.state_dict(keep_vars=True).items())


def _key(t):
    return (t.device, t.untyped_storage().data_ptr())


__all__ = ["FSDP", "default_units", "check_module", "broadcast_module_states"]
