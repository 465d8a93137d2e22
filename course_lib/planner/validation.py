"""The planner against published numbers: ZeRO's Table 1 (memory), and the step time of
published runs that state their layouts: Korthikanti et al. 2022 Table 5, Narayanan et
al. 2021 Table 1 (both Megatron-LM on A100s), BLOOM's run (Megatron-DeepSpeed on A100s)
and Llama 3's Table 4 (Dubey et al. 2024, H100s, with context parallelism at 128k tokens).

Every row of a source uses the same hardware preset and the same rule for what the source
does not state: no per-row factor. What a source's software did is stated per source, not
fitted: Megatron-LM in 2021-22 had no FlashAttention (``MEGATRON_2022``: unfused attention,
the scores written to HBM and kept or recomputed), Llama 3 used it. A row is compared in the
source's own FLOPs convention (model FLOPs, or hardware FLOPs with recomputation). The rows
return plain dicts, so the notebook prints them and the tests assert on them.
"""
from __future__ import annotations

from course_lib.planner import formulas as F
from course_lib.planner.estimate import estimate
from course_lib.layout import split_with_ends
from course_lib.planner.layout import Layout
from course_lib.planner.presets import HARDWARE, MODELS, ModelSpec, gpt_spec

# Megatron-LM of 2021-22 on A100s: attention not fused (scale-mask-softmax kernel between two
# batched GEMMs, the s x s scores through HBM; FlashAttention came later, Dao et al. 2022)
# and its GEMMs at the rate its own software reached. The a100-80gb preset's per-tile fraction
# (0.913) is MAMF's best shape on torch 2.6 / CUDA 12.6 (2024); Korthikanti et al. 2022 timed
# one layer of their 22B model on Selene's A100s, forward and backward, in five configurations
# (Table 4: ten times). The clock runs that layer (``course_lib.lab.layer_times``) with every
# constant as stated but the GEMM's per-tile fraction, which is the one value that minimises
# the log-rms error over the ten times (``layer_times.fit_gemm``: mean |error| 1.3%, worst 3.2%,
# against 7.9% / 12.4% at MAMF's 0.913). Fitted on that layer table, never on a step time:
# every step-time row of the validation (Table 5 included) is checked with it.
MEGATRON_2022_GEMM = 0.797
MEGATRON_2022_GEMM_SOURCE = ("Korthikanti et al. 2022 (arXiv 2205.05198), Table 4: one layer of GPT 22B, tp 8, "
                             "forward and backward in five configurations on Selene's A100s; the per-tile "
                             "fraction that minimises the clock's log-rms error over those ten times "
                             "(course_lib.lab.layer_times.fit_gemm), Megatron-LM's 2021-22 cuBLAS")
MEGATRON_2022 = HARDWARE["a100-80gb"].with_(fused_attention=False).with_kernel_rate(
    "gemm", MEGATRON_2022_GEMM, MEGATRON_2022_GEMM_SOURCE)

# Rajbhandari et al. 2020, Table 1: model-state GB per device of a 7.5B model (K = 12)
# under ZeRO stages 1 / 2 / 3 (P_os, P_os+g, P_os+g+p), for each DP degree.
ZERO_TABLE1 = {1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5),
               64: (31.4, 16.6, 1.88), 256: (30.4, 15.4, 0.47), 1024: (30.1, 15.1, 0.12)}
ZERO_PSI = 7.5e9


def zero_table1(tolerance: float = 0.01) -> list[dict]:
    """Our ZeRO memory next to the paper's Table 1 (GB = 1e9 bytes).

    A row passes if it is within ``tolerance`` relative, or within half a unit of the
    last digit the paper prints (0.12 GB is 0.1172 rounded).
    """
    rows = []
    for dp, paper in ZERO_TABLE1.items():
        for stage, gb in zip((1, 2, 3), paper):
            ours = F.zero_memory_bytes(ZERO_PSI, stage, dp)["total"] / 1e9
            decimals = len(str(gb).split(".")[1]) if "." in str(gb) else 0
            rounding = 0.5 * 10 ** -decimals
            rel = (ours - gb) / gb
            rows.append({"devices": dp, "stage": stage, "paper_GB": gb, "ours_GB": ours, "rel_err": rel,
                         "ok": abs(rel) <= tolerance or abs(ours - gb) <= rounding + 1e-12})
    return rows


