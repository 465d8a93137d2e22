"""Data parallelism (DDP) from scratch: every rank holds the whole model, runs its own slice
of the batch, and the ranks average their gradients before the optimizer step.

    model = DDP(MLP(), bucket_cap_mb=25)        # rank 0's weights are broadcast to every rank
    loss_fn(model(x_local), y_local).backward()  # hooks all-reduce buckets as they fill up
    model.finish_gradient_synchronization()      # wait: p.grad is now the mean over all ranks
    optimizer.step()

Three ways to average the gradients (``sync=``), compared in chapter 3:

* ``"per_parameter"``: after backward, one blocking all-reduce per parameter (the textbook loop).
* ``"bucketed"``: after backward, parameters packed into flat buffers of about
  ``bucket_cap_mb`` (in reverse order), one all-reduce per bucket: fewer, larger messages.
* ``"overlap"`` (default): the same buckets, each all-reduced asynchronously the moment its
  last gradient is accumulated (``register_post_accumulate_grad_hook``), so communication
  hides behind the rest of backward, as in ``torch.nn.parallel.DistributedDataParallel``
  (Li et al. 2020, "PyTorch Distributed").

Every collective goes through :class:`Collectives`, which counts the bytes each rank sends
and records a ``comm`` span (from launch to completion) for the timeline.
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib import compat, trace
from course_lib.planner.formulas import collective_bytes_per_rank

SYNC_MODES = ("per_parameter", "bucketed", "overlap")


class Collectives:
    """torch.distributed's collectives on one process group, each call counted and traced.

    ``log`` holds ``(kind, payload_bytes)`` per call (the all-reduce input, the all-gather
    output, the reduce-scatter input); :meth:`bytes_sent` turns it into what each rank
    sends with a bandwidth-optimal (ring) algorithm. Async calls return the work handle;
    their ``comm`` span ends when the work completes.
    """

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.log: list[tuple[str, int]] = []

    def _traced(self, kind, tensor_bytes, name, start, work):
        self.log.append((kind, tensor_bytes))
        if work is None:
            trace.recorder().add(name, "comm", start, trace.now())
            return None
        return TracedWork(work, name, start)

    def all_reduce(self, tensor, async_op=False, name="all-reduce"):
        start = trace.now()
        work = dist.all_reduce(tensor, group=self.group, async_op=async_op)
        return self._traced("all_reduce", _nbytes(tensor), name, start, work)

    def all_gather(self, output, input, async_op=False, name="all-gather"):
        """``output`` (world * n,) <- every rank's ``input`` (n,), in rank order."""
        start = trace.now()
        work = compat.all_gather_into_tensor(output, input, group=self.group, async_op=async_op)
        return self._traced("all_gather", _nbytes(output), name, start, work)

    def reduce_scatter(self, output, input, async_op=False, name="reduce-scatter"):
        """``output`` (n,) <- the sum over ranks of this rank's n-slice of ``input`` (world * n,)."""
        start = trace.now()
        work = compat.reduce_scatter_tensor(output, input, group=self.group, async_op=async_op)
        return self._traced("reduce_scatter", _nbytes(input), name, start, work)

    def broadcast(self, tensor, src=0, name="broadcast"):
        """``src`` is a rank of this group."""
        start = trace.now()
        dist.broadcast(tensor, src=compat.global_rank(self.group, src), group=self.group)
        return self._traced("broadcast", _nbytes(tensor), name, start, None)

    def bytes_sent(self) -> float:
        """Bytes this rank sends for the calls logged so far (ring algorithms; a broadcast
        counts its payload once, a pipelined broadcast's cost)."""
        total = 0.0
        for kind, n in self.log:
            if kind == "broadcast":
                total += n if self.world_size > 1 else 0
            else:
                total += collective_bytes_per_rank(kind, n, self.world_size)
        return total

    def reset(self):
        self.log.clear()


class TracedWork:
    """An async collective's handle whose ``comm`` span ends when the work completes:
    on the backend's thread where the work has a future, else when ``wait()`` returns."""

    def __init__(self, work, name, start):
        self.work, self._span = work, (name, start)
        rec = trace.recorder()
        try:
            work.get_future().then(lambda _: self._end(rec))
        except RuntimeError:  # gloo's reduce-scatter has no future
            pass

    def _end(self, rec):
        if self._span is not None:
            name, start = self._span
            self._span = None
            rec.add(name, "comm", start, rec.now())

    def wait(self):
        self.work.wait()
        self._end(trace.recorder())
        return True


