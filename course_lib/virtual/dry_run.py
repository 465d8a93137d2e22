"""The course's own program at a published model's full shape, priced on the virtual clock.

    from course_lib.planner import Layout
    from course_lib.virtual import dry_run
    r = dry_run("megatron-175b", "a100-80gb",
                Layout(tp=8, pp=8, sp=True, schedule="interleaved", v=2,
                       micro_batch=1, global_batch=64, recompute="selective"))
    r.step_time, r.mfu, r.peak_memory, r.fits    # virtual seconds, planner's MFU, bytes
    r.spans, r.ranks_run                         # trace.Span of the ranks that ran

What runs is one training step of :func:`train_step`, the program a real
``launch(..., clock=VirtualCluster(...))`` runs too: the course's TinyGPT at the model's
shape, cut by :func:`~course_lib.parallel.compose.parallelize_nd` (the pipeline runtime of
chapters 6 and 9, TP + SP, DDP / FSDP, recompute), then AdamW. Every tensor lives on the meta
device (shapes, no data); every op is priced by the clock's compute stream, every message and
collective by its links (:mod:`.clock`, :mod:`.links`): the same pricing code as any virtual run.

Ranks that do identical work run once (:mod:`.priced`): per pipeline stage, the ranks at
dp = tp = 0 (every cp rank, unless they do identical work: :func:`running_ranks`), each in a
thread of this process; their tp / dp / ep (and folded cp) twins would issue every collective at the same instant, so a collective starts
when its running members are ready. A mixture of experts is routed balanced
(:func:`moe_config`); the token places of the members of a routing group it folds are its own to
give (:mod:`.moe_folding`).
Pipeline messages travel between the stages' threads with their start times, in the
program's own order. ``tests/test_dry_run.py`` checks a small dry run against a real launch
of the same layout, to the last bit of the step time.

What a published run's software fused is the caller's to state (``fusions``, :mod:`.software`:
Megatron-LM's fused scale-mask-softmax, FlashAttention): the model runs that attention kernel,
which computes what the course's written-out attention computes; nothing else changes, and
nothing is fitted (``lab.dry_runs.SOFTWARE`` states it per source). What the Hardware states
fused runs fused, as ``planner.estimate`` prices it for the same arguments: ``fused_kernels``
(RMSNorm and SwiGLU) and ``fused_attention`` (FlashAttention, every preset's statement; ring
CP's blocks as that kernel), unless the caller states another attention kernel
(:func:`hardware_attention`; :func:`course_lib.planner.written_out` is the chapters' program).

Numerics: with ``layout.precision`` "full" (the default) the program runs in float and the
clock prices every floating tensor at the cluster's dtype (bf16: 2 bytes, bf16's GEMM rate),
the fp32 master weights and moments counted in memory by formula. Under a mixed precision
(``Layout.precision``, :mod:`course_lib.precision.mixed`: "bf16", "bf16-reduce-fp32",
"bf16-accumulate-fp32") the program runs it for real: a bf16 model, fp32 masters (or ZeRO's fp32
owned slices) and moments, gradients accumulated and reduced in the stated dtype; the cluster
prices each tensor at its own dtype (``VirtualCluster(dtype=None)``), in time and in memory
(``lab.dry_runs.PRECISION`` states each source's).

Memory (``peak_memory``): the largest over the running ranks and over the step of what its GPU
holds (:func:`gpu_memory`, ``memory_by_stage[k]["peak"]``), every tensor the program holds.
At moments, the pipeline runner asks after each forward and at the end of each backward: the
model states as they are then (:class:`MemoryProbe`: parameters, masters and moments, and the
gradient buffers as the program allocates and frees them, :func:`gradient_tensors`: ZeRO-2's
fp32 sums live during the schedule and are gone after it, the masters' fp32 gradients of
"bf16" appear after it; DDP's buckets, made with the model, are held all step and after the
sums hold the gradients) plus the activations autograd saved for backward then (the runner's
count; a backward's end counts its saved tensors beside the gradients it made), and the states
after the step: ``moment_memory`` (``memory_by_stage[k]["moments"]``), what the planner walks
moment by moment. Between two moments the program holds more for a while: the loss's logits
and their gradient, a layer recomputed, FSDP's gathered parameters, a gradient on its way
into ``.grad``, the optimizer's temporaries. :mod:`.live_memory`
follows every tensor the step's ops create, so the peak is each moment's count plus the most
the program added after it (a replayed action, which runs no op, is given its real runs'
rise); checked against torch's own ``MemTracker`` on a real step
(``tests/test_dry_run_live_memory.py``). Not counted: an op's own workspace, module buffers,
and the stage outputs and messages the course's runner keeps across moments (an output until
its backward, every send until the step's end, RECV_DEPTH receive buffers), which Megatron-LM
and Llama 3 free once sent (``deallocate_output_tensor``;
:func:`course_lib.lab.llama3_memory.held_over_step` sizes them); ``memory_by_stage`` keeps
"states" (after the step) and "activations" (their own peak) beside.
"""
from __future__ import annotations

