"""TinyGPT: a decoder-only transformer in parts that every parallelism can cut.

    model = TinyGPT(GPTConfig(), seed=0)
    logits, loss = model(idx, targets)                       # the whole model, as nanoGPT
    x = model.embed(idx, positions)                          # (b, s) -> (b, s, h): first stage
    for block in model.blocks:
        x = block(x, positions)                              # (b, s, h) -> (b, s, h)
    loss = model.loss(model.head(x), targets, n_tokens)      # last stage

Llama-style by default (RMSNorm, rotary positions, causal attention with grouped KV heads,
SwiGLU MLP) or a GPT-2-style block (LayerNorm, learned positions, GeLU 4h MLP, dropout)
for the activation-memory lesson. The shapes the parallel dimensions cut it into:

* pipeline: ``embed`` / ``blocks`` (an ``nn.ModuleList``) / ``head`` + ``loss`` run separately;
* tensor: :class:`Attention` reads its head counts from its weights, so a copy whose
  W_q, W_k, W_v rows and W_o columns were sliced to a subset of heads computes those
  heads' share of the output (the shares sum to the full output);
* context: ``positions`` are the absolute positions of the local tokens (int64, (s,);
  None = 0..s-1): rotary angles and the causal mask ``q_pos >= k_pos`` follow them, and
  :func:`course_lib.attention.causal_attention` takes keys and values from another shard
  with their own positions;
* packed documents: ``doc_ids`` gives each token of the WHOLE sequence its document (a
  context-parallel rank gets the whole sequence's ids, as every rank gets FlashAttention's
  cu_seqlens): attention never crosses a document; everything else is per token;
* loss: a SUM over the local tokens divided by ``n_tokens``, the GLOBAL token count, so the
  losses of all shards (vocabulary, sequence, micro-batch) add up to the global mean.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.attention import (apply_rotary, attention_output, attention_scores, causal_attention,
                                  check_doc_ids, check_positions, document_mask, rotary_rows, rotary_tables)
from course_lib.init import draw_device
from course_lib.recompute import layer_policies, recompute, set_recompute


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
    n_experts: int = 0           # > 0: every block's MLP is a mixture of experts (course_lib.moe)
    top_k: int = 1               # experts per token
    capacity_factor: float | None = 1.25   # None: dropless (every assignment served)
    moe_aux_coef: float = 0.01   # weight of the load-balancing loss (Switch's alpha)
    moe_dispatch: str = "all_to_all"   # how expert parallelism moves tokens: "all_to_all" / "all_gather"
    n_shared_experts: int = 0    # DeepSeekMoE's always-on experts, beside the routed ones
    expert_mlp: str = "gelu"     # each expert's MLP: "gelu" (with biases) or "swiglu" (Mixtral's)
    recompute: object = "none"   # "none", "selective", "full", or one per block (course_lib.recompute)

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
        if self.n_experts:
            from course_lib.moe import check_moe_config
            check_moe_config(self.n_experts, self.top_k, self.capacity_factor)
            if self.moe_dispatch not in ("all_to_all", "all_gather"):
                raise ValueError(f"moe_dispatch must be 'all_to_all' or 'all_gather', got {self.moe_dispatch!r}")
            if self.expert_mlp not in ("gelu", "swiglu"):
                raise ValueError(f"expert_mlp must be 'gelu' or 'swiglu', got {self.expert_mlp!r}")
        if not isinstance(self.recompute, str):
            self.recompute = tuple(self.recompute)
        layer_policies(self.recompute, self.n_layers)   # ValueError naming an unknown policy
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise TypeError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
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


class Attention(nn.Module):
    """Causal self-attention, written out (no fused kernel) so each saved tensor is visible.

    Grouped-query attention: ``n_kv_heads`` key/value heads, each shared by
    ``n_heads / n_kv_heads`` query heads. The head counts are read from the weights
    (``wq`` has ``n_heads * head_dim`` rows), so a tensor-parallel copy holding a slice of
    the heads runs its own heads, and ``wo`` (columns sliced alike) gives its share.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim, self.max_len = cfg.head_dim, cfg.seq_len
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

    @property
    def n_heads(self) -> int:  # local query heads: all of them, or this tensor-parallel rank's
        return self.wq.weight.shape[0] // self.head_dim

    @property
    def n_kv_heads(self) -> int:
        return self.wk.weight.shape[0] // self.head_dim

    recompute = "none"   # "selective": the core keeps Q, K, V only, re-run in backward

    def attend(self, q, k, v, q_pos=None, k_pos=None, future=None):  # (b, a, s, d) -> (b, a, s, d)
        """The attention core, softmax(q k^T / sqrt(d)) v, recomputed in backward if selective."""
        def core(q, k, v):
            return causal_attention(q, k, v, q_pos, k_pos, self.attn_dropout, future)
        if self.recompute == "selective":
            return recompute(core, (q, k, v), rng_of=(self.attn_dropout,))
        return core(q, k, v)

    def project(self, x):  # (b, s, h) -> Q (b, s, a d), K and V (b, s, kv d)
        """The three projections, three GEMMs (Megatron-LM runs one: virtual.software's fused_qkv)."""
        return self.wq(x), self.wk(x), self.wv(x)

    def forward(self, x, positions=None, doc_ids=None):  # (b, s, h) -> (b, s, h); positions (s,)
        b, s, _ = x.shape
        d = self.head_dim
        positions = check_positions(positions, s, self.max_len)
        q, k, v = self.project(x)
        q = q.view(b, s, -1, d).transpose(1, 2)            # (b, a, s, d): a local query heads
        k = k.view(b, s, -1, d).transpose(1, 2)            # (b, kv, s, d)
        v = v.view(b, s, -1, d).transpose(1, 2)            # (b, kv, s, d)
        if self.rotary:
            cos, sin = rotary_rows(self.cos, self.sin, positions, s)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        future = self.future_mask[:s, :s] if positions is None else None  # else built from positions
        if doc_ids is not None:                            # packed: no attention across documents
            pos = torch.arange(s, device=x.device) if positions is None else positions
            future = document_mask(pos, pos, doc_ids)      # (s, s), or (b, 1, s, s) a packing per row
        y = self.attend(q, k, v, positions, positions, future)  # (b, a, s, d)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))  # (b, s, a * d) -> (b, s, h)


