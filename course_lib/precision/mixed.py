"""Mixed precision: 16-bit compute and communication, 32-bit master weights.

    compute, reduce = check_precision("bf16-reduce-fp32")   # (torch.bfloat16, torch.float32)
    master = MasterWeights(model.parameters(), compute, reduce)   # fp32 copies; model now bf16
    master.to_model()                     # before forward: model <- master, rounded to bf16
    loss.backward()                       # bf16 gradients (accumulated in fp32 if reduce is fp32)
    master.to_master()                    # master.grad <- the gradients, in the master dtype
    opt = torch.optim.AdamW(master.parameters())       # the optimizer only sees the masters

Micikevicius et al. 2018 ("Mixed Precision Training"): a bf16 weight cannot absorb an
update smaller than 2**-8 of itself (its unit roundoff u = 2**-8), so the optimizer keeps
fp32 master weights and its moments, and the model computes with a bf16 copy made each
step. What a precision name asks for:

* ``"full"``: nothing changes, the model's own dtype everywhere (the course's default);
* ``"bf16"``: bf16 weights, activations, and gradients, reduced in bf16 (2 bytes on the wire);
* ``"bf16-reduce-fp32"``: bf16 compute, gradients reduced in fp32 (torch FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``): 4 bytes per gradient
  element on the wire, no bf16 rounding of the sum (the micro-batches' gradients are
  accumulated by autograd in bf16, then widened);
* ``"bf16-accumulate-fp32"``: as ``"bf16-reduce-fp32"``, and each micro-batch's gradient
  added into an fp32 buffer as its backward produces it (Megatron-LM's ``main_grad`` under
  ``accumulate_allreduce_grads_in_fp32``, DeepSpeed's BF16_Optimizer ``update_hp_grads``,
  Llama 3's "FP32 gradient accumulation"): :class:`MasterWeights` with ``accumulate=True``;
* ``"fp32"``: fp32 compute and reduction under whatever master dtype the model has (with
  a float64 model: the same plumbing as bf16, checkable to fp32's derived bounds).

The master weights live with the optimizer, on every rank that owns the parameter: with
DDP / TP / PP in :class:`MasterWeights` (a full fp32 copy of this rank's parameters), with
FSDP they ARE FSDP's fp32 shards (1/N each), all-gathered in the compute dtype.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from course_lib.precision.loss_scale import FP16_NAMES, check_loss_scaler

PRECISIONS = {"full": (None, None), "fp32": (torch.float32, torch.float32),
              "bf16": (torch.bfloat16, torch.bfloat16), "bf16-reduce-fp32": (torch.bfloat16, torch.float32),
              "bf16-accumulate-fp32": (torch.bfloat16, torch.float32)}
ACCUMULATE_IN_REDUCE = ("bf16-accumulate-fp32",)    # each micro-batch's gradient added in the reduce dtype


def accumulates(name) -> bool:
    """Whether precision ``name`` adds each backward's gradients into a buffer of its reduce
    dtype as they are produced (:class:`MainGrads`), not in the compute dtype by autograd."""
    check_precision(name)
    return name in ACCUMULATE_IN_REDUCE


class MainGrads:
    """Each backward's gradient of ``params`` added, as soon as autograd has it (a
    post-accumulate-grad hook), into a buffer of ``dtype`` (Megatron-LM's ``main_grad``: its
    hook's ``main_grad.add_(grad)``; the first backward's gradient cast into a new buffer), and
    the parameter's own gradient freed. ``buffer(p)``/``pop(p)`` read it; ``into(p)`` (optional)
    names where the sum lives (a master's ``.grad``), else :attr:`grads` keeps it."""

    def __init__(self, params, dtype, into=None):
        self.dtype, self.into, self.grads = dtype, into, {}
        self.params = [p for p in params if p.requires_grad]
        self.handles = [p.register_post_accumulate_grad_hook(self._add) for p in self.params]
        # {id(parameter): a context manager} an add into an existing buffer runs in (None: none);
        # the dry run's Megatron-Core software prices those adds inside the weight-gradient GEMM
        # (course_lib.virtual.software's "gradient_accumulation_fusion"); the same add runs
        self.accumulating = None

    @torch.no_grad()
    def _add(self, p):
        if self.into is not None:
            m = self.into(p)
            if m.grad is None:
                m.grad = p.grad.to(self.dtype)
            else:
                with self._accumulating(p):
                    m.grad.add_(p.grad)
        else:
            g = self.grads.get(id(p))
            if g is None:
                self.grads[id(p)] = p.grad.to(self.dtype)
            else:
                with self._accumulating(p):
                    g.add_(p.grad)
        p.grad = None

    def _accumulating(self, p):
        ctx = self.accumulating.get(id(p)) if self.accumulating is not None else None
        return ctx() if ctx is not None else contextlib.nullcontext()

    def holders(self) -> dict:
        """{id(parameter): an object whose ``.grad`` is its buffer (zeros if no backward reached
        it)}: what a sum written for ``.grad`` (the pipeline's tied-embedding sum) reads."""
        return {id(p): MainGrad(self, p) for p in self.params}

    def pop(self, p):
        """The buffer of ``p`` (None if no backward reached it), forgotten here."""
        return self.grads.pop(id(p), None)

    def clear(self):
        self.grads.clear()

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def check_precision(name):
    """(compute dtype, reduce dtype) of a precision name (None, None for "full");
    a ValueError naming an unknown one. fp16 is refused by name: it needs a loss scaler
    (chapter 9c), which this option does not run; bf16's 8 exponent bits need none."""
    if isinstance(name, str) and name in FP16_NAMES:
        check_loss_scaler(name, None, "precision", fix="this option runs no scaler: use 'bf16' (no scaler "
                          "needed), or fp16 with precision.DynamicLossScaler around your own step (chapter 9c)")
    if not isinstance(name, str) or name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}: must be one of {tuple(PRECISIONS)}")
    return PRECISIONS[name]


