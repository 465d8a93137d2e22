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
(unit, offset, shape) tokens by ``saved_tensors_hooks`` and re-gathered on use; every other
saved tensor goes on to the pair FSDP's forward runs inside (a count of activations).

Gradients: the reduce-scatter sums over the FSDP ranks, then FSDP divides by ``divisor``
(default their number: each rank's loss is the mean over its own batch; 1 when the loss is
already divided by the global token count), as ``grad_sync.GradSync`` does for DDP. A
parameter whose gradient is reduced over more mesh dimensions (``reduce_dims``, the plan's, or
its ``set_reduce_dims`` mark, e.g. ("dp", "tp") for a sequence-parallel norm weight) is then
all-reduced (summed) over the others. The reduce-scatter also carries one flag per parameter,
"used on this rank": a parameter no rank used keeps ``grad = None``, as on one device. Rank 0's values are
broadcast before sharding: no rank draws its own shard.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import trace
from course_lib.parallel.data_parallel import broadcast_module_states
from course_lib.parallel.fsdp_params import ShardedUnit, assign_units, check_fsdp_module, default_units
from course_lib.parallel.hsdp import every_group, hsdp_comms, reshard_comm, rule_hsdp
from course_lib.parallel.mesh import as_mesh, get_reduce_dims
from course_lib.parallel.tp_plan import tp_slice_of
from course_lib.parallel.zeropp import (check_zeropp, node_comms, node_size, quantized_all_gather,
                                        quantized_reduce_scatter, rule_zeropp)

MAX_IN_FLIGHT = 1  # gradient reduce-scatters in flight (each keeps a full-size gradient alive)
PEAKS = ("gathered parameters", "unsharded gradients")  # FSDP.peak's keys: bytes held at once


class _FreedParam(NamedTuple):
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


def rule_fsdp(cfg, layout):
    """The ranks hold the data-parallel copies whole (ZeRO 0: DDP) or sharded (ZeRO 3: FSDP over
    dp x cp); a weight tied across two pipeline stages would be one weight in two FSDP units."""
    if layout.zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={layout.zero!r}: the ZeRO stage is 0 (data='ddp'), 1, 2 (the optimizer "
                         f"sharded: zero_nd) or 3 (data='fsdp' / 'hsdp')")
    rule_hsdp(cfg, layout)
    rule_zeropp(cfg, layout)
    if layout.data != "ddp" and cfg.n_experts and layout.ep > 1:
        raise ValueError(f"experts split over ep={layout.ep} under FSDP: FSDP shards over dp x cp, but an expert is "
                         f"held by the dp / ep ranks of its EP slot only; not supported here, use data='ddp'")
    if layout.data != "ddp" and cfg.tie_embeddings and layout.pp * layout.v > 1:
        raise ValueError("a tied embedding on two pipeline stages (pp > 1, or pp = 1 with v > 1 chunks) is "
                         "one weight in two FSDP units: not supported here; untie it or use data='ddp'")


