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

import functools

# the activation-memory and communication formulas live in rooms of their own; they are
# part of this namespace live in their own room; they are part of this namespace
from course_lib.planner.activations import (  # noqa: F401
    RECOMPUTE,
    activation_bytes_per_layer,
    llama_activation_bytes_per_layer,
)
from course_lib.planner.communication import moe_dispatch_bytes, moe_dispatch_payloads  # noqa: F401
from course_lib.planner.communication import (  # noqa: F401
    QUANT_BYTES,
    all_to_all_time,
    collective_bytes_per_rank,
    collective_time,
    cp_bytes_per_layer,
    dp_bytes_per_step,
    ep_bytes_per_layer,
    hsdp_bytes_per_step,
    nccl_time,
    pp_bytes_per_microbatch,
    ring_steps,
    tp_bytes_per_layer,
    zeropp_bytes_per_step,
)
from course_lib.schedules import PLANNED as SCHEDULES  # the schedules the planner prices
from course_lib.schedules import (V_SCHEDULES, chunks, formula_idle, formula_peak_activations, make_schedule,
                                  microbatch_group, reduce_points)
from course_lib.schedules import bubble_fraction  # noqa: F401  (next to the schedules it prices)

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
    if out["n_experts"] == 0:                       # course_lib.models' GPTConfig: 0 experts = dense
        out["n_experts"] = 1
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


def layer_flops_per_token(cfg=None, seq_len: int = 2048, recompute: str = "none", causal: bool = False,
                          **override):
    """(forward, backward) matmul FLOPs of ONE transformer layer per token.

    Forward: 2 per matmul weight (attention projections, MLP, router; top_k experts
    of a mixture) plus attention itself, QK^T and AV: 4 s h_attn (the causal mask is
    not subtracted, as in PaLM, Chowdhery et al. 2022, App. B). Backward: twice the
    forward (a gradient for the input and one for the weight), plus what
    recomputation re-runs first: ``"selective"`` the attention core forward
    (+4 s h_attn, Korthikanti et al. 2022, Sec. 5), ``"full"`` the whole forward.
    ``causal=True`` counts only the unmasked half of QK^T and AV (2 s h_attn forward):
    the work a causal kernel that skips masked tiles does, and the convention of
    publications that count causal attention.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    d = model_dims(cfg, **override)
    h = d["hidden"]
    attn_w = 2 * h * h + 2 * h * d["n_kv_heads"] * (h // d["n_heads"])
    mlp_w = d["top_k"] * (3 if d["mlp"] == "swiglu" else 2) * h * d["ffn"] + \
        (h * d["n_experts"] if d["n_experts"] > 1 else 0)
    core = (2.0 if causal else 4.0) * seq_len * h   # QK^T + AV forward, per token
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


def flops_per_token(cfg=None, seq_len: int = 2048, recompute: str = "none", causal: bool = False,
                    **override) -> float:
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
    lf, lb = layer_flops_per_token(d, seq_len, recompute, causal)
    hf, hb = head_flops_per_token(d)
    return d["n_layers"] * (lf + lb) + hf + hb


def in_flight_microbatches(p: int, m: int, schedule: str = "1f1b", v: int = 1, stage: int = 0,
                           group: int | None = None) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak.

    GPipe runs all m forwards first: m. 1F1B (Narayanan et al. 2021) lets stage i
    start backward after p - i forwards: min(p - i, m). Interleaving v chunks makes
    the first stage hold p (1 + (p-1)/(p v)) micro-batches' worth of its layers
    (Korthikanti et al. 2022, Sec. 4.2.3): it runs 2 (p-1) + (v-1) p chunk forwards
    before its first backward, plus the one of the steady state, and each chunk holds
    1/v of its layers. Stage i warms up with two chunk forwards fewer per stage
    before it (Megatron-LM's schedule, and the course's: tests/test_planner_formulas.py
    counts it on ``course_lib.schedules``): p + (p - 1 - 2 i)/v, at most m. Taken N at a time
    per chunk (``schedules.microbatch_group``: torch's rounds where p does not divide m, or a
    chosen N), the warm-up is 2 (p - 1 - i) + (v - 1) N: (2 (p - 1 - i) + (v - 1) N + 1)/v,
    at most m (N = p gives the above). ZB-V and DualPipeV
    (``schedules.formula_peak_activations``, in chunks of half a stage): min(p, m) and p + 1/2
    on every stage.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule in V_SCHEDULES:     # every rank alike; two chunks of half the stage's layers each
        return formula_peak_activations(schedule, p, m) / 2
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b" or v == 1:
        return float(min(p - stage, m))
    n = microbatch_group(p, m, group)
    return min((2 * (p - 1 - stage) + (v - 1) * n + 1) / v, float(m))


SPLIT = ("zb-h1", *V_SCHEDULES)      # the schedules whose backwards split into B and W


def split_moments(schedule: str, p: int, m: int, stage: int, chunk_bytes: dict, grad_bytes: dict | None = None) -> list:
    """[(gradient bytes allocated, activation bytes held)] after each action of pp rank
    ``stage`` under a schedule that splits its backwards (:data:`SPLIT`), walked on the
    schedule's own order (``make_schedule``'s actions): a forward of chunk c adds its
    activations, a B trades them for what W needs (``chunk_bytes[c]`` = (activations, kept for
    W), per micro-batch), a W frees that; a backward not split frees all. A chunk's gradient
    buffers (``grad_bytes[c]``) come with its first backward."""
    actions = make_schedule(schedule, p, m, chunks(schedule))[stage]
    split = {(a.stage, a.mb) for a in actions if a.op == "W"}
    live, grads, seen, out = 0.0, 0.0, set(), []
    for a in actions:
        act, kept = chunk_bytes[a.stage]
        if a.op == "F":
            live += act
        elif a.op == "B":
            live += (kept if (a.stage, a.mb) in split else 0.0) - act
            if a.stage not in seen:
                seen.add(a.stage)
                grads += (grad_bytes or {}).get(a.stage, 0.0)
        else:
            live -= kept
        out.append((grads, live))
    return out


def split_peak(schedule: str, p: int, m: int, stage: int, chunk_bytes: dict) -> float:
    """The activation bytes a rank holds at its peak under a schedule with W actions: the
    largest of :func:`split_moments`'."""
    return max(held for _, held in split_moments(schedule, p, m, stage, chunk_bytes))