class MasterWeights:
    """Master copies (the parameters' dtype now) of ``params``, which are cast to ``compute``.

    Autograd accumulates the micro-batches' gradients in the model, in the compute dtype;
    :meth:`to_master` moves them to the masters' ``.grad``, before the reduction when
    ``reduce`` is the masters' dtype (:attr:`reduce_on_master`), after it otherwise.
    ``accumulate=True`` (``"bf16-accumulate-fp32"``): each backward's gradient is added into
    the master's ``.grad`` as autograd produces it (:class:`MainGrads`), in the masters' dtype.
    :attr:`of` maps a parameter to its master: where it sits and which dims sum its gradient
    are the plan's record of the parameter (``NDParallel.placements``)."""

    def __init__(self, params, compute, reduce=None, accumulate=False):
        self.model = list({id(p): p for p in params}.values())
        self.compute, self.reduce = compute, reduce or compute
        self.master = []
        for p in self.model:
            self.master.append(nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
        self.dtype = self.master[0].dtype if self.master else None
        self.reduce_on_master = self.reduce != self.compute
        self.of = {id(p): m for p, m in zip(self.model, self.master)}   # model parameter -> master
        for p in self.model:
            p.data = p.data.to(compute)                  # the model computes in 16 bits
        self.main_grads = MainGrads(self.model, self.dtype, into=lambda p: self.of[id(p)]) if accumulate else None

    def parameters(self):
        return list(self.master)

    def pairs(self):
        return list(zip(self.model, self.master))

    @torch.no_grad()
    def to_model(self):
        """model <- master, rounded to the compute dtype (round to nearest)."""
        for p, m in zip(self.model, self.master):
            p.copy_(m)

    @torch.no_grad()
    def to_master(self):
        """master.grad <- model.grad in the master dtype (accumulating); the model's cleared."""
        for p, m in zip(self.model, self.master):
            if p.grad is not None:
                g = p.grad.to(m.dtype)
                m.grad = g if m.grad is None else m.grad.add_(g)
                p.grad = None


class MainGrad:
    """One parameter's :class:`MainGrads` buffer as a ``.grad`` to read and write."""

    def __init__(self, main, p):
        self.main, self.p = main, p

    @property
    def grad(self):
        g = self.main.grads.get(id(self.p))
        if g is None:
            g = self.main.grads[id(self.p)] = torch.zeros(self.p.shape, dtype=self.main.dtype, device=self.p.device)
        return g

    @grad.setter
    def grad(self, value):
        self.main.grads[id(self.p)] = value


def cast_buffers(module, dtype):
    """Floating buffers (rotary tables) in the compute dtype, as FSDP's ``compute_dtype`` does."""
    for buf in module.buffers():
        if buf.is_floating_point():
            buf.data = buf.data.to(dtype)


def train_mixed(model, batches, lr, precision="bf16", weight_decay=0.1):
    """The single-device run of a precision: ``model`` (its dtype = the masters') trained by
    AdamW on the masters, one step per batch (the GPT loss of course_lib.reference).
    Returns (master state {name: tensor}, losses, first step's master gradients)."""
    compute, reduce = check_precision(precision)
    names = [n for n, _ in model.named_parameters()]
    master = None
    if compute is not None:
        master = MasterWeights(model.parameters(), compute, reduce, accumulate=accumulates(precision))
        cast_buffers(model, compute)
    params = master.parameters() if master else list(model.parameters())
    opt = torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, weight_decay=weight_decay)
    losses, first = [], None
    for x, y in batches:
        if master:
            master.to_model()
        loss = model(x, y, n_tokens=int((y != -100).sum()))[1]
        loss.backward()
        if master:
            master.to_master()
        if first is None:
            first = {n: p.grad.detach().clone() for n, p in zip(names, params) if p.grad is not None}
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in zip(names, params)}, losses, first


def relative_error(got: dict, want: dict) -> float:
    """Norm-wise relative error over all tensors: ||got - want|| / ||want|| (in float64)."""
    num = sum(float((got[k].double() - want[k].double()).square().sum()) for k in want)
    den = sum(float(want[k].double().square().sum()) for k in want)
    return (num / den) ** 0.5 if den else num ** 0.5


def sum_rounded(terms, dtype):
    """terms[0] + terms[1] + ... with every partial sum rounded to ``dtype``: what a ring
    reduce in ``dtype`` computes over its n - 1 hops (each rank adds its share to the partial
    sum it received and sends it on), and what n micro-batches' gradients accumulated in a
    ``dtype`` .grad compute. Each addition rounds once, so the error grows with n (towards
    (n - 1) u of the sum's scale): the reason Megatron accumulates and reduces gradients in an
    fp32 ``main_grad`` and FSDP2 offers ``reduce_dtype=torch.float32``."""
    if not len(terms):
        raise ValueError("sum_rounded needs at least one term")
    total = terms[0].to(dtype)
    for t in terms[1:]:
        total = total + t.to(dtype)     # rounded to dtype after every hop
    return total


__all__ = ["PRECISIONS", "ACCUMULATE_IN_REDUCE", "accumulates", "MainGrads", "check_precision", "MasterWeights", "cast_buffers", "train_mixed", "relative_error",
           "sum_rounded"]