# ----------------------------------------------------------------------------- MLP, block, model


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


class AddAuxLoss(torch.autograd.Function):
    """Returns ``y`` unchanged; in backward, ``aux`` receives the gradient ``scale``: the
    load-balancing loss joins the gradients without joining the loss value, wherever the
    layer sits (a pipeline stage far from the loss included). Megatron-LM's
    MoEAuxLossAutoScaler."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g, g.new_full(ctx.aux_shape, ctx.scale), None


class MoEMLP(nn.Module):
    """The MLP of a mixture-of-experts block: (b, s, h) -> T = b*s tokens -> MoE -> (b, s, h).

    ``groups``: routing groups of this call (capacity and load balance per group, GShard);
    ``aux_weight``: this call's share of the step's tokens. The gradient of the step's
    load-balancing loss, ``moe_aux_coef * sum over calls of aux_weight * aux``, is added in
    backward (:class:`AddAuxLoss`). A single device that stands for dp ranks with m
    micro-batches each routes in ``groups = dp * m`` groups with weight 1; each rank routes its
    own tokens (groups 1) with weight 1 / (dp * m): the same loss, the same gradients.
    ``moe`` may be replaced by an ``ExpertParallelMoE`` built from it (``forward(x) -> y, aux``).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        from course_lib.moe import MoE
        self.moe = MoE(cfg.hidden, cfg.ffn_hidden, cfg.n_experts, cfg.top_k, cfg.capacity_factor,
                       n_shared=cfg.n_shared_experts, mlp=cfg.expert_mlp)
        self.aux_coef, self.groups, self.aux_weight = cfg.moe_aux_coef, 1, 1.0
        self.last_aux = None

    def forward(self, x):  # (b, s, h) -> (b, s, h)
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)                              # (T, h)
        y, aux = self.moe(tokens, groups=self.groups) if self.groups != 1 else self.moe(tokens)
        self.last_aux = aux.detach()
        if self.aux_coef and torch.is_grad_enabled():
            y = AddAuxLoss.apply(y, aux, self.aux_coef * self.aux_weight)
        return y.view(b, s, h)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.block == "llama":
            self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
            self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
            self.mlp = SwiGLU(cfg) if not cfg.n_experts else MoEMLP(cfg)
        else:
            self.attn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
            self.mlp_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
            self.mlp = GeLUMLP(cfg) if not cfg.n_experts else MoEMLP(cfg)
        self.attn = Attention(cfg)
        self.attn_out_dropout = Dropout(cfg.dropout)
        self.mlp_out_dropout = Dropout(cfg.dropout)

    recompute = "none"   # "full": keep only x, re-run the block in backward (course_lib.recompute)

    def forward(self, x, positions=None, doc_ids=None):  # (b, s, h) -> (b, s, h)
        if self.recompute == "full":
            return recompute(lambda x: self.layer(x, positions, doc_ids), (x,), params_of=(self,))
        return self.layer(x, positions, doc_ids)

    def layer(self, x, positions=None, doc_ids=None):  # the block's arithmetic
        # doc_ids by keyword: torch's PrepareModuleInput lays out the positional inputs only
        x = x + self.attn_out_dropout(self.attn(self.attn_norm(x), positions, doc_ids=doc_ids))
        return x + self.mlp_out_dropout(self.mlp(self.mlp_norm(x)))


