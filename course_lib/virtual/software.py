"""What a published run's software fused, run as the course's program: the dry run's per-source
software (:func:`course_lib.virtual.dry_run`, ``fusions=``).

The course's attention is written out in plain ops (:class:`course_lib.gpt.Attention`: the
scores scaled, a causal mask added, softmax, dropout, the product with V), each a kernel of
its own on the virtual clock. The published systems ran fewer kernels, and each says which:

* ``"scale_mask_softmax"``: Megatron-LM (Narayanan et al. 2021, Sec. 4.2, "Computation
  Optimizations": "two custom kernels to enable the fusion of scale, mask, and softmax
  (reduction) operations", one with implicit causal masking for GPT; Korthikanti et al. 2022
  run the same code base). Here: Q K^T (one batched GEMM), then one kernel for the masked
  softmax (``torch._masked_softmax``: reads the scores once, writes the probabilities once;
  backward one ``_softmax_backward_data``), dropout, then the product with V. The 1/sqrt(d)
  scale is applied to Q (b a s d elements) instead of inside the softmax kernel (b a s s).
* ``"flash_attention"``: FlashAttention (Dao et al. 2022; Llama 3 trained with it, Dubey et al.
  2024, Sec. 3.3): one kernel forward, one backward, the s x s scores never stored
  (torch's ``_scaled_dot_product_flash_attention_for_cpu``, which the clock prices as the GPU's
  fused kernel: its FLOPs, causal half, at the preset's cited "attention" fraction of peak,
  :mod:`course_lib.planner.kernel_cost`). It keeps Q, K, V, the output and the log-sum-exp
  for backward whatever the recompute policy: its backward recomputes the scores itself.
  Grouped-query K and V are read in the kernel, not copied per query head. Ring CP runs
  each of its blocks as this kernel (``ContextParallelAttention.flash_blocks``). A Hardware
  that states ``fused_attention`` gets it without naming it (``dry_run.hardware_attention``).

* ``"bias_dropout_add"``: Megatron-LM's fused bias + dropout + residual add after each
  row-parallel layer (Narayanan et al. 2021, Sec. 4.2: "fused kernels for ... bias + GeLU and
  bias + dropout + add"; the flags ``--no-bias-dropout-fusion`` / ``--no-bias-gelu-fusion`` are
  ``store_false``, so both run by default in Megatron-LM and in BLOOM's Megatron-DeepSpeed,
  whose tr11-176B-ml.slurm sets neither). Megatron's row layer skips its bias
  (``skip_bias_add``) and one kernel reads the partial output, the bias and the residual and
  writes the sum once (:func:`bias_dropout_add`): the course's two (the row layer's
  ``y + bias``, then ``x + y``) become one. With dropout (p > 0, ``lab.dry_runs.DROPOUT``)
  the same kernel reads the keep mask (the dropout's own draw, from its stream; on a GPU the
  kernel draws and writes it, the same bytes) and keeps it for backward, 1 byte per element,
  as Megatron's jit-fused ``bias_dropout_add_fused_train``.
  Bias + GeLU needs no entry: the course's column
  layer adds its bias inside the GEMM (``addmm``), so the MLP's first half is a GEMM and one
  GeLU kernel, forward and backward, as in Megatron's fused path (``mm`` + ``bias_gelu``).

* ``"fused_qkv"``: Megatron-LM's one QKV GEMM (its ``query_key_value`` ColumnParallelLinear of
  width 3h/t) for the course's three projections W_q, W_k, W_v
  (:mod:`course_lib.virtual.fused_qkv`: the course's weights, one GEMM forward, one for dX and
  one for dW backward; Megatron stores the three as one tensor, so no concatenation is priced;
  the same values and gradients to the bit, ``tests/test_fused_qkv.py``).

And one runtime behaviour (:data:`RUNTIME`), a way the source's software ran the course's
program, not a kernel:

* ``"blocking_sends"``: DeepSpeed's PipelineEngine (BLOOM's Megatron-DeepSpeed; ``p2p.send``
  is ``dist.send``, blocking, and refuses ``async_op=True``; its TrainSchedule is 1F1B with one
  send or receive per instruction): the pipeline runner waits for each send where it posts it
  (:class:`~course_lib.parallel.pipeline.runner.ScheduleRunner`'s ``blocking_sends``), so the
  sender's next action starts once the message has been delivered. A real launch waits there
  too (gloo on the CPU), and the clock prices the wait: the dry run adds nothing of its own.
* ``"launch_blocking"``: ``CUDA_LAUNCH_BLOCKING=1`` in the run's environment (BLOOM's
  tr11-176B-ml.slurm: "do not remove or the training will hang"): every kernel launch returns
  when the kernel ends, NCCL's collectives and point-to-point kernels too, so the host never runs
  ahead of the GPU and each kernel costs the host's issue interval (the clock's
  ``launch_overhead``, cited in the hardware preset) plus its own time. Set on the rank's
  clock (:meth:`~course_lib.virtual.clock.RankClock.launched`,
  :class:`~course_lib.virtual.compute.ComputeStream`); nothing computed changes.
* ``"deepspeed_p2p_order"``: where DeepSpeed's TrainSchedule (deepspeed/runtime/pipe/schedule.py,
  2020 to PR #2862 of March 2023, so BLOOM's 2022 run) puts a stage's sends. Its per-stage
  order of forwards and backwards is 1F1B's, but a step is ``RecvActivation, SendGrad(previous
  backward), ForwardPass`` or ``SendActivation(previous forward), RecvGrad, BackwardPass``: a
  backward's input gradient leaves only once the stage's next activation has arrived (or,
  with no forward left, before its next RecvGrad). :class:`DeepSpeedP2POrder` holds each
  gradient send of the runner until then (:mod:`.deepspeed_order`); the messages, their tags
  and values are the same.
* ``"deepspeed_partitioned_pipe"`` (with ``"deepspeed_p2p_order"``): the same engine sends each
  activation and input gradient as a ``PartitionedTensor`` over the model-parallel group, 1/t
  from each tensor-parallel rank, all-gathered by the receiver, and its backward gathers the
  stage's own freed output again (:func:`~course_lib.virtual.deepspeed_order.install_partitioned_pipe`).

* ``"megatron_p2p"``, ``"megatron_timers"``: Megatron-LM's pipeline exchange (``_communicate``:
  1/t pieces over the network, blocking waits, ``torch.cuda.synchronize()``, the pieces
  all-gathered over the tensor-parallel group; its interleaved schedule's send order) and its
  timers' synchronisations (:mod:`.megatron_p2p`); the same values, bit for bit.

* ``"overlapped_dp"``: PyTorch's DDP as Megatron-LM's ``--DDP-impl torch`` runs it (Narayanan
  et al. 2021's scripts on their PP = 1 rows, ``lab.dry_runs.NARAYANAN_SC21``): the gradient
  buckets are all-reduced as they fill under the last micro-batch's backward, the earlier
  backwards inside ``no_sync`` (megatron/schedules.py ``forward_backward_no_pipelining``), not
  after the schedule: the course's :class:`~course_lib.parallel.grad_sync.OverlappedGradSync`
  (the same 25 MiB buckets, in reverse order, as torch's DDP) in place of the runtime's
  GradSync. Without a pipeline only (pp = 1: Megatron-LM runs its own DDP under one).

* ``"zero_all_reduce"``: DeepSpeed's BF16_Optimizer (BLOOM: tr11-176B-ml.slurm's ZERO_STAGE=0,
  "bf16 ... implements its own zero stage 1 equivalent"; deepspeed/runtime/pipe/engine.py
  ``_bf16_reduce_grads`` all-reduces the fp32 gradients, then each rank steps its partition):
  ZeRO's gradient buckets all-reduced, each rank keeping its slice of the sum
  (:class:`~course_lib.parallel.zero_nd.ZeroSync`'s ``all_reduce``), in place of a
  reduce-scatter: the same sums, twice the bytes.

* ``"gradient_accumulation_fusion"``: Megatron-LM's weight-gradient GEMM that accumulates into
  the fp32 ``main_grad`` itself (NVIDIA/Megatron-LM commit 83b1e42f30, "gradient accumulation
  fusion", 2022-02-13: ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``; Transformer
  Engine's ``fuse_wgrad_accumulation`` in Megatron-Core). ``--no-gradient-accumulation-fusion``
  is ``store_false`` (megatron/training/arguments.py at bbe933713d, 2025-04-14), so it is on
  wherever gradients accumulate in fp32 and no script turns it off: Megatron-Core's ``--bf16``
  accumulates in fp32, and the MoE ModelZoo's Mixtral-8x22B.yaml (78fd4d6) sets neither flag.
  Megatron-LM 2022 turned it off unless gradients accumulate in fp32 (arguments.py at
  55ba1f7b96, L182-188), so its ``--fp16`` rows ran without it. The course's program adds each
  backward's 16-bit weight gradient into its fp32 sum (:class:`~course_lib.precision.mixed.
  MainGrads`: ``add_``, 10 bytes an element); the fused GEMM reads and writes the fp32 sum in its
  epilogue instead (8 bytes an element beside 2T FLOPs, for T rows: T/4 FLOPs a byte, under the
  GEMM's compute when T exceeds about 1,200 rows on an H100, 989 TFLOP/s over 3.35 TB/s; the
  rows' T is a micro-batch's 4,096 tokens, an expert's ~4,096 routed rows). So the adds into an
  existing sum of a GEMM's weight (every Linear's, not an embedding's or the router's, which
  Megatron-Core multiplies with a plain ``F.linear``) run unpriced (:func:`fuse_gradient_accumulation`);
  the first backward's cast into a new sum stays priced, as Megatron's zeroing of its buffers
  each step would be (4 bytes an element, against the cast's 6). The values are the course's.

* ``"overlap_grad_reduce"``, ``"overlap_param_gather"``: Megatron-Core's distributed optimizer
  with ``--overlap-grad-reduce`` and ``--overlap-param-gather`` (the MoE ModelZoo's yaml sets
  both; :data:`ZERO_RUNTIME`'s comment has the code read). On the course's ZeRO-1/2
  (:func:`overlap_distributed_optimizer`): the first pipeline stage's buckets are
  reduce-scattered from its last backward's gradient hooks, each as soon as it is complete,
  the other stages' all at once when their schedule ends (Megatron's default
  ``align_grad_reduce``); each bucket is gathered where a module's forward first uses it, in
  the step's first forward, the next bucket's gather started as this one is waited for
  (``align_param_gather`` off: forced so without an interleaved schedule). What it costs, in
  a pipeline: a stage's first forward waits for the gathers its host starts there, after its
  first activation arrived, and the fill hands that wait from stage to stage; what it saves:
  the first stage's reductions under its last backward. The same sums and gathers
  (``tests/test_zero_overlap.py``: as one device in float64, and the dry run a real launch).

The kernels compute what the course's ops compute (``tests/test_dry_run.py`` checks them
on the CPU against :func:`course_lib.attention.causal_attention`, values and gradients). They
replace the attention core of the model the dry run builds (:func:`install`), nothing else:
every other op is the course's.
"""
from __future__ import annotations

