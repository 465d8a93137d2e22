"""Tensor parallelism (Megatron-LM) and sequence parallelism: the layers.

Every layer is built FROM its single-device layer by slicing (never re-drawing) the
weights, so t ranks together hold exactly the single-device model:

    col = ColumnParallelLinear(fc, comm)     # rows of fc.weight: a slice of the OUTPUT features
    row = RowParallelLinear(proj, comm)      # columns of proj.weight: a slice of the INPUT features
    y = row(F.gelu(col(x)))                  # Megatron's MLP: = proj(gelu(fc(x))) on every rank

Column -> nonlinearity -> row: the column layer gives each rank complete output features
(its slice of them), so the elementwise nonlinearity runs locally on that slice; the row
layer gives each rank a partial sum of the whole output, summed by ONE all-reduce ``g``
forward. Backward is the transpose: the input's gradient is a sum of the ranks' partial
gradients, ONE all-reduce ``f``. Communication is not optional: without ``g`` each rank
holds a partial sum, not the output.

Sequence parallelism (Korthikanti et al. 2022): between the tensor-parallel regions the
activations are split along the sequence instead of replicated, ``g`` becomes a
reduce-scatter and ``f`` an all-gather (same bytes), and the column layers keep only their
s/t input tokens for backward, gathering them again there (:class:`SequenceShardInput`).

The ops ``f``, ``g`` and SP's ``g``, ``g-bar`` live in :mod:`course_lib.parallel.comm_ops`;
applying all of this to the tiny GPT is :func:`course_lib.parallel.tp_plan.parallelize`.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import trace
from course_lib.collectives.comm import Comm
from course_lib.parallel.async_tp import all_gather_matmul, matmul_reduce_scatter
from course_lib.parallel.comm_ops import (gather_along, gather_from_parallel,
                                          gather_from_sequence_parallel, reduce_from_parallel,
                                          reduce_scatter_along, scatter_to_sequence_parallel, sum_over_copies)
from course_lib.parallel.mesh import set_reduce_dims
from course_lib.parallel.replicas import check_replicas
from course_lib.parallel.tp_backward_overlap import LinearAllReducingInput, enter_tensor_parallel
from course_lib.parallel.weight_grads import linear, open_record
from course_lib.parallel.vocab_parallel import shard_range

INPUTS = ("replicated", "sequence", "entered")
OUTPUTS = ("reduce", "reduce_scatter", "partial")


def _check_comm(comm):
    if not isinstance(comm, Comm):
        raise TypeError(f"pass the tensor-parallel group's Comm (mesh.comm('tp')), got {type(comm).__name__}")


def check_same_everywhere(module: nn.Module, comm: Comm, what: str):
    """ValueError on every rank unless every rank of ``comm`` holds the same single-device
    ``module`` (shapes and values): each rank keeps a slice of it, and slices of different
    layers are no layer at all (torch's parallelize_module takes rank 0's instead). The
    replica check of data parallelism with values (one all-gather of five numbers), before
    any other check can differ between ranks; outside the model's traffic: not in ``comm.log``."""
    check_replicas(list(module.named_parameters()), comm, what, values=True, traced=False,
                   model=type(module).__name__)


def slice_parameter(p: nn.Parameter, dim: int, start: int, stop: int) -> nn.Parameter:
    """A new Parameter holding ``p[start:stop]`` along ``dim`` (a copy of the single-device
    values), tagged ``tp_shard = (dim, start, stop, full size)`` so it can be put back."""
    q = nn.Parameter(p.detach().narrow(dim, start, stop - start).clone(), requires_grad=p.requires_grad)
    q.tp_shard = (dim, start, stop, p.shape[dim])
    return q


AGAIN = "SP g: all-gather again (backward)"


