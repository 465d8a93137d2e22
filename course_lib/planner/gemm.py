"""GEMM efficiency as a function of the GEMM's shape, and the GEMMs of one layer.

The assumption, named (``GEMM_MODEL``): a GPU computes a GEMM C = A B (M x K times
K x N) as output tiles of ``hw.gemm_tile`` = (t_m, t_n), one tile per SM at a time
(CUTLASS / cuBLAS's data-parallel kernels). Every tile costs the same, 2 t_m t_n K
FLOPs at the per-SM share of the achievable rate (``peak x matmul_efficiency /
sm_count``, what a large, well-shaped GEMM sustains), plus a fixed cost per tile, its
pipeline's fill and its epilogue, stated as ``hw.gemm_tile_overhead`` = K_0 more steps of K
(fitted on XLA's measured H100 table, :mod:`course_lib.planner.gemm_measured`), so

    time = ceil(tiles / SMs) x 2 t_m t_n (K + K_0) / (rate / SMs),  tiles = ceil(M/t_m) ceil(N/t_n)

which charges both **tile quantisation** (a partial tile costs a whole one) and **wave
quantisation** (a last, partly filled wave of tiles costs a whole wave); the kernel takes
the better of the tile and its transpose. And the **roofline**: a GEMM cannot beat the
time to move its operands and result through HBM once, 2 (MK + KN + MN) bytes in bf16
(a fused attention kernel keeps its M x N scores on chip: no MN term). A Hardware with
``sm_count = 0`` (the default for a hand-made or calibrated one) keeps the flat model:
every GEMM at ``matmul_efficiency`` of peak.

A fused attention kernel (FlashAttention, ``hw.fused_attention``) is not a GEMM: its score
and PV products, the causal trim and the backward's recomputed QK^T run inside one kernel,
priced by its own tile x wave model (:data:`ATTENTION_MODEL`, :func:`attention_kernel_time`,
the model the virtual clock's kernel model prices the same kernel by). :func:`attention_gemms`
marks its products ``"attention"`` (forward) or ``"attention_backward"`` (the last field of a
GEMM tuple) and :func:`gemms_time` prices those by that model; unfused attention's batched
GEMMs stay GEMMs.

Left out: split-K and stream-K kernels (which soften wave quantisation for small M N and
large K: fewer tiles than SMs), L2 effects, a kernel's fixed cost of a few microseconds
(the clock's ``kernel_floor`` bounds it from below), and the tile choice of a real library
(several shapes, chosen per problem); so a GEMM with fewer tiles than SMs is priced slow.
``benchmarks/gemm_table.py`` prints the model against the measured table.
"""
from __future__ import annotations

import math

GEMM_MODEL = ("tile x wave quantisation over the GPU's SMs (output tiles of hw.gemm_tile, one per SM at a "
              "time, every tile at peak x matmul_efficiency / SMs, K + hw.gemm_tile_overhead steps) and an HBM roofline (operands and result "
              "read/written once, bf16)")


def tile_work(M: float, N: float, K: float, hw, batch: int = 1) -> tuple[int, float]:
    """(output tiles, seconds of one tile on one SM) of ``batch`` GEMMs of (M x K) @ (K x N) on
    ``hw`` (``sm_count`` > 0): the tile or its transpose, whichever gives fewer tiles (both
    take a tile's same time, so the fewer tiles the fewer waves)."""
    tm, tn = hw.gemm_tile
    rate = hw.peak_flops * hw.matmul_efficiency
    per_tile = 2.0 * tm * tn * (K + getattr(hw, "gemm_tile_overhead", 0)) / (rate / hw.sm_count)
    return min(math.ceil(M / a) * math.ceil(N / b) * batch for a, b in ((tm, tn), (tn, tm))), per_tile