import contextlib
import math
import types

import torch

from course_lib import fused, trace
from course_lib.fused import flash_attention
from course_lib.gpt import Attention, Block
from course_lib.parallel.compose import chunk_of
from course_lib.parallel.grad_sync import OverlappedGradSync
from course_lib.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from course_lib.parallel.vocab_parallel import VocabParallelEmbedding
from course_lib.precision.mixed import accumulates
from course_lib.recompute import recompute
from course_lib.virtual.bias_dropout_add import bias_dropout_add, layer_bias_dropout_add, output_layer
from course_lib.virtual.deepspeed_order import DeepSpeedP2POrder, install_partitioned_pipe
from course_lib.flash_prefix import flash_attention_prefix
from course_lib.virtual.fused_qkv import project_fused
from course_lib.virtual.megatron_p2p import MegatronP2P, install_megatron_p2p

FUSIONS = ("scale_mask_softmax", "flash_attention", "bias_dropout_add", "fused_qkv")
# RMSNorm and SwiGLU as one kernel each way (course_lib.fused): what Hardware.fused_kernels
# states for the planner, run by the ranks (dry_run adds it for such a Hardware)
FUSIONS = FUSIONS + ("rmsnorm_swiglu",)
RUNTIME = ("blocking_sends", "overlapped_dp", "launch_blocking",  # how the program runs, not a kernel
           "deepspeed_p2p_order", "zero_all_reduce")              # (:func:`install_runtime`)
