"""Gradient synchronisation: sum each gradient over the mesh dimensions its parameter is
replicated on, in a few large all-reduces, then divide by the data-parallel degree.

    sync = GradSync(model.parameters(), mesh, divisor=mesh.size("dp"))
    loss.backward()                       # one or more backward calls: p.grad accumulates
    sync.start()                          # launch every bucket's all-reduce (async)
    ...                                   # anything that overlaps the communication
    sync.finish()                         # wait: p.grad = (sum over its ranks) / divisor

Every parameter says over which mesh dimensions its gradient is summed
(:func:`~course_lib.parallel.mesh.get_reduce_dims`: "dp" by default; ("dp", "tp") for a
sequence-parallel norm weight; ("edp",) for an expert). Gradients are packed into flat
**buckets** of one dtype, one device and one set of dims, filled in *reverse* parameter
order (backward produces the last layer's gradients first), and each bucket is summed by
ONE all-reduce over ``mesh.comm(its dims)``, then scaled by ``1 / divisor``: DDP's mean
divides by the data-parallel degree (dp, or dp * cp), the same number for every parameter,
experts included; ``divisor=1`` when the loss is already normalised by the global token count.

``start()`` and ``finish()`` are explicit so that a pipeline schedule can launch the
synchronisation after its last backward and wait for it as late as it likes.
:class:`OverlappedGradSync` adds the optimisation of torch's DDP (Li et al. 2020): a hook
launches a bucket the moment its last gradient is accumulated, while backward goes on.

As on one device: frozen parameters are never communicated; a tied parameter is one
parameter; a parameter that some rank did not use counts as zero there, and one that no
rank used keeps ``grad = None`` (each bucket carries one flag per parameter, "had a
gradient here", summed with the gradients: > 0 afterwards means some rank had one).
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch

from course_lib.parallel.mesh import get_reduce_dims


def assign_buckets(params, bucket_cap_bytes, key=None):
    """Group parameter indexes into buckets of at most ``bucket_cap_bytes`` (a larger
    parameter gets a bucket of its own), walking the parameters in *reverse* order.

    A bucket is one flat buffer sent over one group: it holds parameters with the same
    ``key(p)`` (default: dtype and device). One bucket is open per key; it closes when the
    next parameter of its key would overflow it; those still open at the end close in the
    order they were opened. Buckets are returned in the order they closed: roughly the
    order in which backward completes them.
    """
    key = key or (lambda p: (p.dtype, p.device))
    closed, open_ = [], {}  # open_: key -> [indexes, bytes], in the order opened
    for i in reversed(range(len(params))):
        p, k = params[i], key(params[i])
        nbytes = p.numel() * p.element_size()
        if k in open_ and open_[k][1] + nbytes > bucket_cap_bytes:
            closed.append(open_.pop(k)[0])
        ids, size = open_.setdefault(k, [[], 0])
        ids.append(i)
        open_[k][1] = size + nbytes
    return closed + [ids for ids, _ in open_.values()]


class Bucket:
    """Some parameters' gradients in one flat buffer, summed over one mesh group by one call.

    buffer: (n_1 + ... + n_k + k,): the k gradients, flattened, then one flag per
    parameter: 1 if it had a gradient on this rank (after the sum: on how many ranks).
    """

    def __init__(self, index, params, comm):
        self.index, self.params, self.comm = index, params, comm
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        numel = self.offsets[-1]
        self.buffer = torch.zeros(numel + len(params), dtype=params[0].dtype, device=params[0].device)
        self.flags = self.buffer[numel:]             # (k,) "had a gradient"
        self.filled = [False] * len(params)          # copied into the buffer this step
        self.work = None                             # the all-reduce's handle once launched

    def grad_view(self, k):
        p = self.params[k]
        return self.buffer[self.offsets[k]:self.offsets[k + 1]].view_as(p)

    def fill(self, k):
        """Copy parameter k's gradient into the buffer (zeros if it has none on this rank)."""
        p, view = self.params[k], self.grad_view(k)
        if p.grad is None:
            view.zero_()
        elif p.grad._base is not self.buffer or p.grad.data_ptr() != view.data_ptr():
            # after a step p.grad may already BE the view; the base too (on the meta
            # device every fresh tensor's data_ptr is 0, the first view's too)
            view.copy_(p.grad)
        self.flags[k] = p.grad is not None
        self.filled[k] = True

    def launch(self):
        """Start summing the buffer over this bucket's ranks (async: returns at once)."""
        self.work = self.comm.all_reduce(self.buffer, async_op=True, name=f"all-reduce b{self.index}")

    def complete(self) -> bool:
        return all(self.filled)