def gemm_time(M: float, N: float, K: float, hw, batch: int = 1, writes_output: bool = True) -> float:
    """Seconds of ``batch`` GEMMs of (M x K) @ (K x N) on ``hw`` (see the module doc)."""
    if min(M, N, K, batch) <= 0:
        return 0.0
    if not getattr(hw, "sm_count", 0):
        return 2.0 * M * N * K * batch / (hw.peak_flops * hw.matmul_efficiency)   # the flat model
    tiles, per_tile = tile_work(M, N, K, hw, batch)
    best = math.ceil(tiles / hw.sm_count) * per_tile
    moved = 2.0 * batch * (M * K + K * N + (M * N if writes_output else 0.0))
    return max(best, moved / hw.hbm_bandwidth)


def gemm_efficiency(M: float, N: float, K: float, hw, batch: int = 1, writes_output: bool = True) -> float:
    """Fraction of peak a GEMM of this shape reaches under :data:`GEMM_MODEL`."""
    t = gemm_time(M, N, K, hw, batch, writes_output)
    return 2.0 * M * N * K * batch / (t * hw.peak_flops) if t > 0 else 0.0


def attention_rate(hw, peak: float | None = None) -> float:
    """FLOP/s of one tile of a fused attention kernel's forward on ``hw``: ``peak`` (default
    ``hw.peak_flops``, bf16) x ``hw.efficiencies()["attention"]`` (a Hardware that states none:
    ``matmul_efficiency``, the flat GEMM rate). With ``sm_count = 0`` the whole kernel's rate."""
    return (hw.peak_flops if peak is None else peak) * hw.efficiencies()["attention"]


ATTENTION_BLOCK = 128
ATTENTION_MODEL = (
    "FlashAttention-2's grid: the forward one CTA per 128 queries of a head, the backward one per 128 keys, "
    "launched head by head in ascending blocks; a CTA visits the keys (forward) or queries (backward) it sees, "
    "causal aligned at the bottom right; it costs 4 x 128 x (d + D_0) x (visited + K_0) FLOPs "
    "(x 2.5 backward) at the per-SM share of peak x its direction's efficiency; the GPU runs the CTAs one per "
    "SM, each SM taking the next when it frees (greedy list schedule): waves, the causal imbalance and a "
    "partly filled last wave all priced")


