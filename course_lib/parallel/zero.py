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

import math

import torch

from course_lib.parallel.data_parallel import broadcast_module_states
from course_lib.parallel.grad_sync import assign_buckets, register_grad_ready_hooks
from course_lib.parallel.mesh import as_mesh

MAX_IN_FLIGHT = 2  # buckets being reduced at once: bounds the full-size temporaries


class _ShardedBucket:
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


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 / ZeRO-2 around ``optimizer_cls``. Use it like the optimizer itself::

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, stage=2)
        loss.backward(); opt.step(); opt.zero_grad()

    The model is *not* wrapped in DDP: this class does the gradient communication, through
    ``mesh.comm(dims)`` (or one process group ``group=``, None = the world), as DDP does.
    Parameters are broadcast from rank 0 when it is built. After ``step()`` every rank
    holds the updated full parameters; with stage 1, only the owned slices of ``p.grad``
    hold the averaged gradient.
    """

    def __init__(self, params, optimizer_cls, *, stage=1, mesh=None, group=None, dims=("dp",), bucket_cap_mb=25,
                 **kwargs):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class, got {optimizer_cls!r}")
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2 (stage 3 is course_lib.parallel.FSDP), got {stage!r}")
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
        super().__init__(params, dict(kwargs))
        everything = [p for g in self.param_groups for p in g["params"]]
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
        broadcast_module_states(holder, self.comm)
        ids = assign_buckets(self._params, bucket_cap_mb * 2**20)
        self.buckets = [_ShardedBucket(k, b, self._params, rank, n) for k, b in enumerate(ids)]
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
        if stage == 2:
            self._start_round()
            register_grad_ready_hooks(self, self._params, "ShardedOptimizer(stage=2)")

    # ------------------------------------------------------------ gradients: reduce-scatter
    def _reduce_scatter(self, b):
        """Launch the reduce-scatter of bucket b's full gradients into this rank's slice."""
        out = b.empty(b.shard)
        work = self.comm.reduce_scatter_tensor(out, b.flat_grad, async_op=True, name=f"reduce-scatter b{b.index}")
        self._in_flight.append((b, out, work))
        while len(self._in_flight) > MAX_IN_FLIGHT:
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
                if not used[i]:
                    view.grad = None
                elif self.stage == 1:  # write the mean into the owned slice of p.grad
                    p = self._params[i]
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    view.grad = p.grad.view(-1)[lo:hi].copy_(shard_grad)
                else:
                    view.grad = shard_grad
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
        pending = []
        for b in self.buckets:
            send = b.empty(b.shard)
            for i, lo, hi, at, view in b.pieces:
                send[at:at + hi - lo].copy_(view)
            full = b.empty(b.shard * self.comm.size)
            work = self.comm.all_gather_into_tensor(full, send, async_op=True, name=f"all-gather b{b.index}")
            pending.append((b, full, work))
            if len(pending) >= MAX_IN_FLIGHT or b is self.buckets[-1]:
                for b_, full_, work in pending:
                    work.wait()
                    for i in b_.param_ids:
                        p = self._params[i]
                        p.detach().view(-1).copy_(full_[b_.offsets[i]:b_.offsets[i] + p.numel()])
                pending = []

    def zero_grad(self, set_to_none: bool = True):
        for p in self._params:
            if p.grad is not None:
                p.grad = None if set_to_none else p.grad.zero_()
        for b in self.buckets:
            b.grad_shard = None if set_to_none or b.grad_shard is None else b.grad_shard.zero_()
        self.local.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        raise NotImplementedError("ShardedOptimizer holds one slice of the state per rank: "
                                  "save self.local.state_dict() on every rank")


__all__ = ["ShardedOptimizer"]