import contextlib
import copy
import re
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.fx.experimental._config as _fx_config
import torch.nn as nn

from course_lib import trace
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.layout import Layout
from course_lib.parallel.compose import parallelize_nd
from course_lib.parallel.grad_sync import GradSync
from course_lib.parallel.layout_rules import check_layout
from course_lib.parallel.mesh import MeshShape
from course_lib.parallel.pipeline.rules import partition_layers
from course_lib.planner import formulas
from course_lib.planner.presets import ModelSpec, get_hardware, get_model, runs_flash
from course_lib.precision.mixed import check_precision
from course_lib.schedules import chunks, make_schedule, placement_of, rank_stage_ids, validate
from course_lib.virtual.compute import tensor_bytes
from course_lib.virtual.live_memory import LiveBytes
from course_lib.virtual.moe_folding import check_balanced_folding, fold_token_places
from course_lib.virtual.priced import DryRankClock, MetaScalars, StageMesh, Stages
from course_lib.virtual.replay import ActionMemo, TapeRecorder
from course_lib.virtual.software import check_fusions, fp32_sums_needed, install, install_runtime, zero_runtime_error

_ALL_NONZERO = _fx_config.patch


@dataclass
class DryRun:
    model: ModelSpec
    hardware: object
    layout: Layout
    step_time: float           # virtual seconds of one optimizer step (the slowest running rank)
    mfu: float                 # model FLOPs (planner's count, full attention) / (step * GPUs * peak)
    peak_memory: int           # bytes, the largest over the GPUs (see the module's docstring)
    memory_by_stage: list      # per pipeline stage: {"states": after the step, "activations": their peak,
                               #  "peak": the largest held over the step, every tensor;
                               #  "moments": the largest count at a moment (no temporaries)} (bytes)
    spans: list                # trace.Span of the running ranks, virtual seconds
    ranks_run: int
    kernels: int               # kernels priced on the running ranks' compute streams
    wall_seconds: float
    replayed: int              # actions whose price was replayed (:mod:`.replay`), of all the ranks run
    config: GPTConfig = field(repr=False, default=None)
    fusions: tuple = ()        # the source's fused kernels the program ran (:mod:`.software`)

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.hardware.hbm_bytes

    @property
    def moment_memory(self) -> int:
        """Bytes, the largest count at a moment over the GPUs (``memory_by_stage[k]["moments"]``:
        states plus saved activations, no temporaries): what the planner walks moment by moment."""
        return max(m["moments"] for m in self.memory_by_stage)


def model_config(spec: ModelSpec, layout: Layout, recompute=None, dropout: float = 0.0) -> GPTConfig:
    """The course's GPTConfig of a planner ModelSpec: "gpt2" blocks (LayerNorm, GeLU 4h, biases,
    learned positions) for a GeLU / LayerNorm model, "llama" blocks (RMSNorm, SwiGLU, rotary, no
    biases) for the others; the sequence the layout's (else the model's). ``dropout``: the
    source's hidden and attention dropout (one p for both, as Megatron-LM's defaults), run by
    the model's own Dropout modules."""
    gpt2 = spec.mlp == "gelu"
    if gpt2 != (spec.norm == "layernorm") or gpt2 != spec.bias:
        raise ValueError(f"{spec.name}: the course's blocks are GPT-2 (GeLU, LayerNorm, biases) or Llama "
                         f"(SwiGLU, RMSNorm, no biases), not mlp={spec.mlp!r}, norm={spec.norm!r}, bias={spec.bias}")
    s = layout.seq_len or spec.seq_len
    return GPTConfig(vocab_size=spec.vocab, seq_len=s, n_layers=spec.n_layers, hidden=spec.hidden,
                     n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads, ffn_hidden=spec.ffn,
                     block="gpt2" if gpt2 else "llama", tie_embeddings=spec.tied,
                     recompute=layout.recompute if recompute is None else recompute, dropout=dropout,
                     **moe_config(spec, layout))


