"""The published runs the planner is validated on, run by the course's own program on the
virtual clock (:func:`course_lib.virtual.dry_run`), next to the paper's step time and the
planner's.

    rows = validation_rows()                 # every row (minutes each on 2 cores)
    rows = validation_rows(["Korthikanti 2022 T5"], models=("megatron-175b",))
    print(format_table(rows)); print(summary(rows))

A row is each source's stated layout on the source's hardware (Narayanan's micro-batch and
schedule as its own scripts ran them, :data:`NARAYANAN_SC21`), with what the source does not
state filled by the one rule the planner's validation uses (:mod:`course_lib.planner.validation`:
Megatron-LM of 2021-22 unfused attention, ``MEGATRON_2022``; BLOOM's Jean Zay network; Llama
3 on H100s): nothing is fitted per row. The published step time is the paper's where it prints
one (Korthikanti), else the FLOPs the paper counts per step over the throughput it reports
(Narayanan and BLOOM: hardware FLOPs with recomputation; Llama 3: model FLOPs), with the
planner's FLOP count for the step (the same for the three columns). What each source's
software fused is stated once per source (:data:`SOFTWARE`) and run by the dry run as the
course's program with those kernels (:mod:`course_lib.virtual.software`), and so are how it
numbered its ranks (:data:`ORDER`: which groups sit inside a node) and its numerics
(:data:`PRECISION`: fp32 masters and moments, gradients summed and reduced in the stated dtype,
each tensor priced at its own dtype; the planner prices the same, :mod:`course_lib.planner.numerics`); its attention kernel
agrees with the source's hardware's ``fused_attention`` (the planner's statement of the same
thing). Llama 3's 128k row runs its CP as stated: K and V all-gathered over the cp ranks,
each local query chunk attended by one FlashAttention kernel, dK/dV reduce-scattered
(``cp_comm="all_gather"``, :mod:`course_lib.parallel.cp_allgather`); its cp ranks do equal
priced work and run once (:func:`course_lib.virtual.dry_run.folds_cp`; see the row's note).
"""
from __future__ import annotations

import time

from course_lib.layout import MESH_ORDER, Layout
from course_lib.planner import estimate
from course_lib.planner.presets import HARDWARE, MODELS, ModelSpec, cudnn_attention, gpt_spec
from course_lib.planner.validation import (BLOOM, BLOOM_ORDER, JEAN_ZAY, KORTHIKANTI_DP8, KORTHIKANTI_FULL_RECOMPUTE,
                                           KORTHIKANTI_TABLE5, LLAMA3_TABLE4, MEGATRON_2022, MOE_FOLDING_2025,
                                           NARAYANAN_TABLE1, korthikanti_dp8_layout, korthikanti_layout,
                                           llama3_layout, moe_folding_layout)
from course_lib.virtual import dry_run

FULL_RECOMPUTE = "Korthikanti 2022 T5 full recompute"     # Table 5's "Full Recompute" column
DP8 = "Korthikanti 2022 Sec. 6.3"                         # its 530B row at 8-way DP
MOE_FOLDING = "Liu 2025 T2-3"                             # MoE Parallel Folding: Mixtral 8x22B, EP
SOURCES = ("Korthikanti 2022 T5", FULL_RECOMPUTE, DP8, "Narayanan 2021 T1", "BLOOM 2022", "Llama 3 T4", MOE_FOLDING)
# the rows the planner's validation uses (planner.validation.published_rows: issue #36's table);
# FULL_RECOMPUTE and DP8 are the same paper's rows the course did not carry before
PLANNER_SOURCES = ("Korthikanti 2022 T5", "Narayanan 2021 T1", "BLOOM 2022", "Llama 3 T4")