def _nbytes(t):
    return t.numel() * t.element_size()


def broadcast_module_states(module: nn.Module, comm: Collectives, src: int = 0):
    """Make every rank hold ``src``'s parameters and buffers (one broadcast per tensor)."""
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            comm.broadcast(t.detach(), src=src, name=f"broadcast {name}")


def check_module(module, what: str):
    """The bad inputs every wrapper of this chapter refuses, with the constraint named."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what} wraps an nn.Module, got {type(module).__name__}")
    params = list(module.parameters())
    if not params:
        raise ValueError(f"{what}: the module has no parameters: there is nothing to synchronise "
                         f"(run it without a data-parallel wrapper)")
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise ValueError(f"{what}: all parameters must be on one device (one device per rank), "
                         f"found {devices}")
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError(f"{what}: every parameter is frozen (requires_grad=False): no gradient "
                         f"to synchronise")
    return trainable


def assign_buckets(params, bucket_cap_bytes):
    """Group parameter indexes into buckets of at most ``bucket_cap_bytes`` (a larger
    parameter gets a bucket of its own), walking the parameters in *reverse* order.

    Backward produces gradients roughly from the last layer to the first, so the
    first bucket fills up first and its all-reduce can start while backward goes on.
    A bucket holds one dtype and one device (it is one flat buffer).
    """
    buckets, current, size, key = [], [], 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if current and ((p.dtype, p.device) != key or size + nbytes > bucket_cap_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        key = (p.dtype, p.device)
    if current:
        buckets.append(current)
    return buckets


class GradReadyHook:
    """Post-accumulate-grad hook: tells ``owner._grad_ready(i)`` that parameter i's gradient
    is complete for this backward. Holds the owner weakly: a discarded wrapper's hooks go quiet."""

    def __init__(self, owner, i):
        self.owner, self.i = weakref.ref(owner), i

    def __call__(self, param):
        owner = self.owner()
        if owner is not None:
            owner._grad_ready(self.i)


def register_grad_ready_hooks(owner, params, what):
    for p in params:  # two live wrappers on one parameter would each launch collectives
        hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        if any(isinstance(h, GradReadyHook) and h.owner() is not None for h in hooks.values()):
            raise ValueError(f"{what}: a parameter is already managed by another live DDP / ZeRO-2 "
                             f"wrapper: wrap a fresh module")
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(GradReadyHook(owner, i))


class _Bucket:
    """Flat gradient buffer of some parameters: one all-reduce instead of many."""

    def __init__(self, index, param_ids, params):
        self.index, self.param_ids = index, param_ids
        self.offsets, n = {}, 0
        for i in param_ids:
            self.offsets[i] = n
            n += params[i].numel()
        p0 = params[param_ids[0]]
        self.buffer = torch.zeros(n, dtype=p0.dtype, device=p0.device)  # (sum of numels,)
        self.pending = len(param_ids)  # gradients not ready yet in this step
        self.work = None

    def view(self, i, param):
        return self.buffer[self.offsets[i]:self.offsets[i] + param.numel()].view_as(param)