def moe_config(spec: ModelSpec, layout: Layout) -> dict:
    """GPTConfig's mixture-of-experts fields of ``spec`` ({} for a dense model): experts with the
    model's MLP (GeLU or SwiGLU, :class:`~course_lib.moe.Expert`). On the meta device the router
    has no values: the dry run routes BALANCED (every top-k takes
    :func:`~course_lib.meta.round_robin`'s experts over its routing group's tokens in the
    single-device order: each expert T*k/E of a group's T tokens), so the dispatch sizes are
    static and no token is dropped at any capacity factor >= 1 (dropless prices the same: a real
    dropless run's sizes follow its data, which a dry run does not have)."""
    if spec.n_experts <= 1:
        return {}
    return {"n_experts": spec.n_experts, "top_k": spec.top_k, "moe_dispatch": spec.moe_dispatch,
            "capacity_factor": 1.25, "expert_mlp": spec.mlp}


def train_step(cfg: GPTConfig, layout: Layout, mesh, device="cpu", memo=None, model=None,
               optimizer="fused", fusions=(), watch=None) -> dict:
    """One training step of the course's program on this rank: the model built (or ``model``,
    only read) and cut (not priced), then ``net.step`` of a global batch and an AdamW step
    (priced; ``optimizer``: "fused", :class:`FusedAdamW`, or "foreach", torch's AdamW as the clock
    runs it). Run by the dry run (meta device, a :class:`~.priced.StageMesh`, an
    :class:`~.replay.ActionMemo`) and by a real launch (a Mesh) alike. ``fusions``: the attention
    kernels the model built here runs (:func:`.software.install`, and FlashAttention where the
    clock's Hardware states it, :func:`hardware_attention`, as the dry run does; a ``model``
    given has its own),
    and the runtime behaviours the runner keeps (:func:`.software.install_runtime`). ``watch``
    (optional): ``watch(net, opt)`` -> a context manager entered around the step (another tool
    watching the same step: the tests' torch ``MemTracker``). Returns the clock's end, its
    kernels, and this GPU's memory (:func:`gpu_memory`)."""
    clock = trace.clock()
    with clock.muted():
        if model is None:
            with torch.device(device):
                model = TinyGPT(cfg, seed=0)
            install(model, fusions + hardware_attention(clock.cluster.hw, layout, fusions, cfg.dropout))
        net = parallelize_nd(model, mesh, layout)
        install_runtime(net, fusions)
        opt = FusedAdamW(net.parameters()) if optimizer == "fused" else \
            torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)
        optimizer_state(opt)
        x = torch.zeros(layout.global_batch, cfg.seq_len, dtype=torch.int64, device=device)
        fold_token_places(net, cfg, layout, mesh, document_ids(layout.documents))
    if memo is not None:
        memo.install(net.runner)
    stream = getattr(clock, "_mode", None)     # every tensor the step allocates followed (live_memory)
    live = None if stream is None else LiveBytes(stream.sizes)
    net.runner.memory_probe = probe = MemoryProbe(net, opt, clock.cluster, live)
    probe.start()
    if stream is not None:
        stream.live = live
    try:
        with watch(net, opt) if watch is not None else contextlib.nullcontext():
            net.step(x, x, doc_ids=document_ids(layout.documents))
            opt.step()
            net.runner.note_held()              # the step's end: its reductions and the optimizer's
    finally:
        if stream is not None:
            stream.live = None
    clock.settle()
    return {"t": clock.t, "kernels": clock.kernels, "replayed": memo.replays if memo is not None else 0,
            **gpu_memory(net, opt, clock.cluster), "late_frees": 0 if live is None else live.late}


def optimizer_state(opt) -> None:
    """Give ``opt`` (:class:`FusedAdamW` or torch's AdamW) the state its first step would create:
    zero moments and a zero step count, the values it creates them with (so the step computes
    the same), made here, where the clock is muted. The priced step is one of a run in
    progress, as the planner's and a published run's are: it finds its state there (creating
    it, two ``zeros_like`` per parameter, is not part of a training step)."""
    params = opt.params if isinstance(opt, FusedAdamW) else [q for g in opt.param_groups for q in g["params"]]
    for q in params:
        if isinstance(opt, FusedAdamW):
            opt.state.setdefault(q, {"step": torch.zeros((), dtype=torch.float32, device=q.device),
                                     "exp_avg": torch.zeros_like(q), "exp_avg_sq": torch.zeros_like(q)})
        elif not opt.state[q]:          # torch's AdamW (not capturable, not fused): its step on the host
            step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            opt.state[q].update(step=torch.tensor(0.0, dtype=step_dtype),
                                exp_avg=torch.zeros_like(q, memory_format=torch.preserve_format),
                                exp_avg_sq=torch.zeros_like(q, memory_format=torch.preserve_format))