RUNTIME = RUNTIME + ("megatron_p2p", "megatron_timers")   # Megatron-LM's exchange, its timers' syncs
RUNTIME = RUNTIME + ("deepspeed_partitioned_pipe",)      # DeepSpeed's PartitionedTensor pipeline messages
# Megatron-LM 2022's sequence-parallel column layer (NVIDIA/Megatron-LM at 55ba1f7b96,
# megatron/mpu/layers.py, LinearWithGradAccumulationAndAsyncCommunication.backward, L239-309):
# the input re-gathered with ``_all_gather_base(..., async_op=True)`` while ``grad_output.matmul
# (weight)`` (dX) runs, ``handle.wait()``, then dX reduce-scattered with ``_reduce_scatter_base(...,
# async_op=True)`` while the weight gradient's GEMM and the bias's sum run, ``handle.wait()``
# (Korthikanti et al. 2022, Sec. 4.2.2: "we overlap this communication with the computation
# required to calculate gradients"). Run by the course's SP column layers
# (:func:`~course_lib.parallel.tensor_parallel.column_backward`; the fused QKV GEMM's too), the
# collectives on the tp group's stream; the values are the plain layer's, to the bit. Narayanan
# et al. 2021's code (de7dc40) has no SP and a synchronous f (copy_to_tensor_model_parallel_region).
SP_RUNTIME = ("sp_backward_overlap",)
# Megatron-LM 2022's tensor-parallel column layer without SP (55ba1f7b96, megatron/mpu/layers.py
# L239-309 as above, ``ctx.async_grad_allreduce``: dX all-reduced with ``torch.distributed.
# all_reduce(grad_input, ..., async_op=True)`` while the weight gradient's GEMM and the bias's sum
# run, ``handle.wait()``; L397-408: the column layer then skips ``copy_to_tensor_model_parallel_
# region``, f; model/language_model.py L30-55: the LM head's too). ``--no-async-tensor-model-
# parallel-allreduce`` (arguments.py L570-575, store_false: on by default), turned off where
# sequence parallelism runs (L314-317). Korthikanti et al. 2022, Sec. 6.2: "we overlap
# all-reduce communication with the linear weight's gradient computation". Run by the course's
# TP column layers and the fused QKV GEMM without SP (:mod:`course_lib.parallel.
# tp_backward_overlap`), the all-reduce on the tp group's stream; the values are the plain
# layer's, to the bit. Narayanan et al. 2021's code (de7dc40) has no such flag: f waits.
TP_RUNTIME = ("tp_backward_overlap",)
RUNTIME = RUNTIME + SP_RUNTIME + TP_RUNTIME
# Megatron-LM keeps its activations (sequence, batch, hidden) (megatron/model/transformer.py,
# "hidden_states: [s, b, h]"), so its sequence-parallel collectives gather and scatter the first
# dimension, contiguous pieces (megatron/mpu/mappings.py at 55ba1f7b96, _gather_along_first_dim
# and _reduce_scatter_along_first_dim): none of the copies that move the course's (batch,
# sequence, hidden) sequence to the front and back (course_lib.parallel.comm_ops.layout_copies,
# at micro-batches over 1). Run by the course's layers with those copies unpriced.
LAYOUT_RUNTIME = ("sequence_first",)
RUNTIME = RUNTIME + LAYOUT_RUNTIME
RUNTIME = RUNTIME + ("gradient_accumulation_fusion",)     # Megatron's wgrad GEMM into main_grad
# Megatron-Core's distributed optimizer with --overlap-grad-reduce and --overlap-param-gather
# (megatron/core/distributed/param_and_grad_buffer.py at c45e651854, 2025-04-15): each bucket
# group's reduce-scatter issued asynchronously from a parameter's backward hook once the last
# micro-batch's backward has made every gradient in it (register_grad_ready, is_last_microbatch:
# the schedule's no_sync() around the others), on the first pipeline stage only: by default
# (--no-align-grad-reduce not set, arguments.py) the other stages launch theirs when their
# schedule ends ("other pipeline stages do grad reduction during pipeline bubble",
# core/pipeline_parallel/schedules.py: an asynchronous reduction slows the compute beside it,
# and a slower last backward on every stage would add up along the pipeline's drain); waited
# for in finish_grad_sync after the schedule; each bucket group's all-gather waited for in a forward pre-hook of the modules
# that use it (finish_param_sync), which starts the next group's (next_param_gather_bucket_group,
# one chain per buffer of a model chunk), the first started there too: each stage gathers in its
# own first forward (align_param_gather, which starts every stage's gathers at once, is forced off
# without an interleaved schedule: arguments.py L480-487). Run by the course's ZeRO-1/2 (course_lib.parallel.zero_nd.ZeroSync); the values
# are the same sums and gathers.
ZERO_RUNTIME = ("overlap_grad_reduce", "overlap_param_gather")
RUNTIME = RUNTIME + ZERO_RUNTIME


