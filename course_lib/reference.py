"""The single-device run every test, grader and notebook compares a parallel one with.

    X, Y, perms = mlp_data(seed=0, batch=24, steps=5, sizes=(16, 32, 16, 32))
    model = MLP((16, 32, 16, 32), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    state, losses = train(model, shuffled(X, Y, perms), opt, micro=2)

    model = TinyGPT(cfg, seed=0)
    state, losses = train_gpt(model, gpt_batches(cfg, batch=8, steps=5), opt, micro=2)

A parallel run is right when it ends with the same ``state`` (bit for bit on one rank,
to rounding on several). The rules a parallel run reproduces:

* data: the same global batch every step, drawn from one seeded generator (every rank
  draws all of it and keeps its own rows), reshuffled every step;
* MLP loss: the mean squared error of each of ``micro`` equal micro-batches, divided by
  ``micro`` (the mean of the means is the full batch's mean);
* GPT loss: each micro-batch's cross entropy SUMMED over its tokens and divided by the
  step's GLOBAL token count (targets that are not -100), the rule that also makes
  vocabulary-, context- and pipeline-parallel shards add up to the global mean.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib import data


def mlp_data(seed=0, batch=24, steps=5, sizes=(16, 32, 16, 32)):
    """Inputs X (batch, sizes[0]), targets Y (batch, sizes[-1]) and one permutation of the
    rows per step, all drawn from one generator in that order."""
    if batch < 1 or steps < 0:
        raise ValueError(f"batch must be >= 1 and steps >= 0, got batch={batch}, steps={steps}")
    g = torch.Generator().manual_seed(seed)
    X, Y = torch.randn(batch, sizes[0], generator=g), torch.randn(batch, sizes[-1], generator=g)
    perms = [torch.randperm(batch, generator=g) for _ in range(steps)]  # reshuffled every step
    return X, Y, perms


def shuffled(X, Y, perms):
    """One (x, y) batch per step: the rows of X and Y in that step's order."""
    return [(X[p], Y[p]) for p in perms]


def mlp_batches(seed=0, batch=24, steps=5, sizes=(16, 32, 16, 32)):
    """``shuffled(*mlp_data(...))``: the list of (x, y) batches, one per step."""
    return shuffled(*mlp_data(seed, batch, steps, sizes))


def gpt_batches(cfg, batch=8, steps=5, seed=0, n_chars=20_000):
    """``steps`` batches (x, y) of shape (batch, cfg.seq_len), y = x shifted by one: windows
    of ``course_lib.data.synthetic_text`` as bytes (nothing downloaded). Bytes that do not
    fit a vocabulary smaller than 256 are folded into it (token % vocab_size)."""
    tokens = data.byte_tokens(data.synthetic_text(n_chars, seed)) % cfg.vocab_size
    return list(data.batches(tokens, batch, cfg.seq_len, seed=seed, n_batches=steps))


def mse_loss(model, x, y):
    return F.mse_loss(model(x), y)


def sgd_step(params, lr):
    """Plain SGD written out (p -= lr * grad; no momentum, no decay), for loops that update by hand."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= lr * p.grad


def _steps(model, batches, optimizer, micro, micro_loss):
    """The loop both trainers share: each batch cut into ``micro`` micro-batches, their
    losses backpropagated (gradients accumulate), one optimizer step, gradients cleared.
    ``optimizer``: a ``torch.optim.Optimizer`` over the model's parameters, or a function
    ``update(params)`` applying one step from their ``.grad``. Returns the step losses."""
    if micro < 1:
        raise ValueError(f"micro (micro-batches per step) must be >= 1, got {micro}")
    losses = []
    for x, y in batches:
        if len(x) % micro:
            raise ValueError(f"a batch of {len(x)} rows does not cut into micro={micro} equal micro-batches")
        total = 0.0
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            loss = micro_loss(xm, ym, y)
            loss.backward()
            total += loss.item()
        if isinstance(optimizer, torch.optim.Optimizer):
            optimizer.step()
            optimizer.zero_grad()
        else:
            optimizer(list(model.parameters()))
            model.zero_grad()
        losses.append(total)
    return losses


def train(model, batches, optimizer, *, loss=mse_loss, micro=1):
    """Train ``model`` on ``batches`` [(x, y), ...], one optimizer step per batch, each
    micro-batch's ``loss(model, x, y) / micro`` accumulated. Returns (state_dict, step losses)."""
    losses = _steps(model, batches, optimizer, micro, lambda x, y, _: loss(model, x, y) / micro)
    return model.state_dict(), losses


def train_gpt(model, batches, optimizer, *, micro=1):
    """``train`` for a GPT ``model(idx, targets, n_tokens=...) -> (logits, loss)``: each
    micro-batch's cross entropy summed over its tokens and divided by the step's global
    token count (not by ``micro``). Returns (state_dict, step losses)."""
    def micro_loss(x, y, step_targets):
        return model(x, y, n_tokens=int((step_targets != -100).sum()))[1]

    losses = _steps(model, batches, optimizer, micro, micro_loss)
    return model.state_dict(), losses


def train_parallel(net, batches, optimizer) -> list:
    """Train a parallel ``net`` whose ``step(x, y)`` runs one step's forward and backward (its
    micro-batches, its communication) and returns the step's loss: ``optimizer`` steps after
    each batch. Returns the step losses, to compare with :func:`train_gpt`'s."""
    losses = []
    for x, y in batches:
        losses.append(net.step(x, y))
        optimizer.step()
        optimizer.zero_grad()
    return losses


__all__ = ["mlp_data", "shuffled", "mlp_batches", "gpt_batches", "mse_loss", "sgd_step", "train", "train_gpt",
           "train_parallel"]