def document_ids(lengths) -> torch.Tensor | None:
    """(s,) the document id of every token of a sequence packed with documents of ``lengths``
    (on the host: index arithmetic, as CP's positions); None for one document."""
    if not lengths:
        return None
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def stage_model(model, pp_rank: int, layout: Layout):
    """``model`` as pp rank ``pp_rank`` reads it: its own blocks (where the schedule places its
    stages: a V schedule's two chunks in V order), an empty ``nn.Identity`` in the place of
    every block another rank keeps (the stages copy the model they are given: a 1T model's
    128 blocks, 64 times over, for one or two blocks each). Shares the tensors."""
    v = chunks(layout.schedule, layout.v)               # the V schedules: 2, in V order
    ids = rank_stage_ids(pp_rank, layout.pp, v, placement_of(layout.schedule, layout.pp, v))
    layers = partition_layers(len(model.blocks), layout.pp * v, layout.stage_layers)
    mine = {i for s in ids for i in layers[s]}
    view = copy.copy(model)
    view._modules = dict(model._modules)            # (a shallow copy shares the dict of children)
    other = nn.Identity()           # one for all: each stage's deepcopy copies it once, not L - l times
    view.blocks = nn.ModuleList(b if i in mine else other for i, b in enumerate(model.blocks))
    return view