def check_fusions(fusions) -> tuple:
    """``fusions`` as a tuple of names of :data:`FUSIONS` (ValueError naming the unknown one;
    the two attention kernels exclude each other)."""
    if isinstance(fusions, str):
        fusions = (fusions,)
    fusions = tuple(fusions or ())
    for f in fusions:
        if f not in FUSIONS + RUNTIME:
            raise ValueError(f"unknown fusion {f!r}: the dry run knows {FUSIONS + RUNTIME}")
    if "deepspeed_partitioned_pipe" in fusions and "deepspeed_p2p_order" not in fusions:
        raise ValueError("fusions: 'deepspeed_partitioned_pipe' is DeepSpeed's PipelineEngine's exchange: "
                         "give 'deepspeed_p2p_order' with it")
    if "megatron_timers" in fusions and "megatron_p2p" not in fusions:
        raise ValueError("fusions: 'megatron_timers' (Megatron-LM's timers) times Megatron's own exchange: "
                         "give 'megatron_p2p' with it")
    if {"scale_mask_softmax", "flash_attention"} <= set(fusions):
        raise ValueError("fusions: 'scale_mask_softmax' and 'flash_attention' are two kernels for the same "
                         "attention core; give one")
    return fusions


def _kv_for_each_head(q, k, v):
    """K and V with one head per query head (grouped-query attention): a view for one KV head."""
    rep = q.shape[1] // k.shape[1]
    if rep == 1:
        return k, v
    if k.shape[1] == 1:
        return k.expand(-1, q.shape[1], -1, -1), v.expand(-1, q.shape[1], -1, -1)
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


