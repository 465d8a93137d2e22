"""ZeRO stages 1 and 2 (Rajbhandari et al. 2020): data parallelism without redundant copies.

Every rank still runs the whole model on its own slice of the batch. The trainable
parameters are grouped into buckets (as in DDP); each bucket is seen as one flat vector,
padded to a multiple of N, and rank r *owns* the r-th of its N equal slices:

    bucket (numel 10, N = 4, slice S = 3):  [r0 r0 r0 | r1 r1 r1 | r2 r2 r2 | r3 pad pad]

* ``stage=1`` (ZeRO-1): a rank keeps optimizer state for its slices only. ``step()``
  reduce-scatters the gradients (each rank receives the mean of the slices it owns),
  updates those slices, then **all-gathers** the parameters. Each rank sends 2P elements,
  as DDP does: an all-reduce *is* a reduce-scatter followed by an all-gather.
* ``stage=2`` (ZeRO-2): the gradients are sharded too. During backward, each bucket is
  **reduce-scattered** the moment its gradients are complete and the full-size gradients
  are freed: a rank only ever keeps the gradient slice it owns. (All-reducing and then
  slicing would hold, and send, the full gradient.)

The optimizer (``optimizer_cls(**kwargs)``, any element-wise one: SGD, Adam, AdamW...)
sees one tensor per (parameter, owned slice): a parameter nobody used keeps no gradient
and gets no update, exactly as on one device.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from course_lib.parallel.data_parallel import broadcast_module_states
from course_lib.parallel.grad_sync import assign_buckets, register_grad_ready_hooks
from course_lib.parallel.mesh import as_mesh

BUCKETS_IN_FLIGHT = 2  # buckets being reduced at once: bounds the full-size temporaries


class ShardedBucket:
    """One bucket's flat layout: which elements this rank owns, as views into the parameters."""

    def __init__(self, index, param_ids, params, rank, world_size):
        self.index, self.param_ids = index, param_ids
        self.offsets, n = {}, 0
        for i in param_ids:
            self.offsets[i] = n
            n += params[i].numel()
        self.numel, self.shard = n, math.ceil(n / world_size)  # padded to world_size * shard
        lo, hi = rank * self.shard, min((rank + 1) * self.shard, n)
        self.pieces = []  # (param id, start, end in the parameter, start in the shard, view)
        for i in param_ids:
            a, b = max(lo, self.offsets[i]), min(hi, self.offsets[i] + params[i].numel())
            if a < b:
                a_p, b_p = a - self.offsets[i], b - self.offsets[i]
                self.pieces.append((i, a_p, b_p, a - lo, params[i].detach().view(-1)[a_p:b_p]))
        p0 = params[param_ids[0]]
        self.dtype, self.device = p0.dtype, p0.device
        self.flat_grad = None   # (world * shard,) full-size gradients, only while being reduced
        self.grad_shard = None  # (shard,) mean gradient of the owned slice (stage 2 keeps it)
        self.pending = len(param_ids)

    def empty(self, n):
        return torch.zeros(n, dtype=self.dtype, device=self.device)


def owned_gradient(p, lo, hi, summed, stage):
    """The gradient of ``p``'s owned elements [lo, hi) given their ``summed`` gradient: ZeRO-2
    keeps the sum itself; ZeRO-1 writes it into that slice of ``p.grad`` (the full gradient it
    keeps; made if this rank had none) and returns the slice (``summed`` None: the slice, for
    the caller to write)."""
    if stage == 2:
        return summed
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    view = p.grad.view(-1)[lo:hi]
    return view if summed is None else view.copy_(summed)


def all_gather_buckets(buckets, params, sources, comm_of):
    """The full ``params`` from every rank's owned slices: per bucket b, ``sources(b)`` (one
    tensor per piece of ``b.pieces``) packed and all-gathered over ``comm_of(b)``, then copied
    into the parameters, ``BUCKETS_IN_FLIGHT`` buckets at a time. The pack is one ``cat``
    whatever the number of pieces, so every rank of the group does the same work before the
    all-gather (the first the most bytes: its slice is never short)."""
    pending = []
    for b in buckets:
        pending.append((b, *start_gather(b, sources(b), comm_of(b))))
        if len(pending) >= BUCKETS_IN_FLIGHT or b is buckets[-1]:
            for b_, full, work in pending:
                end_gather(b_, params, full, work)
            pending = []