class FusedAdamW:
    """AdamW as a fused kernel runs it (apex's FusedAdam in Megatron-LM and DeepSpeed, torch's
    ``fused=True`` on CUDA): the step counts in one ``_foreach_add_``, then every tensor in one
    ``_fused_adamw_``, torch's own fused op (called directly: torch's AdamW refuses
    ``fused=True`` on the meta device; on the CPU the same op computes AdamW)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1):
        self.params = [q for q in params if q.requires_grad]
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.state = {}

    def step(self):
        ps = [q for q in self.params if q.grad is not None]
        for q in ps:
            if q not in self.state:         # created at the first step, as torch's optimizers do
                self.state[q] = {"step": torch.zeros((), dtype=torch.float32, device=q.device),
                                 "exp_avg": torch.zeros_like(q), "exp_avg_sq": torch.zeros_like(q)}
        st = [self.state[q] for q in ps]
        steps = [s["step"] for s in st]
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(ps, [q.grad for q in ps], [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st],
                            [], steps, lr=self.lr, beta1=self.betas[0], beta2=self.betas[1],
                            weight_decay=self.weight_decay, eps=self.eps, amsgrad=False, maximize=False)


FP32 = 4
# a running rank's memory (bytes): the states after the step, the peak of what autograd saved,
# the peak over the step of every tensor the program held, and the largest count at a moment
MEMORY_KEYS = ("states", "activations", "peak", "moments")


def gpu_memory(net, opt, cluster) -> dict:
    """Bytes this rank's GPU holds, as mixed-precision training on the virtual cluster keeps
    them: "states", after the step; "activations", the runner's peak of activations saved for
    backward; "moments", the largest over the step of the states as they are at a moment plus
    the activations saved then (:class:`MemoryProbe`), and the states after the step; "peak",
    the same with every tensor the program held between two moments (the runner's
    ``peak_held_bytes``: :mod:`.live_memory`), the GPU's peak. A cluster of one dtype (the course's float program standing for a
    bf16 one): ZeRO's convention, K = 12, the parameters and gradients the stages compute with
    at the cluster's dtype, an fp32 master of every parameter the optimizer updates and its fp32
    optimizer states by formula; activations at the cluster's dtype. A cluster of each tensor's
    own dtype (a program run under ``Layout.precision``: its masters and moments are real
    tensors): every tensor the rank holds, once, at its own dtype: the 16-bit parameters and
    gradients, the masters, their gradients, the fp32 gradient sums and the optimizer's
    states; the activations as they are."""
    probe = net.runner.memory_probe or MemoryProbe(net, opt, cluster)
    states = probe.states()
    return {"states": states, "activations": probe.activations(net.last_result.peak_activation_bytes),
            "peak": max(states, net.last_result.peak_held_bytes), "moments": max(states, probe.top_moment)}


class MemoryProbe:
    """What this rank's GPU holds at a moment of the step (see :func:`gpu_memory`):
    ``probe(saved, states_changed)`` -> its states now (the tensors that do not change during a step, counted
    once here, and :func:`gradient_tensors` as they are now) plus ``saved`` bytes of
    activations (the runner's count, at the cluster's dtype). Installed as the pipeline
    runner's ``memory_probe`` before the step.
    With ``live`` (:class:`~course_lib.virtual.live_memory.LiveBytes`, following every tensor
    the program allocates), the most the GPU held since the previous moment: that moment's
    count plus the most the program added after it (the loss's and the recompute's
    temporaries, gathered parameters, buckets, the optimizer's temporaries), where larger;
    ``excess`` (after the call) is how far that rose above both moments, which a replayed
    action (no op runs) is given back (``excess=``)."""

    def __init__(self, net, opt, cluster, live=None):
        self.net, self.cluster, self.live, self.excess, self.previous = net, cluster, live, 0, None
        self.top_moment = 0             # the largest count at a moment (no temporaries)
        model, updated = net.model_parameters(), net.parameters()
        moments = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.numel() > 1]
        self.own = cluster.dtype is None
        if self.own:
            self.fixed = tensor_bytes(cluster, {id(t): t for t in [*model, *updated, *moments]}.values())
            self.act_scale = (1, 1)
        else:
            self.fixed = tensor_bytes(cluster, model) + FP32 * (sum(q.numel() for q in updated) +
                                                                 sum(t.numel() for t in moments))
            act_item = net.act_dtype.itemsize if net.act_dtype is not None else \
                next(q.element_size() for q in model if q.is_floating_point())
            self.act_scale = (cluster.dtype.itemsize, act_item)
        self.model, self.updated, self.last = model, updated, None

    def activations(self, saved: int) -> int:
        return saved * self.act_scale[0] // self.act_scale[1]

    def states(self) -> int:
        return self.fixed + tensor_bytes(self.cluster, gradient_tensors(self.net, self.model, self.updated, self.own))

    def __call__(self, saved: int, states_changed: bool = True, excess: int = 0, going: int = 0) -> int:
        if states_changed or self.last is None:     # (a forward changes no gradient buffer)
            self.last = self.states()
        held = self.last + self.activations(saved)
        before = held if self.previous is None else self.previous
        # the count at this moment: a backward's end with its saved tensors (``going``) beside
        # the gradients it made, where the two coexist at their largest (the planner's moment)
        self.previous, self.top_moment = held, max(self.top_moment, held + self.activations(going))
        if self.live is None:
            return held
        top = max(before + self.live.rise(), max(before, held) + excess)
        self.live.mark()
        self.excess = max(0, top - max(before, held))
        return max(held, top)

    def start(self) -> None:
        """The step begins: its first moment is what the GPU holds now (states, nothing saved)."""
        self.previous = self(0)


def gradient_tensors(net, model, updated, own_dtype: bool) -> list:
    """The gradient buffers this rank holds now, each once: the model parameters' ``.grad``;
    ZeRO's owned slices' reduced gradients and its fp32 sums (``MainGrads``: whole buffers, from
    a parameter's first backward to the reduce-scatter after the schedule); FSDP's gradient
    shards reduced in the backward and the unsharded sums it keeps where it does not sync
    (before they are handed to the parameters' ``.grad``); under a precision
    (``own_dtype``) the gradients of what the optimizer updates (the masters', where the fp32
    sums of "bf16-accumulate-fp32" live without ZeRO); DDP's buckets, each once with the
    gradients that are views of it."""
    grads = [q.grad for q in model if q.grad is not None]
    zero = getattr(net, "zero", None)
    if zero is not None:
        grads += zero.shard_gradients()
        if zero.main_grads is not None:
            grads += zero.main_grads.grads.values()
    for mod in getattr(net, "modules", {}).values():      # FSDP's units: shards reduced in backward,
        for u in getattr(mod, "units", ()):                # sums kept unsharded where it does not sync
            grads += [t for t in (getattr(u, "grad_shard", None), getattr(u, "accumulated", None)) if t is not None]
    if own_dtype:
        grads += [q.grad for q in updated if q.grad is not None]
    # DDP's buckets (GradSync): made with the model, held all step (torch's DDP the same, its
    # default gradient_as_bucket_view=False); after the sums a gradient is a view of its bucket
    sync = getattr(net, "grad_sync", None)
    buffers = [b.buffer for b in sync.buckets] if isinstance(sync, GradSync) else []
    inside = {id(b) for b in buffers}
    grads = [g for g in grads if g._base is None or id(g._base) not in inside] + buffers
    return list({id(g): g for g in grads}.values())


def check_dry_run(spec, layout: Layout, dropout: float = 0.0) -> GPTConfig:
    """The GPTConfig of the run, once the layout passed every rule the ranks apply
    (:func:`~course_lib.parallel.layout_rules.check_layout`: ValueError naming the rule) and the
    dry run's own limits (NotImplementedError)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a course_lib Layout, got {type(layout).__name__}")
    cfg = model_config(spec, layout, dropout=dropout)
    check_layout(cfg, layout)
    check_balanced_folding(cfg, layout, document_ids(layout.documents))
    return cfg


def dry_run(model, hardware, layout: Layout, *, gpus_per_node=None, dtype=torch.bfloat16,
            progress: float | None = 30.0, replay: bool = True, optimizer: str = "fused",
            fusions=(), dropout: float = 0.0) -> DryRun:
    """One step of ``layout`` for ``model`` (a preset name or ModelSpec) on ``hardware`` (a preset
    name or Hardware), priced on a :class:`~course_lib.virtual.VirtualCluster`: see the module's
    docstring. ``progress``: every so many seconds of a long run, a line on stderr (None: quiet).
    ``replay``: an action whose price repeats is replayed (:mod:`.replay`), not run again.
    ``optimizer``: "fused" (:class:`FusedAdamW`, what the published systems ran) or "foreach".
    ``fusions``: the kernels the source's software fused (:data:`.software.FUSIONS`:
    "scale_mask_softmax", Megatron-LM's; "flash_attention"; "bias_dropout_add"; "fused_qkv";
    "rmsnorm_swiglu", added for a Hardware with ``fused_kernels``) and
    how its program ran (:data:`.software.RUNTIME`: DeepSpeed's "blocking_sends" and
    "deepspeed_p2p_order", "launch_blocking" for ``CUDA_LAUNCH_BLOCKING=1``, PyTorch DDP's
    "overlapped_dp", Megatron-LM's exchange, overlaps and (s, b, h) activations:
    "megatron_p2p", "sp_backward_overlap", "tp_backward_overlap", "sequence_first"; the full
    list and each one's source in :mod:`.software`), stated per source, never fitted; default
    none: the course's attention, written out, and sends waited at the end of the step.
    ``dropout``: the source's hidden and attention dropout (:func:`model_config`), stated per
    source like ``fusions``; default 0. ``dtype``: the cluster's, under ``layout.precision`` "full" (under another
    precision each tensor is priced at its own dtype, see the module's docstring)."""
    if optimizer not in ("fused", "foreach"):
        raise ValueError(f"optimizer must be 'fused' or 'foreach', got {optimizer!r}")
    from course_lib.virtual import VirtualCluster      # (the package imports this module)
    spec, hw = get_model(model), get_hardware(hardware)
    cfg = check_dry_run(spec, layout, dropout)
    fusions = check_fusions(fusions)
    if "rmsnorm_swiglu" in fusions and not (spec.norm == "rmsnorm" or spec.mlp == "swiglu"):
        raise ValueError(f"fusions: 'rmsnorm_swiglu' fuses RMSNorm and SwiGLU, and {spec.name} has neither "
                         f"(norm {spec.norm!r}, mlp {spec.mlp!r})")
    if getattr(hw, "fused_kernels", False) and "rmsnorm_swiglu" not in fusions:
        fusions += ("rmsnorm_swiglu",)     # the Hardware's statement, which the planner reads too
    fusions += hardware_attention(hw, layout, fusions, dropout)
    if "gradient_accumulation_fusion" in fusions and (error := fp32_sums_needed(layout.precision)):
        raise error                           # (before any rank runs)
    if (error := zero_runtime_error(layout, fusions)) is not None:
        raise error
    # a layout's precision runs the GPU's dtypes for real: each tensor priced at its own
    cluster = VirtualCluster(hw, gpus_per_node=gpus_per_node,
                             dtype=None if check_precision(layout.precision)[0] is not None else dtype)
    shape = MeshShape(**layout.sizes, etp=layout.etp, order=layout.order, fold_order=layout.fold_order)
    cluster.check(shape.world_size)
    running = running_ranks(shape, fold_cp=folds_cp(layout, fusions))
    run_layout = validated_once(layout)
    with torch.device("meta"):
        model = TinyGPT(cfg, seed=0)        # built once: each stage copies its part of it
    install(model, fusions)
    stages, out, records = Stages(running), {}, {}
    began = time.perf_counter()

    def run(rank):
        rec = records[rank] = TapeRecorder(rank)
        trace.install_thread(rec)
        rec.clock = DryRankClock(cluster, rank, shape.world_size, rec, stages)
        if replay and "overlapped_dp" not in fusions:   # (its last backward's hooks launch collectives)
            # a forward replayed before its backward's tape repeated (replay.ActionMemo.early):
            # not where a backward may hold async collectives or messages (FSDP, async TP, CP, MoE)
            early = layout.zero == 0 and not layout.async_tp and layout.cp == 1 and spec.n_experts <= 1
            rec.memo = rec.clock.memo = ActionMemo(rec.clock, early=early)
        try:
            # a boolean mask's selection (the vocab-parallel loss) has the shape of its True count:
            # on meta, every element (tp rank 0 of a batch of token 0: what the real run selects);
            # torch's config patches hold in the thread that makes them
            with _ALL_NONZERO(meta_nonzero_assume_all_nonzero=True), MetaScalars(), rec.clock:
                mesh = StageMesh(rank, **layout.sizes, etp=layout.etp, order=layout.order,
                                 fold_order=layout.fold_order)
                out[rank] = train_step(cfg, run_layout, mesh, device="meta", memo=rec.memo,
                                       model=stage_model(model, shape.coords(rank)["pp"], layout),
                                       optimizer=optimizer, fusions=fusions)
        except BaseException as e:   # noqa: BLE001  (every stage stops; the first error is raised below)
            out[rank] = e
            stages.fail(f"stage {shape.coords(rank)['pp']}: {type(e).__name__}: {e}")
        finally:
            trace.install_thread(None)

    threads = [threading.Thread(target=run, args=(r,), name=f"dry-run stage {i}", daemon=True)
               for i, r in enumerate(running)]
    for t in threads:
        t.start()
    deadlock = _watch(threads, records, began, progress, layout.microbatches, stages)
    if deadlock:
        raise RuntimeError(deadlock)
    errors = [v for v in out.values() if isinstance(v, BaseException)]
    if errors:
        first = next((e for e in errors if not type(e).__name__ == "StageFailed"), errors[0])
        raise first
    res = [out[r] for r in running]
    step = max(r["t"] for r in res)
    s = cfg.seq_len
    model_flops = formulas.flops_per_token(spec, s, "none") * layout.global_batch * s
    memory = [{k: r[k] for k in MEMORY_KEYS} for r in res]
    spans = [sp for r in running for sp in records[r].resolve()]
    return DryRun(spec, hw, layout, step, model_flops / (step * shape.world_size * hw.peak_flops),
                  max(m["peak"] for m in memory), memory, spans, len(running),
                  sum(r["kernels"] for r in res), time.perf_counter() - began, sum(r["replayed"] for r in res),
                  cfg, fusions)


def hardware_attention(hw, layout: Layout, fusions=(), dropout: float = 0.0) -> tuple:
    """``("flash_attention",)`` where the Hardware states ``fused_attention`` (the planner's
    FlashAttention: no s x s scores kept, one kernel each way) and ``fusions`` name no attention
    kernel of their own; else ``()``: a source's stated kernel wins (``lab.dry_runs.SOFTWARE``:
    Megatron-LM's on ``MEGATRON_2022``, whose Hardware says unfused). Ring CP then runs each of
    its blocks as the same kernel (``ContextParallelAttention.flash_blocks``), and Ulysses its
    core on the gathered sequence put in order. Packed documents (``layout.documents``) keep
    the written-out attention and its document mask (the course's flash core runs one causal
    sequence) (:func:`course_lib.planner.presets.runs_flash`, the planner's rule too). Dropout in attention is refused here, by name: the course's CPU
    flash kernel has none (ValueError)."""
    if not runs_flash(hw, layout, fusions):
        return ()
    if dropout:
        raise ValueError(f"dropout {dropout}: {hw.name} states fused_attention (FlashAttention) and the course's "
                         "flash kernel runs no dropout; give dropout=0, or state the source's attention kernel "
                         "(fusions=('scale_mask_softmax',)) or hardware.with_(fused_attention=False)")
    return ("flash_attention",)


def validated_once(layout: Layout) -> Layout:
    """``layout`` with its named schedule made and validated here, once, as the action lists
    every stage runs (``parallelize_nd`` and the runner take a validated list as is). Each
    stage would otherwise build and check all p ranks' lists itself: p x p x m x v actions, the
    largest cost of a long pipeline (1T: 64 stages x 131,072 actions). The same lists, so the
    same step. A V schedule's name (two chunks whatever ``v`` says) and pp = 1 stay as given."""
    if not isinstance(layout.schedule, str) or layout.pp == 1 or chunks(layout.schedule, layout.v) != layout.v:
        return layout
    p, m, v = layout.pp, layout.microbatches, layout.v
    return layout.with_(schedule=validate(make_schedule(layout.schedule, p, m, v), p, m, v))


def running_ranks(shape: MeshShape, fold_cp: bool = False) -> list:
    """The ranks the dry run runs: dp = tp = 0 of every pipeline stage and every cp rank. The
    cp ranks all run (not folded): under the zigzag split they do equal work but not the same
    kernels (rank 0's later ring blocks are (s/2N, s/N) rows x keys, rank N-1's (s/N, s/2N)),
    so their times differ by a little, and the ring's messages run between them for real.
    ``fold_cp`` (:func:`folds_cp`): cp = 0 alone, its cp twins folded like tp's."""
    cps = range(1 if fold_cp else shape.sizes["cp"])
    return [shape.rank_of(pp=i, cp=j) for i in range(shape.sizes["pp"]) for j in cps]


def folds_cp(layout: Layout, fusions=()) -> bool:
    """Whether the cp ranks do identical work: Llama 3's all-gather CP (``cp_comm="all_gather"``)
    under FlashAttention, zigzag, one document. Every rank then runs the same kernels but its
    two attention chunks' (chunks i and 2N-1-i: (i+1) and 2N-i chunks of keys), priced at their
    FLOPs, whose sum is the same on every rank, and one all-gather and one reduce-scatter that
    every member issues alike. (The written-out attention's GEMMs round to waves by shape, and
    the ring's blocks differ: those run every cp rank.)"""
    return (layout.cp > 1 and layout.cp_comm == "all_gather" and "flash_attention" in fusions
            and layout.cp_layout == "zigzag" and not layout.documents)


def _watch(threads, records, began, every, microbatches=None, stages=None) -> str | None:
    """Wait for the stages; every ``every`` seconds, a line on stderr: the elapsed wall time and,
    for the first and the last stage, the micro-batch its last pipeline action ran (F12@3: the
    forward of micro-batch 12 on virtual stage 3) and its virtual time. A deadlock (every stage
    still running waits for a message or a collective, and nothing was posted for
    ``STUCK_CHECKS`` checks a second apart: none can send what another waits for) stops every
    stage and is returned, each stage's last action named; None when the stages ended."""
    last, seen, stuck = time.perf_counter(), None, 0
    for t in threads:
        while t.is_alive():
            t.join(1.0)
            snap = stages.stuck(sum(th.is_alive() for th in threads)) if stages is not None else None
            stuck, seen = (stuck + 1 if snap is not None and snap == seen else 0), snap
            if stuck >= STUCK_CHECKS:
                where = "; ".join(f"rank {r}: {_where(records[r].spans, microbatches)}" for r in sorted(records))
                why = ("the dry run stopped: every running stage waits for a message or a collective "
                       f"that no stage will send (a deadlock in the program's order): {where}")
                stages.fail("deadlock")
                for th in threads:
                    th.join()
                return why
            if every is not None and time.perf_counter() - last >= every:
                last = time.perf_counter()
                where = []
                for i, rank in ((0, min(records)), (len(records) - 1, max(records))) if records else ():
                    where.append(f"stage {i}: {_where(records[rank].spans, microbatches)} "
                                 f"(t={records[rank].clock.t:.3f} s)")
                print(f"dry run, {last - began:.0f} s: " + "; ".join(where), file=sys.stderr, flush=True)


STUCK_CHECKS = 3   # a deadlock is called after 3 checks a second apart with nothing posted
_ACTION = re.compile(r"([FBWI])(\d+)(?:@(\d+))?$")
_PASS = {"F": "forward", "B": "backward", "I": "input backward", "W": "weight backward"}


def _where(spans, microbatches) -> str:
    """The last pipeline action among ``spans`` in words (building: none yet)."""
    for sp in reversed(spans[-64:]):
        m = _ACTION.match(sp.name) if sp.dim == "pp" and sp.kind == "compute" else None
        if m:
            of = f"/{microbatches}" if microbatches else ""
            return f"{_PASS[m.group(1)]} of micro-batch {int(m.group(2)) + 1}{of}" + \
                (f" (virtual stage {m.group(3)})" if m.group(3) else "")
    return spans[-1].name if spans else "building"


__all__ = ["dry_run", "DryRun", "train_step", "FusedAdamW", "gpu_memory", "MemoryProbe", "gradient_tensors",
           "model_config", "moe_config",
           "check_dry_run", "running_ranks", "folds_cp", "document_ids", "hardware_attention"]