class CausalSoftmax(torch.autograd.Function):
    """softmax over the last dim with the entries where ``future`` is True left out: one kernel
    forward (``_masked_softmax``), one backward (``_softmax_backward_data``: a left-out entry's
    probability is 0, so its gradient is too)."""

    @staticmethod
    def forward(ctx, scores, future):
        probs = torch._masked_softmax(scores, future, -1, 0)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, probs, -1, probs.dtype), None


def scale_mask_softmax_attention(q, k, v, future, dropout=None):
    """Megatron-LM's attention core: (b, a, s, d) -> (b, a, s, d), causal (``future``: (s, s),
    True above the diagonal)."""
    k, v = _kv_for_each_head(q, k, v)
    scores = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)
    probs = CausalSoftmax.apply(scores, future)
    if dropout is not None:
        probs = dropout(probs)
    return probs @ v


def _attend_scale_mask_softmax(self, q, k, v, q_pos=None, k_pos=None, future=None):
    _plain_positions(q_pos, k_pos)
    fut = self.future_mask[:q.shape[2], :q.shape[2]] if future is None else future

    def core(q, k, v):
        return scale_mask_softmax_attention(q, k, v, fut, self.attn_dropout)
    if self.recompute == "selective":
        return recompute(core, (q, k, v), rng_of=(self.attn_dropout,))
    return core(q, k, v)


def _attend_flash(self, q, k, v, q_pos=None, k_pos=None, future=None):
    if q_pos is None and k_pos is None:
        return fused.attend_flash(self, q, k, v, q_pos, k_pos, future)
    if self.training and self.attn_dropout.p:
        raise NotImplementedError("flash_attention: attention dropout is not run fused (the course's CPU "
                                  "kernel has no dropout mask the course's Dropout would match)")
    _prefix_positions(q_pos, k_pos, future)       # all-gather CP: a query chunk over the keys it sees
    return flash_attention_prefix(q, k, v)


def _prefix_positions(q_pos, k_pos, future):
    """The one shape of positions a fused core runs besides a whole sequence: keys 0..L-1 and
    the queries at the last of them (:mod:`course_lib.flash_prefix`)."""
    n_q, n_k = q_pos.numel(), k_pos.numel()
    clock = trace.clock()
    with clock.muted() if clock is not None else contextlib.nullcontext():   # a host check, not a kernel
        plain = (torch.equal(k_pos, torch.arange(n_k, device=k_pos.device))
                 and torch.equal(q_pos, torch.arange(n_k - n_q, n_k, device=q_pos.device)))
    if future is not None or n_q > n_k or not plain:
        raise NotImplementedError("a fused attention core runs one whole causal sequence (positions 0..s-1) or "
                                  "one query chunk over the keys before it (all-gather CP), without documents")


def _plain_positions(q_pos, k_pos):
    if q_pos is not None or k_pos is not None:
        raise NotImplementedError("a fused attention core runs one whole causal sequence (positions 0..s-1)")


