"""The zero-bubble split of a backward (Qi et al. 2023), for the pipeline executor: ``B`` computes the gradient of the stage's input
and of every Linear layer's *output* (one backward pass through the activations, no
weight GEMM), keeping each Linear's input and output gradient; ``W`` later does the
weight GEMMs ``dW = dy^T x`` (and ``db = sum dy``). The few other parameters (norm weights,
embeddings) get their gradients in ``B``.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def _linears(module):
    return [mod for mod in module.modules() if isinstance(mod, nn.Linear)]


def _outside(module, linears):
    """The trainable parameters of ``module`` that no Linear of ``linears`` holds."""
    in_linear = {id(w) for lin in linears for w in lin.parameters()}
    return [q for q in module.parameters() if q.requires_grad and id(q) not in in_linear]


def _accumulate(p, g):
    """p.grad += g; the first time, p.grad = a copy of g."""
    if g is None:
        return
    if p.grad is None:
        p.grad = g.clone()
    else:
        p.grad += g


def backward_input(y, dy, x, record):
    """B: gradients of the stage input ``x`` and of each Linear output recorded in the
    forward, in one pass; non-Linear parameters get their gradient now. Returns (dx, for_w)
    where ``for_w`` = [(linear, its input, grad of its output)] for :func:`backward_weight`."""
    calls, others = record["calls"], record["others"]
    wanted = ([x] if x is not None else []) + [out for _, _, out in calls] + others
    grads = torch.autograd.grad(y, wanted, dy, allow_unused=True)
    k = 1 if x is not None else 0
    for p, g in zip(others, grads[k + len(calls):]):
        _accumulate(p, g)
    for_w = [(mod, inp, g) for (mod, inp, _), g in zip(calls, grads[k:k + len(calls)]) if g is not None]
    return (grads[0] if x is not None else None), for_w


def backward_weight(for_w):
    """W: the weight-gradient GEMMs of every Linear, from what B kept. From the second
    micro-batch on, the GEMM adds into ``.grad`` in place (one pass, no temporary)."""
    for mod, inp, dout in for_w:
        dout2, inp2 = dout.reshape(-1, dout.shape[-1]), inp.reshape(-1, inp.shape[-1])
        w, b = mod.weight, mod.bias
        if w.requires_grad:                                              # dW = dout^T inp: (out, in)
            w.grad = dout2.t() @ inp2 if w.grad is None else w.grad.addmm_(dout2.t(), inp2)
        if b is not None and b.requires_grad:
            b.grad = dout2.sum(0) if b.grad is None else b.grad.add_(dout2.sum(0))


__all__ = ["backward_input", "backward_weight"]