class GradSync:
    """Sum gradients over their reduce dims, bucket by bucket, then divide by ``divisor``.

    params: the parameters (duplicates and frozen ones are dropped; one marked with
        reduce dims () is never communicated). mesh: a ``Mesh`` or ``GroupMesh``.
    default_dims: the reduce dims of a parameter that carries none.
    dims: {id(parameter): its reduce dims}, handed by a plan (``parallelize_nd``); default:
        each parameter's marks (``set_reduce_dims``).
    """

    def __init__(self, params, mesh, *, divisor=1, bucket_cap_mb=25, default_dims=("dp",), dims=None):
        if isinstance(divisor, bool) or not isinstance(divisor, (int, float)) or not divisor > 0:
            raise ValueError(f"divisor must be a positive number (the data-parallel degree, or 1), got {divisor!r}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not math.isfinite(bucket_cap_mb) or bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be a number of MiB >= 0 (0: one bucket per parameter), "
                             f"got {bucket_cap_mb!r}")
        if hasattr(params, "parameters"):
            params = params.parameters()
        unique = list({id(p): p for p in params if p.requires_grad}.values())
        dims = {id(p): tuple(dims[id(p)]) if dims is not None else get_reduce_dims(p, default_dims) for p in unique}
        self.params = [p for p in unique if dims[id(p)]]
        if not self.params:
            raise ValueError("GradSync: no parameter requires a gradient reduced over a mesh dimension")
        self.mesh, self.divisor, self.require_sync = mesh, divisor, True
        ids = assign_buckets(self.params, bucket_cap_mb * 2**20, key=lambda p: (p.dtype, p.device, dims[id(p)]))
        self.buckets = [Bucket(k, [self.params[i] for i in b], mesh.comm(dims[id(self.params[b[0]])]))
                        for k, b in enumerate(ids)]
        self._where = [None] * len(self.params)  # parameter index -> (bucket, position in it)
        for b, members in zip(self.buckets, ids):
            for k, i in enumerate(members):
                self._where[i] = (b, k)
        self._reset()

    def _reset(self):
        self.armed, self._started, self._next = False, False, 0
        for b in self.buckets:
            b.filled, b.work = [False] * len(b.params), None

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate local gradients (no hook launches anything)."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def start(self):
        """Launch the all-reduce of every bucket not launched yet, in bucket order."""
        if self._started:
            raise RuntimeError("GradSync.start() was called twice in one step: call finish() first")
        self._started = True
        self._launch_all()

    def _launch_all(self):
        self.armed = True
        for b in self.buckets:
            if b.work is None:
                for k in range(len(b.params)):
                    if not b.filled[k]:  # (with hooks: not used by this backward)
                        b.fill(k)
                b.launch()
        self._next = len(self.buckets)

    def finish(self):
        """Launch what is left, wait, and write ``sum / divisor`` into ``p.grad`` (a view
        of its bucket: no copy back); None for a parameter no rank had a gradient for."""
        if not self.require_sync:
            return  # inside no_sync(): gradients stay local
        self._launch_all()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            used = (b.flags > 0).tolist()
            if self.divisor != 1:
                b.buffer.div_(self.divisor)
            for k, p in enumerate(b.params):
                p.grad = b.grad_view(k) if used[k] else None
        self._reset()

    def comms(self):
        """The Comms the buckets talk through (one per distinct set of reduce dims)."""
        return list({id(b.comm): b.comm for b in self.buckets}.values())


class GradReadyHook:
    """Post-accumulate-grad hook: tells ``owner._grad_ready(i)`` that parameter i's gradient
    is complete for this backward. Holds the owner weakly: a discarded wrapper's hooks go quiet."""

    def __init__(self, owner, i):
        self.owner, self.i = weakref.ref(owner), i

    def __call__(self, param):
        owner = self.owner()
        if owner is not None:
            owner._grad_ready(self.i)


def register_grad_ready_hooks(owner, params, what, start=0):
    """One :class:`GradReadyHook` per parameter (numbered from ``start``); refuse a parameter
    another live owner hooks."""
    for p in params:  # two live wrappers on one parameter would each launch collectives
        hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
        if any(isinstance(h, GradReadyHook) and h.owner() is not None for h in hooks.values()):
            raise ValueError(f"{what}: a parameter is already managed by another live DDP / ZeRO-2 "
                             f"wrapper: wrap a fresh module")
    for i, p in enumerate(params, start):
        p.register_post_accumulate_grad_hook(GradReadyHook(owner, i))


class OverlappedGradSync(GradSync):
    """:class:`GradSync` whose buckets launch DURING backward: a hook runs when a
    parameter's gradient is accumulated (for a tied weight: after all its uses), copies it
    into its bucket, and launches every complete bucket, strictly in bucket order (the
    same order on every rank, whichever gradients this rank produced first). At the end
    of that backward the buckets still waiting (a parameter unused here) are launched.

    Only backward passes with ``require_sync`` (outside ``no_sync()``) launch anything:
    with gradient accumulation, or a pipeline's F, F, B, B order, the last one does.
    """

    def __init__(self, params, mesh, **kwargs):
        super().__init__(params, mesh, **kwargs)
        register_grad_ready_hooks(self, self.params, "GradSync")

    def _grad_ready(self, i):
        if not self.require_sync:
            return
        bucket, k = self._where[i]
        if bucket.filled[k]:
            raise RuntimeError("a gradient became ready twice before finish(): call finish() "
                               "(DDP: finish_gradient_synchronization()) after each step's last backward, "
                               "and run the earlier backward passes of a step inside no_sync()")
        if not self.armed:  # first gradient of this backward: launch the rest when it ends
            self.armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._launch_all)
        bucket.fill(k)
        while self._next < len(self.buckets) and self.buckets[self._next].complete():
            self.buckets[self._next].launch()
            self._next += 1


__all__ = ["assign_buckets", "Bucket", "GradSync", "OverlappedGradSync", "GradReadyHook",
           "register_grad_ready_hooks"]