def _masked_softmax_on_meta() -> None:
    """torch has no meta kernel for ``_masked_softmax``: its shape is its input's (registered
    once per process, for the meta device only)."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_masked_softmax", "Meta"):
        torch.library.register_fake("aten::_masked_softmax")(_masked_softmax_shape)


def _masked_softmax_shape(x, mask, dim=None, mask_type=None):
    return torch.empty_like(x)


def install(model, fusions) -> int:
    """Every :class:`~course_lib.gpt.Attention` of ``model`` runs its core as ``fusions`` say
    (with ``"fused_qkv"`` its projections as one GEMM), with ``"rmsnorm_swiglu"`` its RMSNorm
    and SwiGLU modules as :mod:`course_lib.fused`'s kernels, and with ``"bias_dropout_add"`` every
    :class:`~course_lib.gpt.Block` its output adds (this
    instance only; before the model is cut). Returns how many modules were changed."""
    fusions = check_fusions(fusions)
    attend = _attend_flash if "flash_attention" in fusions else \
        _attend_scale_mask_softmax if "scale_mask_softmax" in fusions else None
    n = 0
    if attend is not None:
        _masked_softmax_on_meta()
        for mod in model.modules():
            if isinstance(mod, Attention):
                mod.attend = types.MethodType(attend, mod)
                mod.flash_blocks = attend is _attend_flash   # ring CP: its blocks as the same kernel
                n += 1
    if "fused_qkv" in fusions:
        for mod in model.modules():
            if isinstance(mod, Attention):
                mod.project = types.MethodType(project_fused, mod)
                n += 1
    if "rmsnorm_swiglu" in fusions:
        n += fused.install(model)
    if "bias_dropout_add" in fusions:
        for mod in model.modules():
            if isinstance(mod, Block):
                output_layer(mod.mlp, "proj" if hasattr(mod.mlp, "proj") else "w2")
                mod.layer = types.MethodType(layer_bias_dropout_add, mod)
                n += 1
    return n


def install_runtime(net, software) -> None:
    """The runtime behaviours of :data:`RUNTIME` in ``software`` set on ``net`` (what
    :func:`~course_lib.parallel.compose.parallelize_nd` returned): ``"blocking_sends"``, its
    pipeline runner waits for each send where it posts it; absent, it does not. And on this
    rank's virtual clock, if one runs (:func:`install_launch_blocking`; ``"sequence_first"``:
    :data:`LAYOUT_RUNTIME`)."""
    software = check_fusions(software)
    runner = getattr(net, "runner", None)
    if runner is not None:
        runner.blocking_sends = "blocking_sends" in software
        if "deepspeed_p2p_order" in software:
            order = DeepSpeedP2POrder(runner)
            if "deepspeed_partitioned_pipe" in software:
                install_partitioned_pipe(net, order)
        install_megatron_p2p(net, software)
    if "overlapped_dp" in software and getattr(net, "grad_sync", None) is not None:
        overlap_dp(net)
    if getattr(net, "zero", None) is not None:
        net.zero.all_reduce = "zero_all_reduce" in software
    overlap_sp_backward(net, "sp_backward_overlap" in software)
    overlap_tp_backward(net, "tp_backward_overlap" in software)
    fuse_gradient_accumulation(net, "gradient_accumulation_fusion" in software)
    overlap_distributed_optimizer(net, software)
    clock = trace.clock()
    install_launch_blocking(clock, software)
    if clock is not None:
        clock.sequence_first = "sequence_first" in software


def fp32_sums_needed(precision) -> ValueError | None:
    """The error for ``"gradient_accumulation_fusion"`` under ``precision`` (None: a net with
    no fp32 gradient sums), or None where gradients are summed in fp32 (Megatron-LM turns the
    fusion off otherwise)."""
    if precision is not None and accumulates(precision):
        return None
    got = "" if precision is None else f", not {precision!r}"
    return ValueError(f"fusions: 'gradient_accumulation_fusion' fuses the add into an fp32 gradient sum: "
                      f"run it with precision='bf16-accumulate-fp32'{got} (Megatron-LM turns it off otherwise)")


def gemm_weights(net) -> list:
    """The weights ``net``'s stages (or ``net``, a module) multiply in a GEMM whose weight
    gradient Megatron-LM's fused kernel accumulates: every Linear's (the course's column and
    row layers, the experts' and the LM head's), not an embedding's (tied to the head too) or
    a router's."""
    stages = [net] if isinstance(net, torch.nn.Module) else getattr(net, "stages", {}).values()
    mods = [mod for stage in stages for mod in stage.modules()]
    skip = {id(q) for mod in mods if isinstance(mod, (torch.nn.Embedding, VocabParallelEmbedding))
            for q in mod.parameters()}
    skip |= {id(q) for mod in mods if isinstance(getattr(mod, "router", None), torch.nn.Module)
             for q in mod.router.parameters()}
    linear = (torch.nn.Linear, ColumnParallelLinear, RowParallelLinear)
    weights = {id(mod.weight): mod.weight for mod in mods
               if isinstance(mod, linear) and isinstance(getattr(mod, "weight", None), torch.nn.Parameter)}
    return [q for k, q in weights.items() if k not in skip]


