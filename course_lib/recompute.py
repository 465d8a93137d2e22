"""Activation recomputation (checkpointing): keep less for backward, compute it again there.

    block.recompute = "full"        # keep only the block's input; re-run the block in backward
    attn.recompute = "selective"    # keep Q, K, V; re-run softmax(QK^T)V in backward
    policies = layer_policies(["full", "none"], n_layers=2)   # one policy per block

Three policies (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models"), per block:

* ``"none"``: autograd keeps what every op saves (the census of chapter 0);
* ``"selective"``: the attention core (scores, softmax, dropout, probs @ V) keeps only its
  inputs Q, K, V; its (a, s, s) softmax output, the only term quadratic in s, is recomputed
  in backward: a few percent more FLOPs for the largest activation;
* ``"full"``: the block keeps only its input (b, s, h); its whole forward runs again in
  backward, collectives included (TP's all-reduces, SP's all-gathers): 1/3 more FLOPs.

A list of policies, one per block, is per-block checkpointing ("full" on every k-th
block: :func:`every`). :func:`recompute` is the mechanism, written out: an autograd
Function whose inputs are the region's tensors AND the parameters it reads, so its
backward hands each parameter its gradient through autograd as any op would (a DDP hook,
a TP weight shared by copies, an FSDP all-gathered view: all see an ordinary gradient).
``torch.utils.checkpoint`` is torch's version of the same idea (chapter 9b compares them).
"""
from __future__ import annotations

import contextlib

import torch

POLICIES = ("none", "selective", "full")


def check_policy(policy):
    """``policy`` if it is one of :data:`POLICIES`, else a ValueError naming it."""
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}: must be one of {POLICIES} "
                         f"(or a list of them, one per block)")
    return policy


def layer_policies(recompute, n_layers: int) -> list[str]:
    """One policy per block: a name for every block, or a list / tuple of ``n_layers`` names."""
    if isinstance(recompute, str):
        return [check_policy(recompute)] * n_layers
    if not isinstance(recompute, (list, tuple)):
        raise ValueError(f"unknown recompute policy {recompute!r}: a name in {POLICIES} or a list of them")
    if len(recompute) != n_layers:
        raise ValueError(f"a recompute policy per block: got {len(recompute)} for {n_layers} blocks")
    return [check_policy(p) for p in recompute]


def every(k: int, n_layers: int, policy: str = "full") -> list[str]:
    """Per-block checkpointing: ``policy`` on blocks 0, k, 2k, ...; "none" on the others."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"every k-th block: k must be a positive int, got {k!r}")
    return [check_policy(policy) if i % k == 0 else "none" for i in range(n_layers)]


def set_recompute(model, recompute, layers=None):
    """Give each block of ``model.blocks`` its policy (``layers``: the single-device layer index
    of each block, for a pipeline stage holding some of them). Returns ``model``."""
    layers = list(range(len(model.blocks))) if layers is None else list(layers)
    n = getattr(getattr(model, "config", None), "n_layers", len(model.blocks))
    policies = layer_policies(recompute, n)
    for block, i in zip(model.blocks, layers):
        block.recompute = policies[i]
        block.attn.recompute = "selective" if policies[i] == "selective" else "none"
    return model


def _param_slots(modules):
    """[(module, name)] of every parameter the modules hold now (an FSDP view included), once."""
    slots, seen = [], set()
    for top in modules:
        for mod in top.modules():
            for name, p in mod._parameters.items():      # frozen ones too: FSDP swaps them all
                if p is not None and (id(mod), name) not in seen:
                    seen.add((id(mod), name))
                    slots.append((mod, name))
    return slots


def _generators(modules):
    """Random streams the region draws from: torch's default one and any dropout's own."""
    gens = [m.generator for top in modules for m in top.modules() if getattr(m, "generator", None) is not None]
    return list({id(g): g for g in gens}.values())


def _draws(modules):
    return any(getattr(m, "p", 0.0) and m.training for top in modules for m in top.modules())


@contextlib.contextmanager
def _swapped(slots, tensors):
    """The parameters in ``slots`` replaced by ``tensors`` while the block runs (restored after)."""
    old = [mod._parameters[name] for mod, name in slots]
    for (mod, name), t in zip(slots, tensors):
        mod._parameters[name] = t
    try:
        yield
    finally:
        for (mod, name), t in zip(slots, old):
            mod._parameters[name] = t


class Recompute(torch.autograd.Function):
    """Forward: run ``fn`` without keeping anything but its inputs. Backward: run it again
    (same random draws), with grad, from detached copies of the inputs and parameters, and
    return their gradients. Inputs: the region's tensors, then the parameters it reads."""

    @staticmethod
    def forward(ctx, fn, slots, n_inputs, rng, *tensors):
        ctx.fn, ctx.slots, ctx.n_inputs, ctx.rng = fn, slots, n_inputs, rng
        ctx.save_for_backward(*tensors)     # the inputs (b, s, h) and the parameters (not activations)
        return fn(*tensors[:n_inputs])      # grad is off here: nothing else is kept

    @staticmethod
    def backward(ctx, grad):
        tensors = ctx.saved_tensors
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        with torch.enable_grad(), _swapped(ctx.slots, leaves[ctx.n_inputs:]), _replay(ctx.rng):
            out = ctx.fn(*leaves[:ctx.n_inputs])
        wants = [t for t in leaves if t.requires_grad]
        if wants:   # into the copies' .grad (autograd.grad would trip torch's module-tracking hooks),
            # and every op of the graph run again: an FSDP unit inside the region (an MoE's experts,
            # gathered by their own hook here) reduce-scatters its gradient from this graph
            torch.autograd.backward(out, grad)
        return (None, None, None, None) + tuple(t.grad if t.requires_grad else None for t in leaves)


def _rng_state(modules):
    """The random state the region starts from, if it draws (dropout in training), else None."""
    if not _draws(modules):
        return None
    return torch.get_rng_state(), [(g, g.get_state()) for g in _generators(modules)]


@contextlib.contextmanager
def _replay(rng):
    """Recompute with the forward's random draws; the streams continue where they were."""
    if rng is None:
        yield
        return
    cpu, gens = rng
    now_cpu, now = torch.get_rng_state(), [(g, g.get_state()) for g, _ in gens]
    torch.set_rng_state(cpu)
    for g, state in gens:
        g.set_state(state)
    try:
        yield
    finally:
        torch.set_rng_state(now_cpu)
        for g, state in now:
            g.set_state(state)


def recompute(fn, inputs, params_of=(), rng_of=None):
    """``fn(*inputs)``, keeping for backward only ``inputs`` and the parameters of the modules
    ``params_of`` (which ``fn`` reads: they get their gradients). ``rng_of``: the modules whose
    dropout must draw the same masks again (default ``params_of``). Grad off: ``fn(*inputs)``."""
    if not torch.is_grad_enabled():
        return fn(*inputs)
    slots = _param_slots(params_of)
    params = [mod._parameters[name] for mod, name in slots]
    rng = _rng_state(params_of if rng_of is None else rng_of)
    return Recompute.apply(fn, slots, len(inputs), rng, *inputs, *params)


__all__ = ["POLICIES", "check_policy", "layer_policies", "every", "set_recompute", "recompute", "Recompute"]
