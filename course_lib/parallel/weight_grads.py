"""Zero-bubble's W for the tensor-parallel layers: a layer's weight gradient left for later.

Where a pipeline schedule has W actions (ZB-H1, ZB-V, DualPipeV; Qi et al. 2023), the runner
(:mod:`course_lib.parallel.pipeline.runner`) splits each backward in two: B computes the input
gradients, which the previous stage waits for, and W the weight GEMMs dW = dY^T X, which wait
for nobody. A plain ``nn.Linear`` the runner splits itself: a forward hook keeps its input and
output. A tensor-parallel layer (:class:`~course_lib.parallel.tensor_parallel.ColumnParallelLinear`,
``RowParallelLinear``) runs its matmul inside the layer, on its slice of the weight, and under
sequence parallelism keeps only its s/t tokens of the input; so it splits its own backward:

    with recording(record):        # the runner, around a forward whose backward is split
        y = layer(x)               # the layer calls linear(...): its dW is left in the record
    ...                            # B: autograd computes dX only
    run_later(record["later"])     # W: every dW (and db), in the order B left them

:func:`linear` is ``F.linear`` whose backward, while a record was open at its forward, computes
dX = dY W only and appends (its weight, bias, input, dY) to ``record["later"]``; outside a
record it is :func:`torch.nn.functional.linear` itself. Under sequence parallelism the layer
hands its region (:class:`~course_lib.parallel.tensor_parallel.SequenceShardInput`) and its
s/t shard: the shard is what is kept, and W gathers the full input again (the region's one
all-gather, now in W: B needs none, dX = dY W reads no input). A weight that is a sum over K/V
copies (``sum_over_copies``: not a leaf) gets dW through autograd, so the copies' all-reduce
runs in W. ``record["deferred"]`` lists the parameters whose gradients W computes: B does not
ask autograd for them.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

_LOCAL = threading.local()      # .open: the records open now in this thread (a dry run's ranks are threads)


def _open() -> list:
    if not hasattr(_LOCAL, "open"):
        _LOCAL.open = []
    return _LOCAL.open


@contextlib.contextmanager
def recording(record: dict):
    """Inside the block, :func:`linear` leaves its weight gradients in ``record`` ("later",
    "deferred": created if missing)."""
    record.setdefault("later", [])
    record.setdefault("deferred", [])
    _open().append(record)
    try:
        yield record
    finally:
        _open().pop()


def open_record() -> dict | None:
    """The record open now (None: the weight gradients are autograd's, as usual)."""
    records = _open()
    return records[-1] if records else None


def linear(x, weight, bias=None, params=(), source=None, shard=None):
    """y = x W^T + b. Under :func:`recording`, its backward leaves dW (and db) for W:
    ``params``, the layer's own parameters behind ``weight`` / ``bias`` (``record["deferred"]``);
    ``source``, ``shard``: sequence parallelism's region and this rank's s/t tokens of ``x``,
    the one kept for W (which gathers it again). Outside a record: ``F.linear``."""
    record = open_record()
    if record is None:
        return F.linear(x, weight, bias)
    record["deferred"].extend(q for q in params if q is not None and q.requires_grad)
    if source is not None:
        source.add_reader()
    return _LinearLater.apply(x, weight, bias, record, source, shard)


class _LinearLater(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias, record, source, shard):
        ctx.save_for_backward(shard if source is not None else x, weight)   # W multiplies the first
        ctx.weight, ctx.bias, ctx.record, ctx.source = weight, bias, record, source
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):                                  # grad (.., out)
        kept, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = g2.mm(weight).view(*grad.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
        ctx.record["later"].append((ctx.weight, ctx.bias, kept, ctx.source, g2))
        return grad_x, None, None, None, None, None


def add_grad(p, grad_of_p):
    """Into ``p``'s gradient: a leaf's ``.grad`` (the GEMM adds into it in place from the second
    micro-batch on, ``grad_of_p(out)``; ``grad_of_p(None)``: a new tensor), then the leaf's
    post-accumulate-grad hooks, as autograd's AccumulateGrad runs them (mixed precision's fp32
    sums, :class:`~course_lib.precision.mixed.MainGrads`, take the gradient there); or through
    autograd for a tensor computed from one (a sum over K/V copies: its all-reduce too)."""
    if not p.requires_grad:
        return
    if p.grad_fn is not None:
        torch.autograd.backward(p, grad_of_p(None))
        return
    if p.grad is None:
        p.grad = grad_of_p(None)
    else:
        grad_of_p(p.grad)
    hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
    for hook in list(hooks.values()):
        hook(p)


def run_later(later) -> None:
    """W: each deferred layer's dW = dY^T X (and db = the sum of dY), in the order B left them;
    under sequence parallelism X is first gathered again from the kept shard."""
    for weight, bias, kept, source, g2 in later:
        x = kept
        if source is not None:                                # SP: the region's all-gather, in W
            x = source.full(kept)
            source.release()
        x2 = x.reshape(-1, x.shape[-1])
        add_grad(weight, lambda out: g2.t().mm(x2) if out is None else out.addmm_(g2.t(), x2))
        if bias is not None:
            add_grad(bias, lambda out: g2.sum(0) if out is None else out.add_(g2.sum(0)))


def held(later) -> list:
    """The tensors W still needs (for the runner's memory count): kept inputs and dY."""
    return [t for _, _, kept, _, g2 in later for t in (kept, g2)]


__all__ = ["recording", "open_record", "linear", "run_later", "held", "add_grad"]