def fuse_gradient_accumulation(net, on: bool = True) -> int:
    """``on``: the adds of a GEMM weight's gradient into its existing fp32 sum (the
    :class:`~course_lib.precision.mixed.MainGrads` of ``net``'s ZeRO or master weights) run
    unpriced on this rank's clock, as inside Megatron-LM's fused weight-gradient GEMM
    (``"gradient_accumulation_fusion"``, the module doc); off: priced again. ValueError where
    no gradient accumulates in fp32 (Megatron turns the fusion off there too). Returns how many
    weights it set."""
    mains = [m for m in (getattr(getattr(net, "zero", None), "main_grads", None),
                         getattr(getattr(net, "master", None), "main_grads", None)) if m is not None]
    if not on:
        for main in mains:
            main.accumulating = None
        return 0
    if not mains:
        raise fp32_sums_needed(None)

    def unpriced():
        clock = trace.clock()
        return clock.muted() if clock is not None else contextlib.nullcontext()

    ids = {id(q) for q in gemm_weights(net)}
    for main in mains:
        main.accumulating = {id(q): unpriced for q in main.params if id(q) in ids}
    return sum(len(main.accumulating) for main in mains)


def _column_layers(net):
    """The column-parallel layers of ``net``'s stages (or of ``net``, a module)."""
    stages = [net] if isinstance(net, torch.nn.Module) else getattr(net, "stages", {}).values()
    return [mod for stage in stages for mod in stage.modules() if isinstance(mod, ColumnParallelLinear)]


def overlap_sp_backward(net, on: bool = True) -> int:
    """Every column-parallel layer of ``net``'s stages (or of ``net``, a module) runs (``on``) or not its SP backward as
    Megatron-LM 2022's (:data:`SP_RUNTIME`): the re-gather under dX's GEMM, dX's reduce-scatter
    under dW's. Returns how many layers it set."""
    layers = _column_layers(net)
    for mod in layers:
        mod.overlap_backward = on
    return len(layers)


def overlap_tp_backward(net, on: bool = True) -> int:
    """Every column-parallel layer of ``net``'s stages (or of ``net``, a module) runs (``on``) or
    not its tensor-parallel backward as Megatron-LM 2022's (:data:`TP_RUNTIME`): dX's all-reduce
    under dW's GEMM, where the layer is its region's only column layer and SP is off. Returns
    how many layers it set."""
    layers = _column_layers(net)
    for mod in layers:
        mod.overlap_all_reduce = on
    return len(layers)


def zero_runtime_error(layout, software) -> ValueError | None:
    """The error for :data:`ZERO_RUNTIME` items in ``software`` under ``layout`` (None: none):
    they run Megatron-Core's distributed optimizer, the course's ZeRO-1/2 (``zero`` 1 or 2,
    ``data="ddp"``), its gradients reduced in the schedule by bucket (``grad_reduce="step"``: not
    chunk by chunk as well), in a schedule that neither interleaves nor splits a backward."""
    asked = [f for f in ZERO_RUNTIME if f in software]
    if not asked:
        return None
    if layout.zero not in (1, 2) or getattr(layout, "data", "ddp") != "ddp":
        return ValueError(f"fusions: {asked} overlap Megatron-Core's distributed optimizer: run them with ZeRO-1 "
                          f"or ZeRO-2 (zero=1 or 2, data='ddp'), got zero={layout.zero}, "
                          f"data={getattr(layout, 'data', 'ddp')!r}")
    if "overlap_grad_reduce" in asked and layout.grad_reduce != "step":
        return ValueError(f"fusions: 'overlap_grad_reduce' reduces each bucket in its chunk's last backward: "
                          f"run it with grad_reduce='step', got {layout.grad_reduce!r}")
    sched = layout.schedule     # (a name, or the action lists a validated layout carries)
    plain = sched in ("1f1b", "gpipe") if isinstance(sched, str) else \
        not any(action[0] == "W" for row in sched for action in row)
    if "overlap_grad_reduce" in asked and not (plain and layout.v == 1):
        # (interleaved: Megatron-Core launches each chunk's reductions at one moment on every stage,
        # align_grad_reduce, which the course does not run; zero bubble: a backward split in two)
        got = repr(sched) if isinstance(sched, str) else "a list schedule that splits backwards"
        return ValueError(f"fusions: 'overlap_grad_reduce' runs Megatron-Core's non-interleaved schedule: run it "
                          f"with schedule='1f1b' (or 'gpipe') and v=1, got {got}, v={layout.v}")
    return None