# The attention kernels each source's software ran (course_lib.virtual.software.FUSIONS):
# Megatron-LM (Narayanan et al. 2021, Sec. 4.2: fused scale + mask + softmax, one kernel with
# implicit causal masking for GPT; Korthikanti et al. 2022 run the same code base; BLOOM's
# Megatron-DeepSpeed is a fork of it); Llama 3 ran FlashAttention (the planner's validation:
# ``fused_attention`` on its H100s). Megatron-LM of 2021-22 all-reduces the DP gradients after
# the last backward, not under it (its train_step: ``allreduce_gradients()`` after
# ``forward_backward_func``, DDP_impl "local"): what the course's runtime does (Narayanan's PP = 1
# rows ran DDP_impl "torch": NARAYANAN_SC21, row_software). The same code
# base fuses each row layer's bias + dropout + residual add (Narayanan et al. 2021, Sec. 4.2;
# ``--no-bias-dropout-fusion`` is store_false: on by default, and neither Korthikanti's nor
# BLOOM's tr11-176B-ml.slurm turns it off): "bias_dropout_add". Its bias + GeLU fusion is what
# the course already runs (the bias in the GEMM, then one GeLU kernel): no entry. Its attention
# projects Q, K and V with one GEMM: ParallelAttention's ``query_key_value`` ColumnParallelLinear
# of width 3h/t (NVIDIA/Megatron-LM megatron/model/transformer.py, 2021-22; BLOOM's fork,
# bigscience-workshop/Megatron-DeepSpeed, keeps the same layer in the same file): "fused_qkv".
# BLOOM's pipeline ran in DeepSpeed's PipelineEngine (Megatron-DeepSpeed with
# --pipeline-model-parallel-size 12, bigscience train/tr11-176B-ml/tr11-176B-ml.slurm): its
# TrainSchedule is 1F1B, one SendActivation / RecvGrad / SendGrad / RecvActivation per
# instruction, and deepspeed/runtime/pipe/p2p.py's send is ``dist.send``, blocking
# (``async_op=True`` is refused): "blocking_sends", the runner waits for each send where it posts it.
# Measured on BLOOM's row (2026-11-29): +0.03 s (90.601 -> 90.632 s, -13.3% either way): in
# 1F1B a stage's next action waits for a message anyway, and a send completes once delivered
# (the clock has no rendezvous with the receiver's post). DeepSpeed's rank order is stated
# below (:data:`ORDER`). BLOOM's tr11-176B-ml.slurm also sets CUDA_LAUNCH_BLOCKING=1 ("do not
# remove or the training will hang and nodes will be lost w/o this workaround"): every kernel
# launch, NCCL's too, returns when the kernel ends, so the host never runs ahead of the GPU:
# "launch_blocking", priced by the clock's own issue interval (the preset's launch_overhead),
# nothing fitted. BigScience measured it on the 200B prototype (train/tr11-176B-ml/
# chronicles-prequel.md, "dealing with JZ hanging on the large model"): 91.04 against 97.20
# TFLOPs on 80 GPUs, 84.59 / 84.44 and 90.29 / 90.25 on 160 (blocking / not): "a tiny impact
# or no impact at all to the throughput" at scale. Measured on BLOOM's row (2026-11-29):
# +0.894 s (92.947 -> 93.841 s), 62,089 kernels a running rank x 12.32 us = 0.765 s of it.
# DeepSpeed's TrainSchedule (deepspeed/runtime/pipe/schedule.py, September 2020 to March 2023:
# the version of BLOOM's 2022 run) runs 1F1B's forwards and backwards, but sends a backward's
# input gradient only after the stage's next RecvActivation: "deepspeed_p2p_order"
# (course_lib.virtual.deepspeed_order). Measured: +2.960 s (93.841 -> 96.801 s): with
# DeepSpeed's rank order each of those waits is a 117 MB activation over Omni-Path.
_MEGATRON = ("scale_mask_softmax", "bias_dropout_add", "fused_qkv")
# Megatron-LM's activations are (sequence, batch, hidden), its sequence-parallel collectives on
# the first dimension: "sequence_first" (course_lib.virtual.software.LAYOUT_RUNTIME), the
# course's transposing copies around them unpriced (at micro-batch 1 there are none; without
# SP none run). BLOOM's fork keeps the same layout. Measured (2026-11-29): Table 5's 22B row
# (micro-batch 4) 1.175 -> 0.975 s (+6.8% -> -11.4%): 16 copies a layer less, 4.1 ms of
# a layer's 22.6 ms (Table 4's selective + sequence row, lab.layer_times); no other row moves.
_MEGATRON = _MEGATRON + ("sequence_first",)
# The same engine partitions each pipeline message over the model-parallel group
# (is_pipe_partitioned = is_grad_partitioned = is_model_parallel, deepspeed/runtime/pipe/engine.py
# L132-134 at 735406e53, June 2022): 1/t of an activation or gradient from each TP rank, the
# receiver's all-gather, the sender's output gathered again before its backward:
# "deepspeed_partitioned_pipe" (course_lib.virtual.deepspeed_order.install_partitioned_pipe).
# Measured on BLOOM's row (2026-11-29): 99.209 -> 92.783 s (-5.1% -> -11.2%): its activations
# cross Omni-Path (DeepSpeed's rank order), now a quarter of each from every TP rank.
_DEEPSPEED = ("blocking_sends", "launch_blocking", "deepspeed_p2p_order", "deepspeed_partitioned_pipe",
              "zero_all_reduce")
SOFTWARE = {"Korthikanti 2022 T5": _MEGATRON, "Narayanan 2021 T1": _MEGATRON,
            "BLOOM 2022": _MEGATRON + _DEEPSPEED, "Llama 3 T4": ("flash_attention",)}

