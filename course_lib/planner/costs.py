"""What one pipeline stage costs: memory held, and the duration of each piece of work
of one micro-batch (compute, and the communication each dimension adds).

``estimate`` composes these pieces analytically, the simulator composes the very same
pieces event by event; only the composition differs, so the two can be compared.

What overlaps with what (the assumptions, stated once):

- TP collectives sit on the critical path (the next matmul needs their result).
- CP's ring (``layout.cp_comm="ring"``) passes K/V while attention computes, hop by hop: in each of the cp - 1 steps
  the next block's K/V travels while this block's attention runs, and only the excess of
  the hop over the block's attention is exposed (backward: K/V and the dK/dV accumulator,
  whose last hop home is exposed).
  Causal attention is load-balanced over the CP ranks (the zigzag layout of the CP chapter).
  Packed documents (``layout.documents``) under a fused (varlen) attention kernel: the layer's
  attention costs the slowest CP rank's visible pairs (:mod:`.documents`), so the split
  (``cp_layout``) shows; an unfused kernel computes the masked scores anyway.
  Llama 3's all-gather CP (``cp_comm="all_gather"``) is exposed.
- Matmuls run at the efficiency of their shape (:mod:`course_lib.planner.gemm`).
- EP's all-to-alls and PP's sends are exposed (a send blocks its stage); each pipeline hop
  on NVLink or the network by its own two ranks' nodes (:mod:`.pipeline_hops`). Without
  sequence parallelism a stage's t tensor-parallel ranks each send 1/t of the message and the
  receiver all-gathers the pieces over its TP group (Megatron-LM's scatter/gather, DeepSpeed's
  partitioned pipe); the course's runtime sends it whole.
- DP's gradient reduction overlaps the last micro-batch's backward and the ZeRO
  parameter all-gather the next forward, when ``layout.overlap_dp``; ZeRO-2/3's
  per-micro-batch collectives overlap that micro-batch's compute.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from course_lib.planner import formulas as F
from course_lib.planner import gemm as G
from course_lib.planner.async_tp import async_tp_hop, async_tp_layer, transformer_steps
from course_lib.planner.documents import attention_scale
from course_lib.planner.activations import (course_layer_activation_bytes, head_w_kept_bytes, layer_activation_bytes,
                                            w_kept_bytes_per_layer)
from course_lib.layout import rank_order
from course_lib.planner.layout import (Layout, expert_holders, holds_head, intra_node, layers_per_chunk,
                                      layers_per_stage, strides)
from course_lib.planner.numerics import numerics
from course_lib.schedules import stage_rank
from course_lib.planner.pipeline_hops import stage_send_time
from course_lib.planner.presets import Hardware, ModelSpec, flash_core

# Bytes of HBM traffic per parameter in an AdamW step: the precision's
# (numerics.Numerics.optimizer_bytes: 28 under "full", the fp32 master weight, momentum and
# variance read and written, the bf16 gradient read, the bf16 weight written). The step is
# memory bound, so time = bytes / HBM bandwidth.
# The logits of the last stage: bf16 logits plus the fp32 softmax the loss keeps.
LOGIT_BYTES = 2 + 4


@dataclass
class StageCost:
    stage: int
    layers: int
    params: float                 # parameters this GPU holds (before ZeRO sharding)
    expert_params: float          # of which expert weights (reduced over dp * cp / ep ranks)
    memory: dict                  # bytes by category, and "total"
    fwd: dict                     # seconds per micro-batch (all chunks of the stage) by kind
    bwd: dict
    p2p: float                    # seconds for one activation (or gradient) send
    grad_sync: float              # DP gradient all-reduce / reduce-scatter, whole step
    param_gather: float           # ZeRO-1/2 all-gather of updated parameters
    optimizer: float
    comm_bytes: dict = field(default_factory=dict)   # bytes this GPU sends per step, by dimension
    gemm_flops: float = 0.0       # matmul FLOPs this GPU runs per micro-batch (all chunks)
    loss_sync: float = 0.0        # the loss's all-reduce after the step (runtime="course")
    kernels: int = 0              # kernels this GPU launches per step (runtime="course")
    calls: dict = field(default_factory=dict)        # collectives and sends per step, by mesh dims
    # seconds per micro-batch (all chunks) of the fwd / bwd times that are the host's issue beyond
    # the device's work (runtime="course"; 0: launches hidden): a stage waiting for its input has
    # its host issue them meanwhile (estimate.pipeline_time)
    host: tuple = (0.0, 0.0)
    # ZeRO-2 reduced chunk by chunk in the schedule (formulas.zero_rounds): one chunk's
    # reduce-scatters' seconds, each waited for at the end of the round after its own
    round_reduce: float = 0.0
    # a schedule that splits its backwards (formulas.SPLIT): the seconds of W per micro-batch (all
    # chunks), inside ``bwd`` (0: the formula's convention, half the backward); ``bwd`` is the whole
    # backward, and a split one (B, then W) runs ``w_fused`` seconds less: the adds into .grad that
    # W's GEMMs do themselves (runtime="course")
    w_time: float = 0.0
    w_fused: float = 0.0

    @property
    def fwd_time(self) -> float:
        return sum(self.fwd.values())

    @property
    def bwd_time(self) -> float:
        return sum(self.bwd.values())


def _split_params(model: ModelSpec, layout: Layout, stage: int, n_layers: int):
    """(dense params, expert params) this GPU holds on ``stage``: the dense ones cut by TP, the
    experts by the expert mesh folded over the same ranks (EP x ETP, Megatron-Core's folding)."""
    parts = F.param_breakdown(model)
    expert_layer = model.n_experts * parts["mlp_one_expert"] if model.n_experts > 1 else 0
    dense_layer = parts["per_layer"] - expert_layer
    dense = n_layers * dense_layer
    if stage == 0:
        dense += parts["embedding"]
    if holds_head(layout, stage):
        # the final norm, and the LM head: a tied head is a second copy on the last stage when it is
        # not the first (Megatron's word-embedding copy), the embedding itself where one rank holds
        # both (pp = 1; a V schedule's rank 0)
        dense += F.param_count(model) - model.n_layers * parts["per_layer"] - parts["embedding"] - parts["lm_head"]
        dense += parts["lm_head"] or (model.vocab * model.hidden if stage != 0 else 0)
    return dense / layout.tp, n_layers * expert_layer / (layout.ep * layout.etp)   # the folded expert mesh


def _chunk_shares(model: ModelSpec, layout: Layout, per_chunk: list) -> dict:
    """{chunk: its share of its pp rank's parameters}: its layers, the embedding with the
    first chunk, the final norm and LM head with the last (a tied head's copy as
    :func:`_split_params` counts it)."""
    placement = "v" if layout.schedule in F.V_SCHEDULES else "loop"
    parts = F.param_breakdown(model)
    head = F.param_count(model) - model.n_layers * parts["per_layer"] - parts["embedding"]
    size = {k: n * parts["per_layer"] + (parts["embedding"] if k == 0 else 0)
            + (head if k == len(per_chunk) - 1 else 0) for k, n in enumerate(per_chunk)}
    rank = {k: stage_rank(k, layout.pp, placement) for k in size}
    total = {r: sum(v for k, v in size.items() if rank[k] == r) for r in set(rank.values())}
    return {k: v / total[rank[k]] if total[rank[k]] else 0.0 for k, v in size.items()}


RUNTIMES = ("megatron", "course")


def stage_costs(model: ModelSpec, hw: Hardware, layout: Layout, runtime: str = "megatron") -> list[StageCost]:
    """Every stage's cost. ``runtime="megatron"`` (default): the published systems the planner is
    validated against; ``"course"``: the course's own program (:mod:`course_lib.planner.runtime`),
    its times replacing the compute and communication ones, its activations what the course's
    program keeps (:func:`~course_lib.planner.activations.course_layer_activation_bytes`: the
    softmax output, no dropout); the states and bytes sent are the same."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    out = _megatron_stage_costs(model, hw, layout, course=runtime == "course")
    if runtime == "course":
        from course_lib.planner.runtime import stage_parts
        for st in out:
            r = stage_parts(model, hw, layout, st.stage, st.layers)
            st.fwd, st.bwd, st.p2p, st.grad_sync = r["fwd"], r["bwd"], r["p2p"], r["grad_sync"]
            st.param_gather = r["param_gather"]            # ZeRO-1/2's gather at the step's start
            st.optimizer, st.loss_sync, st.kernels, st.calls = r["optimizer"], r["loss_sync"], r["kernels"], r["calls"]
            st.round_reduce = r["round_reduce"]
            st.w_time, st.w_fused = r["w_time"], r["w_fused"]
            st.host = r["host"]
    return out


def _megatron_stage_costs(model: ModelSpec, hw: Hardware, layout: Layout, course: bool = False) -> list[StageCost]:
    # The planner's GEMMs: tiles x waves at its own planning rate, ``matmul_efficiency`` of a
    # whole GEMM (0.70, assumed: a published system's GEMM losses, the tile's fixed cost among
    # them). The clock's measured per-tile cost K_0 (gemm_tile_overhead, fitted with the
    # record's per-tile fraction on XLA's H100 table) belongs to that fraction, not to 0.70.
    hw = hw.with_(gemm_tile_overhead=0.0)
    s = layout.seq_len or model.seq_len
    b, t, c, p, m = layout.micro_batch, layout.tp, layout.cp, layout.pp, layout.microbatches
    h = model.hidden
    tokens = b * s / c                               # tokens of one micro-batch on this GPU
    fused = hw.fused_attention
    # matmul seconds of one layer / the head for one micro-batch, by the GEMMs' shapes
    lg_f, lg_b = G.layer_gemms(model, s, b, t, c, layout.ep, layout.recompute, fused, etp=layout.etp,
                               sp=layout.sp)
    lf, lb = G.gemms_time(lg_f, hw), G.gemms_time(lg_b, hw)
    if layout.documents and fused:   # packed documents: a varlen kernel runs the slowest CP rank's pairs
        scale = attention_scale(s, c, layout.cp_layout if c > 1 else "contiguous", layout.documents) - 1
        doc_f, doc_b = G.attention_gemms(model, s, b, t, c, fused)
        lf, lb = lf + scale * G.gemms_time(doc_f, hw), lb + scale * G.gemms_time(doc_b, hw)
    hg_f, hg_b = G.head_gemms(model, s, b, t, c)
    hf, hb = G.gemms_time(hg_f, hw), G.gemms_time(hg_b, hw)
    layer_ran = G.gemms_flops(lg_f) + G.gemms_flops(lg_b)
    head_ran = G.gemms_flops(hg_f) + G.gemms_flops(hg_b)
    a_tp, bw_tp = hw.link(intra_node(layout, hw, "tp"))
    a_cp, bw_cp = hw.link(intra_node(layout, hw, "cp"))
    a_dp, bw_dp = hw.link(intra_node(layout, hw, "dp"))
    a_ep, bw_ep = hw.link(intra_node(layout, hw, "ep"))
    a_etp, bw_etp = hw.link(intra_node(layout, hw, "etp"))
    act = b * s * h * 2 / c                           # bytes of one (s/cp, b, h) bf16 activation

    # TP per layer: 2 all-reduces forward, 2 backward, (+2 for full recompute); with SP
    # each is a reduce-scatter + an all-gather of the same total size. Async TP decomposes each
    # of them into t - 1 hops of act / t bytes, each beside one chunk's matmuls
    # (planner.async_tp: (t - 1) max(0, hop - step) per op, the steps of each op's own GEMMs).
    def tp_time(n_collectives):
        if t == 1:
            return 0.0
        if layout.sp:
            return n_collectives * (F.collective_time("reduce_scatter", act, t, a_tp, bw_tp)
                                    + F.collective_time("all_gather", act, t, a_tp, bw_tp))
        return n_collectives * F.collective_time("all_reduce", act, t, a_tp, bw_tp)
    tp_fwd_layer = tp_time(2)
    tp_bwd_layer = tp_time(4 if layout.recompute == "full" else 2)
    if t > 1 and layout.sp and getattr(layout, "async_tp", False):
        hop = async_tp_hop(hw, act / t, intra_node(layout, hw, "tp"))
        kv = model.n_kv_heads * model.head_dim
        up = (2 if model.mlp == "swiglu" else 1) * model.ffn
        steps_f, steps_b = transformer_steps(lambda M, N, K: G.gemm_time(M, N, K, hw), tokens, h, h + 2 * kv,
                                             up, model.ffn, t, dense_mlp=model.n_experts <= 1)
        tp_fwd_layer = async_tp_layer(hop, steps_f, t)
        tp_bwd_layer = async_tp_layer(hop, steps_b + (steps_f if layout.recompute == "full" else []), t)
    # CP per layer: ring attention passes K and V (this TP rank's heads) c-1 times, hop by
    # hop under the attention of the block in hand (1/c of this rank's attention)
    kv_local = max(1, model.n_kv_heads // t) * model.head_dim
    kv_bytes = 2 * s * b * kv_local * 2              # K and V of the whole sequence, bf16
    cp_fwd_layer = cp_bwd_layer = 0.0
    if c > 1 and layout.cp_comm == "all_gather":
        # Llama 3's CP: all-gather K and V before attention (again in backward), reduce-scatter
        # dK and dV after it; on the critical path
        cp_fwd_layer = F.collective_time("all_gather", kv_bytes, c, a_cp, bw_cp)
        cp_bwd_layer = cp_fwd_layer + F.collective_time("reduce_scatter", kv_bytes, c, a_cp, bw_cp)
    elif c > 1:
        at_f, at_b = G.attention_gemms(model, s, b, t, c, fused)
        hop = F.collective_time("send_recv", kv_bytes / c, 2, a_cp, bw_cp)
        cp_fwd_layer = (c - 1) * max(0.0, hop - G.gemms_time(at_f, hw) / c)
        # backward: K/V and the dK/dV accumulator per hop; the accumulator's last hop home is exposed
        cp_bwd_layer = (c - 1) * max(0.0, 2 * hop - G.gemms_time(at_b, hw) / c) + hop
    # EP per layer (forward; the backward the same): the payloads of the folded expert mesh's
    # dispatch and combine (F.moe_dispatch_payloads), each token routed on one TP rank (SP)
    ep_tokens = tokens / (t if layout.sp else 1)
    ep_layer = _ep_time(model, layout, ep_tokens, h, (a_ep, bw_ep), (a_etp, bw_etp))
    p2p_bytes = act / (t if layout.sp else 1)
    # Megatron-LM's scatter/gather of a pipeline message (Narayanan et al. 2021, Sec. 4.1; on by
    # default, de7dc40 to 55ba1f7b: --no-scatter-gather-tensors-in-pipeline is store_false) and
    # DeepSpeed's partitioned pipe (PipelineEngine's is_pipe_partitioned = is_model_parallel,
    # 2020-22): without sequence parallelism each tensor-parallel rank sends 1/t of the
    # activation (or gradient), the receiver all-gathers the pieces over its TP group. Under SP
    # each rank's message is already its own s/t; the course's program sends it whole.
    scatter = t if (t > 1 and not layout.sp and not course and (s * b * h) % t == 0) else 1

    # non-matmul kernels are memory bound: they stream the layer's activations through
    # HBM (with a fused attention kernel, not the s x s scores)
    stream = hw.elementwise_passes * layer_activation_bytes(
        model, s, b, t, layout.sp, "none", cp=c, fused_attention=fused,
        fused_kernels=hw.fused_kernels) / hw.hbm_bandwidth
    ew_fwd_layer = stream
    ew_bwd_layer = 2 * stream + (stream if layout.recompute == "full" else 0.0)

    num = numerics(layout.precision)                  # the bytes of the gradients' sums and the step
    ew_rate = hw.hbm_bandwidth                        # (memory bound, as the stream above)
    n_zero = layout.dp * c                            # ranks holding the same parameters
    # HSDP: FSDP over the shard group (shard_size dp ranks x cp), replicas over the rest
    n_shard = layout.shard_size * c if layout.data == "hsdp" else n_zero
    n_replicas = n_zero // n_shard
    a_sh, bw_sh = hw.link(layout.shard_size * strides(layout)["dp"] <= hw.gpus_per_node) if n_replicas > 1 \
        else (a_dp, bw_dp)
    out = []
    for st, n_l in enumerate(layers_per_stage(model, layout)):
        dense, expert = _split_params(model, layout, st, n_l)
        n_exp_group = expert_holders(layout)              # the ranks holding the same experts
        last, head = st == p - 1, holds_head(layout, st)
        fwd = {"compute": n_l * lf + (hf if head else 0.0),
               "elementwise": n_l * ew_fwd_layer, "tp": n_l * tp_fwd_layer, "cp": n_l * cp_fwd_layer, "ep": n_l * ep_layer, "zero": 0.0}
        bwd = {"compute": n_l * lb + (hb if head else 0.0),
               "elementwise": n_l * ew_bwd_layer, "tp": n_l * tp_bwd_layer, "cp": n_l * cp_bwd_layer, "ep": n_l * ep_layer, "zero": 0.0}

        # DP collectives go layer by layer (DDP buckets, FSDP units): one collective per
        # layer (and one for the embedding / the head), each paying its own latency
        pieces = dp_pieces(layout, st, n_l)

        def coll(kind, n_params, N, nbytes=2, link=(a_dp, bw_dp)):
            if N <= 1 or n_params <= 0:
                return 0.0
            return F.collective_time(kind, n_params * nbytes, N, link[0] * pieces, link[1])
        # HSDP: the shard group's collectives on its (NVLink) link, then the shard all-reduced;
        # the gradients in the precision's reduce dtype (numerics.reduce bytes)
        red = num.reduce
        grad_rs = coll("reduce_scatter", dense, n_shard, red, link=(a_sh, bw_sh)) + coll("reduce_scatter", expert,
                                                                                      n_exp_group, red)
        grad_rs += coll("all_reduce", dense / n_shard, n_replicas, red)
        gather = coll("all_gather", dense, n_shard, link=(a_sh, bw_sh)) + coll("all_gather", expert, n_exp_group)
        rounds = F.zero_rounds(layout)
        if layout.zero == 0:
            grad_sync = coll("all_reduce", dense, n_zero, red) + coll("all_reduce", expert, n_exp_group, red)
            param_gather = 0.0
        elif rounds is not None:
            # ZeRO-2 reduced chunk by chunk in the schedule (layout.grad_reduce): each chunk's
            # reduce-scatter after its round, under the backwards still to come (their excess
            # exposed there); the last chunk's after the schedule
            grad_sync, param_gather = grad_rs / rounds[2], gather   # (the others: estimate.round_waits)
        elif layout.zero == 1 or (layout.zero == 2 and num.per_microbatch):
            # ZeRO-2 summing each micro-batch's gradients in its own (fp32) buffer: one
            # reduce-scatter of the sum after the schedule (Llama 3's FP32 accumulation; the ranks')
            grad_sync, param_gather = grad_rs, gather
        else:
            grad_sync, param_gather = 0.0, (gather if layout.zero == 2 else 0.0)
            # per micro-batch: ZeRO-2 reduce-scatters the gradients, ZeRO-3 also
            # all-gathers the parameters in forward and in backward; they overlap that
            # micro-batch's compute, the excess is exposed
            z_f = gather if layout.zero == 3 else 0.0
            z_b = grad_rs + (gather if layout.zero == 3 else 0.0)
            if layout.zero == 3 and layout.zeropp and n_zero > 1:   # ZeRO++: F.zeropp_bytes_per_step's
                z_f, z_b = _zeropp_times(coll, layout, hw, dense, n_zero)   # collectives, timed
                z_f += coll("all_gather", expert, n_exp_group)
                z_b += coll("reduce_scatter", expert, n_exp_group) + coll("all_gather", expert, n_exp_group)
            if layout.overlap_dp:
                fwd["zero"] = max(0.0, z_f - fwd["compute"])
                bwd["zero"] = max(0.0, z_b - bwd["compute"])
            else:
                fwd["zero"], bwd["zero"] = z_f, z_b
        shard = n_shard if layout.zero >= 1 else 1
        # an expert's ZeRO group: every rank holding it, as Megatron-Core's distributed optimizer
        # shards over its expert-data-parallel group and the course's ranks do (expert_zero_group)
        e_group = n_exp_group
        shard_e = e_group if layout.zero >= 1 else 1
        optimizer = num.optimizer_bytes * (dense / shard + expert / shard_e) / hw.hbm_bandwidth
        if num.masters:     # a mixed precision's gradient sums over the micro-batches, in the backward
            bwd["elementwise"] += num.accumulation_bytes(m) * (dense + expert) / m / ew_rate

        hpz = zeropp_node(layout, hw, n_shard) if "hpz" in layout.zeropp and layout.zero == 3 and n_shard > 1 \
            else None
        mem = _memory(model, layout, st, n_l, dense, expert, n_shard, e_group, s, fused,
                      hw.fused_kernels, hpz_node=hpz, course=course)
        m_rs = rounds[0] if rounds else 1 if num.per_microbatch else m   # ZeRO-2's reduce-scatters a step (above)
        sends = m * layout.chunks * ((0 if last and layout.chunks == 1 else 1) + (0 if st == 0 and layout.chunks == 1 else 1))
        comm = {
            "tp": (m * n_l * F.tp_bytes_per_layer(s, b, h, t, layout.sp, layout.recompute, cp=c) if t > 1 else 0.0)
            + (sends * p2p_bytes * (t - 1) / t if scatter > 1 and p > 1 else 0.0),   # the pieces' all-gathers
            "cp": m * n_l * F.cp_bytes_per_layer(s, b, kv_local, c, algorithm=layout.cp_comm) if c > 1 else 0.0,
            "pp": sends * p2p_bytes / scatter if p > 1 else 0.0,
            "dp": (sum(F.zeropp_bytes_per_step(dense, n_zero, layout.zeropp, zeropp_node(layout, hw, n_zero),
                                               microbatches=m).values()) if layout.zeropp and n_zero > 1
                   else F.hsdp_bytes_per_step(dense, n_shard, n_replicas, microbatches=m) if layout.data == "hsdp"
                   else F.dp_bytes_per_step(dense, n_zero, layout.zero, red, microbatches=m_rs) if n_zero > 1
                   else 0.0)
            + (F.dp_bytes_per_step(expert, n_exp_group, layout.zero, red, microbatches=m_rs) if n_exp_group > 1
               else 0.0),
            "ep": m * n_l * F.ep_bytes_per_layer(s, b, h, layout.ep, model.top_k, cp=c, etp=layout.etp,
                                                 dispatch=model.moe_dispatch) / (t if layout.sp else 1)
            if layout.ep * layout.etp > 1 else 0.0,
        }
        p2p = stage_send_time(layout, hw, st, p2p_bytes / scatter)   # each hop on its own link
        if scatter > 1:            # the t pieces all-gathered over the stage's tensor-parallel group
            p2p += F.collective_time("all_gather", p2p_bytes, t, a_tp, bw_tp)
        out.append(StageCost(st, n_l, dense + expert, expert, mem, fwd, bwd, p2p, grad_sync, param_gather,
                             optimizer, comm, n_l * layer_ran + (head_ran if head else 0.0),
                             round_reduce=grad_rs / rounds[2] if rounds is not None else 0.0))
    return out


def _ddp_buckets(model, layout, st, n_l, dense, expert, n_zero, n_exp_group, num) -> float:
    """Bytes of the course's DDP buckets (``GradSync``, without ZeRO or FSDP) on stage ``st``:
    made with the model and held all step, one element per gradient summed over a dimension of
    more than one rank (the dense ones over (dp, cp); with SP the norms' over tp too; the
    experts' over the ranks holding the same experts), in the reduce dtype (the masters' fp32,
    or the 16-bit model's; under "full", 2 bytes). torch's DDP holds the same by default
    (``gradient_as_bucket_view=False``); Megatron-LM's contiguous buffer is the gradients
    themselves (the planner's "megatron" runtime counts none)."""
    if layout.data != "ddp" or layout.zero != 0:
        return 0.0
    per_norm = model.hidden * (2 if model.norm == "layernorm" else 1)       # (a LayerNorm's bias too)
    norms = (2 * n_l + (1 if holds_head(layout, st) else 0)) * per_norm
    dense_summed = dense if n_zero > 1 else (norms if layout.sp and layout.tp > 1 else 0.0)
    return (dense_summed + (expert if n_exp_group > 1 else 0.0)) * (num.reduce if num.masters else 2)


def _ep_time(model, layout, tokens, h, ep_link, etp_link) -> float:
    """Seconds of one MoE layer's forward dispatch and combine on the folded expert mesh."""
    if layout.ep * layout.etp == 1:
        return 0.0
    gather = model.moe_dispatch == "all_gather"
    group = {"all_to_all": (layout.ep, ep_link),
             "all_gather": (layout.ep * layout.etp, ep_link) if gather else (layout.etp, etp_link)}
    group["reduce_scatter"] = group["all_gather"]
    payloads = F.moe_dispatch_payloads(tokens, h, model.top_k, layout.ep, layout.etp, model.moe_dispatch)
    calls = {"all_to_all": 2, "all_gather": 1, "reduce_scatter": 1}   # dispatch and combine: two all-to-alls
    return sum(calls[kind] * F.collective_time(kind, n / calls[kind], group[kind][0], *group[kind][1])
               for kind, n in payloads.items() if group[kind][0] > 1)


def _zeropp_times(coll, layout, hw, dense, n_zero):
    """(forward, backward) seconds of ZeRO++'s collectives: qwZ's int8 all-gather over the
    group, hpZ's backward all-gather and qgZ's first all-to-all inside the node (its link)."""
    G, z, q = zeropp_node(layout, hw, n_zero), layout.zeropp, F.QUANT_BYTES
    node = hw.link(True)
    ag = coll("all_gather", dense, n_zero, nbytes=q if "qwz" in z else 2)
    ag_b = coll("all_gather", dense, G, link=node) if "hpz" in z else ag
    rs = (coll("all_to_all", dense, G, nbytes=q, link=node) + coll("all_to_all", dense / G, n_zero // G, nbytes=q)
          if "qgz" in z else coll("reduce_scatter", dense, n_zero))
    return ag, ag_b + rs


def zeropp_node(layout: Layout, hw, n_zero: int) -> int:
    """ZeRO++'s node in FSDP members: the layout's ``gpus_per_node``, else the GPUs of one node
    over the ranks of the other dims inside the outermost of dp, cp (default order: tp x pp),
    cut to a divisor of the group."""
    order = rank_order(layout.order, layout.sizes)
    inner = order[min(order.index("dp"), order.index("cp")):]
    others = math.prod(layout.sizes[d] for d in inner if d not in ("dp", "cp"))
    return math.gcd(n_zero, layout.gpus_per_node or max(1, hw.gpus_per_node // others))


def dp_pieces(layout: Layout, stage: int, n_layers: int) -> int:
    """How many separate DP collectives (one per layer, plus embedding and head) a stage runs."""
    return max(1, n_layers + (stage == 0) + holds_head(layout, stage))


def _memory(model, layout, st, n_l, dense, expert, n_zero, n_exp_group, s, fused=True,
            fused_kernels=False, hpz_node=None, course=False) -> dict:
    """Bytes one GPU of stage ``st`` holds at its peak over the step, by category: the larger
    of the schedule's moment (the states with the gradient buffers the schedule holds, the
    activations and the temporaries) and the step's end (the states after it, no activation),
    as the dry run counts (:func:`course_lib.virtual.dry_run.gpu_memory`). "grads": the
    gradients at that moment ("grads_after_step" beside: the step's end is the peak where they
    are the same).
    Under ZeRO-1/2 and DDP the schedule holds every gradient whole, in the precision's
    accumulation dtype (``Numerics.accumulate``: ZeRO-2's fp32 sums, gone after the
    reduce-scatter; the bf16 model's gradients, before the masters' fp32 ones appear); ZeRO-3
    reduce-scatters them in the backward: its shards. A chunk's buffers come with its first
    backward (:func:`~course_lib.planner.formulas.gradient_moments`: an interleaved stage whose
    every forward runs before its first backward holds one chunk's with the most activations).
    ``hpz_node`` G: ZeRO++'s
    hpZ keeps a secondary copy of the 16-bit parameters sharded over the node, 2P/G more.
    ``course``: the activations the course's own program keeps
    (:func:`~course_lib.planner.activations.course_layer_activation_bytes`), and its DDP's
    buckets beside the gradients all step (:func:`_ddp_buckets`; after the step they hold them)."""
    t, c, b, p = layout.tp, layout.cp, layout.micro_batch, layout.pp
    # a mixed precision's masters hold fp32 gradients after the step (the bf16 model's freed)
    num = numerics(layout.precision)
    g = 4 if num.masters else 2
    z = F.zero_memory_bytes(dense, layout.zero, n_zero, grad_bytes=g)
    ze = F.zero_memory_bytes(expert, layout.zero, n_exp_group, grad_bytes=g)
    per_layer = (course_layer_activation_bytes(model, s, b, t, layout.sp, layout.recompute, cp=c,
                                               fused_kernels=fused_kernels,
                                               fused_attention=fused and flash_core(layout),
                                               ulysses=c > 1 and layout.cp_comm != "all_gather"
                                               and layout.cp_method == "ulysses") if course
                 else layer_activation_bytes(model, s, b, t, layout.sp, layout.recompute, cp=c,
                                             fused_attention=fused, fused_kernels=fused_kernels))
    in_flight = F.in_flight_microbatches(p, layout.microbatches, layout.schedule, layout.chunks, stage=st)
    activations = per_layer * n_l * in_flight
    temporaries = 0.0
    if holds_head(layout, st):
        temporaries += b * s / c * model.vocab / t * LOGIT_BYTES
    if layout.recompute == "full" and n_l:
        # the one layer being recomputed holds its activations during its backward
        # (its attention scores a block at a time, inside the fused attention kernel)
        temporaries += layer_activation_bytes(model, s, b, t, layout.sp, "selective", cp=c,
                                              fused_attention=fused, fused_kernels=fused_kernels) - per_layer
    if layout.zero == 3 and n_l:
        # the gathered parameters of the layer computing and of the one prefetched
        temporaries += 2 * 2 * (dense + expert) / n_l
    if hpz_node:
        z = {**z, "params": z["params"] + 2 * dense / hpz_node, "total": z["total"] + 2 * dense / hpz_node}
    buckets = _ddp_buckets(model, layout, st, n_l, dense, expert, n_zero, n_exp_group, num) if course else 0.0
    # after the sums a gradient is a view of its bucket; under "bf16" the masters' fp32 ones are apart
    after = z["grads"] + ze["grads"] + (buckets if num.masters and num.reduce < 4 else 0.0)
    whole = (dense + expert) * num.accumulate
    rest = z["params"] + ze["params"] + z["optimizer"] + ze["optimizer"]
    # the schedule's moments: each chunk's gradient buffers from its first backward (ZeRO-3: its shards)
    rounds = F.zero_rounds(layout)
    if rounds is not None and layout.schedule == "interleaved" and layout.chunks > 1 and (rounds[0] > 1 or rounds[1] == 1):
        # reduced after each round (or the schedule's one round): a chunk's sums freed once
        # sent (F.round_moments), beside the owned slices' reduced gradients
        moments = [(held * whole / layout.chunks + owned * after, per_layer * n_l * saved + temporaries)
                   for held, owned, saved in F.round_moments(p, layout.microbatches, layout.chunks, st)]
    else:
        moments = [(after if layout.zero == 3 else share * whole, per_layer * n_l * saved + temporaries)
                   for share, saved in F.gradient_moments(p, layout.microbatches, layout.schedule, layout.chunks, st)]
    if layout.schedule in F.SPLIT:     # B trades a chunk's activations for what its W needs
        kept = w_kept_bytes_per_layer(model, s, b, t, layout.sp, c)
        per_chunk = layers_per_chunk(model, layout)
        last_chunk = len(per_chunk) - 1
        head = head_w_kept_bytes(model, s, b, t, layout.sp, c)
        walk = F.split_moments(layout.schedule, p, layout.microbatches, st,
                               {k: (per_layer * n, kept * n + (head if k == last_chunk else 0.0))
                                for k, n in enumerate(per_chunk)},
                               {k: whole * share for k, share in _chunk_shares(model, layout, per_chunk).items()})
        activations = max(held for _, held in walk)
        moments = [(after if layout.zero == 3 else grads, held + temporaries) for grads, held in walk]
    moments = [(grads + buckets, held) for grads, held in moments]
    grads, held = max(moments, key=sum)
    schedule = grads + held >= after
    return {"params": z["params"] + ze["params"], "grads": grads if schedule else after,
            "optimizer": z["optimizer"] + ze["optimizer"], "activations": activations,
            "temporaries": temporaries, "grads_after_step": after,
            "total": rest + max(grads + held, after)}
