"""Data parallelism (DDP) from scratch: every rank holds the whole model, runs its own slice
of the batch, and the ranks average their gradients before the optimizer step.

Three ways to average the gradients, each built on the previous idea (chapter 3):

1. :func:`average_gradients`: after backward, one blocking all-reduce per parameter (the textbook loop).
2. :class:`~course_lib.parallel.grad_sync.GradSync`: after backward, gradients packed into
   a few flat buckets, one all-reduce per bucket: fewer, larger messages.
3. :class:`~course_lib.parallel.grad_sync.OverlappedGradSync`: the same buckets, each
   launched by a hook the moment its last gradient is accumulated, so communication hides
   behind the rest of backward, as in ``torch.nn.parallel.DistributedDataParallel``.

:class:`DDP` wraps a module with torch's DDP semantics on top of 3 (or 2)::

    model = DDP(MLP(), bucket_cap_mb=25)         # rank 0's weights are broadcast to every rank
    loss_fn(model(x_local), y_local).backward()  # hooks all-reduce buckets as they fill up
    model.finish_gradient_synchronization()      # wait: p.grad is now the mean over the ranks
    optimizer.step()

Every byte goes through a :class:`~course_lib.collectives.comm.Comm` (``mesh.comm("dp")``):
torch's collectives or ours (``Mesh(dp=N, impl="course")``), traced and, inside
``comm.measuring()``, measured.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from course_lib.parallel.grad_sync import GradSync, OverlappedGradSync
from course_lib.parallel.mesh import as_mesh, get_reduce_dims
from course_lib.parallel.replicas import check_replicas


def check_module(module, what: str):
    """The bad inputs every wrapper of this chapter refuses, with the constraint named.
    Returns the trainable parameters (a tied parameter once)."""
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


def broadcast_module_states(module: nn.Module, comm, comm_of=None, src: int = 0,
                            what: str = "broadcast_module_states"):
    """Make every rank of ``comm`` hold group rank ``src``'s parameters and buffers (one
    broadcast per tensor, in registration order: the same on every rank). ``comm_of(p)``:
    the Comm a parameter is broadcast over instead (all the dims it is replicated on; None:
    not replicated, not broadcast). Bool tensors travel as bytes.

    First, :func:`check_replicas`: replicas of different shapes or counts are a ValueError
    on every rank (``what`` names the caller), not a crash in the middle of the broadcasts."""
    plan = []  # (name, tensor, the Comm it is broadcast over)
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        group = comm_of(t) if comm_of is not None and isinstance(t, nn.Parameter) else comm
        if group is not None:
            plan.append((name, t, group))
    check_replicas([(name, t) for name, t, _ in plan], comm, what)
    with torch.no_grad():
        for name, t, group in plan:
            t = t.detach()
            group.broadcast(t.view(torch.uint8) if t.dtype == torch.bool else t, src=src,
                            name=f"broadcast {name}")


def persistent_buffers(module: nn.Module):
    """[(name, buffer)] of the buffers in ``module.state_dict()`` (a shared one once):
    BatchNorm's running statistics, not a non-persistent constant (a rotary table, a mask)."""
    seen, out = set(), []
    for prefix, m in module.named_modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                out.append((f"{prefix}.{name}" if prefix else name, b))
    return out


def broadcast_buffers(module: nn.Module, comm, src: int = 0):
    """Copy group rank ``src``'s persistent buffers to every rank of ``comm`` in ONE flat
    message (every buffer's bytes, concatenated: dtypes may differ). No buffer: no message."""
    buffers = [b for _, b in persistent_buffers(module)]
    if not buffers or comm.size == 1:
        return
    with torch.no_grad():
        flat = torch.cat([b.detach().reshape(-1).view(torch.uint8) for b in buffers])  # (total bytes,)
        comm.broadcast(flat, src=src, name="broadcast buffers")
        if comm.rank == src:
            return
        with contextlib.ExitStack() as stack:  # as torch: a tensor saved for backward stays usable
            at = 0
            for b in buffers:
                stack.enter_context(torch.autograd._unsafe_preserve_version_counter(b))
                n = b.numel() * b.element_size()
                b.copy_(flat[at:at + n].clone().view(b.dtype).view(b.shape))  # clone: aligned for the dtype
                at += n


def _check_device_ids(module, device_ids, output_device):
    """torch's rule: a CPU module takes no device ids; a GPU module at most its own device."""
    device = next(module.parameters()).device
    if device.type == "cpu":
        if device_ids is not None or output_device is not None:
            raise ValueError(f"DDP: device_ids and output_device must be None for a module on the CPU, got "
                             f"device_ids={device_ids!r}, output_device={output_device!r}")
        return

    def same(d):
        try:
            d = torch.device(device.type, d) if isinstance(d, int) else torch.device(d)
        except (TypeError, RuntimeError):
            return False
        return d.type == device.type and d.index in (None, device.index)

    ok_ids = device_ids is None or (isinstance(device_ids, (list, tuple)) and len(device_ids) == 1
                                    and same(device_ids[0]))
    if not ok_ids or not (output_device is None or same(output_device)):
        raise ValueError(f"DDP: device_ids must be None or [the module's device], and output_device None or "
                         f"that device ({device}), got device_ids={device_ids!r}, output_device={output_device!r}")


# ------------------------------------------------------------------ 1. the textbook loop
def average_gradients(model: nn.Module, comm):
    """After backward: one blocking all-reduce (sum) per gradient, then divide by N.

    A first small all-reduce says which parameters had a gradient on SOME rank: one
    nobody used keeps ``grad = None`` (as on one device, where AdamW then neither decays
    nor steps it); one used elsewhere only counts as zero here.
    """
    params = [p for p in model.parameters() if p.requires_grad]   # a tied weight once
    had_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    comm.all_reduce(had_grad, name="all-reduce used")
    for i, p in enumerate(params):
        if had_grad[i] == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        comm.all_reduce(p.grad, name=f"all-reduce p{i}")
        p.grad.div_(comm.size)  # (gloo has no ReduceOp.AVG: sum, then divide)