class SequenceShardInput:
    """The all-gathered input of a sequence-parallel region, shared by its column layers.

    Forward keeps only this rank's s/t tokens (``shard``) for backward; the first backward
    that needs the full input all-gathers it again, the others reuse it, the last drops it
    (Korthikanti et al. 2022, Sec. 4.2.2: an extra all-gather buys t times less memory).
    ``reduced``: (dX, its reduce-scatter) from the region's one column layer
    (:func:`column_backward`'s overlap), for the region's entry to return when the gradient it
    receives is that dX (nothing else read the gathered input; else it reduce-scatters its own)."""

    def __init__(self, shard, comm, dim=1):
        self.shard, self.comm, self.dim = shard, comm, dim
        self.users, self.readers, self._full, self.reduced = 0, 0, None, None

    def add_reader(self):
        """A column layer reads the region (forward): ``readers`` of it in all, ``users`` still to
        run their backward."""
        self.users, self.readers = self.users + 1, self.readers + 1

    def full(self, shard):
        if self._full is None:
            self._full = gather_along(self.comm, shard.detach(), self.dim, AGAIN, sequence=True)
        return self._full

    def full_async(self, shard):
        """A function giving the full input: the all-gather launched now unless another column
        layer of the region gathered it already (its wait is the function's)."""
        if self._full is None:
            pending = gather_along(self.comm, shard.detach(), self.dim, AGAIN, async_op=True, sequence=True)

            def wait():
                if self._full is None:
                    self._full = pending()
                return self._full
            return wait
        return lambda: self._full

    def release(self):
        self.users -= 1
        if self.users <= 0:
            self._full = None


def column_backward(source, shard, overlap, input_grad, weight_grads):
    """The backward of a column layer reading SP region ``source``: (its input gradient, what
    ``weight_grads(x_full)`` returns). ``input_grad()`` computes dX; ``weight_grads`` dW and db
    from the re-gathered input. Plain (``overlap`` False): the all-gather, then dX, then dW;
    the region's entry reduce-scatters dX after. Megatron-LM 2022's
    ``LinearWithGradAccumulationAndAsyncCommunication`` (``overlap``): the all-gather launched
    on the group's stream under dX's GEMM, then, where this layer is the region's only reader
    (its dX is the region's whole gradient), dX's reduce-scatter launched under dW's GEMM: the
    same collectives on the same tensors, so the same values, to the bit."""
    if not overlap:
        x_full = source.full(shard)
        return input_grad(), weight_grads(x_full)
    gathered = source.full_async(shard)
    grad_x = input_grad()                                     # under the all-gather
    x_full = gathered()
    reducing = None
    if source.readers == 1:
        reducing = reduce_scatter_along(source.comm, grad_x, source.dim, "SP g: reduce-scatter (backward)",
                                        async_op=True, sequence=True)
    grads = weight_grads(x_full)                              # under the reduce-scatter
    if reducing is not None:      # kept with the dX it sums: the region's entry checks it got that dX
        source.reduced = (grad_x, reducing())
    return grad_x, grads


def enter_sequence_parallel(x, comm, keep_gathered=False):
    """SP g: all-gather the s/t tokens of every rank (backward: reduce-scatter). Unless
    ``keep_gathered``, the column layers that read the result keep only ``x`` for backward."""
    region = SequenceShardInput(x, comm, dim=1) if not keep_gathered and comm.size > 1 else None
    full = gather_from_sequence_parallel(x, comm, dim=1, region=region)  # (b, s/t, h) -> (b, s, h)
    if region is not None:
        full.sequence_shard = region
    return full


class LinearKeepingShard(torch.autograd.Function):
    """y = x_full W^T + b, saving only the sequence shard of x_full (re-gathered in backward;
    ``overlap``: under the input gradient's GEMM, :func:`column_backward`)."""

    @staticmethod
    def forward(ctx, x_full, shard, weight, bias, source, overlap=False):
        ctx.save_for_backward(shard, weight)                  # (b, s/t, h): not (b, s, h)
        ctx.source, ctx.has_bias, ctx.overlap = source, bias is not None, overlap
        source.add_reader()
        return F.linear(x_full, weight, bias)

    @staticmethod
    def backward(ctx, grad):                                  # grad (b, s, out_r)
        shard, weight = ctx.saved_tensors

        def weight_grads(x_full):
            g2 = grad.reshape(-1, grad.shape[-1])
            grad_w = g2.t() @ x_full.reshape(-1, x_full.shape[-1])
            return grad_w, (g2.sum(0) if ctx.has_bias else None)
        grad_x, (grad_w, grad_b) = column_backward(ctx.source, shard, ctx.overlap,
                                                   lambda: grad @ weight, weight_grads)   # (b, s, in)
        ctx.source.release()
        return grad_x, None, grad_w, grad_b, None, None


