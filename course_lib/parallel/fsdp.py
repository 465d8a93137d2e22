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

The parts of FSDP each have a module: :mod:`.fsdp_params` (the units and their shards),
:mod:`.fsdp_gather` (all-gather, prefetch, free), :mod:`.fsdp_gradients` (reduce-scatter and the
gradient shards), :mod:`.fsdp_controls` (torch's controls), :mod:`.fsdp_grad_norm` (clipping),
:mod:`.fsdp_state_dict` (single-device checkpoints); this one builds FSDP and runs its forward.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from course_lib import trace
from course_lib.parallel.data_parallel import broadcast_module_states
from course_lib.parallel.fsdp_controls import PEAKS, FSDPControls
from course_lib.parallel.fsdp_gather import FSDPGathering
from course_lib.parallel.fsdp_grad_norm import FSDPGradNorm
from course_lib.parallel.fsdp_gradients import MAX_IN_FLIGHT, FSDPGradients
from course_lib.parallel.fsdp_params import ShardedUnit, assign_units, check_fsdp_module, default_units
from course_lib.parallel.fsdp_state_dict import FSDPStateDict
from course_lib.parallel.hsdp import every_group, hsdp_comms, rule_hsdp
from course_lib.parallel.mesh import as_mesh, get_reduce_dims
from course_lib.parallel.zeropp import check_zeropp, node_comms, node_size, rule_zeropp


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
    if layout.data != "ddp" and cfg.tie_embeddings and layout.pp * layout.v > 1:
        raise ValueError("a tied embedding on two pipeline stages (pp > 1, or pp = 1 with v > 1 chunks) is "
                         "one weight in two FSDP units: not supported here; untie it or use data='ddp'")


class FSDP(FSDPControls, FSDPGathering, FSDPGradients, FSDPGradNorm, FSDPStateDict, nn.Module):
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
        root always is one; a parameter shared by two units (tied weights) is the root's; a
        unit inside a unit (a block's experts inside the block) takes its own parameters, the
        outer one the rest (torch's ``fully_shard`` on both, inner first). FSDP does not nest: torch's ``fully_shard(block)`` per block, then
        ``fully_shard(model)``, is here one ``FSDP(model, units=blocks)`` (refused otherwise).
    unit_dims: {unit module: the mesh dims it shards over instead of ``dims``} (torch's
        ``fully_shard(block.moe.experts, mesh=expert_mesh)`` before ``fully_shard(block)``): an
        expert is held by the ranks of its EP slot only ("edp"), so its unit gathers and
        reduce-scatters in that group; each unit's collectives run in its own group. Not with
        HSDP, ZeRO++ or ``reshard_after_forward=k`` (one shard group for those).

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

    Checkpoints in the single-device form: :class:`~course_lib.parallel.fsdp_state_dict.FSDPStateDict`.
    """

    def __init__(self, module, compute_dtype=None, *, reduce_dtype=None, units=None, mesh=None, group=None,
                 dims="dp", reduce_dims=None, divisor=None, prefetch=True, shard_size=None,
                 reshard_after_forward=None, zeropp=(), gpus_per_node=None, unit_dims=None):
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
        unit_dims = self._unit_dims(unit_dims, unit_modules, shard_size, reshard_after_forward)
        self.divisor = every.size if divisor is None else divisor
        if isinstance(self.divisor, bool) or not isinstance(self.divisor, (int, float)) or self.divisor <= 0:
            raise ValueError(f"FSDP: divisor must be a positive number, got {divisor!r}")
        self.master_dtype = next(module.parameters()).dtype
        self.compute_dtype = compute_dtype or self.master_dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        assigned = assign_units(module, unit_modules)
        shard_dims = {p: unit_dims.get(id(m), self.dims) for m, _, params, _ in assigned for p in params}
        extra = self._extra_reduce_dims(module, reduce_dims, shard_dims)
        # one model: rank 0's values (over all the dims a parameter is replicated on), then shard
        broadcast_module_states(module, every, lambda p: self.mesh.comm(shard_dims[p] + extra.get(p, ())),
                                what="FSDP")
        every.reset()
        if compute_dtype is not None:  # buffers (rotary tables...) computed with, in compute_dtype
            for buf in module.buffers():
                if buf.is_floating_point():
                    buf.data = buf.data.to(compute_dtype)
        self._norm_dims = self._grad_norm_dims(extra, set(unit_dims.values()))
        self._norm_params = []  # [(shard Parameter, counted in the norm on this rank)]
        self.units = self._build_units(assigned, unit_dims, extra)
        for m in module.modules():  # its parameters are shards now: wrapping it again is refused
            m._fsdp_sharded = True
        self._fwd_order = [u.index for u in self.units]  # refined after each forward
        self._pre_order, self._post_order, self._reducing, self._where = [], [], [], {}
        self._replicating, self._explicit = [], {"forward": {}, "backward": {}}
        self.requires_gradient_sync, self.peak = True, dict.fromkeys(PEAKS, 0)
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._pre_forward(u))
            u.module.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u))

    def _unit_dims(self, unit_dims, unit_modules, shard_size, reshard_after_forward) -> dict:
        """{id(unit module): its shard dims} for the units sharded over dims of their own."""
        if not unit_dims:
            return {}
        ids = {id(m) for m in unit_modules}
        out = {}
        for m, dims in dict(unit_dims).items():
            if id(m) not in ids:
                raise ValueError(f"FSDP: unit_dims names a {type(m).__name__} that is not one of the units: "
                                 f"pass it in units=[...] too")
            out[id(m)] = (dims,) if isinstance(dims, str) else tuple(dims)
            self.mesh.comm(out[id(m)])   # a clear error now if the mesh lacks them
        if shard_size is not None or self.zeropp or not isinstance(reshard_after_forward, (bool, type(None))):
            raise ValueError("FSDP: unit_dims (units sharded over groups of their own) is not supported with "
                             "shard_size (HSDP), zeropp or reshard_after_forward=k: those assume one shard group")
        return out

    def _extra_reduce_dims(self, module, reduce_dims, shard_dims):
        """{parameter: dims its gradient is summed over besides the ones its unit shards over},
        for the trainable ones."""
        extra = {}
        for name, p in module.named_parameters():
            dims = get_reduce_dims(p, default=self.dims) if reduce_dims is None else tuple(reduce_dims[id(p)])
            if not p.requires_grad:
                continue
            mine = shard_dims[p]
            if not set(mine) <= set(dims):
                raise ValueError(f"FSDP shards {name!r} over {mine}, but its gradient is reduced over "
                                 f"{dims} (set_reduce_dims): a sharded parameter's gradient must be "
                                 f"reduced over the dimensions it is sharded on")
            rest = tuple(d for d in dims if d not in mine)
            if rest:
                extra[p] = rest
                self.mesh.comm(rest)  # a clear error now if the mesh lacks them
        return extra

    def _build_units(self, assigned, unit_dims, extra):
        built = []
        for m, name, params, where in assigned:
            dims = unit_dims.get(id(m), self.dims)
            comm = self.comm if dims == self.dims else self.mesh.comm(dims)   # the group it shards over
            unit = ShardedUnit(len(built), name, m, params, where, comm.rank, comm.size)
            unit.is_root, unit.comm, unit.dims, unit.rank = m is self.module, comm, dims, comm.rank
            groups = {}  # parameters whose gradients are summed over more dims, by those dims
            for j, p in enumerate(params):
                if p in extra:
                    groups.setdefault(extra[p], []).append(j)
            unit.extra = [(self.mesh.comm(more), js) for more, js in groups.items()]
            self._norm_params += [(unit.pieces[j], self._counted_in_norm(p, extra.get(p, ()), dims))
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


__all__ = ["FSDP", "rule_fsdp", "default_units", "check_fsdp_module", "broadcast_module_states", "PEAKS",
           "MAX_IN_FLIGHT"]