# Korthikanti et al. 2022, Tables 3 and 5: A100 GPUs, sequence 2048, TP 8, sequence
# parallelism + selective recomputation; DP 1.
# (model preset, PP, global batch, paper's iteration time s, paper's MFU)
KORTHIKANTI_TABLE5 = [("megatron-22b", 1, 4, 1.10, 0.415), ("megatron-175b", 8, 64, 13.75, 0.514),
                      ("megatron-530b", 35, 280, 37.83, 0.560), ("gpt-1t", 64, 512, 71.49, 0.563)]
# What the paper states of each row's schedule, keyed by (PP, global batch): Table 3's "Micro
# Batch Size" (4 for 22B, 1 for the others) and Sec. 6: "We use the interleaving schedule with
# three interleaving stages (m = 3) for the 175B and 530B models" (v = 3 chunks per stage; the 1T
# row is not named: 1F1B, v = 1). (micro-batch, v)
KORTHIKANTI_SCHEDULE = {(1, 4): (4, 1), (8, 64): (1, 3), (35, 280): (1, 3), (64, 512): (1, 1)}


# Korthikanti et al. 2022, Table 5's "Full Recompute" column: the same rows (Table 3's layouts,
# Sec. 6's schedules: KORTHIKANTI_SCHEDULE) with full activation recomputation and NO sequence
# parallelism (Sec. 6.3: "performing full recomputation without sequence parallelism"); the
# paper's iteration time, s. (model preset, PP, global batch, seconds)
KORTHIKANTI_FULL_RECOMPUTE = [("megatron-22b", 1, 4, 1.42), ("megatron-175b", 8, 64, 18.13),
                              ("megatron-530b", 35, 280, 49.05), ("gpt-1t", 64, 512, 94.42)]


# Korthikanti et al. 2022, Sec. 6.3: "if we scale the 530B model to 8-way data parallellism
# (2240 GPUs) while keeping batch size per model instance constant ... the time per iteration
# increases slightly from 37.83 seconds to 39.15 seconds ... we do not use any overlapping of
# gradient all-reduces with back-propagation": Table 5's 530B row with DP 8 and 8 x 280
# sequences. (model preset, PP, DP, global batch, seconds)
KORTHIKANTI_DP8 = [("megatron-530b", 35, 8, 2240, 39.15)]


def korthikanti_layout(model, pp: int, global_batch: int, sp: bool = True, recompute: str = "selective") -> Layout:
    """The paper's layout for one row of Table 5: TP 8 with SP, selective recomputation (or the
    ``sp`` and ``recompute`` of another column: ``False, "full"``, the "Full Recompute" one), the
    micro-batch and interleaving the paper states (:data:`KORTHIKANTI_SCHEDULE`)."""
    micro_batch, v = KORTHIKANTI_SCHEDULE[(pp, global_batch)]
    if pp == 1:
        return Layout(tp=8, sp=sp, recompute=recompute, micro_batch=micro_batch, global_batch=global_batch)
    if v == 1:
        return Layout(tp=8, pp=pp, sp=sp, recompute=recompute, schedule="1f1b", micro_batch=micro_batch,
                      global_batch=global_batch)
    return Layout(tp=8, pp=pp, sp=sp, recompute=recompute, schedule="interleaved", v=v,
                  micro_batch=micro_batch, global_batch=global_batch)


def korthikanti_full_recompute(hardware=None, tolerance: float = 0.15) -> list[dict]:
    """The planner's step time next to Table 5's "Full Recompute" column
    (:data:`KORTHIKANTI_FULL_RECOMPUTE`), every row on ``MEGATRON_2022`` unless ``hardware``."""
    hw = hardware or MEGATRON_2022
    rows = []
    for name, pp, gbs, paper_time in KORTHIKANTI_FULL_RECOMPUTE:
        model = MODELS[name]
        layout = korthikanti_layout(model, pp, gbs, sp=False, recompute="full")
        est = estimate(model, hw, layout)
        rows.append(_row("Korthikanti 2022 T5 full recompute", model.name, layout.n_gpus, layout, "step s",
                         paper_time, est.step_time, est, tolerance))
    return rows


def korthikanti_dp8_layout(model, pp: int, dp: int, global_batch: int) -> Layout:
    """Sec. 6.3's run: Table 5's layout for the row (the same micro-batches per model instance)
    with ``dp`` replicas of it, the gradients all-reduced after the backward (not overlapped)."""
    return korthikanti_layout(model, pp, global_batch // dp).with_(dp=dp, global_batch=global_batch,
                                                                    overlap_dp=False)