class TinyGPT(nn.Module):
    """tokens (b, s) -> logits (b, s, vocab); ``forward(idx, targets)`` returns (logits, loss).

    Parts, in order: ``tok_emb`` (+ ``pos_emb`` for GPT-2), ``blocks`` (ModuleList of
    :class:`Block`), ``norm``, ``lm_head``; run them one by one with :meth:`embed`, each
    block, :meth:`head` and :meth:`loss`. Initialisation (GPT-2's): N(0, 0.02) for
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
        set_recompute(self, cfg.recompute)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int = 0):
        """Every weight drawn from one CPU generator in registration order: the same values on
        any device (a model built on a GPU equals one built on the CPU), shapes only on meta."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():  # registration order; a tied weight once
            if name.endswith("bias"):
                p.zero_()
            elif isinstance(self.get_submodule(name.rsplit(".", 1)[0]), (RMSNorm, nn.LayerNorm)):
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith(("wo.weight", "w2.weight", "proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen, device=draw_device(p)) * std)
        return self

    def embed(self, idx, positions=None):  # idx (b, s) int64 -> (b, s, h)
        s = idx.shape[1]
        positions = check_positions(positions, s, self.config.seq_len)
        x = self.tok_emb(idx)                                   # (b, s, h)
        if self.config.block == "gpt2":
            x = x + self.pos_emb(torch.arange(s, device=idx.device) if positions is None else positions)
        return self.emb_dropout(x)

    def head(self, x):  # (b, s, h) -> logits (b, s, vocab)
        return self.lm_head(self.norm(x))

    def loss(self, logits, targets, n_tokens=None):
        """Cross entropy SUMMED over the local tokens and divided by ``n_tokens``, the number
        of tokens in the GLOBAL batch (every shard passes the same count, so the shards'
        losses add up to the global mean). None: the local count of targets that are not
        ignored (-100), i.e. the plain mean."""
        if targets.shape != logits.shape[:-1]:
            raise ValueError(f"targets must have the shape of logits without the vocabulary axis, "
                             f"{tuple(logits.shape[:-1])}, got {tuple(targets.shape)}")
        if logits.dtype != torch.float64:       # 16-bit logits: the softmax in fp32; fp64 stays fp64
            logits = logits.float()
        logits, targets = logits.flatten(0, 1), targets.flatten()   # (b*s, vocab), (b*s,)
        if n_tokens is None:
            return F.cross_entropy(logits, targets)
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, float, torch.Tensor)) or \
                (isinstance(n_tokens, torch.Tensor) and n_tokens.numel() != 1) or n_tokens < 1:
            raise ValueError(f"n_tokens (the global token count) must be a number >= 1, got {n_tokens!r}")
        return F.cross_entropy(logits, targets, reduction="sum") / n_tokens

    def forward(self, idx, targets=None, *, positions=None, n_tokens=None, doc_ids=None):  # idx (b, s)
        """``doc_ids``: a document id per token of the whole sequence ((s,), or (b, s) a packing
        per row; each document one contiguous run): attention stays inside each document."""
        doc_ids = check_doc_ids(doc_ids, self.config.seq_len)
        if doc_ids is not None and positions is None and doc_ids.shape[-1] != idx.shape[1]:
            raise ValueError(f"doc_ids covers {doc_ids.shape[-1]} tokens, idx {idx.shape[1]}: one id per token")
        x = self.embed(idx, positions)                          # (b, s, h)
        for block in self.blocks:
            x = block(x, positions, doc_ids)                    # (b, s, h)
        logits = self.head(x)                                   # (b, s, vocab)
        loss = None if targets is None else self.loss(logits, targets, n_tokens)
        return logits, loss


__all__ = ["GPTConfig", "TinyGPT", "Block", "Attention", "SwiGLU", "GeLUMLP", "RMSNorm", "Dropout",
           "MoEMLP", "AddAuxLoss", "check_positions", "rotary_tables", "rotary_rows", "apply_rotary", "attention_scores",
           "attention_output", "causal_attention"]