def gather_units(net) -> list:
    """The modules whose forward reads their parameters, for the parameter gathers of
    ``overlap_param_gather``: each stage's embedding, final norm and head, and each block's
    children that hold parameters (its norms, its attention, its MLP or MoE: each reads its own
    weights, a fused kernel's or an expert's included, inside its forward)."""
    units = []
    for st in net.stages.values():
        mods = [mod for name, mod in st.part.named_children() if name != "blocks"]
        mods += [child for block in st.part.blocks for child in block.children()]
        units += [mod for mod in mods if next(mod.parameters(), None) is not None]
    return units


def overlap_distributed_optimizer(net, software) -> None:
    """``"overlap_grad_reduce"`` and ``"overlap_param_gather"`` in ``software`` (Megatron-Core's
    flags, :data:`ZERO_RUNTIME`) run on ``net``'s ZeRO (:meth:`~course_lib.parallel.zero_nd.
    ZeroSync.overlap_grad_reduce`, :meth:`~course_lib.parallel.zero_nd.ZeroSync.overlap_param_gather`):
    the runner tells the ZeRO when each chunk's last backward starts and ends, and runs that
    backward as the program (a dry run replays no price there)."""
    software = check_fusions(software)
    if not set(ZERO_RUNTIME) & set(software):
        return
    if (error := zero_runtime_error(net.layout, software)) is not None:
        raise error
    zero, runner, chunks = net.zero, net.runner, chunk_of(net.stages)
    if "overlap_grad_reduce" in software:
        first = runner.me == 0     # Megatron-Core's default (align_grad_reduce): the first stage's hooks
        zero.overlap_grad_reduce(chunks, hooked=first)
        runner.gradients_starting, runner.gradients_done = zero.gradients_starting, zero.gradients_done
        runner.hooked_last = first
    if "overlap_param_gather" in software:
        zero.overlap_param_gather(gather_units(net), chunks)


def install_launch_blocking(clock, software) -> None:
    """``"launch_blocking"`` in ``software``: ``clock`` (a rank's virtual clock; None, a wall-clock
    run: nothing to price) runs as under ``CUDA_LAUNCH_BLOCKING=1``, each launch returning when
    its kernel ends; absent, launches return at once (eager PyTorch's default)."""
    if clock is not None:
        clock.launch_blocking = "launch_blocking" in check_fusions(software)


def overlap_dp(net) -> None:
    """``net``'s gradient sums (its runtime's GradSync, after the schedule) made PyTorch DDP's:
    an :class:`OverlappedGradSync` over the same parameters and groups, whose hooks launch each
    bucket as the last micro-batch's backward fills it; the earlier backwards run without sync."""
    if net.p != 1:
        raise NotImplementedError("overlapped_dp: DDP under the last backward runs without a pipeline (pp = 1), "
                                  f"got pp = {net.p}")
    old = net.grad_sync
    dims = {id(q): tuple(b.comm.dim.split("+")) for b in old.buckets for q in b.params}
    sync = OverlappedGradSync(old.params, old.mesh, divisor=old.divisor, dims=dims)
    net.grad_sync = sync
    net.gradient_sums = [sync.finish if f == old.finish else f for f in net.gradient_sums]
    runner, last, plain = net.runner, net.m - 1, net.runner.B

    def backward(i, s, mb):           # torch DDP's no_sync() around every backward but the last
        sync.require_sync = mb == last
        try:
            plain(i, s, mb)
        finally:
            sync.require_sync = True
    runner.B = backward


__all__ = ["FUSIONS", "RUNTIME", "SP_RUNTIME", "TP_RUNTIME", "LAYOUT_RUNTIME", "overlap_sp_backward",
           "overlap_tp_backward", "check_fusions", "install", "install_runtime", "install_launch_blocking",
           "DeepSpeedP2POrder", "scale_mask_softmax_attention", "flash_attention", "CausalSoftmax",
           "bias_dropout_add", "overlap_dp", "MegatronP2P", "ZERO_RUNTIME", "zero_runtime_error", "gather_units",
           "overlap_distributed_optimizer"]