# Megatron-LM's pipeline exchange, in the code both Megatron sources ran (megatron/
# p2p_communication.py ``_communicate``): every send and receive posted by one batch_isend_irecv,
# each request waited for, then torch.cuda.synchronize() (de7dc40, the sc21 scripts' commit,
# L104-130; 55ba1f7b, May 2022, L113-139), and, on by default, the scatter/gather of Narayanan
# et al. 2021, Sec. 4.1: each tensor-parallel rank sends 1/t of the activation over its own
# InfiniBand card and the receiver all-gathers the pieces over NVLink (de7dc40 arguments.py
# L585-587, ``--no-scatter-gather-tensors-in-pipeline`` store_false; the paper's Figure 18
# measures up to 11% more throughput with it on communication-intensive interleaved runs).
# 55ba1f7b skips the scatter/gather under sequence parallelism (each rank's activation is its
# own s/t rows already, sent whole): Korthikanti's rows, all sp, get the blocking exchange only.
# Its interleaved schedule sends a steady-state forward's activation with the next backward's
# gradient (schedules.py L271-340). "megatron_p2p" (course_lib.virtual.megatron_p2p) runs it.
# Both commits' timers call torch.cuda.synchronize() at every start and stop (de7dc40
# megatron/global_vars.py L192-203, 55ba1f7b L221-231), around every forward, backward and
# exchange: "megatron_timers", priced by the clock's issue interval (launch_overhead).
# Measured (2026-11-29), Narayanan's rows, step s: as recorded -> megatron_p2p -> + timers:
# 39.1B 14.102 -> 14.106 -> 14.107; 76.1B 14.412 -> 14.457 -> 14.459 (-10.2% -> -10.0%);
# 145.6B 22.823 -> 22.854 -> 22.856 (-8.0% -> -7.9%); 310.1B 33.767 -> 33.919 -> 33.925
# (-10.2% -> -9.8%); 529.6B 48.203 -> 48.711 -> 48.728 (-10.9% -> -9.9%); 1008B 94.357 ->
# 94.389 -> 94.397 (-8.1% -> -8.0%); PP = 1 rows: no exchange, the timers +1.5 ms (1.7B),
# +2.7 ms (18.4B). Korthikanti's (blocking, whole s/t activations; the timers add nothing but on
# 22B, +0.7 ms): 175B 13.344 -> 13.410 (-2.9% -> -2.5%); 530B 35.327 -> 36.058 (-6.6% ->
# -4.7%); 1T 67.097 -> 68.119 (-6.1% -> -4.7%).
# The interleaved order alone: +0.003 s (76.1B), +0.002 s (529.6B); blocking whole activations
# (no scatter/gather): +0.529 s (76.1B), +5.394 s (529.6B). Smaller than an estimate
# that adds every blocked send and gather to the step (+0.12 s, +1.28 s): in 1F1B a stage
# mostly waits for its next message anyway, and the clock's send completes once delivered,
# with no rendezvous with the receiver's post (NCCL's does).
_MEGATRON_P2P = {"Narayanan 2021 T1": ("megatron_p2p", "megatron_timers"),
                 "Korthikanti 2022 T5": ("megatron_p2p", "megatron_timers")}
SOFTWARE = {source: software + _MEGATRON_P2P.get(source, ()) for source, software in SOFTWARE.items()}
# Megatron-LM of Korthikanti et al. 2022 (55ba1f7b96, megatron/mpu/layers.py L239-309,
# LinearWithGradAccumulationAndAsyncCommunication): a sequence-parallel column layer's backward
# re-gathers its input under the dX GEMM and reduce-scatters dX under the dW GEMM, both async on
# the tp group's stream (course_lib.virtual.software.SP_RUNTIME). Narayanan et al. 2021's code
# (de7dc40) ran no SP and a synchronous f; BLOOM's and Llama 3's rows run no Megatron SP layer.
SOFTWARE["Korthikanti 2022 T5"] = SOFTWARE["Korthikanti 2022 T5"] + ("sp_backward_overlap",)
# Without SP the same column layer all-reduces dX asynchronously under the dW GEMM
# (--async-tensor-model-parallel-allreduce, on by default at 55ba1f7b96: arguments.py L570-575,
# off under SP, L314-317; course_lib.virtual.software.TP_RUNTIME). Stated for Korthikanti's code:
# its Table 5 rows run SP, where it is off (they do not move: 22B 1.161277926503548 s before and
# after); its "Full Recompute" column runs no SP (Sec. 6.3), so that source runs it and not the
# SP overlap. Narayanan et al. 2021's code (de7dc40) has no such flag (f waits).
# Measured (2026-11-29), the Full Recompute rows without -> with it: 22B 1.430 -> 1.353 s
# (+0.7% -> -4.7%), 175B 18.008 -> 17.308 s (-0.7% -> -4.5%): the clock hides each all-reduce
# whole under the dW GEMM; it slows neither (on a GPU, NCCL's kernels take SMs and HBM
# bandwidth from the GEMM beside them: not modelled).
SOFTWARE["Korthikanti 2022 T5"] = SOFTWARE["Korthikanti 2022 T5"] + ("tp_backward_overlap",)
SOFTWARE[FULL_RECOMPUTE] = tuple(f for f in SOFTWARE["Korthikanti 2022 T5"] if f != "sp_backward_overlap")
SOFTWARE[DP8] = SOFTWARE["Korthikanti 2022 T5"]     # Table 5's code; its DP all-reduce after the backward
# Megatron-Core of 2025 as the authors' ModelZoo ran Mixtral 8x22B (Megatron-MoE-ModelZoo,
# model_configs/benchmarking/Mixtral-8x22B.yaml): --use-flash-attn on Transformer Engine; one QKV
# GEMM (SelfAttention's linear_qkv); RMSNorm and SwiGLU (TE's fused kernels: "rmsnorm_swiglu",
# which the H100 preset's fused_kernels states too); (s, b, h) activations; the pipeline exchange
# batched then synchronised (p2p_communication with batch_p2p_sync, its default); and
# --tp-comm-overlap, of which the course runs the sequence-parallel backward's overlap (the
# forward's all-gather under the QKV GEMM, TE's userbuffers, is not run). Not run either:
# grouped GEMMs and --moe-permute-fusion (the course's dispatch sorts, indexes and scatters the
# rows in separate kernels). Its attention is Transformer Engine's choice (Megatron-Core's
# --attention-backend auto; --use-flash-attn only reaches the legacy model): on Hopper, cuDNN's
# fused attention wherever it and FlashAttention both could run ("Disabling FlashAttention to
# give FusedAttention preference on Hopper+ for performance reasons", NVIDIA/TransformerEngine
# transformer_engine/pytorch/dot_product_attention/utils.py at 66d6afbf6, 2025-04-15, L901-907):
# the rows' Hardware prices it as cuDNN's kernel (:data:`MOE_HARDWARE`). Its weight-gradient GEMMs accumulate into the fp32 main_grad
# (--no-gradient-accumulation-fusion is store_false and the yaml does not set it; --bf16
# accumulates in fp32: "gradient_accumulation_fusion", course_lib.virtual.software). Its
# distributed optimizer runs --overlap-grad-reduce and --overlap-param-gather (the yaml): the
# first stage's reduce-scatters under its last backward, the others' as their schedule ends
# (align_grad_reduce, the default), and each stage's gathers in its own first forward
# (align_param_gather is forced off without an interleaved schedule; runtime.conf's VPP is 1 at
# 78fd4d6): "overlap_grad_reduce", "overlap_param_gather". What each moves, recorded
# (MOE_OVERLAP_RECORDED): A1 4.614 s without them, 4.548 s with the first, 4.906 s with both;
# A2 5.109, 5.037, 5.460 s: each stage's first forward waits for its gathers (72 ms a stage on
# A1, beside 42 ms of forward), and the pipeline's fill carries the wait from stage to stage.
SOFTWARE[MOE_FOLDING] = ("flash_attention", "fused_qkv", "rmsnorm_swiglu", "sequence_first", "sp_backward_overlap",
                         "megatron_p2p", "gradient_accumulation_fusion", "overlap_grad_reduce",
                         "overlap_param_gather")

