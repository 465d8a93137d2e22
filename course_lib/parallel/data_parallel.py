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


def broadcast_module_states(module: nn.Module, comm, comm_of=None, src: int = 0):
    """Make every rank of ``comm`` hold group rank ``src``'s parameters and buffers (one
    broadcast per tensor, in registration order: the same on every rank). ``comm_of(p)``:
    the Comm a parameter is broadcast over instead (all the dims it is replicated on; None:
    not replicated, not broadcast). Bool tensors travel as bytes."""
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            group = comm_of(t) if comm_of is not None and isinstance(t, nn.Parameter) else comm
            if group is not None:
                t = t.detach()
                group.broadcast(t.view(torch.uint8) if t.dtype == torch.bool else t, src=src,
                                name=f"broadcast {name}")


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
    """Distributed data parallel: replicate ``module``, average its gradients.

    bucket_cap_mb: bucket size in MiB (> 0).
    mesh / group: what to talk through: a ``Mesh``, or one process group (a ProcessGroup,
        a ``Comm``, or None for the world) seen as the mesh dimension ``dims[0]``.
    dims: the mesh dimensions the batch is split over (default "dp"; ("dp", "cp") with
        context parallelism). The gradients are divided by their size, ``divisor`` if given.
        A parameter's gradient is summed over its own reduce dims (``set_reduce_dims``),
        ``dims`` if it has none; rank ``0`` of that group broadcasts its value at construction.
    overlap: True: buckets are all-reduced during backward (hooks, torch's behaviour);
        False: all of them after backward, in ``finish_gradient_synchronization()``.

    Frozen parameters are never communicated; a tied (shared) parameter is one parameter;
    a parameter without a gradient on some ranks counts as zero there, and one that no
    rank used this step keeps ``grad = None``, as on a single device.
    """

    def __init__(self, module, bucket_cap_mb=25, *, mesh=None, group=None, dims=("dp",), divisor=None,
                 overlap: bool = True):
        super().__init__()
        check_module(module, "DDP")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        self.module, self.mesh = module, as_mesh(mesh, group, dim=dims[0])
        self.comm = self.mesh.comm(dims)  # the data-parallel group
        # the same start: every replica takes the values of its group's rank 0, each parameter
        # over the dims its gradient is summed over (the dims it is replicated on)
        replicated_on = lambda p: self.mesh.comm(get_reduce_dims(p, dims)) if get_reduce_dims(p, dims) else None
        broadcast_module_states(module, self.comm, replicated_on)
        divisor = self.comm.size if divisor is None else divisor
        sync_cls = OverlappedGradSync if overlap else GradSync
        self.grad_sync = sync_cls(module, self.mesh, divisor=divisor, bucket_cap_mb=bucket_cap_mb,
                                  default_dims=dims)

    def forward(self, *args, **kwargs):
        if self.grad_sync.armed:
            raise RuntimeError("DDP: call finish_gradient_synchronization() after backward and before "
                               "the next forward (gradients of the last step are still in flight)")
        return self.module(*args, **kwargs)

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
        """Wait for the all-reduces; leave the mean gradient in ``p.grad``."""
        self.grad_sync.finish()


__all__ = ["DDP", "average_gradients", "broadcast_module_states", "check_module", "GradSync",
           "OverlappedGradSync"]