def korthikanti_dp8(hardware=None, tolerance: float = 0.15) -> list[dict]:
    """The planner's step time next to Sec. 6.3's 530B at 8-way DP (:data:`KORTHIKANTI_DP8`)."""
    hw = hardware or MEGATRON_2022
    rows = []
    for name, pp, dp, gbs, paper_time in KORTHIKANTI_DP8:
        model = MODELS[name]
        layout = korthikanti_dp8_layout(model, pp, dp, gbs)
        est = estimate(model, hw, layout)
        rows.append(_row("Korthikanti 2022 Sec. 6.3", model.name, layout.n_gpus, layout, "step s",
                         paper_time, est.step_time, est, tolerance))
    return rows


def korthikanti_table5(hardware=None, tolerance: float = 0.15) -> list[dict]:
    """Predicted MFU next to the paper's, every row on the same hardware parameters
    (default ``MEGATRON_2022``)."""
    hw = hardware or MEGATRON_2022
    rows = []
    for name, pp, gbs, paper_time, paper_mfu in KORTHIKANTI_TABLE5:
        model = MODELS[name]
        layout = korthikanti_layout(model, pp, gbs)
        est = estimate(model, hw, layout)
        # the paper's MFU from the paper's time and our FLOP count: the count agrees
        mfu_from_time = est.model_flops / (paper_time * layout.n_gpus * hw.peak_flops)
        rel = est.mfu / paper_mfu - 1
        rows.append({"model": model.name, "GPUs": layout.n_gpus, "PP": pp, "v": layout.chunks,
                     "paper_time_s": paper_time, "ours_time_s": est.step_time,
                     "paper_MFU": paper_mfu, "MFU_from_paper_time": mfu_from_time,
                     "ours_MFU": est.mfu, "rel_err": rel, "ok": abs(rel) <= tolerance,
                     "memory_GiB": est.memory["total"] / 2**30})
    return rows


# Narayanan et al. 2021, Table 1 (weak scaling on Selene, A100 80GB, s = 2048, V = 51200):
# (billions of parameters, heads, hidden, layers, TP, PP, GPUs, global batch, TFLOP/s per GPU).
# The paper counts 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per step: hardware FLOPs with full
# activation recomputation (its Sec. 5.1 and appendix), which every run used.
NARAYANAN_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def narayanan_table1(hardware=None, tolerance: float = 0.15) -> list[dict]:
    """Predicted hardware TFLOP/s per GPU next to the paper's. The table states TP, PP, the
    GPUs and the batch; one rule for the rest: DP = GPUs / (TP PP), full recomputation, no
    sequence parallelism (it came in 2022), the 1F1B schedule, micro-batch 1, no ZeRO."""
    hw = hardware or MEGATRON_2022
    rows = []
    for billions, a, h, L, tp, pp, gpus, gbs, paper in NARAYANAN_TABLE1:
        model = gpt_spec(f"GPT {billions:g}B", L, h, a)
        layout = Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, global_batch=gbs, recompute="full")
        est = estimate(model, hw, layout)
        ours = est.hardware_flops / (est.step_time * gpus) / 1e12
        rows.append(_row("Narayanan 2021 T1", model.name, gpus, layout, "HFU TFLOP/s", paper, ours, est, tolerance))
    return rows


# Dubey et al. 2024 (Llama 3), Table 4: Llama 3 405B on H100s, 16M tokens per batch.
# (GPUs, TP, CP, PP, DP, sequence length, TFLOP/s per GPU); BF16 MFU 43%, 41%, 38%.
LLAMA3_TABLE4 = [(8192, 8, 1, 16, 64, 8192, 430), (16384, 8, 1, 16, 128, 8192, 400),
                 (16384, 8, 16, 16, 8, 131072, 380)]


# Llama 3's chunks per pipeline rank as Sec. 3.3.2 states them: "we reduce one Transformer
# layer each from the first and the last stages ... the first model chunk on the first stage has
# only the embedding, and the last model chunk on the last stage has only output projection and
# loss": 126 layers + the embedding + the output = 128 one-layer slots = 16 ranks x 8 chunks of
# one slot each, bubble (PP - 1) / (V M) with V = 8. The course cuts it as stated
# (``Layout.stage_layers`` = ``course_lib.layout.split_with_ends``: the embedding and the head
# weigh one layer each, torchtitan's input_weight / output_weight).
LLAMA3_V_PAPER = 8