# The Mixtral rows' H100s with the attention kernel their Transformer Engine ran: cuDNN's
# (SOFTWARE[MOE_FOLDING]'s comment), priced by the tile x wave model fitted on cuDNN's measured
# times on an H200 (planner.presets.cudnn_attention: the same SMs and clocks as the H100 SXM);
# the planner's column reads the same Hardware. Measured on 2026-12-01 (A1, A2): the dry run
# 5.096 -> 4.906 s and 5.650 -> 5.460 s, the planner 5.087 -> 4.897 s and 5.206 -> 5.017 s.
MOE_HARDWARE = cudnn_attention("h100-sxm")

# The hidden and attention dropout each source trained with, run by the course's own Dropout
# modules (virtual.dry_run's ``dropout=``): one kernel per dropout forward and backward, a
# 1-byte mask kept; in the fused bias + dropout + add, the kernel reads the mask (on a GPU it
# draws and writes it). Megatron-LM's arguments.py: ``--attention-dropout`` and
# ``--hidden-dropout`` default to 0.1; Narayanan et al. 2021's own scripts
# (examples/academic_paper_scripts/sc21/CONFIG.sh) set neither, and Korthikanti et al. 2022's
# activation count (Sec. 4.1, 34sbh + 5as^2b per layer) includes the masks of the two hidden
# dropouts (2sbh) and of the attention dropout (as^2b). BLOOM: bigscience's
# train/tr11-176B-ml/README.md, "The default Megatron-LM dropout settings are inherited:
# --attention-dropout 0.1, --hidden-dropout default=0.1" (tr11-176B-ml.slurm sets neither;
# Hugging Face's BloomConfig says 0.0, an inference default). Llama 3: none (its FlashAttention
# and context parallelism run no dropout here).
DROPOUT = {"Korthikanti 2022 T5": 0.1, "Narayanan 2021 T1": 0.1, "BLOOM 2022": 0.1, "Llama 3 T4": 0.0}
DROPOUT[FULL_RECOMPUTE] = DROPOUT[DP8] = DROPOUT["Korthikanti 2022 T5"]
DROPOUT[MOE_FOLDING] = 0.0           # the ModelZoo's --attention-dropout 0.0 and --hidden-dropout 0.0

# How each source's software numbered its ranks (Layout.order, outermost first; None: the
# course's dp, pp, cp, tp), which decides which groups sit inside a node. Megatron-LM of 2021-22
# (megatron/mpu/initialize.py, initialize_model_parallel): pipeline stage i owns the ranks
# [i * world/pp, (i + 1) * world/pp) and its data-parallel groups are range(start + j, end, tp):
# pp outermost, then dp, tp innermost. Korthikanti's and Narayanan's rows are all tp = 8 (a
# node per TP group, so every hop and every dp group crosses nodes either way) or pp = 1: the
# order changes none of their groups (tests/test_rank_order.py checks it). BLOOM: Megatron-
# DeepSpeed's GPTModelPipe (megatron/model/gpt_model.py) builds DeepSpeed's
# PipeModelDataParallelTopology(num_pp, num_mp, num_dp), whose axes are ['pipe', 'data',
# 'model'], row-major (deepspeed/runtime/pipe/topology.py): pp outermost, tp innermost, so with
# tp = 4 on 8-GPU nodes every one of the 11 pipeline hops crosses Omni-Path (the course's order
# keeps 6 of them on NVLink). Llama 3: the paper's [TP, CP, PP, DP] (Dubey et al. 2024,
# Sec. 3.3.2), the course's own.
_MEGATRON_ORDER = ("pp", "dp", "tp")
ORDER = {"Korthikanti 2022 T5": _MEGATRON_ORDER, FULL_RECOMPUTE: _MEGATRON_ORDER, DP8: _MEGATRON_ORDER,
         "Narayanan 2021 T1": _MEGATRON_ORDER, "BLOOM 2022": BLOOM_ORDER, "Llama 3 T4": None,
         # Megatron-Core's default order "tp-cp-ep-dp-pp" (tp fastest): pp outermost, then dp, cp,
         # tp; its experts folded over the same ranks in etp-ep-edp (the layout's fold_order)
         MOE_FOLDING: ("pp", "dp", "cp", "tp")}