# ------------------------------------------------------------------ 2 and 3: DDP on GradSync
class DDP(nn.Module):
    """Distributed data parallel: replicate ``module``, average its gradients over ``dims``.

    Call ``finish_gradient_synchronization()`` after a step's last backward and before
    ``optimizer.step()``: the gradients are averaged there (torch's DDP does it inside
    backward). Afterwards ``p.grad`` is a view of its bucket, overwritten by the next step's
    synchronisation (``gradient_as_bucket_view=False``: a copy).

    bucket_cap_mb: bucket size in MiB. mesh / group (torch's ``process_group``): a Mesh, or one
        group seen as the dimension ``dims[0]``. dims: what the batch is split over; gradients are
        divided by its size (or ``divisor``), summed over a parameter's own reduce dims if it has
        any. Rank 0's values are broadcast at construction (replicas that differ: ValueError).
    overlap: buckets all-reduced during backward (hooks), or all of them after it.
    broadcast_buffers: rank 0's persistent buffers (BatchNorm's statistics) sent before each
        training forward, so the replicas' buffers stay identical.
    device_ids, output_device, find_unused_parameters, static_graph: torch's, accepted so that
        DDP can replace DistributedDataParallel; the last two change nothing (a parameter unused
        on some ranks counts as zero there; one no rank used keeps ``grad = None``).
    """

    def __init__(self, module, bucket_cap_mb=25, *, mesh=None, group=None, dims=("dp",), divisor=None,
                 overlap: bool = True, broadcast_buffers: bool = True, process_group=None, device_ids=None,
                 output_device=None, find_unused_parameters: bool = False, gradient_as_bucket_view: bool = True,
                 static_graph: bool = False):
        super().__init__()
        check_module(module, "DDP")
        if isinstance(bucket_cap_mb, (list, tuple)):
            raise ValueError(f"DDP: the second positional argument is bucket_cap_mb (MiB), got {bucket_cap_mb!r}: "
                             f"pass torch's device_ids as a keyword, device_ids={bucket_cap_mb!r}")
        bucket_cap_mb = 25 if bucket_cap_mb is None else bucket_cap_mb
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
        for name, flag in (("overlap", overlap), ("broadcast_buffers", broadcast_buffers),
                           ("find_unused_parameters", find_unused_parameters),
                           ("gradient_as_bucket_view", gradient_as_bucket_view), ("static_graph", static_graph)):
            if not isinstance(flag, bool):
                raise TypeError(f"DDP: {name} must be True or False, got {flag!r}")
        _check_device_ids(module, device_ids, output_device)
        if process_group is not None:
            if group is not None:
                raise ValueError("DDP: pass group= or process_group= (torch's name for it), not both")
            group = process_group
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        self.module, self.mesh = module, as_mesh(mesh, group, dim=dims[0])
        self.comm = self.mesh.comm(dims)  # the data-parallel group
        # the same start: every replica takes the values of its group's rank 0, each parameter
        # over the dims its gradient is summed over (the dims it is replicated on)
        replicated_on = lambda p: self.mesh.comm(get_reduce_dims(p, dims)) if get_reduce_dims(p, dims) else None
        broadcast_module_states(module, self.comm, replicated_on, what="DDP")
        divisor = self.comm.size if divisor is None else divisor
        sync_cls = OverlappedGradSync if overlap else GradSync
        self.grad_sync = sync_cls(module, self.mesh, divisor=divisor, bucket_cap_mb=bucket_cap_mb,
                                  default_dims=dims)
        self.broadcast_buffers, self.gradient_as_bucket_view = broadcast_buffers, gradient_as_bucket_view
        self._sync_buffers = True  # torch's require_forward_param_sync: the next forward sends buffers

    def forward(self, *args, **kwargs):
        if self.grad_sync.armed:
            raise RuntimeError("DDP: call finish_gradient_synchronization() after backward and before "
                               "the next forward (gradients of the last step are still in flight)")
        if self.broadcast_buffers and self._sync_buffers:
            broadcast_buffers(self.module, self.comm)
        out = self.module(*args, **kwargs)
        # torch's rule: only a forward that a synchronised backward may follow makes the next one sync
        self._sync_buffers = torch.is_grad_enabled() and self.grad_sync.require_sync
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside only accumulate local gradients; the
        first backward after the block averages the accumulated sum. (torch's DDP decides at
        forward time; ours at backward time, so a pipeline's F, F, B, B order works: run
        the first backward inside the block.)"""
        with self.grad_sync.no_sync():
            yield

    def start_gradient_synchronization(self):
        """Launch every bucket not launched yet (a pipeline calls it after its last backward)."""
        self.grad_sync.start()

    def finish_gradient_synchronization(self):
        """Wait for the all-reduces; leave the mean gradient in ``p.grad`` (a view of its
        bucket; a copy with ``gradient_as_bucket_view=False``)."""
        self.grad_sync.finish()
        if not self.gradient_as_bucket_view and self.grad_sync.require_sync:
            for p in self.grad_sync.params:
                if p.grad is not None:
                    p.grad = p.grad.clone()  # the bucket is reused next step: a copy of its own


__all__ = ["DDP", "average_gradients", "broadcast_module_states", "broadcast_buffers", "check_replicas",
           "check_module", "persistent_buffers", "GradSync", "OverlappedGradSync"]
