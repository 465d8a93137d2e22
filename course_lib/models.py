"""Single-device reference models: every parallel implementation is checked against these.

    MLP        a few Linear layers; optional frozen layer, shared (tied) weight and unused
               parameter: the awkward cases data-parallel code must get right
    SmallCNN   8x8 handwritten digits (``course_lib.data.digits``)
    TinyGPT    a decoder-only transformer (defined in ``course_lib.gpt``, re-exported here),
               Llama-style by default or GPT-2-style, in parts every parallelism cuts:
               ``embed`` / ``blocks`` / ``head`` + ``loss``, explicit positions, head
               counts read from the weights, a loss summed over a global token count

Every constructor takes ``seed`` and draws all initial values from its own
``torch.Generator``, in parameter-registration order. Nothing reseeds the global
RNG and no helper reseeds per layer, so two ranks that build the same model with
the same seed hold bit-identical copies, and a shard of a layer is a slice of the
single-device layer (not a re-draw that happens to look the same on every rank).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

# The GPT lives in its own room; the names are re-exported so every import keeps working.
from course_lib.gpt import (Attention, Block, Dropout, GeLUMLP, GPTConfig, RMSNorm, SwiGLU, TinyGPT,
                            apply_rotary, attention_output, attention_scores, causal_attention,
                            check_positions, rotary_rows, rotary_tables)
from course_lib.init import draw_device

# ----------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    """``sizes[0] -> sizes[1] -> ... -> sizes[-1]`` with ReLU between the Linear layers.

    frozen: indexes of layers whose parameters have ``requires_grad=False`` (no
        gradient: must be neither all-reduced nor updated).
    shared: the last layer's weight *is* the first layer's weight (one Parameter
        registered under two names and used twice per forward, like GPT's tied
        embeddings); needs ``sizes[-1] == sizes[1]`` and ``sizes[-2] == sizes[0]``.
    unused: add a parameter that forward never touches (its ``.grad`` stays None).
    """

    def __init__(self, sizes=(16, 32, 32, 8), *, frozen=(), shared=False, unused=False, seed=0):
        super().__init__()
        sizes = tuple(int(s) for s in sizes)
        if len(sizes) < 2 or min(sizes) < 1:
            raise ValueError(f"MLP needs at least two positive sizes, got {sizes}")
        n_layers = len(sizes) - 1
        frozen = tuple(frozen)
        for i in frozen:
            if not 0 <= i < n_layers:
                raise ValueError(f"frozen layer index {i} out of range for {n_layers} layers")
        if shared and (n_layers < 2 or sizes[-1] != sizes[1] or sizes[-2] != sizes[0]):
            raise ValueError(f"shared=True ties layers[-1].weight to layers[0].weight: needs "
                             f"sizes[-1] == sizes[1] and sizes[-2] == sizes[0], got sizes={sizes}")
        self.sizes = sizes
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        if shared:
            self.layers[-1].weight = self.layers[0].weight  # one Parameter, two names
        if unused:
            self.unused = nn.Parameter(torch.zeros(sizes[-1]))
        init_uniform_(self, seed)
        for i in frozen:
            for p in self.layers[i].parameters():
                p.requires_grad_(False)

    def forward(self, x):  # (batch, sizes[0]) -> (batch, sizes[-1])
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


def init_uniform_(module: nn.Module, seed: int) -> nn.Module:
    """torch's default Linear/Conv init (U(-1/sqrt(fan_in), 1/sqrt(fan_in))), drawn from one
    generator in registration order. A shared Parameter is drawn once (named_parameters dedups)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in module.modules():
            if isinstance(mod, (nn.Linear, nn.Conv2d)):
                fan_in = mod.weight[0].numel()
                bound = 1.0 / math.sqrt(fan_in)
                for p in mod.parameters(recurse=False):
                    p.copy_(torch.rand(p.shape, generator=gen, device=draw_device(p)) * 2 * bound - bound)
    return module


# ----------------------------------------------------------------------------- CNN


class SmallCNN(nn.Module):
    """Two 3x3 convolutions and two Linear layers for 8x8 grey digits, 10 classes."""

    def __init__(self, channels=(8, 16), hidden=64, n_classes=10, seed=0):
        super().__init__()
        c1, c2 = channels
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1)   # (b, 1, 8, 8) -> (b, c1, 8, 8)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)  # -> (b, c2, 8, 8), pooled to (b, c2, 4, 4)
        self.fc1 = nn.Linear(c2 * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, n_classes)
        init_uniform_(self, seed)

    def forward(self, x):  # (batch, 1, 8, 8) -> logits (batch, n_classes)
        if x.dim() == 3:
            x = x.unsqueeze(1)
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


# ----------------------------------------------------------------------------- measuring memory


class SavedTensor(NamedTuple):
    saved_by: str        # submodule(s) whose forward saved it, e.g. "attn.wq,attn.wk,attn.wv"
    made_by: str         # autograd node that produced it ("-": a mask or other constant)
    shape: tuple
    dtype: torch.dtype
    nbytes: int          # bytes of the underlying storage, counted once
    refs: int            # how many times autograd saved (a view of) this storage


def saved_activations(module: nn.Module, *inputs):
    """Run ``module(*inputs)`` and list what autograd keeps for backward, one row per storage.

    A ``saved_tensors_hooks`` pack hook sees every tensor an op saves. Many saved
    tensors share a storage (the normed input of W_q, W_k and W_v is one tensor;
    a view shares its base's bytes), so rows are unique storages: the bytes really
    held. The module's own parameters and buffers are not activations and are left out.
    Returns ``(output, rows)``.
    """
    constant = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    where, hooks, rows = [""], [], {}

    def enter(name):
        return lambda mod, args: where.append(name)  # returns None: inputs unchanged

    def leave(mod, args, out):
        where.pop()  # returns None: output unchanged

    for name, sub in module.named_modules():
        hooks.append(sub.register_forward_pre_hook(enter(name)))
        hooks.append(sub.register_forward_hook(leave))

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in constant:
            return t
        if key in rows:
            row = rows[key]
            saved_by = row.saved_by if where[-1] in row.saved_by.split(",") else f"{row.saved_by},{where[-1]}"
            rows[key] = row._replace(refs=row.refs + 1, saved_by=saved_by)
        else:
            made_by = type(t.grad_fn).__name__.replace("Backward0", "") if t.grad_fn is not None else "-"
            rows[key] = SavedTensor(where[-1] or "(top)", made_by, tuple(t.shape), t.dtype, storage.nbytes(), 1)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return out, list(rows.values())


def n_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of distinct parameter elements (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


__all__ = ["MLP", "SmallCNN", "GPTConfig", "TinyGPT", "Block", "Attention", "SwiGLU", "GeLUMLP",
           "RMSNorm", "Dropout", "rotary_tables", "rotary_rows", "apply_rotary", "check_positions",
           "attention_scores", "attention_output", "causal_attention", "init_uniform_", "n_params", "SavedTensor", "saved_activations"]