# The numerics each source trained with (Layout.precision, course_lib.precision.mixed), run by
# the dry run for real: a 16-bit model, fp32 master weights and AdamW moments (the course's
# MasterWeights, or ZeRO's owned slices), gradients accumulated and reduced as stated, every
# tensor priced at its own dtype (VirtualCluster(dtype=None)). Read in the sources' code:
# * Megatron-LM 2021-22 (NVIDIA/Megatron-LM at 55ba1f7b96, 2022-05-26): Narayanan et al.'s
#   scripts run --fp16 (examples/sc21/CONFIG.sh); megatron/arguments.py turns on
#   accumulate_allreduce_grads_in_fp32 only for --bf16 (its flag is store_true, default off),
#   so under --fp16 DistributedDataParallel's main_grad buffer has the parameters' dtype
#   (megatron/model/distributed.py, _get_buffer_type): each micro-batch's gradient is added in
#   fp16 and all-reduced in fp16; Float16OptimizerWithFloat16Params
#   (megatron/optimizer/optimizer.py) keeps fp32 masters (``param.detach().clone().float()``)
#   and Adam's moments, takes ``main_grad.float()`` as the masters' gradient and copies the
#   masters back into the fp16 model after the step: "bf16" here (fp16 priced as bf16: the same
#   bytes, and the A100's fp16 and bf16 tensor-core rates are one, 312 TFLOP/s). Korthikanti et
#   al. 2022 ran the same code base; their precision is not in a script we have read: the same
#   --fp16, one rule for the two sources.
# * BLOOM (bigscience train/tr11-176B-ml/tr11-176B-ml.slurm): --bf16 and ZERO_STAGE=0
#   ("important: bf16 must use z0! it implements its own zero stage 1 equivalent"): DeepSpeed's
#   BF16_Optimizer (microsoft/DeepSpeed deepspeed/runtime/bf16_optimizer.py at 9b70ce56e,
#   2022-06-30): after every micro-batch's backward update_hp_grads adds the bf16 gradients into
#   fp32 ones (``hp_grad.add_(lp.grad.to(hp_grad.dtype))``; the pipeline engine calls it after
#   each backward, deepspeed/runtime/pipe/engine.py), the pipeline's ReduceGrads all-reduces
#   those fp32 gradients (``_bf16_reduce_grads``: get_grads_for_reduction, the fp32 flat
#   buffers), each rank steps its partition of the fp32 masters, and the bf16 partitions are
#   all-gathered: "bf16-accumulate-fp32" with ZeRO-1 here, its all-reduce the runtime item
#   "zero_all_reduce" (SOFTWARE; course_lib.virtual.software): the course's ZeRO-1 would
#   reduce-scatter, half an all-reduce's bytes.
# * Llama 3 (Dubey et al. 2024, Sec. 3.3.2, "Numerical stability"): FP32 gradient accumulation
#   during backward over the micro-batches and the reduce-scatter of gradients in FP32 across
#   the data-parallel workers, under FSDP's ZeRO-2: "bf16-accumulate-fp32" with zero=2.
# Left out, in every source: the gradient clipping's global norm (Megatron's --clip-grad and
# BLOOM's: one read of the gradients and a small all-reduce) and, under fp16, the loss scaler's
# unscale and inf check (torch._amp_foreach_non_finite_check_and_unscale_ and an all-reduce of
# found_inf in Float16OptimizerWithFloat16Params); the course's runtime does not run them.
PRECISION = {"Korthikanti 2022 T5": "bf16", FULL_RECOMPUTE: "bf16", DP8: "bf16", "Narayanan 2021 T1": "bf16",
             "BLOOM 2022": "bf16-accumulate-fp32", "Llama 3 T4": "bf16-accumulate-fp32",
             # Megatron-Core's --bf16: "bfloat16 requires gradient accumulation and all-reduce to be
             # done in fp32" (megatron/training/arguments.py; --grad-reduce-in-bf16 not set)
             MOE_FOLDING: "bf16-accumulate-fp32"}


# The runs of Narayanan et al. 2021's Table 1 as its authors scripted them: NVIDIA/Megatron-LM
# examples/sc21/run_table_1.sh (commit de7dc40, "scripts for sc21", 2021-08-10), one case per
# row. The paper prints TP, PP, GPUs and the batch; the script also sets the micro-batch
# (--micro-batch-size) and, on four pipelined rows, the interleaved schedule's layers per
# virtual stage (--num-layers-per-virtual-pipeline-stage); every row --checkpoint-activations
# (full recomputation) and --fp16. And its --DDP-impl: "torch" on the four PP = 1 rows,
# PyTorch's DDP, whose buckets are all-reduced under the last micro-batch's backward (the
# earlier ones in no_sync: megatron/schedules.py forward_backward_no_pipelining), run here as
# software.FUSIONS' "overlapped_dp" (:func:`row_software`); "local" on the others, Megatron's
# own DDP, all-reducing after the backward (megatron/training.py: allreduce_gradients), as the
# course's runtime does (its 25 MiB buckets; Megatron one flat buffer per dtype: not stated).
# billions -> (micro-batch, layers per virtual stage or None, DDP implementation).
NARAYANAN_SC21 = {1.7: (16, None, "torch"), 3.6: (16, None, "torch"), 7.5: (16, None, "torch"),
                  18.4: (8, None, "torch"), 39.1: (4, None, "local"), 76.1: (2, 5, "local"),
                  145.6: (2, 5, "local"), 310.1: (1, 3, "local"), 529.6: (1, 1, "local"),
                  1008.0: (1, None, "local")}