def attention_visits(s_q: int, s_k: int, causal: bool, backward: bool, block: int = ATTENTION_BLOCK) -> list:
    """Rows each CTA of one head visits, in launch order: keys per query block (forward) or
    queries per key block (backward), whole blocks; causal: query i sees keys up to
    s_k - s_q + i (bottom-right aligned, FlashAttention's rule for s_q != s_k)."""
    def whole(n):
        return min(-(-max(n, 0) // block) * block, s_q if backward else s_k)
    if backward:
        first = range(0, s_k, block)
        return [whole(s_q - max(0, k - (s_k - s_q))) if causal else s_q for k in first]
    ends = (min(i + block, s_q) for i in range(0, s_q, block))
    return [whole(s_k - s_q + e) if causal else s_k for e in ends]


_MAKESPANS: dict = {}
_SCHEDULED = 20000      # CTAs scheduled one by one up to this many (> 150 waves on 132 SMs beyond)


def _makespan(heads: int, s_q: int, s_k: int, causal: bool, backward: bool, k0: float, sms: int) -> float:
    """Steps (visited rows + K_0, summed along the busiest SM) of the greedy list schedule of
    ``heads`` x the CTAs of :func:`attention_visits` over ``sms`` SMs, in launch order."""
    key = (heads, s_q, s_k, causal, backward, k0, sms)
    if key in _MAKESPANS:
        return _MAKESPANS[key]
    import heapq
    work = [v + k0 for v in attention_visits(s_q, s_k, causal, backward)]
    n = heads * len(work)
    if n <= sms:
        span = max(work)
    elif min(work) == max(work):                     # equal CTAs: whole waves
        span = -(-n // sms) * work[0]
    elif n > _SCHEDULED:                             # many waves: the mean load plus half a CTA's
        span = heads * sum(work) / sms + max(work) / 2   # tail (within max / 2 of the schedule's)
    else:
        free = [0.0] * sms
        for _ in range(heads):
            for w in work:
                heapq.heapreplace(free, free[0] + w)
        span = max(free)
    _MAKESPANS[key] = span
    return span


def attention_pairs(s_q: int, s_k: int, causal: bool) -> float:
    """(query, key) pairs a head computes: s_q s_k, or causal (bottom right) the past keys in
    full and half the s_q x s_q block (the convention of torch's SDPA FLOP formulas halved)."""
    return s_q * (s_k - s_q) + s_q * s_q / 2 if causal else float(s_q * s_k)


def attention_kernel_time(hw, heads: int, s_q: int, s_k: int, d: int, causal: bool, backward: bool,
                          peak: float | None = None) -> float:
    """Seconds of one fused attention kernel (FlashAttention's forward or backward) over
    ``heads`` (batch x query heads) of ``s_q`` queries and ``s_k`` keys of head dim ``d``
    (:data:`ATTENTION_MODEL`; ``hw.sm_count = 0``: its FLOPs at :func:`attention_rate`).
    Constants: ``hw.efficiencies()["attention"]`` and ``hw.attention_backward_efficiency`` (0:
    the forward's) per tile, ``hw.attention_tile_overhead`` (K_0 forward, backward) and
    ``hw.attention_head_overhead`` (D_0)."""
    rate = attention_rate(hw, peak)
    flops = 4.0 * heads * d * attention_pairs(s_q, s_k, causal) * (2.5 if backward else 1.0)
    if not getattr(hw, "sm_count", 0):
        return flops / rate
    if backward and getattr(hw, "attention_backward_efficiency", 0.0):
        rate = rate / hw.efficiencies()["attention"] * hw.attention_backward_efficiency
    k0 = getattr(hw, "attention_tile_overhead", (0.0, 0.0))[1 if backward else 0]
    d0 = getattr(hw, "attention_head_overhead", 0.0)
    steps = _makespan(int(heads), int(s_q), int(s_k), bool(causal), bool(backward), k0, hw.sm_count)
    return steps * 4.0 * ATTENTION_BLOCK * (d + d0) * (2.5 if backward else 1.0) / (rate / hw.sm_count)


def _weight_gemms(M, N, K, batch=1):
    """The three GEMMs of a linear layer y = x W (x: M x K, W: K x N): forward, the input's
    gradient dx = dy W^T, the weight's gradient dW = x^T dy."""
    return [(M, N, K, batch)], [(M, K, N, batch), (K, N, M, batch)]


def layer_gemms(model, s: int, b: int, t: int = 1, cp: int = 1, ep: int = 1, recompute: str = "none",
                fused_attention: bool = True, etp: int = 1, sp: bool = True):
    """(forward, backward) GEMMs of one transformer layer for one micro-batch on one GPU:
    lists of (M, N, K, batch, writes_output, weight, kernel), ``weight`` the share of the GEMM
    that runs (1, or 1/2 for causal attention in a fused kernel, which skips the masked
    tiles; Megatron's unfused path computes the whole s x s scores and masks them),
    ``kernel`` "gemm", or "attention" for a product inside a fused attention kernel.

    Tokens on this GPU T = b s / cp (sequence parallelism all-gathers before the
    column-parallel GEMMs, so they see all T). Attention: QK^T and AV per head, a/t heads x
    b sequences, queries s/cp, keys s. Backward: dgrad and wgrad of every weight GEMM; of
    attention, dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q, and a fused kernel (Flash-
    Attention) recomputes QK^T first. Recomputation: ``selective`` re-runs the attention
    core forward (unfused; the fused kernel already recomputes), ``full`` the layer forward.
    """
    h, d = model.hidden, model.hidden // model.n_heads
    T = b * s / cp
    kv_dim = model.n_kv_heads * d
    fwd, bwd = [], []

    def linear(M, N, K, batch=1):
        f, g = _weight_gemms(M, N, K, batch)
        fwd.extend((*x, True, 1.0, "gemm") for x in f)
        bwd.extend((*x, True, 1.0, "gemm") for x in g)
    linear(T, (h + 2 * kv_dim) / t, h)               # W_q, W_k, W_v (column parallel)
    linear(T, h, h / t)                              # W_o (row parallel)
    if model.n_experts > 1:
        linear(T, model.n_experts, h)                # the router (replicated)
        # the folded expert mesh: each TP rank routes its T / t tokens (SP); an expert's rows come
        # from its ep ranks and, with ETP, its etp ranks' too; each runs 1 / etp of its width
        local = model.n_experts / ep                 # experts on this GPU, each gets its share
        per_expert = T / (t if sp else 1) * model.top_k * ep * etp / model.n_experts
        n_up = 2 if model.mlp == "swiglu" else 1
        linear(per_expert, n_up * model.ffn / etp, h, local)
        linear(per_expert, h, model.ffn / etp, local)
    else:
        n_up = 2 if model.mlp == "swiglu" else 1
        linear(T, n_up * model.ffn / t, h)           # w1 (and w3)
        linear(T, h, model.ffn / t)                  # w2
    attn_fwd, attn_bwd = attention_gemms(model, s, b, t, cp, fused_attention)
    fwd += attn_fwd
    bwd += attn_bwd
    if recompute == "selective" and not fused_attention:
        bwd += attn_fwd
    elif recompute == "full":
        bwd += fwd
    return fwd, bwd


def attention_gemms(model, s: int, b: int, t: int = 1, cp: int = 1, fused_attention: bool = True):
    """(forward, backward) GEMMs of the attention core (see :func:`layer_gemms`)."""
    a, d = model.n_heads, model.hidden // model.n_heads
    heads, sq = b * a / t, s / cp
    w = 0.5 if fused_attention else 1.0              # causal: a fused kernel skips masked tiles
    out = not fused_attention                        # unfused: the scores go to HBM
    k = "attention" if fused_attention else "gemm"   # fused: one kernel, its own model
    kb = "attention_backward" if fused_attention else "gemm"
    qk, av = (sq, s, d, heads, out, w, k), (sq, d, s, heads, True, w, k)
    bwd = [(s, d, sq, heads, True, w, kb), (sq, s, d, heads, out, w, kb),     # dV, dP
           (sq, d, s, heads, True, w, kb), (s, d, sq, heads, True, w, kb)]    # dQ, dK
    if fused_attention:
        bwd = [(*qk[:6], kb)] + bwd                  # FlashAttention's backward recomputes QK^T
    return [qk, av], bwd


def head_gemms(model, s: int, b: int, t: int = 1, cp: int = 1):
    """(forward, backward) GEMMs of the LM head: T x h times h x V/t."""
    f, g = _weight_gemms(b * s / cp, model.vocab / t, model.hidden)
    return [(*x, True, 1.0, "gemm") for x in f], [(*x, True, 1.0, "gemm") for x in g]


ATTENTION_KERNELS = ("attention", "attention_backward")


def gemms_time(gemms, hw) -> float:
    """Seconds of a list of GEMMs from :func:`layer_gemms` / :func:`head_gemms`: a GEMM on the
    tile x wave model; a fused attention kernel's products (forward, backward) their FLOPs at
    the rate :func:`attention_kernel_time` gives its kernel, a kernel's shape read from its
    first product, QK^T (M queries, N keys, K head dim, batch heads; causal when halved)."""
    total = sum(wt * gemm_time(M, N, K, hw, batch, out) for M, N, K, batch, out, wt, kernel in gemms
                if kernel == "gemm")
    for kernel in ATTENTION_KERNELS:
        mine = [g for g in gemms if g[6] == kernel]
        if mine:
            sq, sk, d, heads, _, wt, _ = mine[0]
            causal, backward = wt < 1, kernel == "attention_backward"
            flops = 4.0 * heads * d * attention_pairs(sq, sk, causal) * (2.5 if backward else 1.0)
            total += gemms_flops(mine) * attention_kernel_time(hw, heads, sq, sk, d, causal, backward) / flops
    return total


def gemms_flops(gemms) -> float:
    """FLOPs of a list of GEMMs (the work that runs: causal halves counted as halves)."""
    return sum(wt * 2.0 * M * N * K * batch for M, N, K, batch, _, wt, _ in gemms)
