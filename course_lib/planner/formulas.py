"""The planner's formulas: one small function per formula, each citing its source.

The planner (``estimate``), the simulator, the notebooks and the tests all call
these functions, so a number in the book has one definition. Bytes are bytes
(GB = 1e9 bytes, GiB = 2**30), FLOPs count a multiply-add as 2.

Notation (Korthikanti et al. 2022): s sequence length, b micro-batch size,
h hidden size, a attention heads, L layers, V vocabulary, t tensor-parallel size,
p pipeline stages, m micro-batches, v model chunks per stage (interleaving),
N (or G) ranks in a collective.
"""
from __future__ import annotations

from course_lib import costmodel

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved")

# Accepted spellings of the config fields, so a nanoGPT-, Hugging Face- or
# course_lib.models-style config all work: first name found wins.
_ALIASES = {
    "n_layers": ("n_layers", "n_layer", "num_layers", "num_hidden_layers", "layers"),
    "hidden": ("hidden", "d_model", "n_embd", "dim", "hidden_size"),
    "n_heads": ("n_heads", "n_head", "num_heads", "num_attention_heads", "heads"),
    "n_kv_heads": ("n_kv_heads", "n_kv_head", "num_kv_heads", "num_key_value_heads", "kv_heads"),
    "ffn": ("ffn", "ffn_hidden", "d_ff", "ffn_dim", "intermediate_size", "hidden_dim", "mlp_hidden"),
    "vocab": ("vocab", "vocab_size", "n_vocab"),
    "mlp": ("mlp", "mlp_type", "activation"),
    "tied": ("tied", "tie_embeddings", "tie_word_embeddings", "tied_embeddings"),
    "bias": ("bias", "use_bias"),
    "norm": ("norm", "norm_type"),
    "learned_pos": ("learned_pos", "max_pos", "block_size_pos"),
    "n_experts": ("n_experts", "num_experts", "num_local_experts"),
    "top_k": ("top_k", "num_experts_per_tok", "experts_per_token"),
}
_DEFAULTS = {"n_kv_heads": None, "ffn": None, "mlp": "swiglu", "tied": False, "bias": False,
             "norm": "rmsnorm", "learned_pos": 0, "n_experts": 1, "top_k": 1}


def model_dims(cfg=None, **override) -> dict:
    """Read a model config (any object with attributes, a dict, or keywords) into plain ints.

    Missing optional fields take Llama defaults: n_kv_heads = n_heads (no GQA),
    ffn = 4h, SwiGLU, RMSNorm, no biases, untied head, rotary positions; a config
    with ``block="gpt2"`` (course_lib.models.GPTConfig) defaults to GPT-2's GeLU MLP,
    biases, LayerNorm and learned positions (``seq_len`` of them).
    """
    src = dict(cfg) if isinstance(cfg, dict) else {}

    def lookup(name):
        if name in override:
            return override[name]
        if name in src:
            return src[name]
        return getattr(cfg, name, None) if cfg is not None and not isinstance(cfg, dict) else None

    defaults = dict(_DEFAULTS)
    if str(lookup("block") or "").lower() in ("gpt2", "gpt"):
        # course_lib.models' GPT-2 block: GeLU MLP, biases, LayerNorm, learned positions
        defaults.update(mlp="gelu", bias=True, norm="layernorm", learned_pos=lookup("seq_len") or 0)
    out = {}
    for key, names in _ALIASES.items():
        val = None
        for n in names:
            val = lookup(n)
            if val is not None:
                break
        if val is None:
            if key not in defaults:
                raise ValueError(f"model config needs {key!r} (any of {names})")
            val = defaults[key]
        out[key] = val
    if out["n_kv_heads"] is None:
        out["n_kv_heads"] = out["n_heads"]
    mlp = str(out["mlp"]).lower()
    out["mlp"] = "swiglu" if mlp in ("swiglu", "silu", "swish") else "gelu" if mlp in ("gelu", "relu") else mlp
    if out["mlp"] not in ("swiglu", "gelu"):
        raise ValueError(f"mlp must be 'swiglu' or 'gelu', got {mlp!r}")
    if out["ffn"] is None:
        out["ffn"] = 4 * out["hidden"]
    for k in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn", "vocab", "n_experts", "top_k"):
        if int(out[k]) != out[k] or out[k] < 1:
            raise ValueError(f"model config {k} must be a positive integer, got {out[k]!r}")
        out[k] = int(out[k])
    if out["hidden"] % out["n_heads"]:
        raise ValueError(f"hidden ({out['hidden']}) must be divisible by n_heads ({out['n_heads']})")
    if out["n_heads"] % out["n_kv_heads"]:
        raise ValueError(f"n_heads ({out['n_heads']}) must be divisible by n_kv_heads ({out['n_kv_heads']})")
    out["learned_pos"] = int(out["learned_pos"] or 0)
    return out