def narayanan_sc21(billions: float, n_layers: int, pp: int) -> dict:
    """Layout keywords of one Table 1 row as :data:`NARAYANAN_SC21` states it: the micro-batch,
    the interleaved schedule with v = layers per stage / layers per virtual stage, and whether
    the DP gradient sums run under the last backward (``overlap_dp``: DDP "torch")."""
    if billions not in NARAYANAN_SC21:
        raise ValueError(f"no row of Narayanan et al. 2021 Table 1 has {billions!r} billion parameters: "
                         f"the rows are {sorted(NARAYANAN_SC21)}")
    micro_batch, per_virtual, ddp = NARAYANAN_SC21[billions]
    # the planner's overlap_dp: the gradient sums under the last backward where torch's DDP ran
    # them there (the dry run reads row_software for the same: the ranks ignore overlap_dp)
    out = {"micro_batch": micro_batch, "overlap_dp": ddp == "torch"}
    if per_virtual is not None:
        out.update(schedule="interleaved", v=n_layers // pp // per_virtual)
    return out


def row_software(source: str, name: str) -> tuple:
    """What the source's software ran on row ``name``: :data:`SOFTWARE`, and on Narayanan's rows
    whose script says ``--DDP-impl torch`` PyTorch's DDP under the backward ("overlapped_dp")."""
    if source == "Narayanan 2021 T1":
        billions = float(name.removeprefix("GPT ").removesuffix("B"))
        if NARAYANAN_SC21[billions][2] == "torch":
            return SOFTWARE[source] + ("overlapped_dp",)
    return SOFTWARE[source]

# Llama 3's CP (Dubey et al. 2024, Sec. 3.3.2): K and V all-gathered, each of a rank's two
# zigzag chunks attended to the keys it sees, dK/dV reduce-scattered; run by the ranks
# (parallel/cp_allgather.py) with one FlashAttention kernel per chunk (course_lib/flash_prefix.py).
# Measured on the 128k row (2026-11-29), v = 2 chunks per stage: +16.0% against the published
# time (+14.1% with the gathered K/V kept for backward instead of gathered again), the planner
# -11.8%; 47 s CPU, 6.1 GiB resident. With the paper's chunks (embedding-only and head-only,
# v = 8; checked on this branch applied to main at 981add3): -8.5%, the planner -31.0%; 53 s
# CPU, 7.0 GiB resident. At 128k attention is most of a layer's work; the planner priced it
# as GEMMs at the GEMM model's rate, the clock at FlashAttention-2's measured rate (0.30 of
# peak, the H100's cited "attention" constant). Both now price it at that one rate
# (planner.gemm.attention_rate): the planner -10.9% (8k rows: -11.5%, -11.8%).
# Neither is fitted to this row.
LLAMA3_CP_NOTE = "CP: all-gathered K/V, cp ranks folded (equal FLOPs under FlashAttention)"


def published_runs():
    """[(source, name, ModelSpec, Hardware, Layout, published seconds or None, (metric, value,
    FLOPs convention), note)]: every row, in the planner validation's order, each layout in its
    source's rank order (:data:`ORDER`) and numerics (:data:`PRECISION`)."""
    rows = []
    for name, pp, gbs, seconds, _ in KORTHIKANTI_TABLE5:
        model = MODELS[name]
        rows.append(("Korthikanti 2022 T5", model.name, model, MEGATRON_2022, korthikanti_layout(model, pp, gbs),
                     seconds, None, ""))
    for name, pp, gbs, seconds in KORTHIKANTI_FULL_RECOMPUTE:     # the same rows, full recompute, no SP
        model = MODELS[name]
        rows.append((FULL_RECOMPUTE, f"{model.name}, full", model, MEGATRON_2022,
                     korthikanti_layout(model, pp, gbs, sp=False, recompute="full"), seconds, None, "no SP"))
    for name, pp, dp, gbs, seconds in KORTHIKANTI_DP8:     # Table 5's 530B row, 8 replicas
        model = MODELS[name]
        rows.append((DP8, f"{model.name}, dp {dp}", model, MEGATRON_2022, korthikanti_dp8_layout(model, pp, dp, gbs),
                     seconds, None, "DP after the backward"))
    for billions, a, h, L, tp, pp, gpus, gbs, tflops in NARAYANAN_TABLE1:
        model = gpt_spec(f"GPT {billions:g}B", L, h, a)
        # the planner validation's rule (narayanan_table1): DP the rest, full recomputation; the
        # micro-batch and the schedule the source's own scripts ran (NARAYANAN_SC21)
        layout = Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, global_batch=gbs, recompute="full",
                        **narayanan_sc21(billions, L, pp))
        rows.append(("Narayanan 2021 T1", model.name, model, MEGATRON_2022, layout, None,
                     ("hardware", tflops), ""))
    for rc in ("none", "full"):        # bloom_row's rule: the least recomputation that fits
        layout = Layout(dp=8, tp=4, pp=12, zero=1, micro_batch=2, global_batch=2048, recompute=rc)
        if estimate(BLOOM, JEAN_ZAY, layout).fits:
            break
    rows.append(("BLOOM 2022", BLOOM.name, BLOOM, JEAN_ZAY, layout, None, ("hardware", 150.0),
                 "ALiBi run as learned positions"))
    h100 = HARDWARE["h100-sxm"]
    for gpus, tp, cp, pp, dp, s, tflops in LLAMA3_TABLE4:
        rows.append(("Llama 3 T4", f"Llama 3 405B, {s // 1024}k", MODELS["llama3-405b"], h100,
                     llama3_layout(tp, cp, pp, dp, s), None, ("model", tflops),
                     LLAMA3_CP_NOTE if cp > 1 else ""))
    for name, tp, ep, etp, pp, dp, tflops in MOE_FOLDING_2025:
        rows.append((MOE_FOLDING, f"Mixtral 8x22B {name}", MODELS["mixtral-8x22b"], MOE_HARDWARE,
                     moe_folding_layout(tp, ep, etp, pp, dp), None, ("model", tflops),
                     f"EP {ep} x ETP {etp}, TP first; ZeRO-1 overlapped"))
    return [(source, name, model, hw, layout.with_(order=ORDER[source], precision=PRECISION[source]), *rest)
            for source, name, model, hw, layout, *rest in rows]