def gradient_moments(p: int, m: int, schedule: str = "1f1b", v: int = 1, stage: int = 0,
                     group: int | None = None) -> list:
    """Where a pipeline stage's gradient buffers and saved activations together can peak:
    [(share of its gradient buffers allocated, micro-batches of activations saved)], one moment
    per chunk: the end of the first backward that reaches it (its buffers come with it; that
    backward's activations not yet freed). Backwards run in groups of N micro-batches per chunk
    (``schedules.microbatch_group``: p where p divides m), the last chunk first (Megatron-LM's
    and torch's interleaved order, the course's): the c-th chunk's first at backward (c - 1) N + 1. Every backward before the last forward ends with the peak's
    in-flight chunks saved (:func:`in_flight_microbatches`); each one after, one fewer. GPipe
    and 1F1B: one chunk, (1, in flight). ZB-H1 and the V schedules (weight gradients apart
    from B): every buffer with the peak, (1, in flight)."""
    n_mb = in_flight_microbatches(p, m, schedule, v, stage, group)
    if schedule != "interleaved" or v == 1:
        return [(1.0, n_mb)]
    n, total = round(n_mb * v), m * v               # chunk forwards in flight at the peak; backwards
    steady = total - n + 1                          # backwards that end with n saved
    size = microbatch_group(p, m, group)
    out = []
    for c in range(1, v + 1):
        j = (c - 1) * size + 1
        if j <= total:
            out.append((c / v, (n - max(0, j - steady)) / v))
    return out