def llama3_layout(tp, cp, pp, dp, seq_len, recompute="selective", v=LLAMA3_V_PAPER) -> Layout:
    """Llama 3's layout for one row of Table 4. Stated (Sec. 3.3.2): TP, CP, PP, DP, 16M
    tokens per step, FSDP sharding optimizer states and gradients (ZeRO-2), an interleaved
    pipeline schedule, CP as an all-gather of K and V, and the pipeline's balance: the
    embedding and the output each weigh one layer (:func:`~course_lib.layout.split_with_ends`),
    v = :data:`LLAMA3_V_PAPER` chunks per rank (``v``: another count, cut by the same rule). One
    rule for what is not stated: sequence parallelism on, micro-batch 1, recompute="selective"
    (with fused attention it stores what "none" stores)."""
    return Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=2, sp=True, schedule="interleaved", v=v,
                  global_batch=16 * 2**20 // seq_len, seq_len=seq_len, recompute=recompute,
                  cp_comm="all_gather", stage_layers=split_with_ends(MODELS["llama3-405b"].n_layers, pp * v))


def llama3_table4(hardware=None, tolerance: float = 0.15, recompute="selective") -> list[dict]:
    """Predicted model TFLOP/s per GPU (full-attention convention, as Megatron and PaLM; the
    paper does not say which it counts) next to Table 4's."""
    hw = hardware or HARDWARE["h100-sxm"]
    rows = []
    for gpus, tp, cp, pp, dp, s, paper in LLAMA3_TABLE4:
        layout = llama3_layout(tp, cp, pp, dp, s, recompute)
        est = estimate("llama3-405b", hw, layout)
        ours = est.model_flops / (est.step_time * gpus) / 1e12
        row = _row("Llama 3 T4", f"Llama 3 405B, {s // 1024}k", gpus, layout, "model TFLOP/s", paper, ours, est,
                   tolerance)
        row["ours_causal"] = est.flops["model_causal"] / (est.step_time * gpus) / 1e12
        rows.append(row)
    return rows


# Liu et al. 2025, "MoE Parallel Folding" (arXiv 2504.14960v2), Tables 2-3: Mixtral 8x22B on 128
# H100s in BF16 on Megatron-Core, global batch 256 of 4096 tokens, token dropping at capacity
# factor 1, with and without folding the experts' mesh apart from attention's (TFLOP/s per GPU,
# Megatron's model FLOPs: 487.7 is the paper's 49.3% MFU of 989). The authors' ModelZoo
# (Megatron-MoE-ModelZoo, model_configs/benchmarking/Mixtral-8x22B.yaml) states what the paper
# does not: micro-batch 1 (its runtime.conf), sequence parallelism, the distributed optimizer
# (ZeRO-1 over each parameter's data-parallel ranks; an expert's over its expert-data-parallel
# group), no dropout, no recomputation flag. (row, TP, EP, ETP, PP, DP, TFLOP/s per GPU).
MOE_FOLDING_2025 = [("A1", 2, 8, 1, 8, 8, 487.7), ("A2", 2, 4, 2, 8, 8, 458.3)]   # A1 folded, A2 not


def moe_folding_layout(tp: int, ep: int, etp: int, pp: int, dp: int) -> Layout:
    """One row of :data:`MOE_FOLDING_2025`: Megatron-Core's expert mesh (etp x ep x edp over a
    stage's innermost ranks: ``fold_order="tp_first"``), the distributed optimizer (ZeRO-1),
    sequence parallelism, micro-batch 1 of 4096 tokens, 256 a step, 1F1B (VPP 1)."""
    return Layout(dp=dp, tp=tp, pp=pp, ep=ep, etp=etp, sp=True, zero=1, micro_batch=1, global_batch=256,
                  seq_len=4096, recompute="none", fold_order="tp_first")


# BLOOM (BigScience 2022; model card and training notes): 176B parameters, 70 layers, h = 14336,
# 112 heads, vocabulary 250880, s = 2048, GeLU, LayerNorm, biases, tied embeddings, ALiBi (no
# learned positions); 384 A100 80GB in 48 nodes of Jean Zay (4 x 100 Gb/s Omni-Path per node:
# 6.25 GB/s per GPU), TP 4 x PP 12 x DP 8 with ZeRO-1, micro-batch 2, global batch 2048;
# "about 150 TFLOPs" per GPU, counted by Megatron-DeepSpeed's formula (hardware FLOPs, with
# recomputation when it is on).
BLOOM = ModelSpec("BLOOM 176B", 70, 14336, 112, 112, 4 * 14336, 250880, 2048, mlp="gelu", tied=True, bias=True,
                  norm="layernorm")
