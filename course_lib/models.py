"""Single-device reference models: every parallel implementation is checked against these.

    MLP        a few Linear layers; optional frozen layer, shared (tied) weight and unused
               parameter: the awkward cases data-parallel code must get right
    SmallCNN   8x8 handwritten digits (``course_lib.data.digits``)
    TinyGPT    a decoder-only transformer, Llama-style by default (RMSNorm, rotary
               positions, causal attention with grouped KV heads, SwiGLU MLP), or a
               GPT-2-style block (LayerNorm, learned positions, GeLU 4h MLP, dropout)
               for the activation-memory lesson; ``.blocks`` is an ``nn.ModuleList``
               so FSDP / pipeline code can wrap or cut per block

Every constructor takes ``seed`` and draws all initial values from its own
``torch.Generator``, in parameter-registration order. Nothing reseeds the global
RNG and no helper reseeds per layer, so two ranks that build the same model with
the same seed hold bit-identical copies, and a shard of a layer is a slice of the
single-device layer (not a re-draw that happens to look the same on every rank).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

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
                    p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)
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


# ----------------------------------------------------------------------------- GPT


@dataclass
class GPTConfig:
    vocab_size: int = 256        # bytes
    seq_len: int = 64            # longest sequence (rotary / position table size)
    n_layers: int = 4
    hidden: int = 64             # h
    n_heads: int = 4             # a; head_dim = hidden / n_heads
    n_kv_heads: int | None = None  # grouped-query attention; None = n_heads (plain multi-head)
    ffn_hidden: int | None = None  # None: SwiGLU 8h/3 rounded up to multiple_of; GPT-2 4h
    multiple_of: int = 16
    block: str = "llama"         # "llama" or "gpt2"
    dropout: float = 0.0         # GPT-2 style only (Llama trains without dropout)
    tie_embeddings: bool = False  # lm_head.weight is tok_emb.weight
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.block not in ("llama", "gpt2"):
            raise ValueError(f"block must be 'llama' or 'gpt2', got {self.block!r}")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("vocab_size", "seq_len", "n_layers", "hidden", "n_heads", "n_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.n_heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.block == "llama" and (self.hidden // self.n_heads) % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.hidden // self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.ffn_hidden is None:
            if self.block == "gpt2":
                self.ffn_hidden = 4 * self.hidden
            else:  # Llama: 2/3 of 4h (three matrices instead of two), rounded up
                f = int(2 * 4 * self.hidden / 3)
                self.ffn_hidden = self.multiple_of * math.ceil(f / self.multiple_of)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


class RMSNorm(nn.Module):
    """x / rms(x) * weight (no mean subtraction, no bias). Written in plain ops, so autograd
    keeps both x and x / rms(x): a fused kernel would keep x and 1/rms only."""

    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (..., dim)
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., 1)
        return (x * rstd) * self.weight


class Dropout(nn.Module):
    """nn.Dropout, except the saved mask is 1 byte per element on every device.

    CUDA's fused dropout keeps a bool mask; on CPU ``F.dropout`` keeps a mask in the
    activation's dtype. ``torch.native_dropout`` keeps the bool mask everywhere, so the
    activation bytes counted here are the ones a GPU would hold.
    """

    def __init__(self, p=0.0):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        return torch.native_dropout(x, self.p, True)[0]


def rotary_tables(seq_len, head_dim, theta=10000.0):
    """cos, sin of shape (seq_len, head_dim): position t rotates pair (i, i + d/2) by t * theta^(-2i/d)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (d/2,)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)           # (s, d/2)
    angles = torch.cat([angles, angles], dim=-1)                                          # (s, d)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x, cos, sin):  # x (b, heads, s, d); cos, sin (s, d)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # the pair (x1, x2) turned by 90 degrees
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal self-attention, written out (no fused kernel) so each saved tensor is visible.

    Grouped-query attention: ``n_kv_heads`` key/value heads, each shared by
    ``n_heads / n_kv_heads`` query heads. Queries of one group are stacked along the
    sequence axis, so K and V are used (and saved for backward) at their own small size.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        bias = cfg.block == "gpt2"
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)
        self.wk = nn.Linear(cfg.hidden, kv_dim, bias=bias)
        self.wv = nn.Linear(cfg.hidden, kv_dim, bias=bias)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)
        self.attn_dropout = Dropout(cfg.dropout)
        self.rotary = cfg.block == "llama"
        if self.rotary:
            cos, sin = rotary_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        future = torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).triu(1)  # True above the diagonal
        self.register_buffer("future_mask", future, persistent=False)

    def forward(self, x):  # (b, s, h) -> (b, s, h)
        b, s, h = x.shape
        a, kv, d = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.wq(x).view(b, s, a, d).transpose(1, 2)   # (b, a, s, d)
        k = self.wk(x).view(b, s, kv, d).transpose(1, 2)  # (b, kv, s, d)
        v = self.wv(x).view(b, s, kv, d).transpose(1, 2)  # (b, kv, s, d)
        if self.rotary:
            q = apply_rotary(q, self.cos[:s], self.sin[:s])
            k = apply_rotary(k, self.cos[:s], self.sin[:s])
        q = q.reshape(b, kv, (a // kv) * s, d)             # (b, kv, group * s, d): a group's queries
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))  # (b, kv, group * s, s)
        scores = scores.view(b, a, s, s).masked_fill(self.future_mask[:s, :s], float("-inf"))
        att = self.attn_dropout(F.softmax(scores, dim=-1))  # (b, a, s, s)
        y = att.view(b, kv, (a // kv) * s, s) @ v           # (b, kv, group * s, d)
        y = y.view(b, a, s, d).transpose(1, 2).reshape(b, s, h)
        return self.wo(y)


class SwiGLU(nn.Module):
    """Llama MLP: w2(silu(w1 x) * w3 x), three (h x f) matrices."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x):  # (b, s, h) -> (b, s, f) -> (b, s, h)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeLUMLP(nn.Module):
    """GPT-2 MLP: proj(gelu(fc x)), h -> 4h -> h, with biases."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_hidden)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.hidden)

    def forward(self, x):  # (b, s, h) -> (b, s, 4h) -> (b, s, h)
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.block == "llama":
            self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
            self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
            self.mlp = SwiGLU(cfg)
        else:
            self.attn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
            self.mlp_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
            self.mlp = GeLUMLP(cfg)
        self.attn = Attention(cfg)
        self.attn_out_dropout = Dropout(cfg.dropout)
        self.mlp_out_dropout = Dropout(cfg.dropout)

    def forward(self, x):  # (b, s, h) -> (b, s, h)
        x = x + self.attn_out_dropout(self.attn(self.attn_norm(x)))
        return x + self.mlp_out_dropout(self.mlp(self.mlp_norm(x)))


class TinyGPT(nn.Module):
    """tokens (b, s) -> logits (b, s, vocab); ``forward(idx, targets)`` returns (logits, loss).

    Parts, in order: ``tok_emb`` (+ ``pos_emb`` for GPT-2), ``blocks`` (ModuleList of
    :class:`Block`), ``norm``, ``lm_head``. Initialisation (GPT-2's): N(0, 0.02) for
    matrices and embeddings, N(0, 0.02 / sqrt(2 n_layers)) for the two projections that
    write into the residual stream, zeros for biases, ones for norm weights.
    """

    def __init__(self, cfg: GPTConfig | None = None, seed: int = 0):
        super().__init__()
        cfg = GPTConfig() if cfg is None else cfg
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
        if cfg.block == "gpt2":
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.emb_dropout = Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps) if cfg.block == "llama" else nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight  # one Parameter, two names
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():  # registration order; a tied weight once
            if name.endswith("bias"):
                p.zero_()
            elif isinstance(self.get_submodule(name.rsplit(".", 1)[0]), (RMSNorm, nn.LayerNorm)):
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith(("wo.weight", "w2.weight", "proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    def forward(self, idx, targets=None):  # idx (b, s) int64
        b, s = idx.shape
        if s > self.config.seq_len:
            raise ValueError(f"sequence length {s} exceeds config.seq_len={self.config.seq_len}")
        x = self.tok_emb(idx)                                   # (b, s, h)
        if self.config.block == "gpt2":
            x = x + self.pos_emb(torch.arange(s, device=idx.device))
        x = self.emb_dropout(x)
        for block in self.blocks:
            x = block(x)                                        # (b, s, h)
        logits = self.lm_head(self.norm(x))                     # (b, s, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        return logits, loss


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
           "RMSNorm", "Dropout", "rotary_tables", "apply_rotary", "init_uniform_", "n_params",
           "SavedTensor", "saved_activations"]
