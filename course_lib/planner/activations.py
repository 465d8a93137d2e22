"""Activation memory of one layer: the two derived formulas, which one a model takes, and
fused attention. (Re-exported by :mod:`course_lib.planner.formulas`.)

Two derived and checked formulas: the GPT-3
block's (Korthikanti et al. 2022, with dropout; ``activation_bytes_per_layer``) and the
Llama block's (RMSNorm, rotary, GQA, SwiGLU; ``llama_activation_bytes_per_layer``).
A model takes the formula of its block: SwiGLU + RMSNorm is the Llama block, anything
else the GPT-3 block.

Fused attention (FlashAttention, Dao et al. 2022): the kernel never writes the s x s
scores; it keeps its output (W_o's input, already counted) and one fp32 log-sum-exp per
query row and head, 4 a s b / (t cp) bytes, and recomputes the scores in backward. So with
``fused_attention`` the score term of either formula is replaced by the log-sum-exp; for
recompute="selective" the two coincide up to that small term. ``fused_attention=False``
keeps the formulas as derived (the scores stored), which is what an unfused attention
(the course's own TinyGPT, Megatron-LM's 2021-22 softmax path) keeps.
"""
from __future__ import annotations

RECOMPUTE = ("none", "selective", "full")


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
                                     value_bytes=2, rstd=True, fused_kernels=False) -> float:
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

    ``fused_kernels``: RMSNorm and SwiGLU as fused kernels (Megatron-LM, Transformer
    Engine; the course's own in :mod:`course_lib.fused`, counted the same way): a norm
    keeps x and an fp32 rstd, 2 s b h + 8 b s for both (not x * rstd), and SwiGLU its two
    inputs w1 x and w3 x (silu(w1 x) is recomputed; the product is W_2's input, kept by
    the matmul): three f-wide tensors, not four. The 16 above becomes 12 and the 8 f/h
    becomes 6 f/h; rstd is fp32 for 16-bit activations (the formula counts 4 bytes).

    Not derived here: FlashAttention (no s x s matrix but its output and an fp32
    log-sum-exp per row and head: :func:`layer_activation_bytes`); mixture-of-experts MLPs
    (top_k of them per token, plus the router); the embedding, final norm, logits and loss.
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
    if fused_kernels:                               # x (and an fp32 rstd) per norm
        norms = 2 * (tok * h * w + (4 * tok if rstd else 0))
    else:                                           # x and x * rstd (and rstd) per norm
        norms = 2 * (2 * tok * h + (tok if rstd else 0)) * w
    column_inputs = 2 * tok * h * w                 # inputs of W_q/W_k/W_v and of w1/w3
    f_wide = 3 if fused_kernels else 4              # w1 x, w3 x, (silu,) product
    heads = (2 * tok * h + f_wide * tok * ffn) * w / t   # Q, W_o's input; the f-wide tensors
    kv = 2 * tok * kv_width * w                     # K and V
    scores = 0.0 if recompute == "selective" else a * s * tok * w / t  # softmax output (a, s/cp, s)
    return (norms + column_inputs) / sp_div + heads + kv + scores


def is_llama_block(model) -> bool:
    return model.mlp == "swiglu" and model.norm == "rmsnorm"


def layer_activation_bytes(model, s, b, t=1, sp=False, recompute="none", cp=1, fused_attention=True,
                           fused_kernels=False) -> float:
    """Bytes one layer of ``model`` keeps for backward, per micro-batch, on one GPU (16-bit).

    A mixture of experts keeps its MLP tensors for each of the top_k experts a token visits
    (the f-wide terms times top_k); the router's few bytes are left out. ``fused_kernels``
    (fused RMSNorm and SwiGLU) applies to the Llama block; the GPT-3 block's formula is
    Megatron-LM's kernels already (its fused bias-GeLU keeps the same two tensors).
    """
    scores_kept = recompute == "none" and not fused_attention
    rc = "none" if scores_kept else ("full" if recompute == "full" else "selective")
    if is_llama_block(model):
        out = llama_activation_bytes_per_layer(s, b, model.hidden, model.n_heads, model.n_kv_heads,
                                                 model.ffn * model.top_k, t, sp, rc, cp=cp,
                                                 fused_kernels=fused_kernels)
    else:
        out = activation_bytes_per_layer(s, b, model.hidden, model.n_heads, t, sp, rc, cp=cp)
    if fused_attention and recompute != "full":
        out += lse_bytes(s, b, model.n_heads, t, cp)
    return out


def lse_bytes(s, b, a, t=1, cp=1) -> float:
    """FlashAttention's saved softmax statistics: one fp32 log-sum-exp per (row, head)."""
    return 4.0 * a * b * s / (t * cp)


def stage_activation_bytes(model, s, b, policies, t=1, sp=False, cp=1, in_flight=1.0, fused_attention=False,
                           fused_kernels=False) -> float:
    """Bytes a pipeline stage's blocks keep for backward at its peak: ``in_flight`` micro-batches
    (``formulas.in_flight_microbatches``) times the sum over its blocks of
    :func:`layer_activation_bytes`, each block with its own recompute policy (``policies``: one
    per block, or one name for all): per-block checkpointing mixes them. ``fused_attention=False``
    is the course's TinyGPT (its attention keeps the softmax output); its ring attention (CP)
    keeps a log-sum-exp instead, as a fused kernel does."""
    if isinstance(policies, str):
        policies = [policies] * model.n_layers
    for p in policies:
        if p not in RECOMPUTE:
            raise ValueError(f"unknown recompute policy {p!r}: must be one of {RECOMPUTE}")
    return in_flight * sum(layer_activation_bytes(model, s, b, t, sp, p, cp=cp, fused_attention=fused_attention,
                                                  fused_kernels=fused_kernels) for p in policies)


def course_layer_activation_bytes(model, s, b, t=1, sp=False, recompute="none", cp=1,
                                  fused_kernels=False, fused_attention=False, ulysses=False) -> float:
    """Bytes one layer of the course's own program (``TinyGPT``, what ``runtime="course"`` and the
    dry run run) keeps for backward, per micro-batch, on one GPU (16-bit).

    Where it differs from :func:`layer_activation_bytes` (Megatron-LM's kernels):

    - attention is written out: its softmax output, 2 a s^2 b / (t cp), is kept (recompute
      "none"); with context parallelism the ring attention keeps a log-sum-exp instead, as a
      fused kernel does (:func:`lse_bytes`), and so does the course's FlashAttention core
      (``fused_attention``, a Hardware's: :func:`course_lib.fused.flash_attention`, which the
      dry run then runs), which keeps Q, K, V, its output and the log-sum-exp at any policy;
      Ulysses CP (``ulysses``) written out (no ``fused_attention``) attends on a / cp heads
      over the whole sequence: the same softmax bytes as a / cp heads of one device's, no
      log-sum-exp; with ``fused_attention`` its FlashAttention core keeps the log-sum-exp;
    - no dropout (``model_config`` builds the model with dropout 0): the GPT-3 block keeps
      neither the two 1-byte masks (2 s b h) nor the attention dropout's mask and output;
      its two LayerNorms keep their mean and rstd, 8 bytes a token (the census of
      ``lab.dry_run_memory.course_terms``);
    - RMSNorm and SwiGLU in plain ops, unless ``fused_kernels`` (a Hardware's: the course's
      own fused kernels, :mod:`course_lib.fused`, which the dry run then runs);
    - a mixture of experts (GPT block, ``ExpertParallelMoE``): per routed (token, expert) pair
      the expert's input row, its two 4h-wide GeLU tensors, its output (kept for the gate's
      product) and that product (kept by ``index_add``, which sums the pairs back onto their
      tokens: ``models.saved_activations`` lists it), 22 h bytes, in place of the dense MLP's
      16 h (its f-wide pair); the router keeps the MLP input, 2 h, as the dense MLP's first
      matmul does.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    scores = recompute == "none" and (cp == 1 or ulysses) and not fused_attention
    rc = "none" if scores else ("full" if recompute == "full" else "selective")
    if is_llama_block(model):
        out = llama_activation_bytes_per_layer(s, b, model.hidden, model.n_heads, model.n_kv_heads,
                                               model.ffn * model.top_k, t, sp, rc, cp=cp,
                                               fused_kernels=fused_kernels)
    else:
        h, a, split = model.hidden, model.n_heads, (t if sp else 1)
        out = activation_bytes_per_layer(s, b, h, a, t, sp, rc, cp=cp)
        if rc != "full":
            tok = s * b / cp
            dropout = 2.0 * tok * h / split + (3.0 * a * s * tok / t if scores else 0.0)
            out += 2 * 2 * 2 * tok / split - dropout
            if model.top_k > 1 or model.n_experts > 1:
                out += tok * h * (22.0 * model.top_k - 16.0) / t
    if recompute != "full" and ((cp > 1 and not ulysses) or fused_attention):
        out += lse_bytes(s, b, model.n_heads, t, cp)
    return out


def w_kept_bytes_per_layer(model, s, b, t=1, sp=False, cp=1, value_bytes=2) -> float:
    """Bytes one layer keeps from B to W under a zero-bubble split (ZB-H1, ZB-V, DualPipeV; the
    course's runner and ``parallel.weight_grads``), per micro-batch on one GPU: what dW = dY^T X
    needs of each Linear, its input X (once where several read it: W_q, W_k, W_v; the MLP's first
    layers) and its output's gradient dY. B frees the rest of the layer's activations.

    - inputs: the attention's and the MLP's (s b h each, s b h / t kept with SP: W gathers the
      shard again), W_o's (s b h / t) and the MLP's last layer's (s b f / t);
    - output gradients: Q (h / t wide), K and V (this rank's K/V heads), the MLP's f-wide
      layers (f / t; SwiGLU's two), and the two row layers' outputs, h wide on every TP rank
      (the partial sums' gradient is the whole one);
    - a mixture of experts: the MLP terms for each of the top_k experts a token visits.
    """
    tok, h, f, k = s * b / cp, model.hidden, model.ffn, model.top_k
    kv = max(1, model.n_kv_heads // t) * model.head_dim
    shared = h / (t if sp else 1)
    first_mlp = 2 if model.mlp == "swiglu" else 1
    inputs = 2 * shared + h / t + k * f / t
    grads = h / t + 2 * kv + h + k * first_mlp * f / t + h
    return value_bytes * tok * (inputs + grads)


def head_w_kept_bytes(model, s, b, t=1, sp=False, cp=1, value_bytes=2) -> float:
    """The LM head's share of :func:`w_kept_bytes_per_layer`: its input (s b h, the shard with
    SP) and its logits' gradient (s b V / t)."""
    tok = s * b / cp
    return value_bytes * tok * (model.hidden / (t if sp else 1) + model.vocab / t)