JEAN_ZAY = MEGATRON_2022.with_(name="A100 80GB (Jean Zay)", network_bandwidth=4 * 100e9 / 8 / 8)


# DeepSpeed's rank order (deepspeed/runtime/pipe/topology.py, PipeModelDataParallelTopology:
# axes ['pipe', 'data', 'model'], row-major), which BLOOM's Megatron-DeepSpeed builds
BLOOM_ORDER = ("pp", "dp", "tp")


def bloom_row(hardware=None, tolerance: float = 0.15) -> list[dict]:
    """BLOOM's run: stated layout, Megatron-DeepSpeed (2022: unfused attention, no sequence
    parallelism, no selective recomputation). Recomputation is not stated: the rule is the
    least recomputation whose memory fits in HBM (the run ran). Its ranks are numbered as
    DeepSpeed's PipeModelDataParallelTopology numbers them (axes pipe, data, model: the pipeline
    outermost), so every pipeline hop crosses nodes."""
    hw = hardware or JEAN_ZAY
    for rc in ("none", "full"):
        layout = Layout(dp=8, tp=4, pp=12, zero=1, micro_batch=2, global_batch=2048, recompute=rc,
                        order=BLOOM_ORDER)
        est = estimate(BLOOM, hw, layout)
        if est.fits:
            break
    ours = est.hardware_flops / (est.step_time * layout.n_gpus) / 1e12
    row = _row("BLOOM 2022", f"{BLOOM.name} ({layout.recompute})", layout.n_gpus, layout, "HFU TFLOP/s", 150.0,
               ours, est, tolerance)
    return [row]


def _row(source, model, gpus, layout, metric, paper, ours, est, tolerance) -> dict:
    rel = ours / paper - 1
    return {"source": source, "model": model, "GPUs": gpus,
            "layout": f"TP{layout.tp} CP{layout.cp} PP{layout.pp} DP{layout.dp}", "metric": metric,
            "paper": paper, "ours": ours, "rel_err": rel, "ok": abs(rel) <= tolerance,
            "memory_GiB": est.memory["total"] / 2**30, "fits": est.fits}


def published_rows(tolerance: float = 0.15) -> list[dict]:
    """Every published step-time row, in one format (Korthikanti's MFU as a percentage)."""
    rows = []
    for r in korthikanti_table5(tolerance=tolerance):
        rows.append({"source": "Korthikanti 2022 T5", "model": r["model"], "GPUs": r["GPUs"],
                     "layout": f"TP8 CP1 PP{r['PP']} DP1", "metric": "MFU %", "paper": 100 * r["paper_MFU"],
                     "ours": 100 * r["ours_MFU"], "rel_err": r["rel_err"], "ok": r["ok"],
                     "memory_GiB": r["memory_GiB"], "fits": r["memory_GiB"] <= 80})
    return rows + narayanan_table1(tolerance=tolerance) + bloom_row(tolerance=tolerance) + \
        llama3_table4(tolerance=tolerance)


def error_by_source(rows: list[dict]) -> list[dict]:
    """Mean and worst |relative error| per source, and how many rows fit in HBM."""
    out = []
    for source in dict.fromkeys(r["source"] for r in rows):
        errs = [abs(r["rel_err"]) for r in rows if r["source"] == source]
        out.append({"source": source, "rows": len(errs), "mean_abs_err": sum(errs) / len(errs),
                    "worst_abs_err": max(errs), "within_15%": sum(e <= 0.15 for e in errs),
                    "fit_in_HBM": sum(r["fits"] for r in rows if r["source"] == source)})
    return out


def format_rows(rows: list[dict], formats: dict | None = None) -> str:
    """A fixed-width text table of ``rows`` (stable output for the notebook)."""
    formats = formats or {}
    cols = list(rows[0])

    def cell(col, val):
        if col in formats:
            return format(val, formats[col])
        if isinstance(val, bool):
            return "yes" if val else "NO"
        if isinstance(val, float):
            return f"{val:.4g}"
        return str(val)
    table = [[cell(c, r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in table]
    return "\n".join(lines)