def start_gather(b, sources, comm) -> tuple:
    """Bucket ``b``'s owned slices (``sources``, one tensor per piece) packed and their
    all-gather over ``comm`` started: (the full buffer it fills, its work)."""
    # buffers made empty, as FSDP2's all-gather output: the slice's padding (the last rank's
    # slice may be short) is sent and received but never read
    send = torch.empty(b.shard, dtype=b.dtype, device=b.device)
    srcs = [src.reshape(-1) for src in sources]
    if srcs:    # the pieces lie end to end from the slice's start: one kernel packs them all
        torch.cat(srcs, out=send[:sum(src.numel() for src in srcs)])
    full = torch.empty(b.shard * comm.size, dtype=b.dtype, device=b.device)
    return full, comm.all_gather_into_tensor(full, send, async_op=True, name=f"all-gather b{b.index}")


def end_gather(b, params, full, work) -> None:
    """Wait for bucket ``b``'s all-gather (:func:`start_gather`) and copy it into ``params``."""
    work.wait()
    for i in b.param_ids:
        p = params[i]
        p.detach().view(-1).copy_(full[b.offsets[i]:b.offsets[i] + p.numel()])


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 / ZeRO-2 around ``optimizer_cls``. Use it like the optimizer itself::

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, stage=2)
        loss.backward(); opt.step(); opt.zero_grad()

    The model is *not* wrapped in DDP: this class does the gradient communication, through
    ``mesh.comm(dims)`` (or one process group ``group=``, None = the world), as DDP does.
    Parameters are broadcast from rank 0 when it is built (replicas of different shapes or
    counts: a ValueError on every rank). After ``step()`` every rank holds the updated full
    parameters; with stage 1, only the owned slices of ``p.grad`` hold the averaged gradient.

    torch's ``ZeroRedundancyOptimizer(params, optimizer_class, process_group=None,
    parameters_as_bucket_view=False, overlap_with_ddp=False, **defaults)`` conventions:
    ``process_group`` (a ProcessGroup, a ``Comm`` or None) is ``group=``; the keyword
    arguments are ``optimizer_cls``'s own (a misspelt one is its TypeError) and
    ``param_groups`` carry all its defaults (``lr`` for a scheduler); the two flags must
    stay False (not implemented). ``add_param_group`` adds new buckets; a checkpoint is
    ``consolidate_state_dict(to=r)`` on every rank, then ``state_dict()`` on rank r (the
    state dict a single-device ``optimizer_cls`` would have); ``load_state_dict`` of such
    a dict (or of a single-device optimizer's) on every rank keeps the owned slices.
    """

    def __init__(self, params, optimizer_cls, process_group=None, parameters_as_bucket_view=False,
                 overlap_with_ddp=False, *, stage=1, mesh=None, group=None, dims=("dp",), bucket_cap_mb=25,
                 **kwargs):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class, got {optimizer_cls!r}")
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2 (stage 3 is course_lib.parallel.FSDP), got {stage!r}")
        if isinstance(bucket_cap_mb, bool) or not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
        if parameters_as_bucket_view is not False:
            raise ValueError("ShardedOptimizer: parameters_as_bucket_view must be False: the parameters stay "
                             "separate tensors here (not implemented)")
        if overlap_with_ddp is not False:
            raise ValueError("ShardedOptimizer: overlap_with_ddp must be False (torch's DDP-hook variant, not "
                             "implemented): stage=2 overlaps the gradient reduce-scatter with backward, without DDP")
        if process_group is not None:
            if group is not None or mesh is not None:
                raise ValueError("ShardedOptimizer: pass one of process_group= (torch's name), group= or mesh=")
            group = process_group
        super().__init__(params, dict(kwargs))
        everything = [p for g in self.param_groups for p in g["params"]]
        self._optimizer_cls, self._bucket_cap_mb = optimizer_cls, bucket_cap_mb
        self._with_defaults(everything[0] if everything else None, kwargs)
        if len({str(p.device) for p in everything}) > 1:
            raise ValueError("ShardedOptimizer: all parameters must be on one device (one device per rank)")
        self._params = [p for p in everything if p.requires_grad]
        if not self._params:
            raise ValueError("ShardedOptimizer: no parameter requires a gradient: nothing to optimize")
        if any(not p.is_contiguous() for p in self._params):
            raise ValueError("ShardedOptimizer: parameters must be contiguous (owned slices are views)")
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        self.stage, self.comm = stage, as_mesh(mesh, group, dim=dims[0]).comm(dims)  # the ranks that shard
        rank, n = self.comm.rank, self.comm.size
        holder = torch.nn.ParameterList(everything)  # broadcast rank 0's values: identical replicas
        broadcast_module_states(holder, self.comm, what="ShardedOptimizer")
        ids = assign_buckets(self._params, bucket_cap_mb * 2**20)
        self.buckets = [ShardedBucket(k, b, self._params, rank, n) for k, b in enumerate(ids)]
        self._bucket_of = {i: b for b in self.buckets for i in b.param_ids}
        group_of = {id(p): k for k, g in enumerate(self.param_groups) for p in g["params"]}
        inner = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in self.param_groups]
        for b in self.buckets:
            for i, *_, view in b.pieces:
                inner[group_of[id(self._params[i])]]["params"].append(view)
        self.local = optimizer_cls(inner)  # state only for the owned slices
        self.state = self.local.state
        self._used = [False] * len(self._params)
        self._in_flight, self._rounds = [], 0
        self._consolidated, self._elementwise = None, None  # see consolidate_state_dict
        self.register_step_post_hook(ShardedOptimizer._forget_consolidated)
        if stage == 2:
            self._start_round()
            register_grad_ready_hooks(self, self._params, "ShardedOptimizer(stage=2)")

    def _with_defaults(self, p0, kwargs):
        """Check ``kwargs`` as ``optimizer_cls`` does (by building one on a 1-element tensor)
        and give every parameter group its defaults, as torch's ZeroRedundancyOptimizer does."""
        floating = p0 is not None and p0.is_floating_point()
        dtype, device = (p0.dtype, p0.device) if floating else (torch.float32, "cpu")   # a local probe
        try:
            probe = self._optimizer_cls([torch.zeros(1, requires_grad=True, dtype=dtype, device=device)], **kwargs)
        except TypeError as exc:
            raise TypeError(f"ShardedOptimizer: {exc} (the keyword arguments are {self._optimizer_cls.__name__}'s, "
                            f"plus stage, mesh, group, process_group, dims, bucket_cap_mb)") from None
        self.defaults = dict(probe.defaults)
        for g in self.param_groups:
            for k, v in probe.defaults.items():
                g.setdefault(k, v)

    # ------------------------------------------------------------ gradients: reduce-scatter
    def _reduce_scatter(self, b):
        """Launch the reduce-scatter of bucket b's full gradients into this rank's slice."""
        out = b.empty(b.shard)
        work = self.comm.reduce_scatter_tensor(out, b.flat_grad, async_op=True, name=f"reduce-scatter b{b.index}")
        self._in_flight.append((b, out, work))
        while len(self._in_flight) > BUCKETS_IN_FLIGHT:
            self._fold_oldest()

    def _fold_oldest(self):
        b, out, work = self._in_flight.pop(0)
        work.wait()
        b.flat_grad = None  # the full-size gradients are gone: only the slice stays
        out.div_(self.comm.size)  # sum over ranks -> mean
        if b.grad_shard is None:
            b.grad_shard = out
        else:  # several backward passes before step(): accumulate
            b.grad_shard.add_(out)

    def _fill_flat(self, b, i):
        p = self._params[i]
        if b.flat_grad is None:
            b.flat_grad = b.empty(b.shard * self.comm.size)
        if p.grad is not None:
            b.flat_grad[b.offsets[i]:b.offsets[i] + p.numel()].copy_(p.grad.view(-1))
            self._used[i] = True

    def _start_round(self):
        self._next, self._round_open = 0, False
        for b in self.buckets:
            b.pending = len(b.param_ids)

    def _grad_ready(self, i):
        """Stage 2 hook: parameter i's gradient is complete for this backward."""
        if not self._round_open:  # at the end of this backward, launch what is left
            self._round_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        b = self._bucket_of[i]
        self._fill_flat(b, i)
        self._params[i].grad = None  # free the full-size gradient now
        b.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._reduce_scatter(self.buckets[self._next])  # bucket order: the same on every rank
            self._next += 1

    def _end_of_backward(self):
        for b in self.buckets[self._next:]:  # buckets holding a parameter unused on this rank
            if b.flat_grad is None:
                b.flat_grad = b.empty(b.shard * self.comm.size)
            self._reduce_scatter(b)
        self._rounds += 1
        self._start_round()

    # ------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.stage == 1:
            for b in self.buckets:
                for i in b.param_ids:
                    self._fill_flat(b, i)
                self._reduce_scatter(b)
        elif self._rounds == 0:
            self._end_of_backward()  # no hook fired on this rank: contribute zeros
        while self._in_flight:
            self._fold_oldest()
        used = torch.tensor(self._used, dtype=torch.int32, device=self._params[0].device)
        self.comm.all_reduce(used, name="all-reduce used")  # who had a gradient anywhere
        used = used.tolist()
        for b in self.buckets:
            for i, lo, hi, at, view in b.pieces:
                shard_grad = b.grad_shard[at:at + hi - lo]
                view.grad = owned_gradient(self._params[i], lo, hi, shard_grad, self.stage) if used[i] else None
            if self.stage == 1:
                b.grad_shard = None
        for outer, inner in zip(self.param_groups, self.local.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})  # lr schedules
        self.local.step()
        self._all_gather_params()
        self._used = [False] * len(self._params)
        self._rounds = 0
        return loss

    def _all_gather_params(self):
        """Every rank sends its updated slices and receives the others': full parameters."""
        all_gather_buckets(self.buckets, self._params, lambda b: [view for *_, view in b.pieces], lambda b: self.comm)

    def zero_grad(self, set_to_none: bool = True):
        for p in self._params:
            if p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()
        for b in self.buckets:
            b.grad_shard = None if set_to_none or b.grad_shard is None else b.grad_shard.zero_()
        self.local.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------ new parameters
    def add_param_group(self, param_group):
        """Add a group (torch's semantics; call it on every rank with the same parameters): its
        parameters are broadcast from rank 0 and sharded in new buckets of their own, so the
        slices (and optimizer state) of the existing ones do not move."""
        if not hasattr(self, "buckets"):  # torch.optim.Optimizer.__init__ adding the first groups
            return super().add_param_group(param_group)
        if self._in_flight or self._rounds:
            raise RuntimeError("ShardedOptimizer.add_param_group: gradients of this step are pending: "
                               "call it before backward or after step()")
        super().add_param_group(param_group)  # validates, fills in the defaults
        group = self.param_groups[-1]
        new = [p for p in group["params"] if p.requires_grad]
        try:
            if any(p.device != self._params[0].device for p in group["params"]):
                raise ValueError("ShardedOptimizer: all parameters must be on one device (one device per rank)")
            if any(not p.is_contiguous() for p in new):
                raise ValueError("ShardedOptimizer: parameters must be contiguous (owned slices are views)")
            broadcast_module_states(torch.nn.ParameterList(group["params"]), self.comm, what="ShardedOptimizer")
        except ValueError:
            self.param_groups.pop()
            raise
        first = len(self._params)
        self._params += new
        ids = assign_buckets(new, self._bucket_cap_mb * 2**20)  # new buckets: the old slices stay put
        buckets = [ShardedBucket(len(self.buckets) + k, [first + i for i in b], self._params, self.comm.rank,
                                  self.comm.size) for k, b in enumerate(ids)]
        self.buckets += buckets
        self._bucket_of.update({i: b for b in buckets for i in b.param_ids})
        self.local.add_param_group({**{k: v for k, v in group.items() if k != "params"},
                                    "params": [view for b in buckets for *_, view in b.pieces]})
        self._used += [False] * len(new)
        self._consolidated = None
        if self.stage == 2:
            register_grad_ready_hooks(self, new, "ShardedOptimizer(stage=2)", start=first)

    # ------------------------------------------------------------ checkpoints
    def _index_of(self):
        """torch's numbering of the parameters in a state dict: by group, in order."""
        index = {}
        for g in self.param_groups:
            for p in g["params"]:
                index.setdefault(id(p), len(index))
        return index

    def _elementwise_keys(self):
        """The state keys ``optimizer_cls`` keeps element by element (exp_avg, momentum_buffer...),
        found by stepping a throwaway one per group on a 3-element tensor; the others ('step')
        are one value per parameter."""
        if self._elementwise is None:
            p0, keys = self._params[0], set()
            for g in self.param_groups:
                x = torch.zeros(3, dtype=p0.dtype, device=p0.device, requires_grad=True)
                probe = self._optimizer_cls([{**{k: v for k, v in g.items() if k != "params"}, "params": [x]}])
                x.grad = torch.ones_like(x)
                probe.step()
                keys |= {k for k, v in probe.state[x].items() if torch.is_tensor(v) and v.shape == x.shape}
            self._elementwise = keys
        return self._elementwise

    def consolidate_state_dict(self, to: int = 0):
        """Gather every rank's slices of the optimizer state on group rank ``to`` (call it on
        EVERY rank of the group, as torch's ZeroRedundancyOptimizer): then ``state_dict()``
        there returns what a single-device ``optimizer_cls`` on all the parameters would hold.
        The slices travel pickled, once (a checkpoint, not a training step: not traced)."""
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < self.comm.size:
            raise ValueError(f"consolidate_state_dict: to={to!r} must be a rank of the group (0..{self.comm.size - 1})")
        elementwise = self._elementwise_keys()
        mine = [(i, lo, hi, {k: (v.detach().cpu(), v.device.type) if torch.is_tensor(v) else (v, None)
                             for k, v in self.local.state[view].items()})
                for b in self.buckets for i, lo, hi, _, view in b.pieces if view in self.local.state]
        if self.comm.size == 1:
            gathered = [mine]
        else:
            gathered = [None] * self.comm.size if self.comm.rank == to else None
            dist.gather_object(mine, gathered, dst=self.comm.ranks[to], group=self.comm.group)
        self._consolidated = None
        if self.comm.rank != to:
            return
        index, state = self._index_of(), {}
        for pieces in gathered:
            for i, lo, hi, piece in pieces:
                p = self._params[i]
                full = state.setdefault(index[id(p)], {})
                for k, (v, device_type) in piece.items():
                    if k in elementwise:  # (numel,) on the parameter's device, filled slice by slice
                        if k not in full:
                            full[k] = torch.zeros(p.numel(), dtype=v.dtype, device=p.device)
                        full[k][lo:hi] = v
                    elif k not in full:  # one value per parameter: the same in every slice
                        full[k] = v.to(p.device) if device_type not in (None, "cpu") else v
        for i, p in enumerate(self._params):
            for k, v in state.get(index[id(p)], {}).items():
                if k in elementwise:
                    state[index[id(p)]][k] = v.view(p.shape)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        self._consolidated = {"state": state, "param_groups": groups}

    def _forget_consolidated(self, *args):
        self._consolidated = None  # a step made it stale

    def state_dict(self):
        """The state dict gathered by the last ``consolidate_state_dict(to=this rank)``: the
        format of a single-device ``optimizer_cls`` (loadable into one, or into this class)."""
        if self._consolidated is None:
            raise RuntimeError("ShardedOptimizer.state_dict(): the optimizer state is sharded over the ranks: "
                               "call consolidate_state_dict(to=r) on every rank (after the last step), then "
                               "state_dict() on rank r. (self.local.state_dict() is this rank's slice only.)")
        return self._consolidated

    def load_state_dict(self, state_dict):
        """Load a single-device-format state dict (``state_dict()`` after
        ``consolidate_state_dict``, or a plain ``optimizer_cls``'s) on EVERY rank: each keeps
        the slices it owns; the hyperparameters of every group are restored."""
        def refuse(problem):
            raise ValueError(f"ShardedOptimizer.load_state_dict: {problem}. It loads the full state dict: "
                             f"state_dict() after consolidate_state_dict(), or a single-device optimizer's; "
                             f"not one rank's self.local.state_dict() (that one: self.local.load_state_dict "
                             f"on the same rank of the same layout)")

        if not (isinstance(state_dict, dict) and {"state", "param_groups"} <= set(state_dict)):
            refuse("expected a dict with 'state' and 'param_groups'")
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            refuse(f"the state dict has {len(saved)} parameter groups, this optimizer {len(self.param_groups)}")
        param_of = {}
        for k, (g, s) in enumerate(zip(self.param_groups, saved)):
            if len(g["params"]) != len(s["params"]):
                refuse(f"parameter group {k} has {len(s['params'])} parameters in the state dict, "
                       f"{len(g['params'])} here")
            param_of.update(zip(s["params"], g["params"]))
        elementwise, state = self._elementwise_keys(), state_dict["state"]
        for index, s in state.items():
            p = param_of.get(index)
            if p is None:
                refuse(f"state for parameter {index!r}, which no group lists")
            for k, v in s.items():
                if k in elementwise and (not torch.is_tensor(v) or v.numel() != p.numel()):
                    refuse(f"state {k!r} of parameter {index} has {v.numel() if torch.is_tensor(v) else v!r} "
                           f"elements, the parameter {p.numel()} {tuple(p.shape)}")
        saved_state = {id(param_of[index]): s for index, s in state.items()}
        for g, s in zip(self.param_groups, saved):
            g.update({k: v for k, v in s.items() if k != "params"})
        for outer, inner in zip(self.param_groups, self.local.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.local.state.clear()
        for b in self.buckets:
            for i, lo, hi, _, view in b.pieces:
                s = saved_state.get(id(self._params[i]))
                if s is not None:
                    self.local.state[view] = {
                        k: (v.detach().reshape(-1)[lo:hi].to(view.device, view.dtype).clone() if k in elementwise
                            else v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v))
                        for k, v in s.items()}
        self._consolidated = None


__all__ = ["ShardedOptimizer", "ShardedBucket", "BUCKETS_IN_FLIGHT", "all_gather_buckets", "start_gather", "end_gather",
           "owned_gradient"]
