"""Model and hardware presets: the shapes of real models and the numbers of real GPUs.

A model is a :class:`ModelSpec` (the config fields ``formulas.param_count`` reads);
a GPU is a :class:`Hardware`, whose nominal numbers come from the vendor's data
sheet and whose *achievable* fractions (matmul efficiency, bus-bandwidth
efficiency, per-message latency) are named assumptions: the planner applies the
same ones to every layout, and the notebook prints them next to every result.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from course_lib.planner import formulas

GiB = 2**30


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: shapes only (no weights)."""

    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    seq_len: int                 # the training sequence length
    mlp: str = "swiglu"          # "swiglu" (3 matrices) or "gelu" (2)
    tied: bool = False
    bias: bool = False
    norm: str = "rmsnorm"
    learned_pos: int = 0         # learned position embeddings (GPT-3), 0 for rotary
    n_experts: int = 1           # > 1: mixture of experts, every layer's MLP
    top_k: int = 1
    moe_dispatch: str = "all_to_all"   # or "all_gather" (course_lib.parallel.expert_parallel)

    @property
    def n_params(self) -> int:
        return formulas.param_count(self)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    def with_(self, **changes) -> "ModelSpec":
        return replace(self, **changes)


def gpt_spec(name, L, h, a, V=51200, s=2048):
    """A GPT-3 / Megatron-shaped model: L layers, hidden h, a heads (GELU MLP 4h, tied embeddings)."""
    # GPT-3 / Megatron shapes (Brown et al. 2020; Narayanan et al. 2021; Korthikanti et al. 2022)
    return ModelSpec(name, L, h, a, a, 4 * h, V, s, mlp="gelu", tied=True, bias=True,
                     norm="layernorm", learned_pos=s)