def published_row(source, name, model, hw, layout, seconds, flops_rate, note) -> dict:
    """One row of :func:`published_runs` with the published step time and the planner's columns
    filled (instant); the dry run's columns empty."""
    est = estimate(model, hw, layout)
    if seconds is None:
        convention, tflops = flops_rate
        flops = est.hardware_flops if convention == "hardware" else est.model_flops
        seconds = flops / (tflops * 1e12 * layout.n_gpus)
    return {"source": source, "model": name, "GPUs": layout.n_gpus,
            "layout": f"TP{layout.tp} CP{layout.cp} PP{layout.pp} DP{layout.dp} m{layout.microbatches}"
                      + (f" EP{layout.ep}" + (f" ETP{layout.etp}" if layout.etp > 1 else "") if layout.ep * layout.etp > 1
                         else ""),
            "published_s": seconds, "planner_s": est.step_time, "planner_err": est.step_time / seconds - 1,
            "dry_s": None, "dry_err": None, "planner_GiB": est.memory["total"] / 2**30, "dry_GiB": None,
            "fits": None, "wall_s": None, "cpu_s": None, "note": note, "fusions": row_software(source, name),
            "dropout": DROPOUT[source], "order": layout.order}


def validation_rows(sources=SOURCES, models=None, progress: float | None = 60.0) -> list[dict]:
    """Run the rows of ``sources`` (and of ``models``, names, when given) through the dry run."""
    out = []
    for run in published_runs():
        source, name, model, hw, layout = run[:5]
        if source not in sources or (models and name not in models and model.name not in models):
            continue
        row = published_row(*run)
        seconds = row["published_s"]
        began, cpu = time.perf_counter(), time.process_time()
        try:
            r = dry_run(model, hw, layout, progress=progress, fusions=row_software(source, name),
                        dropout=DROPOUT[source])
        except (NotImplementedError, ValueError) as e:    # the dry run's limits; a layout the ranks refuse
            row["note"] = f"not run: {e}"
        else:
            row.update(dry_s=r.step_time, dry_err=r.step_time / seconds - 1, dry_GiB=r.peak_memory / 2**30,
                       fits=r.fits, wall_s=time.perf_counter() - began, cpu_s=time.process_time() - cpu,
                       ranks_run=r.ranks_run)
        out.append(row)
        if progress is not None:
            print(format_table([row], header=not out[:-1]), flush=True)
    return out


COLUMNS = (("source", "{}"), ("model", "{}"), ("GPUs", "{}"), ("layout", "{}"), ("published_s", "{:.3f}"),
           ("planner_s", "{:.3f}"), ("dry_s", "{:.3f}"), ("planner_err", "{:+.1%}"), ("dry_err", "{:+.1%}"),
           ("planner_GiB", "{:.1f}"), ("dry_GiB", "{:.1f}"), ("fits", "{}"), ("wall_s", "{:.0f}"), ("cpu_s", "{:.0f}"))


def format_table(rows, header=True) -> str:
    lines = [" | ".join(c for c, _ in COLUMNS)] if header else []
    for r in rows:
        lines.append(" | ".join("-" if r.get(c) is None else f.format(r[c]) for c, f in COLUMNS))
    return "\n".join(lines)


def summary(rows, sources=None) -> str:
    """Mean and worst |error| of the rows the dry run ran (of ``sources`` only, when given), the
    planner's on the same rows beside."""
    ran = [r for r in rows if r["dry_err"] is not None and (sources is None or r["source"] in sources)]
    if not ran:
        return "no row ran"
    lines = []
    for who in ("dry", "planner"):
        errs = [abs(r[f"{who}_err"]) for r in ran]
        lines.append(f"{who:8s} on {len(ran)} rows: mean |error| {sum(errs) / len(errs):.1%}, worst {max(errs):.1%}")
    return "\n".join(lines)


# the planner against the dry run on random valid layouts: a dense GPT (GPT-2 blocks) and a
# Llama-style model with grouped-query attention, small enough to run in seconds
AGREEMENT_MODELS = (gpt_spec("GPT 16L h1024", 16, 1024, 16, V=32000, s=1024),
                    ModelSpec("Llama-style 16L h1024 GQA", 16, 1024, 16, 4, 2816, 32000, 1024))