def param_breakdown(cfg=None, **override) -> dict:
    """Parameters of a decoder-only transformer (GPT / Llama), by part.

    Per layer: attention W_q, W_o (h x h each) and W_k, W_v (h x n_kv_heads*d_head
    each: grouped-query attention, Ainslie et al. 2023); MLP with 3 matrices
    h x ffn (SwiGLU, Shazeer 2020; Llama, Touvron et al. 2023) or 2 (GeLU, GPT);
    two norms (RMSNorm: h weights; LayerNorm: h weights + h biases). Plus token
    embeddings V x h, optional learned positions, a final norm and the LM head
    (V x h, absent when tied to the embeddings). A mixture-of-experts model has
    ``n_experts`` MLPs per layer and a router (h x n_experts).
    """
    d = model_dims(cfg, **override)
    L, h, a, kv, f, V = d["n_layers"], d["hidden"], d["n_heads"], d["n_kv_heads"], d["ffn"], d["vocab"]
    kv_dim = kv * (h // a)                          # width of K (and of V) under GQA
    attn = 2 * h * h + 2 * h * kv_dim + (2 * h + 2 * kv_dim if d["bias"] else 0)
    n_mat = 3 if d["mlp"] == "swiglu" else 2
    mlp_one = n_mat * h * f + ((f * (n_mat - 1) + h) if d["bias"] else 0)
    experts = d["n_experts"]
    mlp = experts * mlp_one + (h * experts if experts > 1 else 0)
    norm_size = 2 * h if d["norm"] == "layernorm" else h
    per_layer = attn + mlp + 2 * norm_size
    return {
        "embedding": V * h + d["learned_pos"] * h,
        "attention": L * attn,
        "mlp": L * mlp,
        "norms": L * 2 * norm_size + norm_size,
        "lm_head": 0 if d["tied"] else V * h,
        "per_layer": per_layer,
        "mlp_one_expert": mlp_one,
    }


def param_count(cfg=None, **override) -> int:
    """Total parameter count of a decoder-only transformer (see :func:`param_breakdown`).

    ``param_count(cfg)`` takes a config object (course_lib.models, nanoGPT, Hugging
    Face spellings) or plain keywords: ``param_count(n_layers=32, hidden=4096,
    n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256)`` is Llama 3 8B: 8,030,261,248.
    """
    p = param_breakdown(cfg, **override)
    return p["embedding"] + p["attention"] + p["mlp"] + p["norms"] + p["lm_head"]


def training_flops(n_params: float, tokens: float) -> float:
    """C = 6 N D: forward 2 FLOPs per parameter per token, backward 4 (Kaplan et al.
    2020, Sec. 2.1; Hoffmann et al. 2022). Ignores attention; see :func:`flops_per_token`."""
    return 6.0 * n_params * tokens


def layer_flops_per_token(cfg=None, seq_len: int = 2048, recompute: str = "none", **override):
    """(forward, backward) matmul FLOPs of ONE transformer layer per token.

    Forward: 2 per matmul weight (attention projections, MLP, router; top_k experts
    of a mixture) plus attention itself, QK^T and AV: 4 s h_attn (the causal mask is
    not subtracted, as in PaLM, Chowdhery et al. 2022, App. B). Backward: twice the
    forward (a gradient for the input and one for the weight), plus what
    recomputation re-runs first: ``"selective"`` the attention core forward
    (+4 s h_attn, Korthikanti et al. 2022, Sec. 5), ``"full"`` the whole forward.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    d = model_dims(cfg, **override)
    h = d["hidden"]
    attn_w = 2 * h * h + 2 * h * d["n_kv_heads"] * (h // d["n_heads"])
    mlp_w = d["top_k"] * (3 if d["mlp"] == "swiglu" else 2) * h * d["ffn"] + \
        (h * d["n_experts"] if d["n_experts"] > 1 else 0)
    core = 4.0 * seq_len * h                        # QK^T + AV forward, per token
    forward = 2.0 * (attn_w + mlp_w) + core
    backward = 2.0 * forward
    if recompute == "selective":
        backward += core
    elif recompute == "full":
        backward += forward
    return forward, backward


def head_flops_per_token(cfg=None, **override):
    """(forward, backward) FLOPs of the LM head per token: 2 V h and 4 V h. It is a
    matmul even when tied to the embeddings, and recomputation leaves it alone."""
    d = model_dims(cfg, **override)
    return 2.0 * d["vocab"] * d["hidden"], 4.0 * d["vocab"] * d["hidden"]


def flops_per_token(cfg=None, seq_len: int = 2048, recompute: str = "none", **override) -> float:
    """FLOPs of one training step per token (forward + backward), all layers and the head.

    Model FLOPs (``recompute="none"``): 6 N_mm + 12 L s h_attn, where N_mm are the
    matmul weights (every linear layer and the LM head; not the embedding lookup,
    norms or biases) and 12 L s h_attn is attention itself. For GPT-3 shapes this is
    Narayanan et al. 2021's 72 B s L h^2 (1 + s/6h + V/12hL) divided by B s.

    Hardware FLOPs add what recomputation runs again (:func:`layer_flops_per_token`):
    with ``"full"`` it is 96 B s L h^2 (1 + s/6h + V/16hL) / (B s) (Korthikanti et al.
    2022, App. A). Korthikanti's HFU for selective recomputation counts
    1 + s/3h, the whole attention term twice; we count the matmuls re-run (4 s h).
    """
    d = model_dims(cfg, **override)
    lf, lb = layer_flops_per_token(d, seq_len, recompute)
    hf, hb = head_flops_per_token(d)
    return d["n_layers"] * (lf + lb) + hf + hb


def activation_bytes_per_layer(s, b, h, a, t=1, sp=False, recompute="none", cp=1, value_bytes=2) -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al.
    2022, Sec. 4, 16-bit activations, GPT-3 block with dropout):

    - no parallelism:      s b h (34 + 5 a s / h)
    - tensor parallel t:   s b h (10 + 24/t + 5 a s / (h t))
    - TP + sequence par.:  s b h (34/t + 5 a s / (h t))
    - selective recompute: the 5 a s / h term (softmax, its dropout, the scores) is
      recomputed, so it drops out
    - full recompute:      only the layer input, 2 s b h (2 s b h / t with SP)

    Of the 34: 32 are 2-byte values (2 norm inputs, QKV input, Q, K, V, attention
    projection input, MLP input, GeLU input and output: 4h wide) and 2 are 1-byte
    dropout masks; of the 5: the softmax output and its dropout (2 bytes each) and the
    mask (1). ``value_bytes=4`` counts fp32 values (masks stay 1 byte). Context
    parallelism ``cp`` splits the sequence: each rank keeps s/cp tokens, and its
    attention scores are (s/cp) x s, so every term divides by cp.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if t < 1 or cp < 1:
        raise ValueError(f"t and cp must be >= 1, got t={t}, cp={cp}")
    w = value_bytes / 2.0                           # bytes of a value relative to 16 bits
    sbh = s * b * h / cp
    if recompute == "full":
        return 2.0 * w * sbh / (t if sp else 1)
    scores = 0.0 if recompute == "selective" else (4.0 * w + 1.0) * a * s / (h * t)
    # values replicated across TP ranks without SP: 2 norm inputs, QKV and MLP inputs (8);
    # split across them: Q, K, V, projection input, GeLU input and output (24); masks (2)
    linear = (32.0 * w + 2.0) / t if sp else 8.0 * w + 2.0 + 24.0 * w / t
    return sbh * (linear + scores)


def llama_activation_bytes_per_layer(s, b, h, a, kv_heads, ffn, t=1, sp=False, recompute="none", cp=1,
                                     value_bytes=2, rstd=True) -> float:
    """Activation bytes one Llama-style layer keeps for backward: course_lib.models' block
    (RMSNorm in plain ops, rotary Q and K, grouped-query attention with ``kv_heads`` K/V
    heads, SwiGLU of width f = ``ffn``; no dropout, no biases). 16-bit values:

    - no parallelism:      s b h (16 + 4 kv/a + 8 f/h + 2 a s/h) + 4 b s
    - tensor parallel t:   s b h (12 + 4/t + 4 kv_t/a + 8 f/(h t) + 2 a s/(h t)) + 4 b s
    - TP + sequence par.:  s b h (16/t + 4 kv_t/a + 8 f/(h t) + 2 a s/(h t)) + 4 b s / t,
      which is the first line / t when t <= kv
    - selective recompute: the 2 a s/h term (the softmax output) drops out
    - full recompute:      only the layer input, 2 s b h (2 s b h / t with SP)

    kv_t = max(kv/t, 1) K/V heads per TP rank (when t > kv each rank keeps a copy of
    the one K/V head its queries use). The terms, one saved tensor each (the census in
    notebooks/00_single_device.ipynb, checked against ``models.saved_activations``):

    - each of the 2 RMSNorms: its input x and x * rstd (for the weight's gradient),
      4 s b h, and rstd itself, (b, s, 1): 2 b s. The 4 b s is in the activations'
      dtype here (``rstd=False`` leaves it out);
    - attention: the input of W_q, W_k, W_v (one tensor) 2 s b h; Q after rotary 2 s b h;
      K after rotary and V, 2 s b h kv/a each; the softmax output, used by the softmax's
      backward and by att @ V, 2 a s^2 b; the input of W_o 2 s b h;
    - MLP: the input of w1 and w3 (one tensor) 2 s b h; w1 x, w3 x, silu(w1 x) and
      their product (w2's input), 2 s b f each.

    Sum: 16 s b h + 4 s b h kv/a + 8 s b f + 2 a s^2 b + 4 b s, against the GPT-3
    block's 34 s b h + 5 a s^2 b (:func:`activation_bytes_per_layer`): no dropout masks
    or dropout output, two tensors per norm, K and V shrunk by kv/a, the MLP four f-wide
    tensors. ``value_bytes=4``: fp32 (every tensor, there are no masks).

    Parallel variants, derived by Korthikanti et al. 2022's rule (Sec. 4.2) and counted on
    course_lib's tensor-parallel Llama block (tests/test_tensor_parallel.py): TP splits what
    has a head or an f axis (Q, K, V, scores, W_o's input, the MLP's f-wide tensors)
    and replicates the norms' tensors and the column-parallel inputs; SP splits those
    along the sequence, keeping the column-parallel inputs as their s/t shard (all-
    gathered again in backward). Selective recomputation re-runs the attention core
    from the Q, K, V it keeps; full keeps only the layer input. Context parallelism
    ``cp``: every term divides by cp, as in :func:`activation_bytes_per_layer`.

    Not derived: fused kernels, which keep less (a fused RMSNorm keeps x and rstd;
    FlashAttention no s x s matrix but its output and an fp32 log-sum-exp per row and
    head; a fused SwiGLU w1 x and w3 x only); mixture-of-experts MLPs (top_k of them
    per token, plus the router); the embedding, final norm, logits and loss.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if t < 1 or cp < 1:
        raise ValueError(f"t and cp must be >= 1, got t={t}, cp={cp}")
    if h % a or a % kv_heads:
        raise ValueError(f"need a | h and kv_heads | a, got h={h}, a={a}, kv_heads={kv_heads}")
    w = float(value_bytes)
    tok = s * b / cp                                # tokens this rank holds
    sp_div = t if sp else 1
    if recompute == "full":
        return tok * h * w / sp_div                 # the layer input, (s/cp, b, h)
    kv_width = max(kv_heads / t, 1.0) * (h // a)    # channels of K (and of V) on one TP rank
    norms = 2 * (2 * tok * h + (tok if rstd else 0)) * w    # x and x * rstd (and rstd) per norm
    column_inputs = 2 * tok * h * w                 # inputs of W_q/W_k/W_v and of w1/w3
    heads = (2 * tok * h + 4 * tok * ffn) * w / t   # Q, W_o's input; w1 x, w3 x, silu, product
    kv = 2 * tok * kv_width * w                     # K and V
    scores = 0.0 if recompute == "selective" else a * s * tok * w / t  # softmax output (a, s/cp, s)
    return (norms + column_inputs) / sp_div + heads + kv + scores


def in_flight_microbatches(p: int, m: int, schedule: str = "1f1b", v: int = 1, stage: int = 0) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak.

    GPipe runs all m forwards first: m. 1F1B (Narayanan et al. 2021) lets stage i
    start backward after p - i forwards: min(p - i, m). Interleaving v chunks makes
    the first stage hold p (1 + (p-1)/(p v)) micro-batches' worth of its layers
    (Korthikanti et al. 2022, Sec. 4.2.3).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b" or v == 1:
        return float(min(p - stage, m))
    return min(p * (1.0 + (p - 1) / (p * v)), float(m))


def zero_memory_bytes(n_params, stage: int, dp: int, param_bytes: int = 2, grad_bytes: int = 2,
                      optimizer_bytes: int = 12) -> dict:
    """Model-state bytes per GPU under ZeRO (Rajbhandari et al. 2020, Sec. 5, Table 1).

    Mixed-precision AdamW keeps 2 bytes of bf16/fp16 parameters, 2 of gradients and
    K = 12 of optimizer state (fp32 master copy, momentum, variance): 16 P in all.
    Stage 1 shards the optimizer state over the dp ranks (4P + 12P/N), stage 2 also
    the gradients (2P + 14P/N), stage 3 also the parameters (16P/N). ZeRO is data
    parallelism with sharded state: each rank still runs the whole model on its own
    data, all-gathering the parameters it does not hold. Pure fp32 AdamW is
    ``param_bytes=4, grad_bytes=4, optimizer_bytes=8``.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    P = float(n_params)
    out = {
        "params": P * param_bytes / (dp if stage >= 3 else 1),
        "grads": P * grad_bytes / (dp if stage >= 2 else 1),
        "optimizer": P * optimizer_bytes / (dp if stage >= 1 else 1),
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def bubble_fraction(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> float:
    """Fraction of a pipeline step that a stage sits idle (equal stages, free p2p).

    GPipe and 1F1B: the first micro-batch needs p - 1 stage-times to reach the last
    stage and the last backward p - 1 to come back, so a step lasts (m + p - 1)
    (t_f + t_b) of which m (t_f + t_b) is work: bubble = (p-1)/(m+p-1) (Huang et al.
    2019; Narayanan et al. 2021). Interleaved with v chunks per stage: each chunk
    takes (t_f + t_b)/v, the fill and drain shrink to (p-1)(t_f + t_b)/v, the work
    stays m (t_f + t_b): bubble = (p-1)/(v m + p - 1) (Narayanan et al. 2021, Sec. 2.2.2).
    The simulator reproduces both (tests/test_planner_simulator.py).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be >= 1, got p={p}, m={m}, v={v}")
    vv = v if schedule == "interleaved" else 1
    return (p - 1) / (vv * m + p - 1)


# ---- communication: what each rank sends, and how long a ring takes -------------------

def collective_bytes_per_rank(kind: str, n_bytes: float, N: int) -> float:
    """Bytes each rank sends in a bandwidth-optimal (ring) collective on N ranks.

    ``n_bytes`` is the size of the whole tensor (the all-reduce input, the all-gather
    output, the reduce-scatter input). all_gather / reduce_scatter / all_to_all:
    (N-1)/N n (each rank sends the N-1 pieces it is responsible for, each n/N);
    all_reduce = reduce_scatter + all_gather: 2 (N-1)/N n (Patarasuk & Yuan 2009).
    send_recv: n. Never (N-1) n: that is a rank sending the whole tensor N-1 times.
    """
    if kind not in ("send_recv", "all_gather", "reduce_scatter", "all_to_all", "all_reduce"):
        raise ValueError(f"unknown collective {kind!r}")
    return costmodel.volume_per_rank(kind, n_bytes, N)


def ring_steps(kind: str, N: int) -> int:
    """Ring steps of a collective: N-1 for all_gather / reduce_scatter / all_to_all
    (pairwise), 2(N-1) for all_reduce, 1 for send_recv, 0 when N == 1."""
    if kind == "send_recv":
        return 1
    if N <= 1:
        return 0
    return (2 if kind == "all_reduce" else 1) * (N - 1)


def collective_time(kind: str, n_bytes: float, N: int, alpha: float, bandwidth: float) -> float:
    """alpha-beta time of a ring collective (Hockney 1994; Thakur et al. 2005):
    steps x alpha + bytes per rank / bandwidth. All N ranks send their n/N chunk at
    the same time in every step, so a ring all-reduce costs 2(N-1) alpha +
    2(N-1)/N n / B, not N-1 full transfers one after another. The cost functions
    are course_lib.costmodel's (the collectives chapter fits alpha and beta to them)."""
    if N <= 1 and kind != "send_recv":
        return 0.0
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    algorithm = _RING_ALGORITHM.get(kind)
    if algorithm is None:
        raise ValueError(f"unknown collective {kind!r}")
    return costmodel.cost(algorithm, n_bytes, N, alpha, 1.0 / bandwidth)


_RING_ALGORITHM = {"all_reduce": "ring_all_reduce", "all_gather": "ring_all_gather",
                   "reduce_scatter": "ring_reduce_scatter", "all_to_all": "pairwise_all_to_all",
                   "send_recv": "point_to_point"}


# ---- communication volume per dimension (bytes one rank sends) ---------------------------

def tp_bytes_per_layer(s, b, h, t, sp=False, recompute="none", dtype_bytes=2, cp=1) -> float:
    """Tensor parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022): bytes one rank
    sends per layer per micro-batch. TP is not communication-free: the row-parallel
    outputs must be summed. Without SP: 2 all-reduces of (s/cp, b, h) forward (after
    attention and after the MLP) and 2 backward (the column-parallel inputs' grads).
    With SP each all-reduce becomes a reduce-scatter + an all-gather: same volume.
    Full recomputation runs the forward's 2 again; selective recomputes inside the
    attention core and adds none."""
    n = s * b * h * dtype_bytes / cp
    n_allreduce = 4 + (2 if recompute == "full" else 0)
    return n_allreduce * collective_bytes_per_rank("all_reduce", n, t)


def cp_bytes_per_layer(s, b, kv_dim, cp, dtype_bytes=2) -> float:
    """Context parallelism, ring attention (Liu et al. 2023; Llama 3's all-gather variant
    sends the same bytes): forward passes the local K and V, (s/cp, b, kv_dim) each,
    around the ring: (cp-1)/cp of the full K and V; backward passes K, V and their
    gradients: twice that."""
    kv = 2 * s * b * kv_dim * dtype_bytes               # K and V of the whole sequence
    return 3 * collective_bytes_per_rank("all_gather", kv, cp)


def pp_bytes_per_microbatch(s, b, h, t=1, sp=False, dtype_bytes=2, cp=1) -> float:
    """Pipeline parallelism: a stage sends its output activation (s/cp, b, h) forward
    and the input gradient of the same shape backward, per micro-batch; with SP
    each TP rank sends its 1/t slice (Narayanan et al. 2021's scatter/gather)."""
    return 2 * s * b * h * dtype_bytes / cp / (t if sp else 1)


def dp_bytes_per_step(n_params_local, dp, zero_stage=0, grad_bytes=2, param_bytes=2,
                      microbatches=1) -> float:
    """Data parallelism over dp ranks, for the n_params_local this rank's replica
    holds. Stage 0: one all-reduce of the gradients, 2(N-1)/N of the model. ZeRO-1:
    its two halves, a reduce-scatter of the gradients and an all-gather of the
    updated parameters, the same bytes. ZeRO-2 keeps only its gradient shard, so it
    reduce-scatters after every micro-batch. ZeRO-3 also all-gathers the parameters
    in forward and again in backward, every micro-batch (Rajbhandari et al. 2020,
    Sec. 7: 1.5x the bytes of DP with one micro-batch)."""
    P = float(n_params_local)
    rs = collective_bytes_per_rank("reduce_scatter", P * grad_bytes, dp)
    ag = collective_bytes_per_rank("all_gather", P * param_bytes, dp)
    if zero_stage == 0:
        return collective_bytes_per_rank("all_reduce", P * grad_bytes, dp)
    if zero_stage == 1:
        return rs + ag
    if zero_stage == 2:
        return microbatches * rs + ag
    return microbatches * (2 * ag + rs)


def ep_bytes_per_layer(s, b, h, ep, top_k=1, dtype_bytes=2, cp=1) -> float:
    """Expert parallelism (Lepikhin et al. 2020): each token's hidden state goes to its
    top_k experts and comes back, an all-to-all each way forward and each way
    backward: 4 all-to-alls of (s/cp, b, top_k, h)."""
    n = s * b * top_k * h * dtype_bytes / cp
    return 4 * collective_bytes_per_rank("all_to_all", n, ep)