MODELS = {
    # Brown et al. 2020, Table 2.1 (GPT-3's tokenizer has 50257 tokens): 174.6B
    "gpt3-175b": gpt_spec("GPT-3 175B", 96, 12288, 96, V=50257),
    # Llama 3 herd (Dubey et al. 2024, Table 3); trained at sequence 8192
    "llama3-8b": ModelSpec("Llama 3 8B", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": ModelSpec("Llama 3 70B", 80, 8192, 64, 8, 28672, 128256, 8192),
    "llama3-405b": ModelSpec("Llama 3 405B", 126, 16384, 128, 8, 53248, 128256, 8192),
    # the 1T GPT of Narayanan et al. 2021 / Korthikanti et al. 2022 (Table 3)
    "gpt-1t": gpt_spec("GPT 1T", 128, 25600, 160),
    # Korthikanti et al. 2022, Table 3: the models of its Table 5 (vocabulary 51200, s = 2048)
    "megatron-22b": gpt_spec("GPT 22B", 48, 6144, 64),
    "megatron-175b": gpt_spec("GPT 175B", 96, 12288, 96),
    "megatron-530b": gpt_spec("GPT 530B", 105, 20480, 128),
    # a mixture of experts, for expert parallelism (Jiang et al. 2024): 8 experts, top-2
    "mixtral-8x7b": ModelSpec("Mixtral 8x7B", 32, 4096, 32, 8, 14336, 32000, 4096,
                              n_experts=8, top_k=2),
    # Mixtral 8x22B (mistralai/Mixtral-8x22B-v0.1, its config.json: 56 layers, hidden 6144,
    # 48 heads, 8 K/V heads, SwiGLU experts of width 16384, 8 experts top-2, vocabulary 32000);
    # trained sequence not published: 4096, as the 8x7B preset
    "mixtral-8x22b": ModelSpec("Mixtral 8x22B", 56, 6144, 48, 8, 16384, 32000, 4096,
                               n_experts=8, top_k=2),
    # a GPT MoE: the 1.3B GPT base of DeepSpeed-MoE (Rajbhandari et al. 2022: 24
    # layers, hidden 2048, 16 heads, s 2048; Megatron's padded vocabulary 51200) with every MLP
    # a mixture of 8 GeLU experts of width 4h, top-2 (Mixtral's routing, Jiang et al. 2024;
    # GeLU experts as GShard's, Lepikhin et al. 2020): the course's own MoE block
    # (course_lib.moe), so the planner and the dry run take the same model
    "gpt-1.3b-moe-8x": ModelSpec("GPT 1.3B MoE 8x top-2", 24, 2048, 16, 16, 8192, 51200, 2048, mlp="gelu",
                                 tied=True, bias=True, norm="layernorm", learned_pos=2048, n_experts=8, top_k=2),
}


@dataclass(frozen=True)
class Hardware:
    """One GPU model in its usual 8-GPU server.

    Nominal (data sheet): ``peak_flops`` dense bf16 FLOP/s, ``hbm_bytes``,
    ``hbm_bandwidth`` B/s, ``nvlink_bandwidth`` and ``network_bandwidth`` B/s per GPU
    per direction (NVLink inside a node, InfiniBand across nodes), ``gpus_per_node``.
    Achievable (named assumptions, shared by every layout): ``matmul_efficiency`` the
    fraction of peak a large bf16 GEMM sustains; ``nvlink_efficiency`` /
    ``network_efficiency`` the bus bandwidth a ring collective reaches as a fraction
    of nominal; ``nvlink_latency`` / ``network_latency`` alpha, seconds per ring step (NCCL's
    own tuning model, ``src/graph/tuning.cc`` ``hwLat`` for Ring/Simple, the protocol large
    messages use: 3.4 us a step over NVLink, 14 us over the network; the virtual clock reads
    NCCL's whole table, scaled by these two);
    ``elementwise_passes`` how many times the non-matmul kernels (norms, activation
    functions, dropout, residual adds) stream each stored activation byte through HBM
    in the forward pass (written once, read once: 2; backward moves twice that);
    Kernels on the virtual clock and the course's runtime (:class:`course_lib.planner.kernel_cost.
    KernelModel`): ``kernel_efficiency`` (class, fraction) pairs: "gemm" of peak per tile of the
    tile x wave model, "attention" of peak for a fused attention kernel, "reduction",
    "broadcast", "elementwise", "copy" of HBM bandwidth (a class not named: ``matmul_efficiency``
    or ``hbm_efficiency``); ``kernel_floor`` the least time a kernel takes on the device;
    ``launch_overhead`` the host's issue interval, one op every so many seconds (eager
    PyTorch: Python, dispatcher, launch); ``sources`` (constant, source) pairs naming where
    each of these numbers comes from (``VirtualCluster.describe`` prints them).
    ``fused_attention`` whether attention runs in a fused kernel (FlashAttention): the s x s
    scores stay on chip (not stored for backward, not streamed through HBM), masked causal
    tiles are skipped, and the backward recomputes QK^T. ``fused_kernels`` whether RMSNorm
    and SwiGLU run fused (Megatron-LM, Transformer Engine), keeping less for backward
    (``llama_activation_bytes_per_layer``) and launching one kernel each way (the dry run and
    the planner's course runtime then run :mod:`course_lib.fused`'s); off by default: the
    course's block, written in plain ops, as counted in chapter 0. ``sm_count`` and ``gemm_tile``:
    the streaming multiprocessors and the output tile of the GEMM-by-shape model
    (:data:`course_lib.planner.gemm.GEMM_MODEL`); ``sm_count = 0`` keeps every GEMM at
    ``matmul_efficiency`` of peak (a hand-made or calibrated Hardware); ``gemm_tile_overhead``
    a tile's fixed cost (pipeline fill, epilogue) in steps of K. A fused attention kernel's
    tile x wave model (:data:`course_lib.planner.gemm.ATTENTION_MODEL`): "attention" above the
    forward's fraction of peak per CTA, ``attention_backward_efficiency`` the backward's (0: the
    forward's), ``attention_tile_overhead`` a CTA's fixed cost in rows visited (K_0: forward,
    backward), ``attention_head_overhead`` its per-score cost in head dims (D_0: the softmax).
    ``nccl_channels`` the channels
    NCCL's ring runs on inside one node, one CTA (one SM) each while a collective runs: the
    virtual clock takes them from the compute kernels beside it
    (:mod:`course_lib.virtual.contention`); 0: collectives take no SMs (a hand-made Hardware).
    """

    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    nvlink_bandwidth: float
    network_bandwidth: float
    gpus_per_node: int = 8
    matmul_efficiency: float = 0.70
    nvlink_efficiency: float = 0.80
    network_efficiency: float = 0.80
    nvlink_latency: float = 3.4e-6     # NCCL tuning.cc hwLat[NVLINK][RING][SIMPLE]
    network_latency: float = 14e-6     # NCCL tuning.cc hwLat[NET][RING][SIMPLE]
    elementwise_passes: float = 2.0
    fused_attention: bool = True
    fused_kernels: bool = False
    sm_count: int = 0
    gemm_tile: tuple = (128, 128)
    gemm_tile_overhead: float = 0.0
    attention_tile_overhead: tuple = (0.0, 0.0)
    attention_head_overhead: float = 0.0
    attention_backward_efficiency: float = 0.0
    dtype_flops: tuple = ()
    launch_overhead: float = 4e-6
    hbm_efficiency: float = 1.0
    kernel_efficiency: tuple = ()
    kernel_floor: float = 0.0
    nccl_channels: int = 0
    sources: tuple = ()

    @property
    def achievable_flops(self) -> float:
        return self.peak_flops * self.matmul_efficiency

    def peak_flops_for(self, dtype_name: str) -> float | None:
        """Dense peak FLOP/s for a dtype ("bfloat16", "float32", ...); None if not known."""
        rates = {"bfloat16": self.peak_flops, **dict(self.dtype_flops)}
        return rates.get(dtype_name)

    def efficiencies(self) -> dict:
        """{kernel class: efficiency}: ``kernel_efficiency``, the classes it does not name at
        ``matmul_efficiency`` (gemm, attention) or ``hbm_efficiency`` (the memory-bound ones)."""
        eff = {"gemm": self.matmul_efficiency, "attention": self.matmul_efficiency}
        eff.update({c: self.hbm_efficiency for c in ("reduction", "broadcast", "elementwise", "copy", "foreach")})
        eff.update(dict(self.kernel_efficiency))
        if "foreach" not in dict(self.kernel_efficiency):   # torch's _foreach_ kernels: measured on the H200
            eff["foreach"] = eff["elementwise"]
        return eff

    def link(self, intra_node: bool) -> tuple[float, float]:
        """(alpha seconds, achievable bandwidth B/s) of one ring step on NVLink or the network."""
        if intra_node:
            return self.nvlink_latency, self.nvlink_bandwidth * self.nvlink_efficiency
        return self.network_latency, self.network_bandwidth * self.network_efficiency

    def with_(self, **changes) -> "Hardware":
        return replace(self, **changes)

    def with_kernel_rate(self, kernel_class: str, fraction: float, source: str) -> "Hardware":
        """This Hardware with the clock's ``kernel_class`` fraction (``kernel_efficiency``) set to
        ``fraction`` and its ``sources`` entry to ``source`` (the planner's ``matmul_efficiency``
        is its own planning rate and does not move)."""
        rates = {**dict(self.kernel_efficiency), kernel_class: fraction}
        sources = {**dict(self.sources), kernel_class: source}
        return replace(self, kernel_efficiency=tuple(rates.items()), sources=tuple(sources.items()))


# The kernel model's constants, fitted once on the course's recorded H100 SXM run
# (course_lib.virtual.gpu_check.H100: scripts/device_check.py, torch 2.11, 2026-11-27;
# gpu_check.fit_kernels reproduces them from the record, tests/test_virtual_compute.py checks it)
_RECORD = "gpu_check.H100 (H100 SXM, 2026-11-27)"
# NCCL's ring inside a DGX node (NVIDIA/nccl 5067397c, src/graph): the search gives each channel
# its speedArray's first speed that fits the GPU's NVLinks (A100: 12 links x SM80_NVLINK_BW 20 =
# 240 GB/s, 6 channels at 40; H100: 18 x 20.6 = 371 GB/s, 6 at 60); ncclTopoDupChannels doubles
# them (search.cc L1036-1049) and ncclTopoPostset doubles again (connect.cc L460): 24 on both.
# The same count seen on an H100: an all-gather of 24 CTAs beside a 132-tile GEMM (NVIDIA
# developer forum, thread 337991: "Compute-Communication Overlap Causes Severe GEMM Performance
# Degradation because of Tail Effect").
_NCCL_CHANNELS = ("NCCL's ring on a DGX A100 / H100 node: 6 channels from the topology search "
                  "(src/graph/search.cc), doubled by ncclTopoDupChannels, doubled in ncclTopoPostset "
                  "(connect.cc): 24 (NVIDIA/nccl 5067397c)")
# FlashAttention-2's tile x wave model (planner.gemm.ATTENTION_MODEL), fitted on 76 shapes timed on
# an H200 (planner.attention_measured.fit_attention, tests/test_attention_model.py checks it): the
# H100's SMs, clocks and bf16 peak, and the kernel is compute bound at every shape kept, so the
# same constants hold on the H100. At 8192 causal tokens they give 340 TFLOP/s forward and 300
# backward, the published range of torch's SDPA on an H100 (287-304 TFLOP/s forward + backward,
# pytorch/benchmark PR #2296; 298-370, Shah et al. 2024, Fig. 5); at 2048 tokens and 12 heads,
# 100-130: the waves and the causal imbalance, which a flat fraction of peak (0.30, before) missed.
_ATTENTION_FIT = dict(attention_backward_efficiency=0.3639, attention_tile_overhead=(128.0, 384.0),
                      attention_head_overhead=16.0)
_ATTENTION_SOURCES = (
    ("attention", "FlashAttention-2's forward per CTA, tiles x waves (planner.gemm.ATTENTION_MODEL), fitted on 76 "
                  "shapes timed on an H200, the H100's SMs and peak (planner.attention_measured): log-rms 6.1%"),
    ("attention_tile", "its backward per CTA 0.3639 of peak, a CTA's fixed cost 128 keys forward, 384 queries "
                       "backward, the softmax 16 head dims a score: the same fit (backward log-rms 2.2%)"),
)
_H100_KERNELS = dict(
    launch_overhead=12.32e-6, hbm_efficiency=0.906, kernel_floor=2e-6, gemm_tile_overhead=192.0, nccl_channels=24,
    kernel_efficiency=(("gemm", 0.85352), ("attention", 0.3935), ("reduction", 0.675), ("broadcast", 0.290),
                       ("copy", 0.257)),
    **_ATTENTION_FIT,
    sources=(
        ("gemm", f"{_RECORD}: GEMM 8192^3 in 1.387 ms less one issue, tiles x waves, K + 192 a tile"),
        ("gemm_tile_overhead", "XLA's measured H100 GEMM table (planner.gemm_measured.XLA_H100, 65 shapes): "
                               "the K_0 in 0, 32, ..., 512 of least log-rms error, the record kept exact"),
        *_ATTENTION_SOURCES,
        ("elementwise", f"{_RECORD}: add 2 x 256 MiB in 277.6 us less one issue"),
        ("broadcast", f"{_RECORD}: the block's per-op profile, least squares"),
        ("reduction", f"{_RECORD}: the block's per-op profile, least squares"),
        ("copy", f"{_RECORD}: the block's per-op profile, least squares"),
        ("launch_overhead", f"{_RECORD}: 1000 one-element adds in 12.32 ms, issued by eager PyTorch"),
        ("kernel_floor", "assumed, not in the record (its tiny kernels are paced by the host): "
                         "an H100 runs a one-element kernel in about 2 us"),
        ("nccl_channels", _NCCL_CHANNELS),
    ))


_OWN_DERIVATION = ("nccl_channels",)     # sources that derive the A100's value too


def _same_kernels(gpu, fields=(), notes=(), **own):
    """The H100's kernel model on another GPU of its software stack: the record's fractions,
    but for the classes in ``own`` (class -> (fraction, its source)), which are the GPU's own,
    and the Hardware ``fields`` (name, value) pairs it states itself, sourced in ``notes``."""
    note = f" (measured on an H100, assumed for the {gpu})"
    fractions = {**dict(_H100_KERNELS["kernel_efficiency"]), **{k: f for k, (f, _) in own.items()}}
    notes = dict(notes)
    sources = tuple((k, notes[k] if k in notes else own[k][1] if k in own
                     else v if k in _OWN_DERIVATION else v + note)
                    for k, v in _H100_KERNELS["sources"])
    return {**_H100_KERNELS, **dict(fields), "kernel_efficiency": tuple(fractions.items()), "sources": sources}


# The H200's own kernel model: gpu_check.fit_kernels of its own record (gpu_check.H200, one H200
# SXM, 2026-11-29); its GEMM tile cost and kernel floor the H100's (the same SMs); attention the
# fit above, made on this GPU. Its host issued an op every 6.55 us, the H100 record's every 12.3:
# the issue interval is the host's (CPU, driver, Python), not the GPU's.
_RECORD_H200 = "gpu_check.H200 (H200 SXM, 2026-11-29)"
_H200_KERNELS = dict(
    launch_overhead=6.5547e-6, hbm_efficiency=0.90658, kernel_floor=2e-6, gemm_tile_overhead=192.0, nccl_channels=24,
    kernel_efficiency=(("gemm", 0.81126), ("attention", 0.3935), ("reduction", 0.56196), ("broadcast", 0.22466),
                       ("copy", 0.19432), ("foreach", 0.698)),
    **_ATTENTION_FIT,
    sources=(
        ("gemm", f"{_RECORD_H200}: GEMM 8192^3 in 1.453 ms less one issue, tiles x waves, K + 192 a tile"),
        ("gemm_tile_overhead", "XLA's measured H100 GEMM table (planner.gemm_measured.XLA_H100): the H100's "
                               "K_0, the same SMs"),
        *_ATTENTION_SOURCES,
        ("elementwise", f"{_RECORD_H200}: add 2 x 256 MiB in 191.6 us less one issue"),
        ("broadcast", f"{_RECORD_H200}: the block's per-op profile, least squares"),
        ("reduction", f"{_RECORD_H200}: the block's per-op profile, least squares"),
        ("copy", f"{_RECORD_H200}: the block's per-op profile, least squares"),
        ("foreach", "gpu_check.H200_FOREACH: torch's in-place _foreach_ kernels over 48 x 2M, 8 x 16M and 256 x 256K "
                    "elements, bf16 and fp32 (36 rows), the geometric mean of their bytes / time / HBM (bf16 0.63, "
                    "fp32 0.77); the H100's is the elementwise share, not measured"),
        ("launch_overhead", f"{_RECORD_H200}: 1000 one-element adds in 6.555 ms, issued by eager PyTorch"),
        ("kernel_floor", "assumed (the H100's): a Hopper GPU runs a one-element kernel in about 2 us"),
        ("nccl_channels", _NCCL_CHANNELS),
    ))


# FlashAttention-2 on an A100 (Dao 2023, arXiv 2307.08691, abstract): "reaching 50-73% of the
# theoretical maximum FLOPs/s on A100", forward and backward, over sequence lengths and head
# dims; the range's lower end, so no shape is favoured. The H100's 0.30 is FlashAttention-2
# there too, a kernel written for the A100's tensor cores (Shah et al. 2024): not the A100's.
_A100_ATTENTION = (0.50, "FlashAttention-2 on an A100: 50-73% of peak (Dao 2023, arXiv 2307.08691, "
                         "abstract), its lower end, a whole kernel's rate: per CTA, with no fixed cost of its "
                         "own (a K_0 and D_0 of 0), the backward at the forward's")
_A100_ATTENTION_TILES = (("attention_backward_efficiency", 0.0), ("attention_tile_overhead", (0.0, 0.0)),
                         ("attention_head_overhead", 0.0))

# The A100's own GEMM rate: MAMF's A100 SXM row (planner.gemm_measured.MAMF: 271.2 TFLOP/s at
# 1024 x 10240 x 5120, torch 2.6 / CUDA 12.6) on the tile x wave model with the H100's K_0
# (gemm_measured.tile_fraction). The same route on MAMF's H100 row gives 0.840 against the
# record's 0.854. The H100's 0.854 per tile on an A100 would price that shape at 254 TFLOP/s.
_A100_GEMM = (0.913, "MAMF's A100 SXM row (stas00/ml-engineering): 271.2 TFLOP/s at 1024x10240x5120, "
                     "tiles x waves, K + 192 a tile (the H100's K_0, assumed; gemm_measured.tile_fraction)")


HARDWARE = {
    # A100 SXM4 80GB: 312 TFLOP/s bf16 dense, 2.0 TB/s HBM2e, NVLink 3 600 GB/s both
    # directions (300 per direction), one 200 Gb/s HDR InfiniBand NIC per GPU (DGX A100);
    # fp16 as bf16, fp32 19.5 TFLOP/s without TF32 (the virtual clock's dtype_flops)
    "a100-80gb": Hardware("A100 80GB", 312e12, 80 * GiB, 2.039e12, 300e9, 25e9, sm_count=108,
                          dtype_flops=(("float16", 312e12), ("float32", 19.5e12)), **_same_kernels("A100", _A100_ATTENTION_TILES, (("attention_tile", _A100_ATTENTION[1]),),
                                          attention=_A100_ATTENTION, gemm=_A100_GEMM)),
    # H100 SXM5: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 4 900 GB/s (450 per
    # direction), one 400 Gb/s NDR NIC per GPU (DGX H100); fp16 as bf16, fp32 67 TFLOP/s without TF32
    "h100-sxm": Hardware("H100 SXM", 989e12, 80 * GiB, 3.35e12, 450e9, 50e9, sm_count=132,
                         dtype_flops=(("float16", 989e12), ("float32", 67e12)), **_H100_KERNELS),
    # H200 SXM: the H100's compute with 141 GB of HBM3e at 4.8 TB/s
    "h200": Hardware("H200", 989e12, 141e9, 4.8e12, 450e9, 50e9, sm_count=132,
                     dtype_flops=(("float16", 989e12), ("float32", 67e12)), **_H200_KERNELS),
}


def get_model(model) -> ModelSpec:
    """A ModelSpec from a preset name or a ModelSpec (anything else: ValueError)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str) and model in MODELS:
        return MODELS[model]
    raise ValueError(f"unknown model {model!r}; presets: {sorted(MODELS)}")


def get_hardware(hw) -> Hardware:
    if isinstance(hw, Hardware):
        return hw
    if isinstance(hw, str) and hw in HARDWARE:
        return HARDWARE[hw]
    raise ValueError(f"unknown hardware {hw!r}; presets: {sorted(HARDWARE)}")


def runs_flash(hw, layout, fusions=()) -> bool:
    """Whether the course's program runs FlashAttention for ``layout`` on ``hw`` (a Hardware):
    where the Hardware states ``fused_attention`` and ``fusions`` (a source's software, the dry
    run's) name no attention kernel of their own, unless the core is not causal calls the
    course's flash kernel makes: packed documents (their mask). Ring CP runs each of its blocks
    as the kernel; all-gather CP each query chunk; Ulysses its core on the gathered sequence
    put in order. The one rule the dry run (``virtual.dry_run.hardware_attention``) and the
    planner's ``runtime="course"`` apply."""
    if not getattr(hw, "fused_attention", False) or {"scale_mask_softmax", "flash_attention"} & set(fusions):
        return False
    return flash_core(layout)


def flash_core(layout) -> bool:
    """Whether ``layout``'s attention core can be FlashAttention calls (:func:`runs_flash`)."""
    return not layout.documents


# cuDNN's attention on a Hopper GPU: planner.attention_measured.fit_attention of the H200 grid's
# cuDNN columns (attention_measured.cudnn, the 36 GPU-bound causal rows), the kernel that
# F.scaled_dot_product_attention runs by default there with torch 2.11
_CUDNN_ATTENTION = dict(attention=0.8121, attention_backward_efficiency=0.7023,
                        attention_tile_overhead=(128.0, 224.0), attention_head_overhead=32.0)


def cudnn_attention(hw) -> Hardware:
    """``hw`` (a Hopper preset's name or Hardware) with its fused attention priced as cuDNN's
    kernel, which ``F.scaled_dot_product_attention`` picks by default on an H100 / H200 with torch
    2.11, instead of FlashAttention-2 (the presets' kernel, the published rows'): the same tile x
    wave model (:data:`course_lib.planner.gemm.ATTENTION_MODEL`) fitted on cuDNN's columns of the
    H200 grid (forward 7.5%, backward 5.3% log-rms). ValueError for a GPU that is not Hopper's
    132 SMs (the fit's)."""
    hw = get_hardware(hw)
    if hw.sm_count != 132:
        raise ValueError(f"cudnn_attention: its constants were fitted on a Hopper GPU's 132 SMs, "
                         f"not {hw.name}'s {hw.sm_count}")
    c = _CUDNN_ATTENTION
    eff = tuple((k, c["attention"] if k == "attention" else v) for k, v in hw.kernel_efficiency)
    note = ("cuDNN's attention (SDPA's default on Hopper, torch 2.11), fitted on the H200 grid's cuDNN "
            "columns (planner.attention_measured.cudnn): forward 0.8121 of peak a CTA, log-rms 7.5%")
    tile = "its backward 0.7023, K_0 128 / 224 rows, D_0 32: the same fit (backward log-rms 5.3%)"
    sources = tuple((k, note if k == "attention" else tile if k == "attention_tile" else v) for k, v in hw.sources)
    return hw.with_(name=hw.name + " (cuDNN attention)", kernel_efficiency=eff, sources=sources,
                    attention_backward_efficiency=c["attention_backward_efficiency"],
                    attention_tile_overhead=c["attention_tile_overhead"],
                    attention_head_overhead=c["attention_head_overhead"])


def written_out(hw) -> Hardware:
    """``hw`` (a preset name or Hardware) stating no fused kernels: the course's TinyGPT as the
    chapters run it, attention and norms in plain ops. A preset states FlashAttention
    (``fused_attention``), what published systems run and what ``planner.estimate`` and
    ``virtual.dry_run`` then price; the chapters' model writes its attention out, so the
    planner's ``runtime="course"`` count of that model takes this Hardware."""
    return get_hardware(hw).with_(fused_attention=False, fused_kernels=False)