AGREEMENT_GPUS = ("a100-80gb", "h100-sxm")


def _order(rng):
    """A rank order: None a third of the time, else the four dims in a random order."""
    order = tuple(rng.sample(MESH_ORDER, len(MESH_ORDER)))
    return None if rng.random() < 1 / 3 else order


def random_layouts(n: int, seed: int = 0):
    """``n`` (model, hardware, Layout) drawn at random, each passing every rule the ranks apply;
    each with a rank order (None, the course's, a third of the time; else any order of the four
    dims) from a stream of its own, so the layouts drawn for a seed are the ones drawn before."""
    import random
    from course_lib.virtual.dry_run import check_dry_run
    rng, out = random.Random(seed), []
    order_rng = random.Random(f"rank order {seed}")
    while len(out) < n:
        model, hw = rng.choice(AGREEMENT_MODELS), rng.choice(AGREEMENT_GPUS)
        tp, pp, dp = rng.choice((1, 2, 4, 8)), rng.choice((1, 2, 4)), rng.choice((1, 2, 4))
        schedule = rng.choice(("1f1b", "gpipe", "interleaved")) if pp > 1 else "1f1b"
        m = rng.choice((1, 2, 4, 8)) * (pp if pp > 1 else 1)
        layout = Layout(dp=dp, tp=tp, pp=pp, sp=tp > 1 and rng.random() < 0.7, schedule=schedule,
                        v=2 if schedule == "interleaved" else 1, micro_batch=rng.choice((1, 2)), microbatches=m,
                        recompute=rng.choice(("none", "selective", "full")), zero=rng.choice((0, 0, 3)),
                        order=_order(order_rng))
        try:
            check_dry_run(model, layout)
        except (ValueError, NotImplementedError):
            continue
        out.append((model, hw, layout))
    return out


# What Megatron-Core's overlapped distributed optimizer moves on the Mixtral rows: each row run
# by the dry run with SOFTWARE[MOE_FOLDING] less the statements named ({variant: dropped}), the
# last variant the row as stated (RECORDED's); recorded by moe_overlap_rows (a dry run of 30-40 s
# of CPU each, more than chapter 10's budget), on 2026-12-01 (twenty-seventh session), the Intel
# AVX-512 machine, beside the test suite.
MOE_OVERLAP = {"neither": ("overlap_grad_reduce", "overlap_param_gather"), "reductions": ("overlap_param_gather",),
               "both": ()}
MOE_OVERLAP_RECORDED = {
    ('Mixtral 8x22B A1', 'neither'): 4.613845182055181,
    ('Mixtral 8x22B A1', 'reductions'): 4.547614883211637,
    ('Mixtral 8x22B A1', 'both'): 4.905835825835336,
    ('Mixtral 8x22B A2', 'neither'): 5.1089672121434795,
    ('Mixtral 8x22B A2', 'reductions'): 5.037137290040476,
    ('Mixtral 8x22B A2', 'both'): 5.459597240981879,
}


def moe_overlap_rows(progress: float | None = None) -> dict:
    """{(row name, variant of :data:`MOE_OVERLAP`): the dry run's step seconds}: the literal of
    :data:`MOE_OVERLAP_RECORDED`."""
    out = {}
    for run in published_runs():
        source, name, model, hw, layout = run[:5]
        if source != MOE_FOLDING:
            continue
        for variant, dropped in MOE_OVERLAP.items():
            software = tuple(f for f in row_software(source, name) if f not in dropped)
            out[(name, variant)] = dry_run(model, hw, layout, progress=progress, fusions=software,
                                           dropout=DROPOUT[source]).step_time
    return out


def agreement_rows(n: int = 50, seed: int = 0, progress: float | None = None) -> list[dict]:
    """The planner's step time and memory against the dry run's on :func:`random_layouts`: the
    planner's ``runtime="course"`` (the course's eager program, kernel by kernel, each op issued
    by the host: what the dry run runs), and its default ``"megatron"`` (launches hidden, fused
    kernels: the published systems) beside it."""
    rows = []
    for model, hw, layout in random_layouts(n, seed):
        est, r = estimate(model, hw, layout, runtime="course"), dry_run(model, hw, layout, progress=progress)
        rows.append({"model": model.name, "GPU": hw, "layout": layout.describe(),
                     "planner_s": est.step_time, "dry_s": r.step_time, "time_diff": est.step_time / r.step_time - 1,
                     "planner_megatron_s": estimate(model, hw, layout).step_time,
                     "planner_GiB": est.memory["total"] / 2**30, "dry_GiB": r.moment_memory / 2**30,
                     "memory_diff": est.memory["total"] / r.moment_memory - 1})
        if progress is not None:
            row = rows[-1]
            print(f"{row['model'][:14]:14s} {hw:9s} {row['layout'][:70]:70s} time {row['time_diff']:+.1%} "
                  f"memory {row['memory_diff']:+.1%}", flush=True)
    return rows


__all__ = ["published_runs", "published_row", "FULL_RECOMPUTE", "DP8", "PLANNER_SOURCES", "NARAYANAN_SC21",
           "narayanan_sc21", "row_software", "validation_rows", "format_table", "summary", "SOURCES", "SOFTWARE",
           "DROPOUT", "ORDER", "PRECISION", "random_layouts", "agreement_rows", "MOE_HARDWARE", "MOE_OVERLAP",
           "MOE_OVERLAP_RECORDED", "moe_overlap_rows"]