def round_moments(p: int, m: int, v: int, stage: int = 0) -> list:
    """:func:`gradient_moments` of an interleaved stage whose ZeRO-2 sums are reduced after each
    round through a chunk (``grad_reduce="round"``): [(chunks' sums held whole, share of the
    owned slices' reduced gradients, micro-batches of activations saved)] at the end of each
    chunk's first backward of each round. A round's end sends its chunk's sums (held until the
    next round's end has waited for them) and the next chunk's come: two whole at most; the
    owned slices get each chunk's share when its reduction is waited for."""
    n_mb = in_flight_microbatches(p, m, "interleaved", v, stage)
    n, total, size = round(n_mb * v), m * v, microbatch_group(p, m)
    steady = total - n + 1
    out = []
    for k in range(m // size * v):                  # the k-th (round, chunk) in backward order
        j = k * size + 1
        out.append((min(k + 1, 2), max(0, k - 1) / v if k < v else 1.0, (n - max(0, j - steady)) / v))
    return out


def zero_rounds(layout) -> tuple | None:
    """ZeRO-2 reducing chunk by chunk in the schedule (``layout.grad_reduce`` "chunk" or
    "round"): (reductions of each chunk per step, rounds the schedule runs through a chunk,
    chunks per stage); None when it reduces after the schedule. Counted on the schedule's own
    order (``schedules.reduce_points`` of the first rank): a round is a run of backwards through
    one chunk, m / N of them in the interleaved order, one in 1F1B, one per micro-batch where a
    V schedule alternates its two chunks; "round" reduces after each, "chunk" after the last."""
    if layout.zero != 2 or layout.grad_reduce == "step":
        return None
    ends, chunks = _round_ends(layout.schedule, layout.pp, layout.microbatches, layout.v)
    rounds = ends / chunks
    return (rounds if layout.grad_reduce == "round" else 1), rounds, chunks


@functools.lru_cache(maxsize=256)
def _round_ends(schedule, p: int, m: int, v: int) -> tuple:
    """(round ends, chunks) on the first rank of ``schedule``'s order (a name: the planner prices
    named schedules)."""
    points = reduce_points(make_schedule(schedule, p, m, chunks(schedule, v))[0])
    return sum(end for end, _ in points.values()), len({a.stage for a in points})


def pipeline_idle(schedule: str, p: int, t_f: float, t_b: float) -> float:
    """Idle time of a stage per step, equal stages, a stage's forward ``t_f`` and backward
    ``t_b`` per micro-batch (all its chunks): (p - 1)(t_f + t_b) for GPipe and 1F1B, (p - 1)(t_f +
    t_b - 2 W) for ZB-H1 with W = t_b / 2 (its weight GEMMs, half the backward's); for ZB-V and
    DualPipeV ``schedules.formula_idle`` (DeepSeek-V3's Table 2) on each of the two chunks' times,
    the weight-gradient part W half a backward (its GEMMs are half the backward's)."""
    if schedule in V_SCHEDULES:
        return formula_idle(schedule, p, t_f=t_f / 2, t_b=t_b / 2, t_w=t_b / 4)
    return formula_idle(schedule, p, t_f=t_f, t_b=t_b, t_w=t_b / 2)     # (W: zb-h1's only)


def p2p_sends(schedule: str, p: int, stage: int, v: int = 1) -> int:
    """Messages a stage sends per micro-batch (activations forward, gradients back). One chunk per
    rank: 2 (1 on the first and last stage); interleaved v chunks: 2 per chunk; a V: 2 per chunk,
    less the turn of the V (stage p - 1 -> p, one rank) and its two ends: 2 on the first and
    the last rank, 4 between (twice 1F1B's: Qi et al. 2024's "communication volume 2x")."""
    if schedule in V_SCHEDULES:
        return 2 if stage in (0, p - 1) else 4
    if v > 1:
        return 2
    return (stage < p - 1) + (stage > 0)


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