class DDP(nn.Module):
    """Distributed data parallel: replicate ``module``, average gradients over ``group``.

    bucket_cap_mb: bucket size in MiB (> 0). sync: one of ``SYNC_MODES`` (see the module doc).
    Frozen parameters are never communicated; a tied (shared) parameter is one parameter;
    a parameter without a gradient on some ranks counts as zero there, and one that no
    rank used this step keeps ``grad = None``, as on a single device.
    """

    def __init__(self, module, bucket_cap_mb=25, *, sync="overlap", group=None):
        super().__init__()
        params = check_module(module, "DDP")
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not math.isfinite(bucket_cap_mb) or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
        self.module, self.sync, self.comm = module, sync, Collectives(group)
        broadcast_module_states(module, self.comm)
        self.comm.reset()
        self._params = params
        cap = 0 if sync == "per_parameter" else bucket_cap_mb * 2**20
        self._buckets = [_Bucket(k, ids, params) for k, ids in enumerate(assign_buckets(params, cap))]
        self._bucket_of = {i: b for b in self._buckets for i in b.param_ids}
        self._require_sync = True
        self._reset_step()
        register_grad_ready_hooks(self, params, "DDP")

    def forward(self, *args, **kwargs):
        if self._step_open:
            raise RuntimeError("DDP: call finish_gradient_synchronization() after backward and before "
                               "the next forward (gradients of the last step are still in flight)")
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside only accumulate local gradients;
        the first backward after the block averages the accumulated sum."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    # ------------------------------------------------------------------ per step
    def _reset_step(self):
        self._ready = [False] * len(self._params)
        self._next_bucket, self._step_open, self._used_work = 0, False, None
        for b in self._buckets:
            b.pending, b.work = len(b.param_ids), None

    def _grad_ready(self, i):
        """Hook: parameter i's gradient is accumulated for this backward."""
        if not self._require_sync:
            return
        if self._ready[i]:
            raise RuntimeError("DDP: a gradient became ready twice before finish_gradient_synchronization(); "
                               "call it after every backward, or accumulate inside no_sync()")
        self._ready[i] = True
        if not self._step_open:
            self._step_open = True
            if self.sync == "overlap":  # runs once backward has finished: launch the stragglers
                torch.autograd.Variable._execution_engine.queue_callback(self._launch_remaining)
        if self.sync == "overlap":
            bucket = self._bucket_of[i]
            self._copy_grad(i, bucket)
            bucket.pending -= 1
            while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
                self._launch(self._buckets[self._next_bucket])  # in bucket order on every rank
                self._next_bucket += 1

    def _copy_grad(self, i, bucket):
        p, view = self._params[i], bucket.view(i, self._params[i])
        if p.grad is None:
            view.zero_()  # not used on this rank: contributes zero to the mean
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)

    def _launch(self, bucket, async_op=True):
        bucket.work = self.comm.all_reduce(bucket.buffer, async_op=async_op, name=f"all-reduce b{bucket.index}")

    def _launch_used_flags(self):
        # One small all-reduce says which parameters had a gradient on *some* rank:
        # those nobody used keep grad None (no weight decay, no Adam step), as on one device.
        used = torch.tensor([r or p.grad is not None for r, p in zip(self._ready, self._params)],
                            dtype=torch.int32, device=self._params[0].device)
        self._used_work = (used, self.comm.all_reduce(used, async_op=True, name="all-reduce used"))

    def _launch_remaining(self):
        """End of backward (overlap): buckets with an unused parameter were not launched yet."""
        for bucket in self._buckets[self._next_bucket:]:
            for i in bucket.param_ids:
                if not self._ready[i]:
                    self._copy_grad(i, bucket)
            self._launch(bucket)
        self._next_bucket = len(self._buckets)
        self._launch_used_flags()

    def _sync_per_parameter(self, used):
        """The textbook version: one blocking all-reduce per parameter, after backward."""
        for i in reversed(range(len(self._params))):
            p = self._params[i]
            if not used[i]:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.comm.all_reduce(p.grad, name=f"all-reduce p{i}")

    def _sync_bucketed(self):
        """After backward: copy gradients into the buckets, one blocking all-reduce each."""
        for bucket in self._buckets:
            for i in bucket.param_ids:
                self._copy_grad(i, bucket)
            self._launch(bucket, async_op=False)

    def finish_gradient_synchronization(self):
        """Wait for the outstanding all-reduces; leave the mean gradient in ``p.grad``."""
        if not self._require_sync:
            return  # inside no_sync(): gradients stay local
        if self.sync == "overlap" and self._used_work is None:
            self._launch_remaining()  # no hook fired on this rank (no parameter was used)
        elif self.sync != "overlap":
            self._launch_used_flags()
        used, work = self._used_work
        work.wait()
        used = used.tolist()
        if self.sync == "per_parameter":
            self._sync_per_parameter(used)
        elif self.sync == "bucketed":
            self._sync_bucketed()
        n = self.comm.world_size
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
            if self.sync != "per_parameter":
                bucket.buffer.div_(n)
                for i in bucket.param_ids:  # the gradient becomes a view of the bucket: no copy back
                    self._params[i].grad = bucket.view(i, self._params[i])
        for i, p in enumerate(self._params):
            if self.sync == "per_parameter" and p.grad is not None:
                p.grad.div_(n)
            if not used[i]:
                p.grad = None
        self._reset_step()


__all__ = ["DDP", "Collectives", "SYNC_MODES", "assign_buckets", "broadcast_module_states", "check_module",
           "GradReadyHook", "register_grad_ready_hooks"]