class FSDP(nn.Module):
    """Fully sharded data parallel (ZeRO-3) over mesh dimension(s) ``dims``.

    Gradients are NOT in ``p.grad`` after ``loss.backward()`` (unlike torch's ``fully_shard``):
    backward only launches the reduce-scatters, ``p.grad`` stays None (or last step's). Call
    ``finish_gradient_synchronization()`` after the last backward and before
    ``clip_grad_norm_`` / ``optimizer.step()``: it waits for them and sets each parameter's
    ``.grad`` to its shard of the gradient (the rows this rank holds, summed over the ranks
    and divided by ``divisor``). Several forward/backward passes before it accumulate
    gradients. Every rank must run the same units in forward. Clip with this FSDP's
    ``clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_`` on the shards gives each rank the
    norm of its own rows only.

    mesh / group: a :class:`~course_lib.parallel.mesh.Mesh`, or one process group (None:
        the world) named ``dims``; every collective goes through ``mesh.comm(...)``.
    compute_dtype: dtype of the gathered parameters, the buffers and the floating inputs
        (None: the parameters' own); master weights, gradients and optimizer stay in the
        parameters' dtype. reduce_dtype: dtype of the reduce-scatter (None: compute_dtype).
    dims: the mesh dimension(s) FSDP shards over ("dp"; ("dp", "cp") needs ``mesh``).
    reduce_dims: {id(parameter): the mesh dims its gradient is summed over}, ``dims`` and maybe
        more (the plan's record, as ``GradSync``'s ``dims``); None: each parameter's mark
        (``set_reduce_dims``), default ``dims``.
    divisor: the summed gradients are divided by it (None: the number of FSDP ranks).
    units: submodules that get their own all-gather (default :func:`default_units`); the
        root always is one; a parameter shared by two units (tied weights) is the root's.
        FSDP does not nest: torch's ``fully_shard(block)`` per block, then
        ``fully_shard(model)``, is here one ``FSDP(model, units=blocks)`` (refused otherwise).

    HSDP and FSDP's controls (torch's names):

    - ``shard_size=S``: shard over S ranks of ``dims``, replicate over the other R = N / S
      (torch's ``fully_shard`` on a 2-D mesh): the reduce-scatter sums over the shard group,
      then the gradient SHARD is all-reduced over the replicate group (:mod:`~course_lib.parallel.hsdp`).
    - ``reshard_after_forward``: True (free the gathered unit after forward; all-gather again
      in backward), False (keep it to backward: no second all-gather, the whole unit held), an
      int k (keep 1/k of it: the backward all-gather runs inside blocks of k ranks). None:
      True; the root always stays gathered into backward (torch's default for the root).
    - ``set_requires_gradient_sync(False)``: backward accumulates full, unsharded gradients
      and reduce-scatters nothing; the first backward with True (or
      ``finish_gradient_synchronization``) reduce-scatters their sum once.
    - ``set_modules_to_forward_prefetch(unit, [units])`` / ``..._backward_prefetch``: the
      all-gathers started when ``unit`` starts, instead of the next unit in recorded order.
    - ``peak``: the largest gathered-parameter and unsharded-gradient bytes held at once.
    - ``zeropp``: any of ("hpz", "qwz", "qgz") (:mod:`~course_lib.parallel.zeropp`), nodes of
      ``gpus_per_node`` consecutive ranks of the group; hpZ is ``reshard_after_forward=G``.

    Checkpoints:

    - ``state_dict()`` (``nn.Module``'s own) is this rank's shards: keys ``module.<name>``
      (the single-device names behind the ``module.`` prefix, a tied weight under each of its
      names), each parameter a plain tensor in the master dtype holding rows
      ``[r * c, r * c + rows)`` of dim 0 (c = ceil(d0 / N); shape (rows, ...), maybe 0 rows:
      nothing marks it as a shard), buffers whole (in compute_dtype if given).
      ``load_state_dict`` takes such a dict back on the same rank of the same FSDP layout.
    - ``full_state_dict()``: the single-device state dict (no prefix, full shapes, master
      dtype; buffers as held), gathered: what ``model.load_state_dict`` on one device takes.
    - ``load_full_state_dict(sd)``: each rank keeps its rows of a single-device state dict.
    """

    def __init__(self, module, compute_dtype=None, *, reduce_dtype=None, units=None, mesh=None, group=None,
                 dims="dp", reduce_dims=None, divisor=None, prefetch=True, shard_size=None,
                 reshard_after_forward=None, zeropp=(), gpus_per_node=None):
        super().__init__()
        check_fsdp_module(module)
        _check_not_wrapped(module)
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
        every = self.mesh.comm(self.dims)  # every data-parallel copy: HSDP's shard x replicate
        self.module, self.comm, self.replicate, self.prefetch = module, every, None, prefetch
        self.shard_sets = None   # every shard group's ranks, where a block of it is needed
        if shard_size is not None:
            self.comm, self.replicate, self.shard_sets = hsdp_comms(self.mesh, self.dims, shard_size, self.mesh.impl)
        self.zeropp, self.node, self.qgz = check_zeropp(zeropp), None, None
        if self.zeropp:
            if shard_size is not None:
                raise ValueError("FSDP: zeropp is ZeRO-3's (one shard group): not with shard_size (HSDP)")
            self.node = node_size(self.comm.size, gpus_per_node)
            if "hpz" in self.zeropp and reshard_after_forward is not None:
                raise ValueError("FSDP: zeropp 'hpz' is reshard_after_forward=gpus_per_node: give one of them")
            if "hpz" in self.zeropp:   # hpZ: keep 1/G after forward, the backward all-gather in the node
                reshard_after_forward = self.node
            if "qgz" in self.zeropp:   # (intra-node, inter-node) Comms of the hierarchical all-to-all
                self.qgz = node_comms(self.comm, self.node, self.mesh.impl,
                                      every_group(self.mesh, self.dims, self.comm), self.mesh)
        self.reshard_after_forward, self.reshard_group = self._reshard_policy(reshard_after_forward)
        self.divisor = every.size if divisor is None else divisor
        if isinstance(self.divisor, bool) or not isinstance(self.divisor, (int, float)) or self.divisor <= 0:
            raise ValueError(f"FSDP: divisor must be a positive number, got {divisor!r}")
        self.master_dtype = next(module.parameters()).dtype
        self.compute_dtype = compute_dtype or self.master_dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        extra = self._extra_reduce_dims(module, reduce_dims)
        # one model: rank 0's values (over all the dims a parameter is replicated on), then shard
        broadcast_module_states(module, every, lambda p: self.mesh.comm(self.dims + extra.get(p, ())),
                                what="FSDP")
        every.reset()
        if compute_dtype is not None:  # buffers (rotary tables...) computed with, in compute_dtype
            for buf in module.buffers():
                if buf.is_floating_point():
                    buf.data = buf.data.to(compute_dtype)
        self._norm_dims = self._grad_norm_dims(extra)
        self._norm_params = []  # [(shard Parameter, counted in the norm on this rank)]
        self.units = self._build_units(module, unit_modules, extra)
        for m in module.modules():  # its parameters are shards now: wrapping it again is refused
            m._fsdp_sharded = True
        self._fwd_order = [u.index for u in self.units]  # refined after each forward
        self._pre_order, self._post_order, self._reducing, self._where = [], [], [], {}
        self._replicating, self._explicit = [], {"forward": {}, "backward": {}}
        self.requires_gradient_sync, self.peak = True, dict.fromkeys(PEAKS, 0)
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._pre_forward(u))
            u.module.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u))

    def _reshard_policy(self, value):
        """(True / False / k, the Comm of this rank's block of k) as torch's ``fully_shard``
        takes ``reshard_after_forward``: k must divide the shard group; k = shard group is
        True, k = 1 is False."""
        if value is None or isinstance(value, bool):
            return value is not False, None
        n = self.comm.size
        if not isinstance(value, int) or value < 1 or n % value:
            raise ValueError(f"FSDP: reshard_after_forward must be True, False or an int dividing the "
                             f"shard group's {n} ranks, got {value!r}")
        if value in (1, n):
            return value == n, None
        sets = self.shard_sets or every_group(self.mesh, self.dims, self.comm)
        return value, reshard_comm(sets, value, self.comm.dim, self.mesh.impl, self.mesh)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool):
        """torch's ``FSDPModule.set_requires_gradient_sync``: False on all but the last
        micro-batch of gradient accumulation (full gradients summed locally, no reduce-scatter)."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"set_requires_gradient_sync takes a bool, got {requires_gradient_sync!r}")
        self.requires_gradient_sync = requires_gradient_sync

    def set_modules_to_forward_prefetch(self, module, modules):
        """When ``module``'s unit starts its forward, start the all-gathers of ``modules``'
        units (torch: ``block.set_modules_to_forward_prefetch([...])``)."""
        self._explicit["forward"][self._unit_of(module)] = [self._unit_of(m) for m in modules]

    def set_modules_to_backward_prefetch(self, module, modules):
        """When ``module``'s unit starts its backward, start the all-gathers of ``modules``'."""
        self._explicit["backward"][self._unit_of(module)] = [self._unit_of(m) for m in modules]

    def _unit_of(self, module):
        for u in self.units:
            if u.module is module:
                return u.index
        raise ValueError(f"FSDP: {type(module).__name__} is not one of this FSDP's units "
                         f"{[u.name for u in self.units]}")

    def _note_memory(self):
        """Track the peaks: gathered parameters (in flight, gathered, kept 1/k after forward)
        and accumulated unsharded gradients, in bytes."""
        b = torch.empty((), dtype=self.compute_dtype, device="cpu").element_size()   # bytes, never sent
        held = sum(u.numel * self.comm.size * ((u.full is not None) + (u.gather is not None)) +
                   (u.post.numel() if u.post is not None else 0) for u in self.units) * b
        grads = sum(u.accumulated.numel() * u.accumulated.element_size()
                    for u in self.units if u.accumulated is not None)
        for key, now in zip(PEAKS, (held, grads)):
            self.peak[key] = max(self.peak[key], now)

    def _extra_reduce_dims(self, module, reduce_dims=None):
        """{parameter: dims its gradient is summed over besides FSDP's} for the trainable ones."""
        extra = {}
        for name, p in module.named_parameters():
            dims = get_reduce_dims(p, default=self.dims) if reduce_dims is None else tuple(reduce_dims[id(p)])
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

    def _grad_norm_dims(self, extra):
        """The mesh dims ``clip_grad_norm_`` sums over: FSDP's, the dims some gradient is also
        reduced over, and "tp" if the mesh has it (TP slices differ between TP ranks)."""
        others = set().union(*extra.values()) - set(self.dims)
        if self.mesh.sizes.get("tp", 1) > 1 and "tp" not in self.dims:
            others.add("tp")
        return self.dims + tuple(sorted(others))

    def _counted_in_norm(self, p, extra_dims):
        """Does this rank count (original, unsharded) parameter p in the norm? A copy held by
        several ranks of the norm's extra dims counts once: on their coordinate 0."""
        coord = getattr(self.mesh, "coord", {})
        where, copies = tp_slice_of(p)
        for d in self._norm_dims[len(self.dims):]:
            tp_slice = d == "tp" and where is not None
            replicated = d in extra_dims or d == "cp" or (d == "tp" and not tp_slice)
            if replicated and coord[d] != 0:
                return False
            if tp_slice and coord[d] % copies:  # a TP slice held by `copies` ranks
                return False
        return True

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
            self._norm_params += [(unit.pieces[j], self._counted_in_norm(p, extra.get(p, ())))
                                  for j, p in enumerate(params) if p.requires_grad]
            for mod, attr, i in where:
                mod._parameters[attr] = unit.pieces[i]  # the module now holds its shard only
            built.append(unit)
        return built

    # ------------------------------------------------------------------ forward
    def forward(self, *args, **kwargs):
        self._drain(0)  # an earlier backward of this step (gradient accumulation)
        for u in self.units:   # nothing stays gathered from a forward that had no backward
            self._reshard(u)
        if self.compute_dtype != self.master_dtype:  # inputs in the compute dtype, like the weights
            args = [self._cast(a) for a in args]
            kwargs = {k: self._cast(v) for k, v in kwargs.items()}
        for u in self.units:
            u.reset_step()
        self._pre_order, self._post_order = [], []
        pack, unpack = self._saved_tensor_hooks()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = self.module(*args, **kwargs)
        self._fwd_order = self._pre_order  # prefetch order for the next forward
        return out

    def _cast(self, t):
        return t.to(self.compute_dtype) if torch.is_tensor(t) and t.is_floating_point() else t

    def _pre_forward(self, u):
        u.forward_ran = torch.is_grad_enabled()
        self._pre_order.append(u.index)
        self._unshard(u)
        self._prefetch(u, "forward", self._fwd_order)  # the next all-gather overlaps this compute
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
        if not torch.is_grad_enabled():
            self._reshard(u)
        elif u.is_root or self.reshard_after_forward is False:  # the root is needed first in backward
            return
        elif self.reshard_after_forward is True:
            self._reshard(u)
        else:  # keep this rank's 1/k: backward gathers inside its block of k
            k = self.reshard_after_forward
            part = u.by_rank(u.full).view(k, -1)[self.reshard_group.rank]  # (N * S / k,)
            self._reshard(u)
            u.post = part.clone()
            self._note_memory()

    def _prefetch(self, u, phase, order):
        """The explicit list set for u in this phase, else (prefetch=True) the next in ``order``."""
        explicit = self._explicit[phase].get(u.index)
        if explicit is None:
            if self.prefetch:
                self._prefetch_after(u, order)
            return
        for j in explicit:
            nxt = self.units[j]
            if nxt.full is None and nxt.gather is None and not (nxt.reduced or nxt is u):
                self._start_gather(nxt)

    def _prefetch_after(self, u, order):
        k = order.index(u.index) + 1 if u.index in order else len(order)
        for j in order[k:]:
            nxt = self.units[j]
            if nxt.full is None and nxt.gather is None and not (nxt.reduced or nxt is u):
                self._start_gather(nxt)
                return

    # ------------------------------------------------------------------ gather / free
    def _start_gather(self, u):
        """Launch one all-gather of all of u's shards: (S,) per rank -> (N * S,); after a
        reshard to k ranks, of the (N * S / k,) parts inside this rank's block of k."""
        comm, send = (self.comm, u.flat_shard.to(self.compute_dtype)) if u.post is None \
            else (self.reshard_group, u.post)  # a copy only when casting
        gathered = send.new_empty(self.comm.size * u.numel)
        if "qwz" in self.zeropp and u.post is None:   # qwZ: int8 blocks from the primary shards
            work = quantized_all_gather(comm, gathered, send, name=f"all-gather {u.name}")
        else:
            work = comm.all_gather_into_tensor(gathered, send, async_op=True, name=f"all-gather {u.name}")
        u.gather, u.post = (work, send, gathered), None
        self._note_memory()

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
        self._note_memory()

    def _reshard(self, u):
        if u.gather is not None:  # a prefetch nobody used
            u.gather[0].wait()
            u.gather = None
        if u.full is not None:
            self._where.pop(_key(u.full), None)
            u.full = None  # the last reference: the gathered parameters are freed
        u.post = None

    def _saved_tensor_hooks(self):
        """FSDP's (pack, unpack), composed with the pair this forward runs inside, if any (a count
        of the activations saved for backward: the pipeline runner's, the dry run's). torch calls
        only the innermost pair, so FSDP hands that pair every saved tensor that is not a view of
        gathered parameters, and its packed form back to its unpack: the enclosing pair sees
        exactly what it sees around the module without FSDP, parameters excepted. (torch has no
        public getter of the enclosing pair; its AOT autograd reads it the same way.)"""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if outer is None:
            return self._pack, self._unpack
        outer_pack, outer_unpack = outer

        def pack(t):
            token = self._pack(t)
            return token if isinstance(token, _FreedParam) else outer_pack(t)

        def unpack(saved):
            return self._unpack(saved) if isinstance(saved, _FreedParam) else outer_unpack(saved)

        return pack, unpack

    def _pack(self, t):
        """Autograd saves a tensor: a view of gathered parameters becomes a token."""
        unit = self._where.get(_key(t)) if t.numel() else None
        if unit is None:
            return t
        return _FreedParam(unit, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def _unpack(self, saved):
        if not isinstance(saved, _FreedParam):
            return saved
        u = self.units[saved.unit]
        if not u.backward_started:
            u.backward_started, u.t_backward = True, trace.now()
            self._unshard(u)  # backward runs the units in reverse order of their forward end
            self._prefetch(u, "backward", self._post_order[::-1])
        self._unshard(u)
        return u.full.as_strided(saved.size, saved.stride, saved.offset)

    # ------------------------------------------------------------------ gradients
    def _reduce_scatter(self, u, grad_full, sync=None):
        """u's full gradients (N * S,) -> this rank's (S_grad,) shard, summed over ranks;
        without gradient sync, added to its unsharded gradient instead (nothing sent)."""
        if not (self.requires_gradient_sync if sync is None else sync):
            if u.accumulated is None:  # (N * S,): the unit's full gradient, kept to the last one
                u.accumulated = grad_full.to(self.reduce_dtype, copy=True)
            else:
                u.accumulated.add_(grad_full)
            u.reduced = True
            self._note_memory()
            self._reshard(u)
            return
        if u.accumulated is not None:  # the earlier micro-batches' sum, never reduced
            grad_full, u.accumulated = u.accumulated.add_(grad_full), None
        packed = u.pack_gradients(grad_full, self.reduce_dtype)  # (N, S_grad + T) rank after rank
        out = packed.new_empty(packed.shape[1])                   # (S_grad + T,): my shard, summed
        if self.qgz is None:
            work = self.comm.reduce_scatter_tensor(out, packed.view(-1), async_op=True,
                                                   name=f"reduce-scatter {u.name}")
        else:   # qgZ: gradients as int8 all-to-alls; the "used" flags exact, apart
            work = quantized_reduce_scatter(*self.qgz, out[:u.grad_numel], packed[:, :u.grad_numel],
                                            name=f"reduce-scatter {u.name}")
            self.comm.reduce_scatter_tensor(out[u.grad_numel:], packed[:, u.grad_numel:].contiguous().view(-1),
                                            name=f"reduce-scatter {u.name} flags")
        self._reducing.append((u, out, work, packed))
        u.reduced = True
        if not u.is_root and u.backward_started:
            trace.recorder().add(f"backward {u.name}", "compute", u.t_backward, trace.now())
        self._reshard(u)
        self._drain(MAX_IN_FLIGHT)

    def _drain(self, in_flight):
        """Finish reduce-scatters until ``in_flight`` are left; under HSDP each then starts the
        all-reduce of its shard over the replicas (as many left in flight)."""
        while len(self._reducing) > in_flight:
            u, out, work, _ = self._reducing.pop(0)
            work.wait()
            if self.replicate is None or self.replicate.size == 1:
                self._fold(u, out)
            else:  # (S_grad + T,): the shard only, 1/S of the gradient, crosses the replicas
                self._replicating.append((u, out, self.replicate.all_reduce(
                    out, async_op=True, name=f"all-reduce {u.name} over replicas")))
        while len(self._replicating) > in_flight:
            u, out, work = self._replicating.pop(0)
            work.wait()
            self._fold(u, out)

    def _fold(self, u, out):
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
        for u in self.units:  # a unit that ran forward but got no gradient: reduce zeros (+ its sum
            if u.trainable and (u.accumulated is not None or (u.forward_ran and not u.reduced)):  # unsynced)
                self._reduce_scatter(u, u.flat_shard.new_zeros(self.comm.size * u.numel, dtype=self.reduce_dtype),
                                     sync=True)
        self._drain(0)
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

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False):
        """``torch.nn.utils.clip_grad_norm_`` for the sharded gradients: returns the total
        ``norm_type`` norm of the gradients of the whole (unsharded) model, as one device
        computes it, and scales every gradient shard by min(1, max_norm / (norm + 1e-6)).

        Each rank holds rows of each gradient (padding excluded), so: inf norm = a MAX
        all-reduce of the local max |g|; p-norm = (SUM all-reduce of sum |g|^p)^(1/p). The sum
        runs over FSDP's dims, plus any dim a gradient is also reduced over (a sequence-
        parallel weight, replicated there: counted once) and, when the mesh has "tp", over
        the TP ranks: a weight TP cut (``tp_shard``, as course_lib's TP layers tag it) counts
        its slice on each TP rank, any other parameter (replicated over tp) counts once; so
        every rank gets the same norm, that of the single-device model, as torch's DTensor
        gradients give. Pipeline stages are not summed: each stage's FSDP clips by its own norm.
        Call it after ``finish_gradient_synchronization()``, on every rank (a collective).
        """
        if self._reducing or self._replicating or any(u.grad_shard is not None for u in self.units):
            raise RuntimeError("FSDP.clip_grad_norm_: gradient reduce-scatters are still pending: call "
                               "finish_gradient_synchronization() after backward, before clipping")
        number, order = _number(max_norm), _number(norm_type)  # as torch: "inf", 0-d tensors
        if number is None or not number >= 0:
            raise ValueError(f"FSDP.clip_grad_norm_: max_norm must be a number >= 0, got {max_norm!r}")
        if order is None or not order > 0:
            raise ValueError(f"FSDP.clip_grad_norm_: norm_type must be a number > 0 or inf, got {norm_type!r}")
        max_norm, norm_type = number, order
        first = self.replicate is None or self.replicate.rank == 0  # HSDP: one replica counts its shards
        grads = [(p.grad, counted and first) for p, counted in self._norm_params if p.grad is not None]
        local = self.units[0].flat_shard.new_zeros((), dtype=torch.float64)  # float64: no overflow
        for g, counted in grads:
            if counted and g.numel():
                a = g.detach().abs()  # (rows, ...): this rank's rows, no padding
                local = torch.maximum(local, a.max().double()) if norm_type == math.inf \
                    else local + a.double().pow(norm_type).sum()
        comm = self.mesh.comm(self._norm_dims)
        if norm_type == math.inf:  # [max |g|, NaN seen]: a MAX may drop a NaN, a flag does not
            stats = torch.stack([local.nan_to_num(nan=0.0), local.isnan().double()])
            comm.all_reduce(stats, op=dist.ReduceOp.MAX, name="all-reduce grad norm")
            total = stats[0] if stats[1] == 0 else stats[1] * math.nan
        else:  # sum over ranks of sum |g|^p
            comm.all_reduce(local, name="all-reduce grad norm")
            total = local.pow(1.0 / norm_type)
        total = total.to(self.master_dtype)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it "
                               f"cannot be clipped. To disable this error and scale the gradients by the "
                               f"non-finite norm anyway, set `error_if_nonfinite=False`")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g, _ in grads:  # every shard, counted here or not: replicas stay equal
            g.mul_(coef.to(g.dtype))
        return total

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

    def full_state_dict(self, rank0_only=False):
        """The single-device state dict (``module.state_dict()`` of the unwrapped model: same
        keys, full shapes, master dtype), gathered; a collective: every rank calls it. With
        ``rank0_only`` the other ranks get ``{}`` (they still take part in the all-gathers)."""
        full = self.gather_full_params()
        return full if not rank0_only or self.comm.rank == 0 else OrderedDict()

    @torch.no_grad()
    def load_full_state_dict(self, state_dict):
        """Load a single-device state dict (the unwrapped model's keys and full shapes): each
        rank copies its rows of every parameter into its shard, and the buffers whole. No
        communication: every rank must be given the same dict."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"FSDP.load_full_state_dict takes a dict, got {type(state_dict).__name__}")
        where = {id(piece): (u, i) for u in self.units for i, piece in enumerate(u.pieces)}
        targets = self.module.state_dict(keep_vars=True)  # name -> shard Parameter or buffer
        missing = [k for k in targets if k not in state_dict]
        unexpected = [k for k in state_dict if k not in targets]
        if missing or unexpected:
            prefixed = [k for k in unexpected if k.startswith("module.")]
            hint = (" (keys start with 'module.': that is FSDP.state_dict()'s sharded dict; use "
                    "load_state_dict for it)") if prefixed else ""
            raise ValueError(f"FSDP.load_full_state_dict: the state dict does not match the model: "
                             f"missing keys {missing}, unexpected keys {unexpected}{hint}")
        plan = []
        for name, t in targets.items():
            value, u_i = state_dict[name], where.get(id(t))
            full_shape = t.shape if u_i is None else u_i[0].slots[u_i[1]].shape
            if not torch.is_tensor(value):
                raise TypeError(f"FSDP.load_full_state_dict: {name!r} is a {type(value).__name__}, not a tensor")
            if tuple(value.shape) != tuple(full_shape):
                raise ValueError(f"FSDP.load_full_state_dict: {name!r} has shape {tuple(value.shape)}, the "
                                 f"single-device model's is {tuple(full_shape)} (a full, unsharded tensor)")
            plan.append((name, t, value, u_i))
        for name, t, value, u_i in plan:  # checked everything first: all or nothing
            if u_i is None:
                t.copy_(value)
            else:
                u, i = u_i
                s = u.slots[i]
                start = self.comm.rank * s.chunk
                t.copy_(value[start:start + s.rows])  # (rows, *trailing): my rows, maybe none


def _key(t):
    """The storage ``t`` views. On the meta device every storage's data_ptr is 0 (the dry
    run): there, the storage's own identity."""
    storage = t.untyped_storage()
    return (t.device, storage._cdata if t.is_meta else storage.data_ptr())


def _number(x):
    """float(x) for a real number, "inf" or a one-element tensor; None for anything else."""
    if isinstance(x, bool) or (torch.is_tensor(x) and x.numel() != 1):
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _check_not_wrapped(module):
    """FSDP does not nest: an FSDP inside, or parameters some FSDP already sharded, would be
    sharded twice (a layer that never trains, or mismatched collectives)."""
    if isinstance(module, FSDP):
        raise ValueError("FSDP: the module is already an FSDP: wrap the original module once")
    for name, m in module.named_modules():
        where = f"submodule {name!r}" if name else "the module"
        if isinstance(m, FSDP):
            raise ValueError(f"FSDP: {where} is already an FSDP, and FSDP does not nest (torch's habit: "
                             f"fully_shard each block, then the root). Wrap the original model once and "
                             f"pass the blocks as units=[...]: each unit gets its own all-gather")
        if getattr(m, "_fsdp_sharded", False):
            raise ValueError(f"FSDP: {where} was already wrapped by an FSDP (its parameters are shards): "
                             f"wrap the original model once, passing the blocks as units=[...]")


__all__ = ["FSDP", "rule_fsdp", "default_units", "check_fsdp_module", "broadcast_module_states"]