class ColumnParallelLinear(nn.Module):
    """Y_r = X W_r^T + b_r: rows ``[start, stop)`` of an ``nn.Linear``'s weight (and bias),
    i.e. a slice of the OUTPUT features. Its matmul needs no communication: every rank
    needs the whole input X, and where that input comes from decides the collective:

    input="replicated"  every rank holds X: ``f`` (identity forward, all-reduce of dX backward)
    input="sequence"    each rank holds s/t tokens of X (SP): SP ``g`` (all-gather forward,
                        reduce-scatter backward), keeping only the s/t tokens for backward
    input="entered"     the caller applied f or SP g once for several layers reading the
                        same X (W_q, W_k, W_v): no collective here

    rows: default an even split of the output features (must divide); ``copies``: how
    many ranks hold these same rows (a K/V head shared by several ranks' query heads):
    their gradients are summed over the copies in backward (``sum_over_copies``).
    gather_output: all-gather the slices (every rank gets the whole Y: communication; the
    slices must be equal). check: first verify that every rank was given the same ``linear``
    (one small all-gather; ``parallelize`` checks the whole model once instead).
    async_tp: with input="sequence", the all-gather decomposed under the matmul
    (:mod:`course_lib.parallel.async_tp`); with input="entered", the region's pre-hook did it.
    """

    def __init__(self, linear: nn.Linear, comm: Comm, *, input="replicated", rows=None, copies=1,
                 gather_output=False, keep_gathered=False, check=True, async_tp=False):
        super().__init__()
        _check_comm(comm)
        if input not in INPUTS:
            raise ValueError(f"input must be one of {INPUTS}, got {input!r}")
        if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1 or comm.size % copies:
            raise ValueError(f"copies={copies!r} must be a positive int dividing the tensor-parallel size {comm.size}")
        if check:
            check_same_everywhere(linear, comm, "ColumnParallelLinear")
        out = linear.out_features
        if rows is None:
            if out % comm.size:
                raise ValueError(f"ColumnParallelLinear: out_features={out} is not divisible by the "
                                 f"tensor-parallel size {comm.size}")
            rows = shard_range(out, comm.size, comm.rank)
        start, stop = rows
        if not 0 <= start < stop <= out:
            raise ValueError(f"rows [{start}, {stop}) are not a slice of the {out} output features")
        if gather_output and (stop - start) * comm.size != out:
            raise ValueError(f"gather_output concatenates equal slices: rows [{start}, {stop}) is not 1/{comm.size} "
                             f"of the {out} output features")
        self.comm, self.input, self.gather_output, self.keep_gathered = comm, input, gather_output, keep_gathered
        self.in_features, self.out_features, self.full_out_features = linear.in_features, stop - start, out
        self.copies, self.rows, self.async_tp = copies, (start, stop), bool(async_tp)
        # Megatron-LM 2022's backward overlaps (course_lib.virtual.software): "sp_backward_overlap"
        # (SP: re-gather under dX, reduce-scatter under dW), "tp_backward_overlap" (TP alone: dX's
        # all-reduce under dW, course_lib.parallel.tp_backward_overlap)
        self.overlap_backward, self.overlap_all_reduce = False, False
        self.weight = slice_parameter(linear.weight, 0, start, stop)           # (out_r, in)
        self.bias = slice_parameter(linear.bias, 0, start, stop) if linear.bias is not None else None
        for p in (self.weight, self.bias):
            if p is not None and copies > 1:
                p.tp_copies = copies

    def _params(self):
        w, b = self.weight, self.bias
        if self.copies > 1:  # n_slots distinct copies across the group, mine is slot rank // copies
            slot, n_slots = self.comm.rank // self.copies, self.comm.size // self.copies
            w = sum_over_copies(w, self.comm, slot, n_slots)
            b = sum_over_copies(b, self.comm, slot, n_slots) if b is not None else None
        return w, b

    def weight_and_bias(self):
        """The (weight, bias) this rank multiplies by (a copied K/V head's: summed in backward)."""
        return self._params()

    def forward(self, x):  # (..., in) -> (..., out_r)
        pending = getattr(x, "async_outputs", None)
        if pending is not None:   # async TP: the region's decomposed all-gather-matmul computed me
            if self not in pending:
                raise ValueError("async TP: this column layer reads a region input it was not computed "
                                 "with (only the region's own column layers may read it)")
            return pending[self]
        if self.input == "sequence" and self.async_tp:        # (b, s/t, h) -> (b, s, out_r)
            y = all_gather_matmul(x, self.comm, *map(list, zip(self.weight_and_bias())))[0]
            return gather_from_parallel(y, self.comm, dim=-1) if self.gather_output else y
        if self.input == "replicated":
            x = enter_tensor_parallel(x, self.comm)   # f (x is read by the matmul only)
        elif self.input == "sequence":
            x = enter_sequence_parallel(x, self.comm, self.keep_gathered)     # SP g
        weight, bias = self._params()
        source = getattr(x, "sequence_shard", None)
        region = getattr(x, "replicated_region", None) if self.overlap_all_reduce else None
        if open_record() is not None:   # a zero-bubble split: dW for W to compute (weight_grads)
            y = linear(x, weight, bias, (self.weight, self.bias), source, getattr(source, "shard", None))
        elif source is not None:   # SP: keep the s/t shard for backward, not the gathered input
            y = LinearKeepingShard.apply(x, source.shard, weight, bias, source, self.overlap_backward)
        elif region is not None:  # TP: dX's all-reduce under dW's GEMM
            y = LinearAllReducingInput.apply(x, weight, bias, region)
        else:
            y = F.linear(x, weight, bias)
        return gather_from_parallel(y, self.comm, dim=-1) if self.gather_output else y

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features} of {self.full_out_features}, "
                f"input={self.input}" + (f", copies={self.copies}" if self.copies > 1 else ""))


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r W_r^T + b: columns ``[start, stop)`` of an ``nn.Linear``'s weight, i.e. a
    slice of the INPUT features. X_r is already split (a column layer's output), so each
    rank computes a partial sum of the whole output:

    output="reduce"          ``g``: all-reduce forward (identity backward): every rank has Y
    output="reduce_scatter"  SP ``g-bar`` (reduce-scatter): each rank keeps its s/t tokens of Y
    output="partial"         no collective, no bias: a partial sum (wrong unless the caller sums
                             it and adds the bias once)

    The bias is added once, after the sum (added before, it would count t times). With
    ``"reduce_scatter"`` a rank adds it to its s/t tokens only, so its gradient is a partial
    sum: it is marked ``("dp", "tp")`` (``set_reduce_dims``) and ``GradSync`` /
    ``sync_tensor_parallel_grads`` sum it over the group (torch's DTensor reduces such a
    Partial gradient itself). check: verify that every rank was given the same ``linear``.
    async_tp: with output="reduce_scatter", the reduce-scatter decomposed under the matmul.
    """

    def __init__(self, linear: nn.Linear, comm: Comm, *, output="reduce", cols=None, check=True,
                 async_tp=False):
        super().__init__()
        _check_comm(comm)
        if output not in OUTPUTS:
            raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
        if check:
            check_same_everywhere(linear, comm, "RowParallelLinear")
        n_in = linear.in_features
        if cols is None:
            if n_in % comm.size:
                raise ValueError(f"RowParallelLinear: in_features={n_in} is not divisible by the "
                                 f"tensor-parallel size {comm.size}")
            cols = shard_range(n_in, comm.size, comm.rank)
        start, stop = cols
        if not 0 <= start < stop <= n_in:
            raise ValueError(f"cols [{start}, {stop}) are not a slice of the {n_in} input features")
        self.comm, self.output, self.async_tp = comm, output, bool(async_tp)   # async_tp: see below
        self.in_features, self.full_in_features, self.out_features = stop - start, n_in, linear.out_features
        self.weight = slice_parameter(linear.weight, 1, start, stop)           # (out, in_r)
        self.bias = None
        if linear.bias is not None:  # replicated: every rank adds the same bias to the summed output
            self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
            if output == "reduce_scatter":
                set_reduce_dims(self.bias, ("dp", "tp"))   # added to my s/t tokens only

    def forward(self, x):  # (..., in_r) -> (..., out), (b, s/t, out) with output="reduce_scatter"
        if x.shape[-1] != self.in_features:
            raise ValueError(f"RowParallelLinear expects this rank's {self.in_features} of the "
                             f"{self.full_in_features} input features (a column-parallel output), "
                             f"got {x.shape[-1]}")
        if self.output == "reduce_scatter" and self.async_tp:   # the reduce-scatter under the matmul
            y = matmul_reduce_scatter(x, self.weight, self.comm)                # (b, s/t, out)
            return y + self.bias if self.bias is not None else y
        y = linear(x, self.weight, None, (self.weight,))       # partial sum (zero bubble: dW in W)
        if self.output == "reduce":
            y = reduce_from_parallel(y, self.comm, in_place=True)   # g, into the fresh partial sum
        elif self.output == "reduce_scatter":
            y = scatter_to_sequence_parallel(y, self.comm, dim=1)               # SP g-bar
        else:
            return y
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return f"in={self.in_features} of {self.full_in_features}, out={self.out_features}, output={self.output}"


def head_rows(n_heads: int, n_kv_heads: int, head_dim: int, t: int, r: int):
    """Which rows of W_q and of W_k / W_v rank ``r`` of ``t`` keeps, and how many ranks share
    its K/V rows: ((q_start, q_stop), (kv_start, kv_stop), copies).

    Query heads split evenly. K/V heads split evenly when t divides their number; when
    there are fewer K/V heads than ranks (grouped-query attention), each rank keeps a copy
    of the one K/V head its query heads use (t / kv ranks share it: their gradients are
    summed). Anything else cannot be cut along heads: ValueError naming the constraint."""
    if n_heads % t:
        raise ValueError(f"tensor parallelism splits attention by heads: n_heads={n_heads} is not "
                         f"divisible by tp={t}")
    if n_kv_heads % t and t % n_kv_heads:
        raise ValueError(f"grouped-query attention: n_kv_heads={n_kv_heads} must divide tp={t} (a copy "
                         f"per rank) or be divisible by it (a split), neither holds")
    q = shard_range(n_heads, t, r)
    if n_kv_heads % t == 0:
        kv, copies = shard_range(n_kv_heads, t, r), 1
    else:
        copies = t // n_kv_heads
        kv = (r // copies, r // copies + 1)
    return (q[0] * head_dim, q[1] * head_dim), (kv[0] * head_dim, kv[1] * head_dim), copies


class TensorParallelRNG:
    """Two random streams per rank (Megatron's model-parallel RNG tracker, without globals):

    ``replicated``: the same seed on every rank of the group, for dropout on activations every
    rank holds whole (the same mask everywhere, else the copies drift apart);
    ``sharded``: seed + 2718 + tp rank, for dropout on a rank's own heads or own tokens
    (independent masks: the same seed would repeat one mask on every shard)."""

    def __init__(self, comm: Comm, seed: int = 0, device="cpu"):
        if torch.device(device).type == "meta":   # (the dry run: no generator there, and no values drawn)
            device = "cpu"
        self.replicated = torch.Generator(device=device).manual_seed(seed)
        self.sharded = torch.Generator(device=device).manual_seed(seed + 2718 + comm.rank)


class _KeptScaled(torch.autograd.Function):
    """``x * keep * scale`` as CUDA's fused dropout runs it: one kernel forward (it reads x,
    writes the output and, on a GPU, the mask it draws: the bytes ``native_dropout_backward``
    reads and writes here), one backward; keeps the bool mask."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.ops.aten.native_dropout_backward(x, keep, scale)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return torch.ops.aten.native_dropout_backward(grad, keep, ctx.scale), None, None


class TensorParallelDropout(nn.Module):
    """Dropout drawing its mask from an explicit generator (one of :class:`TensorParallelRNG`'s),
    or replaying ``masks`` (a list, consumed in order: a single-device run with the masks the
    ranks drew). ``record``: a list that receives every mask drawn. Saves a bool mask."""

    def __init__(self, p: float, generator=None, masks=None, region: str = ""):
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, got {p!r}")
        self.p, self.generator, self.masks, self.region = p, generator, masks, region
        self.record = None

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        if self.masks is not None:
            keep = self.masks.pop(0)
        else:
            clock = trace.clock()             # the draw is inside the one kernel below on a GPU
            with clock.muted() if clock is not None else contextlib.nullcontext():
                keep = torch.rand(x.shape, generator=self.generator, device=x.device) >= self.p
        if self.record is not None:
            self.record.append(keep)
        return _KeptScaled.apply(x, keep, 0.0 if self.p == 1.0 else 1.0 / (1.0 - self.p))

    def extra_repr(self):
        return f"p={self.p}, {self.region}"


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "SequenceShardInput", "LinearKeepingShard", "column_backward",
           "enter_sequence_parallel", "slice_parameter", "check_same_everywhere", "head_rows", "shard_range",
           "TensorParallelRNG", "TensorParallelDropout"]
