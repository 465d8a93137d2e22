"""``runtime="course"``: one step as the course's own program runs it (``parallelize_nd``).

The default planner (``runtime="megatron"``) models the published systems it is validated
against (Megatron-LM, Llama 3): fused kernels whose launches hide behind the previous kernel,
one DP collective per layer, 4 TP collectives per layer. The course's runtime differs, and
this module counts what IT issues, per mesh dimension, from the layout and the model config
(the same structure the virtual clock prices as it happens):

- compute: the kernels of the course's TinyGPT, traced once on the meta device
  (:func:`course_lib.planner.kernels.trace_step`), each at its roofline plus the preset's
  launch overhead. A TP rank runs the same kernels on 1/tp of a layer's elements (heads, FFN
  columns, or with SP the sequence), a CP rank on 1/cp (its tokens); the counts do not shrink;
- TP with SP, per layer and micro-batch: forward 2 all-gathers + 2 reduce-scatters; backward
  2 reduce-scatters, 2 all-gathers again (the column-parallel weight gradient re-gathers its
  input instead of keeping it) and 2 all-gathers (g-bar's backward): 10, not the paper's 8.
  The vocabulary-parallel embedding adds a reduce-scatter (+ all-gather backward), the head an
  all-gather (+ reduce-scatter and all-gather backward), the loss 2 all-reduces (max, sums).
  Without SP: 2 all-reduces forward and 2 backward per layer, 1 at the embedding, 1 at the
  head's backward, 2 in the loss;
- CP (ring): a CP rank's own program is traced (:mod:`.ring_ops`: its s/cp tokens, the ring's
  blocks and merges); a hop costs alpha + K/V bytes / bandwidth and travels under one block;
  forward waits cp - 1 hops, backward cp hops (K/V, then each dK/dV accumulator) and the
  accumulator's hop home (full recomputation: the forward's again);
- CP (all-gather, Llama 3's; Ulysses): a CP rank's own program is traced too (:mod:`.cp_ops`:
  the K/V gathered and put in sequence order, each query chunk attended; or Q, K, V to head
  shards and back); its messages are exposed, the core waits for them (:func:`_gathered_cp`).
  Packed documents, or another split of the sequence: one device's attention cut by cp, with
  the ring's kernel count and hops in its place (:data:`RING_KERNELS`), an approximation;
- the host: it issues one op every ``launch_overhead``, and where the program reads a value
  (a ring's positions, an MoE router's counts) or blocks on TP's collectives it waits for the
  stream: the rank's traced order runs through that issue chain (:mod:`.issue`); under ZeRO-3
  with FSDP's own kernels in their places (:func:`.fsdp_ops.fsdp_chain`);
- PP: one send per micro-batch and direction between neighbouring stages; a pass whose traced
  order holds no host wait reports what its host's issue adds beyond its device's work
  (``host``): a stage waiting for its input issues it ahead, so the fill and the drain pass it
  at its device's pace (:func:`course_lib.planner.estimate.pipeline_time`);
- DP (``GradSync``): after the schedule, one all-reduce per 25 MiB bucket and per set of
  reduce dims: the weights over (dp, cp), the sequence-parallel norm weights over
  (dp, cp, tp); FSDP: an all-gather per unit (each block, the rest; a block's experts on a
  folded expert mesh, a unit of their own over the ranks holding them) forward, again per
  block backward, a reduce-scatter per unit, the SP norms' all-reduce over tp per unit, in
  the order the course's FSDP issues them (:func:`.fsdp_ops.fsdp_order`); ZeRO-1/2: the
  buckets gathered before the schedule, reduce-scattered after it (:mod:`.zero_sync`);
- the loss: one all-reduce over the (dp, pp, cp) ranks that hold parts of it.
"""
from __future__ import annotations

import math

from course_lib.planner import formulas as F
from course_lib.planner.async_tp import async_tp_hop, nccl_all_to_all
from course_lib.planner.fsdp_ops import fsdp_chain, fsdp_expert_unit, fsdp_order, fsdp_step_kernels, fsdp_units
from course_lib.planner.issue import pass_time, run_chain
from course_lib.planner.buckets import BUCKET_CAP_BYTES, assign_buckets, bucket_copy, stage_params
from course_lib.planner.kernel_cost import COPY, ELEMENTWISE, KernelModel
from course_lib.planner.kernels import Kernels, trace_step
from course_lib.planner.layout import (expert_holders, expert_replica_offsets, expert_zero_group, fold_offsets,
                                      holds_head, strides)
from course_lib.planner.numerics import gradient_sums, master_copies, numerics
from course_lib.planner.pipeline_hops import stage_send_time
from course_lib.planner.presets import runs_flash
from course_lib.planner.cp_ops import cp_message_bytes, traced_cp
from course_lib.planner.ep_ops import traced_ep
from course_lib.planner.ring_ops import traced_ring
from course_lib.planner.formulas import zero_rounds
from course_lib.planner.zero_sync import zero_sync

# Kernels the course's parallel code adds, counted on that code (the planner sits below
# parallel/ and imports none of it; tests/test_planner_runtime.py checks these numbers
# against the counts of course_lib.lab.virtual_runs, for cp = 2..8):
VOCAB_LOSS_KERNELS = 29           # vocabulary-parallel cross entropy less the plain one, fwd + bwd
VOCAB_LOSS_BYTES = {              # ... and the bytes its kernels move per local logit, by class
    # (every float at 2 bytes, as under precision "full"; it computes in fp32, so twice these at
    # the tensors' own dtypes, under a mixed precision: tests/test_planner_course_tp.py)
    "fwd": {"reduction": -2, "broadcast": 8, "elementwise": 4, "copy": 2},
    "bwd": {"reduction": -2, "elementwise": 4, "copy": 2},   # its contiguous copies stream
}
RING_KERNELS = {                  # per layer, busiest rank: (fixed, per ring rank), fwd and bwd
    False: ((7, 41), (3, 32)),    # one K/V head per query head
    True: ((6, 42), (1, 35)),     # grouped-query attention: K/V heads repeated per block
}


def ring_attention_kernels(cp: int, grouped: bool) -> tuple[int, int]:
    """(forward, backward) kernels the zigzag ring attention adds to one layer over the plain
    causal attention it replaces, on the busiest of ``cp`` > 1 ranks: linear in cp (each of the
    cp blocks runs the same kernels; the merge and the hops add a fixed part)."""
    (f0, f1), (b0, b1) = RING_KERNELS[grouped]
    return f0 + f1 * cp, b0 + b1 * cp


def group_in_node(layout, hw, dims) -> bool:
    """True if the group of mesh ``dims`` (one or several) stays inside one node (its last member
    within gpus_per_node of its first, in the layout's rank order: :func:`.layout.strides`)."""
    stride, sizes = strides(layout), layout.sizes
    last = sum((sizes[d] - 1) * stride[d] for d in ("tp", "cp", "pp", "dp") if d in dims)
    return last < hw.gpus_per_node


def _size(layout, dims) -> int:
    return math.prod({"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp}[d] for d in dims)


def collective(layout, hw, kind, nbytes, dims, latency: bool = True) -> float:
    """Seconds of one collective of ``nbytes`` over the group of ``dims`` (``latency=False``:
    its bytes' seconds on the links alone, what it shares with other transfers there): an
    all-reduce, all-gather or reduce-scatter as NCCL's tuning model prices the algorithm and
    protocol it picks (:func:`~course_lib.planner.communication.nccl_time`: LL for small
    messages, the ring's latency terms across nodes); an all-to-all as NCCL posts it
    (:func:`~.async_tp.nccl_all_to_all`); another kind a ring, each step's latency
    its own link's (:func:`ring_alpha`); the network's bandwidth once the group leaves a node."""
    n = _size(layout, dims)
    if n <= 1:
        return 0.0
    if kind == "all_to_all":       # NCCL's grouped point-to-point: the members on the node, the rest
        offsets = group_offsets(layout, dims)
        local = sum(1 for o in offsets if o // hw.gpus_per_node == 0)
        return nccl_all_to_all(hw, nbytes, n, local, latency)
    if kind in ("all_reduce", "all_gather", "reduce_scatter"):
        seconds, data = F.nccl_time(hw, kind, nbytes, n, group_nodes(layout, hw, dims))
        return seconds if latency else data
    _, bw = hw.link(group_in_node(layout, hw, dims))
    alpha = ring_alpha(hw, kind, n, group_nodes(layout, hw, dims))
    return F.collective_time(kind, nbytes, n, alpha if latency else 0.0, bw)


def group_offsets(layout, dims, every: dict | None = None) -> list:
    """The rank offsets of the first rank's group of mesh ``dims`` (the layout's rank order);
    ``every``: {dim: k}, only every k-th index along that dim is a member."""
    stride, sizes, offsets = strides(layout), layout.sizes, [0]
    for d in dims:
        k = (every or {}).get(d, 1)
        offsets = [o + i * stride[d] for o in offsets for i in range(0, sizes[d], k)]
    return offsets


def group_nodes(layout, hw, dims, every: dict | None = None) -> int:
    """The nodes the group of mesh ``dims`` spans (:func:`group_offsets`' members)."""
    return len({o // hw.gpus_per_node for o in group_offsets(layout, dims, every)})


def fold_nodes(layout, hw, dim: str) -> int:
    """The nodes one group of the expert fold spans: "ep", "etp" or "expert mesh"
    (:func:`~.layout.fold_offsets`)."""
    return len({o // hw.gpus_per_node for o in fold_offsets(layout, dim)})


def expert_replica_nodes(layout, hw, etp: bool = False) -> int:
    """The nodes an expert's replicas span: the ranks holding the same expert
    (:func:`~.layout.expert_replica_offsets`: "edp", and the stage dims outside the fold);
    ``etp``: with its etp peers (w2's bias)."""
    return len({o // hw.gpus_per_node for o in expert_replica_offsets(layout, etp)})


def ring_alpha(hw, kind: str, n: int, nodes: int) -> float:
    """A ring step's mean latency over ``n`` ranks on ``nodes`` nodes: a ring through the nodes
    crosses the network on ``nodes`` of a pass's steps (an all-reduce's two passes, 2 (n - 1)
    steps: 2 nodes of them; NCCL's tuning model counts the same, ``nInterSteps``), the other steps
    go GPU to GPU inside a node, at NVLink's latency; one node: NVLink's."""
    intra, inter = hw.link(True)[0], hw.link(False)[0]
    if nodes <= 1:
        return intra
    steps, crossing = (2 * (n - 1), 2 * nodes) if kind == "all_reduce" else (n - 1, nodes - 1)
    crossing = min(steps, crossing if n > nodes else steps)
    return (crossing * inter + (steps - crossing) * intra) / steps


def tp_calls(layout, first: bool, last: bool, n_layers: int, moe: bool = False) -> dict:
    """{(pass, kind): calls} of TP in one micro-batch on one stage (see the module doc); ``moe``:
    the MLPs are mixtures of experts, which under SP route the rank's own tokens (no TP calls)."""
    if layout.tp == 1:
        return {}
    k = 1 if moe else 2                   # TP's sublayers a block: attention, and the MLP unless experts
    if layout.sp:
        fwd_ag, fwd_rs = k * n_layers + last, k * n_layers + first
        bwd_ag, bwd_rs = 2 * k * n_layers + first + last, k * n_layers + last
        calls = {("fwd", "all_gather"): fwd_ag, ("fwd", "reduce_scatter"): fwd_rs,
                 ("bwd", "all_gather"): bwd_ag, ("bwd", "reduce_scatter"): bwd_rs}
    else:
        calls = {("fwd", "all_reduce"): k * n_layers + first, ("bwd", "all_reduce"): k * n_layers + last}
    if layout.recompute == "full":        # the blocks' forward again in the backward, its TP calls too
        for kind in (("all_gather", "reduce_scatter") if layout.sp else ("all_reduce",)):
            calls[("bwd", kind)] += k * n_layers
    if last:
        calls[("fwd", "loss")] = 2
    return calls


def _gathered_cp(model, hw, layout, method: str, b: int, s: int, n_layers: int) -> tuple:
    """(forward, backward seconds, calls) of one micro-batch's CP messages on a stage, all-gather
    CP or Ulysses (the ranks' order, :mod:`.cp_ops`), each exposed: the core waits for them.
    All-gather: K/V gathered forward, gathered again and dK/dV reduce-scattered backward (full
    recomputation: the forward's gather again). Ulysses: the positions gathered (not where the
    core is FlashAttention: the host orders the sequence), Q, K, V to head shards and the output
    back, forward; the four gradients backward (full: the forward again)."""
    c, t = layout.cp, layout.tp
    heads, kv_heads = -(-model.n_heads // t), max(1, model.n_kv_heads // t)
    size = cp_message_bytes(method, b, heads, kv_heads, model.head_dim, s, c)
    again = layout.recompute == "full"

    def call(kind, nbytes):
        return collective(layout, hw, kind, nbytes, ("cp",))
    if method == "all_gather":
        gather, scatter = call("all_gather", size["all_gather"]), call("reduce_scatter", size["all_gather"])
        return n_layers * gather, n_layers * ((1 + again) * gather + scatter), n_layers * (3 + again)
    swap = call("all_to_all", size["q"]) + 2 * call("all_to_all", size["kv"]) + call("all_to_all", size["out"])
    gathers = 0 if runs_flash(hw, layout) else 1     # every rank's positions, int64 (written-out core)
    where = gathers * call("all_gather", s * 8)
    fwd_calls = 4 + gathers
    return (n_layers * (where + swap), n_layers * (swap + again * (where + swap)),
            n_layers * (fwd_calls + 4 + again * fwd_calls))


def stage_parts(model, hw, layout, stage: int, n_layers: int) -> dict:
    """The course's runtime on ``stage``: per micro-batch {fwd, bwd}: {kind: seconds} with
    kinds compute / launch / tp / cp / zero; the step's tail (dp, loss); the optimizer; the
    p2p send; kernels per step; calls per mesh dim per step."""
    s = layout.seq_len or model.seq_len
    b, t, c, p, m = layout.micro_batch, layout.tp, layout.cp, layout.pp, layout.microbatches
    first, last = stage == 0, holds_head(layout, stage)      # (last: holds the head; a V's rank 0)
    # one TP and CP rank's kernels (recomputation: in the backward); ring attention traced as it runs
    ring = traced_ring(layout)
    method, split = traced_cp(layout)       # all-gather CP and Ulysses: a CP rank's own program too
    # a mixed precision runs a bf16 model and computes some of it in fp32: each tensor at its own dtype
    own = layout.precision != "full"
    traced_hw = hw.with_(fused_attention=runs_flash(hw, layout))    # what the ranks' attention runs
    k = trace_step(model, traced_hw, b, s, itemsize=None if own else 2, recompute=layout.recompute, tp=t,
                   sp=layout.sp, cp=c, ring=split, order=layout.zero == 3 or layout.pp > 1, method=method,
                   ep=traced_ep(model, layout), etp=layout.etp)
    # (the order traced: FSDP's kernels join the issue chain, fsdp_ops.fsdp_chain; a pipeline's
    # passes are issued ahead or not by what waits inside them, the ``host`` below)
    fwd_k, bwd_k = k["layer_fwd"].times(n_layers), k["layer_bwd"].times(n_layers)
    for part, here in (("embedding", first), ("head", last)):
        if here:
            fwd_k, bwd_k = fwd_k + k[part + "_fwd"], bwd_k + k[part + "_bwd"]
    traced = {"fwd": fwd_k.device, "bwd": bwd_k.device}     # what the traced order holds (the issue chain's)
    # (every kernel at its own roofline is "compute")
    fwd = {"compute": fwd_k.time, "elementwise": 0.0, "launch": 0.0, "tp": 0.0, "cp": 0.0, "ep": 0.0, "zero": 0.0}
    bwd = {**fwd, "compute": bwd_k.time}
    calls = {}
    ep_calls = {}                            # an EP rank traced as it runs: its blocking calls, each's seconds
    if traced_ep(model, layout):
        ep_calls = ep_call_costs(model, hw, layout, b * s / c / (t if layout.sp else 1))   # the rank's tokens
        forward = [v for name, v in ep_calls.items() if "backward" not in name]   # (routing,) counts, dispatch, combine
        again = layout.recompute == "full"              # the MoE's forward again in the backward, its calls too
        fwd["ep"] = n_layers * sum(forward)
        bwd["ep"] = n_layers * (sum(v for name, v in ep_calls.items() if "backward" in name) + again * sum(forward))
        routing = routing_group(layout)
        group = "ep+etp" if model.moe_dispatch == "all_gather" and layout.etp > 1 else "ep"   # (the code's comm)
        for dims, names in ((group, [x for x in ep_calls if not x.startswith(("routing", "ETP"))]),
                            ("etp", [x for x in ep_calls if x.startswith("ETP")]),
                            ("+".join(routing), [x for x in ep_calls if x.startswith("routing")])):
            if names:
                n_forward = sum("backward" not in x for x in names)
                calls[dims] = calls.get(dims, 0) + m * n_layers * (len(names) + again * n_forward)

    act = b * s / c * model.hidden * 2               # (b, s/cp, h) bf16: a TP collective's full tensor
    added = {"fwd": Kernels(), "bwd": Kernels()}     # TP's own kernels per micro-batch (see below)
    for (phase, kind), n in tp_calls(layout, first, last, n_layers, model.n_experts > 1).items():
        if kind == "loss":                           # (b s/cp,) maxima, then (2, b s/cp) sums: fp32 -> bf16
            cost = sum(collective(layout, hw, "all_reduce", x * b * s / c * 2, ("tp",)) for x in (1, 2)) / 2
            added["fwd"] += Kernels(VOCAB_LOSS_KERNELS, 0.0, 0.0, 0.0, VOCAB_LOSS_KERNELS * hw.kernel_floor)
            for pas, classes in VOCAB_LOSS_BYTES.items():   # its logits fp32: 4 bytes at their own dtype
                classes = {cls: n * (2 if own else 1) for cls, n in classes.items()}
                added[pas] += vocab_loss_kernels(hw, classes, b * s / c * math.ceil(model.vocab / t))
        else:
            cost = collective(layout, hw, kind, act, ("tp",))
            # comm_ops: an all-gather along the sequence copies its input and its output to and
            # from (s, b, h) order, a reduce-scatter its input (free with one sequence); an
            # all-reduce sums in place (the row matmul's output; f's gradient, a matmul's): none
            copied = {"all_gather": (act / t, act) if b > 1 else (), "reduce_scatter": (act,) if b > 1 else (),
                      "all_reduce": ()}[kind]
            added[phase] += sum((copy_kernel(hw, x) for x in copied), Kernels()).times(n)
        (fwd if phase == "fwd" else bwd)["tp"] += n * cost
        calls["tp"] = calls.get("tp", 0) + n * m
    fwd_k, bwd_k = fwd_k + added["fwd"], bwd_k + added["bwd"]
    costs = {kind: collective(layout, hw, kind, act, ("tp",)) for kind in ("all_gather", "reduce_scatter", "all_reduce")}
    costs["loss"] = sum(collective(layout, hw, "all_reduce", x * b * s / c * 2, ("tp",)) for x in (1, 2)) / 2
    lanes = {kind: collective(layout, hw, kind, act, ("tp",), latency=False) for kind in costs if kind != "loss"}
    lanes["loss"] = sum(collective(layout, hw, "all_reduce", x * b * s / c * 2, ("tp",), False) for x in (1, 2)) / 2
    costs.update(ep_calls)
    if c > 1 and split and method != "ring":        # all-gather CP, Ulysses: messages the core waits for
        fwd["cp"], bwd["cp"], calls["cp"] = _gathered_cp(model, hw, layout, method, b, s, n_layers)
        calls["cp"] *= m
    elif c > 1:                                      # ring attention, K and V of this rank's heads
        kv_heads = max(1, model.n_kv_heads // t)
        alpha, bw = hw.link(group_in_node(layout, hw, ("cp",)))
        hop = alpha + 2 * b * kv_heads * (s / c) * model.head_dim * 2 / bw
        again = layout.recompute == "full"          # the ring's forward again in the backward, its hops too
        if ring:        # traced: a hop travels while one block of the ring computes
            block_f, block_b = k["ring_fwd"].device / c, k["ring_bwd"].device / c
        else:           # (another core: its kernels counted, a small kernel issued or its floor)
            ring_f, ring_b = ring_attention_kernels(c, model.n_kv_heads != model.n_heads)
            fwd_k = fwd_k + Kernels(n_layers * ring_f)
            bwd_k = bwd_k + Kernels(n_layers * (ring_b + again * ring_f))
            per = max(hw.launch_overhead, hw.kernel_floor)
            block_f, block_b = (ring_f / c * per, ring_b / c * per)
        # exposed: a hop's excess over the block it travels under; the accumulator's last hop home
        # has nothing to hide behind
        fwd["cp"] = n_layers * (c - 1) * max(0.0, hop - block_f)
        bwd["cp"] = n_layers * (c * max(0.0, hop - block_b) + hop + again * (c - 1) * max(0.0, hop - block_f))
        calls["cp"] = m * n_layers * (c - 1 + c + 1 + again * (c - 1))
    # parameters of this stage's GPU, after TP: weights, and norms (split over the sequence with SP);
    # an MoE's experts cut by the expert mesh (ep x etp), not by TP
    parts = F.param_breakdown(model)
    norms = n_layers * 2 * model.hidden + (model.hidden if last else 0)
    expert_layer = model.n_experts * parts["mlp_one_expert"] if model.n_experts > 1 else 0
    experts = n_layers * expert_layer / (layout.ep * layout.etp)
    weights = (n_layers * (parts["per_layer"] - expert_layer - 2 * model.hidden) + (parts["embedding"] if first else 0)
               + (head_weights(model, first) if last else 0)) / t
    tensors = n_layers * k["tensors_per_layer"] + (1 if first else 0) + ((k["tensors_outside"] - 1) if last else 0)
    if model.n_experts > 1:     # the traced block holds all E experts, this GPU E / ep (etp slices of them)
        per_expert = sum(1 for name, _ in k["params"] if name.startswith("blocks.0.mlp.moe.experts.0."))
        tensors -= n_layers * per_expert * (model.n_experts - model.n_experts // layout.ep)
    norm_tensors = (2 * n_layers + last) * (2 if model.norm == "layernorm" else 1)
    if not (layout.sp and t > 1):          # SP splits the norms only where there is a tp group
        weights, norms, norm_tensors = weights + norms, 0, 0
    num = numerics(layout.precision)        # where the gradients are summed, in which dtype
    fsdp = layout.zero == 3                 # FSDP over dp x cp (also over one rank: the same program)
    # experts on a folded expert mesh: each block's experts a unit of their own, sharded over the
    # e_ranks holding them (compose.expert_units: "edp" and the stage dims outside the fold)
    e_ranks = expert_holders(layout)
    apart = fsdp and model.n_experts > 1 and layout.ep * layout.etp * layout.cp * t > 1
    e_fsdp = (fsdp_expert_unit(k["param_shapes"], model.n_experts // layout.ep, layout.etp), e_ranks, n_layers) \
        if apart else None
    if fsdp:                                # its own kernels around each unit (fsdp_ops)
        units = fsdp_units(k["param_shapes"], t, first, last, n_layers, experts_apart=apart)
        zf, zb = fsdp_step_kernels(hw, units, _size(layout, ("dp", "cp")), m, experts=e_fsdp)
        fwd_k, bwd_k = fwd_k + zf, bwd_k + zb
        fwd["compute"], bwd["compute"] = fwd_k.time, bwd_k.time
    split = layout.schedule in F.SPLIT       # zero bubble: W's GEMMs add into .grad themselves
    w_k = k["layer_w"].times(n_layers) + (k["head_w"] if last else Kernels()) if split else Kernels()
    w_params = [n_layers * k[f"layer_w_{x}"] + (k[f"head_w_{x}"] if last else 0) if split and not num.per_microbatch
                else 0 for x in ("elements", "tensors")]     # (fp32 sums: W's hooks add, as autograd's)
    fused = 0.0                               # per micro-batch: the adds a split backward's W does not run
    if not fsdp and (m > 1 or num.per_microbatch):   # every backward after a stage's first adds into .grad
        acc = gradient_sums(hw, weights + norms + experts, tensors, num, m)   # the step's; per micro-batch:
        if w_params[0]:
            fused = (acc.device - gradient_sums(hw, weights + norms + experts - w_params[0], tensors - w_params[1],
                                                num, m).device) / m
        bwd_k = Kernels(bwd_k.count + round(acc.count / m), bwd_k.flops + acc.flops / m,
                        bwd_k.bytes + acc.bytes / m, bwd_k.time + acc.time / m, bwd_k.device + acc.device / m)
        bwd["compute"] = bwd_k.time
    # "launch": the kernels' floors on the device beyond their own work, plus the time of
    # issuing them from the host (one op every launch_overhead) beyond what the device does
    # meanwhile: its kernels and the collectives it waits for (TP's, CP's hops). Where the host
    # is the slower side the collectives hide behind its issue, except that at each of TP's
    # blocking collectives the host waits for the stream: then the traced order of the rank's
    # kernels is run through the issue chain (:mod:`.issue`), stretch by stretch
    host = {}             # the host's issue beyond the device's work, per phase (what "launch" holds of it)
    for phase, part, kern in (("fwd", fwd, fwd_k), ("bwd", bwd, bwd_k)):
        device = max(kern.device, kern.count * hw.kernel_floor)      # the kernels, at least their floors
        issue = kern.count * hw.launch_overhead                      # the host's side
        part["compute"] = kern.time
        part["launch"] = device - kern.time + max(0.0, issue - device - part["tp"] - part["cp"])
        if k["sequence"] and (t > 1 or ring or layout.ep * layout.etp == 1 or ep_calls):   # (the order traced)
            # the kernels the traced order does not hold (TP's copies and loss, the gradients'
            # accumulation) run on the same stream: their device time on top; FSDP's are issued
            # in their places, the host pacing them where they are short (fsdp_ops.fsdp_chain)
            if fsdp:
                chain = fsdp_chain(hw, units, _size(layout, ("dp", "cp")), n_layers, k["sequence"][phase], phase,
                                   first, last, m, costs, e_fsdp) - (zf if phase == "fwd" else zb).device
            else:
                chain = tp_chain(k["sequence"][phase], phase, first, last, n_layers, hw, costs)
            chain += kern.device - traced[phase]
            part["launch"] = max(part["launch"], chain - part["tp"] - part["ep"] - kern.time)
        host[phase] = part["launch"] - (device - kern.time)
    for phase in host:
        # where the host waits for the stream inside the pass (a blocking collective of TP's, a
        # value it reads: the ring's positions, an MoE router's counts; FSDP's order) it cannot
        # issue the pass ahead of its input
        parts = k["sequence"].get(phase, {}).values() if k["sequence"] else ()
        if fsdp or any(isinstance(x, str) for part in parts for x in part):
            host[phase] = 0.0
    p2p_bytes = act / (t if layout.sp else 1)
    p2p = stage_send_time(layout, hw, stage, p2p_bytes, async_tp_hop)   # each hop on its link, NCCL's price
    if p > 1:
        calls["pp"] = m * (F.p2p_sends(layout.schedule, p, stage) if layout.schedule in F.V_SCHEDULES
                           else (stage < p - 1) + (stage > 0))

    # under SP a split backward's W gathers each column layer's input again (weight_grads.run_later):
    # the re-gathers counted in bwd's TP (two a layer, the head's one) run in W, not in B
    regather = (2 * n_layers + last) * costs["all_gather"] if split and layout.sp and t > 1 else 0.0
    replicas = ("dp", "cp")
    tail, sync_kernels, sync_seconds = 0.0, 0, None
    if fsdp and (_size(layout, replicas) > 1 or (apart and e_ranks > 1)):   # FSDP's collectives,
        sizes = [sum(math.prod(x) for x in u) for u in units]                # per unit and micro-batch
        ag = [collective(layout, hw, "all_gather", n * 2, replicas) for n in sizes]
        rs = [collective(layout, hw, "reduce_scatter", n * 2, replicas) for n in sizes]
        if apart and e_ranks > 1:           # a block's experts' after its own, on the same stream
            e_bytes, nodes = 2 * sum(math.prod(x) for x in e_fsdp[0]), expert_replica_nodes(layout, hw)
            e_ag, e_rs = (F.nccl_time(hw, kind, e_bytes, e_ranks, nodes)[0] for kind in ("all_gather", "reduce_scatter"))
            ag = [a + e_ag for a in ag[:n_layers]] + ag[n_layers:]
            rs = [r + e_rs for r in rs[:n_layers]] + rs[n_layers:]
            calls["edp"] = calls.get("edp", 0) + m * 3 * n_layers
        per = max(1, n_layers)
        c_f = (fwd["compute"] + fwd["launch"] + fwd["tp"] + fwd["cp"] - zf.time) / per   # (the copy out precedes it)
        c_b = (bwd["compute"] + bwd["launch"] + bwd["tp"] + bwd["cp"]) / per
        shared = t > 1 and group_in_node(layout, hw, ("tp",)) == group_in_node(layout, hw, replicas)
        fwd["zero"], bwd["zero"], tail = fsdp_order(hw, layout, stage, units, n_layers, _size(layout, replicas),
                                                    ag, rs, c_f, c_b, k["sequence"] if shared else None, costs,
                                                    lanes)
        if _size(layout, replicas) > 1:
            calls["dp+cp"] = m * (2 * len(units) + len(units) - 1)
    if fsdp and layout.sp and t > 1:           # each unit's norms over tp, after its reduce-scatter
        bwd["tp"] += len(units) * collective(layout, hw, "all_reduce", 2 * model.hidden * 2, ("tp",))
        calls["tp"] = calls.get("tp", 0) + m * len(units)
    gather, rs_chunk = 0.0, 0.0
    if layout.zero in (1, 2):                 # ZeRO-1/2 (zero_sync): gathered at the start, reduced after
        ranks, after = expert_zero_group(layout) if model.n_experts > 1 else (1, ())
        nodes = expert_replica_nodes(layout, hw) if model.n_experts > 1 else 1
        etp_nodes = fold_nodes(layout, hw, "etp")                  # (w2's bias, etp > 1)
        expert = (ranks, after, lambda kind, nbytes: F.nccl_time(hw, kind, nbytes, ranks, nodes)[0],
                  lambda nbytes: F.nccl_time(hw, "all_reduce", nbytes, _size(layout, after) * layout.etp,
                                             etp_nodes)[0])
        tail, gather, sync_kernels, in_schedule, rs_chunk = zero_sync(model, hw, layout, k, n_layers, first, last,
                                                                      calls, collective, _size, num.reduce,
                                                                      expert, num.masters and num.reduce < 4,
                                                                      grad_itemsize=num.accumulate, stage=stage)
        sync_seconds = 0.0                    # (its copies are in its chain)
        bwd["zero"] += (in_schedule + rounds_stretch(hw, layout, rs_chunk, fwd["compute"] + bwd["compute"])) / m
    elif not fsdp:                            # GradSync after the schedule (:func:`dp_sync`)
        tail, sync_kernels, sync_seconds = dp_sync(model, hw, layout, k, n_layers, first, last, calls, num.reduce,
                                                   num.reduce if num.masters else 4)
    loss_dims = tuple(d for d in ("dp", "pp", "cp") if _size(layout, (d,)) > 1)
    loss = collective(layout, hw, "all_reduce", 2, loss_dims) if loss_dims else 0.0
    if loss_dims:
        calls["+".join(loss_dims)] = calls.get("+".join(loss_dims), 0) + 1
    shard = _size(layout, replicas) if layout.zero >= 1 else 1
    # (ZeRO-1/2 and FSDP: an expert's slice of every rank holding it, expert_zero_group's)
    experts = experts / e_ranks if (layout.zero in (1, 2) or fsdp) and experts else experts
    adam = k["adamw_per_element"]
    n_local = (weights + norms) / shard + experts
    # AdamW as on CUDA (foreach): adam.count ops per step, whatever the number of tensors
    if sync_seconds is None:                  # FSDP: no GradSync buckets
        sync_seconds = sync_kernels * max(hw.launch_overhead, hw.kernel_floor)
    step = Kernels(0, 0, 0, 0.0, 0.0)
    if num.masters:     # fp32 masters: AdamW's tensors all fp32 (twice bf16's bytes), the masters copied
        # into the bf16 model at the step's start, and (unless summed in fp32 already) the gradients widened
        adam = Kernels(adam.count, adam.flops, 2 * adam.bytes, 2 * adam.time)
        step = master_copies(hw, (weights + norms) / shard + experts, tensors, num)
    optimizer = adam.scaled(n_local).seconds(hw) + sync_seconds + step.device
    kernels = m * (fwd_k.count + bwd_k.count) + adam.count + sync_kernels + step.count
    return dict(fwd=fwd, bwd=bwd, p2p=p2p, grad_sync=tail, param_gather=gather, loss_sync=loss, optimizer=optimizer,
                round_reduce=rs_chunk, kernels=kernels, calls=calls, host=(host["fwd"], host["bwd"]),
                w_time=w_k.device + regather, w_fused=fused)


def accumulation(hw, elements: float, tensors: int, itemsize: int = 2) -> Kernels:
    """The kernels of one gradient accumulation: autograd's AccumulateGrad adds a backward's
    gradient into ``.grad`` when one is there (every micro-batch after the first), one
    ``add_`` per parameter tensor of the stage's ``elements`` (read two, write one), at the
    elementwise rate (``tests/test_planner_runtime.py`` checks it against a traced second
    backward)."""
    model = KernelModel(hw, {2: "bfloat16", 4: "float32"}[itemsize])
    nbytes = 3 * itemsize * elements
    seconds = model.roofline(elements, nbytes, ELEMENTWISE)
    return Kernels(tensors, elements, nbytes, seconds, max(seconds, tensors * hw.kernel_floor))


def rounds_stretch(hw, layout, rs_chunk: float, compute: float) -> float:
    """Seconds a step of ZeRO-2 reduced chunk by chunk (``formulas.zero_rounds``) adds to the
    compute beside its reductions: each but the last runs under the next round (N chunk-backwards
    and the forwards 1F1B runs between them, ``compute`` a micro-batch's through the stage);
    while it runs its NCCL kernel holds ``nccl_channels`` SMs (a group across nodes: two per GPU
    of a node in it, NCCL's channels on its NICs), so the kernels beside it get the rest: they
    take channels / (SMs - channels) of the time they share with it more. What a reduction
    outlasting its round adds is the pipeline's (``estimate.round_waits``)."""
    rounds = zero_rounds(layout)
    if rounds is None or rs_chunk <= 0:
        return 0.0
    per, sched, chunks = rounds
    window = layout.microbatches / sched * compute / chunks
    ch, sms = getattr(hw, "nccl_channels", 0) or 0, getattr(hw, "sm_count", 0) or 0
    dims = tuple(d for d in ("dp", "cp") if _size(layout, (d,)) > 1)
    nodes = group_nodes(layout, hw, dims) if dims else 1
    if nodes > 1:       # across nodes NCCL runs a channel per NIC of a node in the group, doubled
        ch = min(ch, 2 * _size(layout, dims) // nodes)
    stretch = ch / (sms - ch) if 0 < ch < sms else 0.0
    return (per * chunks - 1) * min(rs_chunk, window) * stretch


def dp_sync(model, hw, layout, k: dict, n_layers: int, first: bool, last: bool, calls: dict,
            itemsize: int = 2, held: int = 4) -> tuple:
    """(seconds the all-reduces add, kernels, seconds of the kernels) of GradSync after the
    schedule on this stage (no ZeRO-3): one all-reduce per bucket (:mod:`.buckets`: the
    program's own buckets) over its reduce dims of size > 1, the experts' over the ranks holding
    the same experts; ``calls`` gets the calls per dims; ``itemsize``: a gradient's bytes on the
    wire (the precision's reduce dtype, :mod:`.numerics`); ``held``: its bytes in the program's
    bucket (the CPU run's fp32; a 16-bit model's own under "bf16"). Bucket by bucket, each gradient is
    copied into it and its flag set (kernels, through the issue chain), then its all-reduce is
    launched (async): it starts when its copies are done and its communicator's last all-reduce
    is; on links (NVLink or the network) that another communicator's all-reduce holds it shares
    their bandwidth, as the clock's lanes share it (slowed by at most its own bytes' time, its
    bytes after theirs); the step waits for the last."""
    edp = expert_holders(layout)
    floor, state, kernels = hw.kernel_floor, [0.0, 0.0], 0
    free, links, done = {}, {}, 0.0       # a communicator's stream; a link's bytes; the last end
    for dims, n, sizes in assign_buckets(stage_params(model, layout, k["params"], n_layers, first, last),
                                         itemsize=held):
        if dims[0] == "edp":      # an expert's (w2's bias under etp: with its etp peers too)
            ranks = edp * (layout.etp if dims == ("edp", "etp") else 1)
            if ranks <= 1:
                continue
            nodes = expert_replica_nodes(layout, hw, etp=dims != ("edp",))
            cost, own = F.nccl_time(hw, "all_reduce", n * itemsize, ranks, nodes)
        else:
            dims = tuple(d for d in dims if _size(layout, (d,)) > 1)
            if not dims:
                continue
            cost, own = (collective(layout, hw, "all_reduce", n * itemsize, dims, x) for x in (True, False))
        calls["+".join(dims)] = calls.get("+".join(dims), 0) + 1
        chain = [x for n_i in sizes for x in (bucket_copy(hw, n_i, itemsize).device, floor)] + [floor]
        kernels += len(chain)
        run_chain(chain, state, hw.launch_overhead)
        link = nodes == 1 if dims[0] == "edp" else group_in_node(layout, hw, dims)
        ready, busy = max(state[1], free.get(dims, 0.0)), links.get(link, 0.0)
        start = ready + min(max(0.0, busy - ready), own)
        links[link] = max(busy, start) + own
        free[dims] = start + cost
        done = max(done, start + cost)
    copies = state[1]
    return max(0.0, done - copies), kernels, copies


def tp_chain(pieces: dict, phase: str, first: bool, last: bool, n_layers: int, hw, costs: dict) -> float:
    """Seconds of one pass of a TP rank's traced kernels and collectives through the host's
    issue chain (:func:`.issue.pass_time`), its parts in the pass's order."""
    order = (("embedding",) if first else ()) + ("layer",) + (("head",) if last else ())
    return pass_time(pieces, order if phase == "fwd" else order[::-1], n_layers, hw.launch_overhead, costs)


def head_weights(model, first: bool) -> int:
    """The LM head's weights on the last stage: its own matrix, or with tied embeddings a copy of
    the embedding's, unless the last stage is also the first (one tensor, counted there)."""
    parts = F.param_breakdown(model)
    return parts["lm_head"] or (0 if first else model.vocab * model.hidden)


def vocab_loss_kernels(hw, classes: dict, logits: float) -> Kernels:
    """The work the vocabulary-parallel loss adds to one pass over the plain one: ``classes``
    its bytes per logit by kernel class, on ``logits`` logits (its launches counted apart)."""
    rate = KernelModel(hw).bytes_rate
    seconds = sum(n * logits / rate[cls] for cls, n in classes.items())
    return Kernels(0, 0.0, sum(classes.values()) * logits, seconds, seconds)


def copy_kernel(hw, nbytes: float) -> Kernels:
    """One copy of ``nbytes`` (read, then written) on ``hw``: a kernel of the copy class."""
    seconds = KernelModel(hw).roofline(0, 2 * nbytes, COPY)
    return Kernels(1, 0.0, 2 * nbytes, seconds, max(seconds, hw.kernel_floor))


def ep_call_costs(model, hw, layout, tokens) -> dict:
    """{name: seconds} of each blocking call an EP rank makes in one MoE layer (all-to-all
    dispatch, balanced routing; :mod:`.ep_ops` marks them by these names): the expert counts'
    exchange, dispatch and combine, and the last two again in backward, each the same message.
    The ep group is ep consecutive ranks of the expert fold (dp, then cp and tp where ep needs
    them, in the layout's rank order: :func:`~.layout.fold_offsets`); the members on this
    rank's node exchange over NVLink, the others over the network, at once, as NCCL posts them
    (:func:`~.async_tp.nccl_all_to_all`). With etp > 1, the etp group's calls (:func:`etp_call_costs`)."""
    n = layout.ep
    local = sum(1 for offset in fold_offsets(layout, "ep") if offset < hw.gpus_per_node)

    def a2a(nbytes):
        return nccl_all_to_all(hw, nbytes, n, local)
    payload = F.moe_dispatch_payloads(tokens, model.hidden, model.top_k, n, 1, "all_to_all")["all_to_all"]
    message = a2a(payload / 2)
    out = {}
    group = routing_group(layout)
    if group:                   # the routing group's token places (int64) and router logits (bf16), gathered
        g = _size(layout, group)
        out = {"routing: token places": collective(layout, hw, "all_gather", g * tokens * 8, group),
               "routing: logits": collective(layout, hw, "all_gather", g * tokens * model.n_experts * 2, group)}
    if model.moe_dispatch == "all_gather":
        return {**out, **gather_call_costs(model, hw, layout, tokens)}
    if n == 1:                  # (ep 1 beside cp or tp: the routing group's calls alone)
        return {**out, **etp_call_costs(model, hw, layout, tokens)}
    return {**out, "expert counts": a2a(model.n_experts * 8), "dispatch": message,
            **etp_call_costs(model, hw, layout, tokens), "combine": message,
            "combine (backward)": message, "dispatch (backward)": message}


def gather_call_costs(model, hw, layout, tokens) -> dict:
    """{name: seconds} of the all-gather dispatch's blocking calls in one MoE layer
    (``ExpertParallelMoE._gathered``, :mod:`.ep_ops` marks them by these names) on the ep x etp
    group, {} for a group of one: the group's tokens (bf16), router weights (bf16) and expert
    ids (int64) all-gathered, the weighted sums reduce-scattered; backward, the sums' all-
    gather, the weights' and the tokens' reduce-scatters. The group is the expert mesh's
    members (:func:`~.layout.fold_offsets`), priced as NCCL's tuning model prices each
    collective over the nodes it spans."""
    n = layout.ep * layout.etp
    if n == 1:
        return {}
    nodes = fold_nodes(layout, hw, "expert mesh")

    def call(kind, nbytes):     # (all-gather: its output; reduce-scatter: its input)
        return F.nccl_time(hw, kind, nbytes, n, nodes)[0]
    rows, weights = n * tokens * model.hidden * 2, n * tokens * model.top_k * 2
    return {"dispatch": call("all_gather", rows), "router weights": call("all_gather", weights),
            "expert ids": call("all_gather", n * tokens * model.top_k * 8),
            "combine": call("reduce_scatter", rows), "combine (backward)": call("all_gather", rows),
            "router weights (backward)": call("reduce_scatter", weights),
            "dispatch (backward)": call("reduce_scatter", rows)}


def etp_call_costs(model, hw, layout, tokens) -> dict:
    """{name: seconds} of the etp group's blocking calls in one MoE layer (``_run_experts``,
    :mod:`.ep_ops` marks them by these names), {} at etp 1: the rows' counts (int64), the
    rows (bf16) and their expert ids (int64) all-gathered, the partial outputs reduce-
    scattered; backward, the last one's all-gather and the rows' reduce-scatter. Balanced
    routing: every etp rank holds the T k rows its ep rank received (the all-to-all's rows).
    The etp group is etp consecutive ranks of the expert fold (:func:`~.layout.fold_offsets`),
    priced as NCCL's tuning model prices each collective over the nodes it spans."""
    n = layout.etp
    if n == 1:
        return {}
    nodes = fold_nodes(layout, hw, "etp")
    rows = tokens * model.top_k

    def call(kind, nbytes):     # (all-gather: its output; reduce-scatter: its input)
        return F.nccl_time(hw, kind, nbytes, n, nodes)[0]
    gathered, scattered = call("all_gather", n * rows * model.hidden * 2), \
        call("reduce_scatter", n * rows * model.hidden * 2)
    return {"ETP row counts": call("all_gather", n * 8), "ETP all-gather": gathered,
            "ETP expert ids": call("all_gather", n * rows * 8), "ETP reduce-scatter": scattered,
            "ETP reduce-scatter (backward)": gathered, "ETP all-gather (backward)": scattered}


def routing_group(layout) -> tuple:
    """The mesh dims an MoE's routing group spans beyond the rank: cp, and tp (sequence
    parallelism: each TP rank routes its own s / tp tokens); () for the rank's own tokens."""
    return tuple(d for d, n in (("cp", layout.cp), ("tp", layout.tp if layout.sp else 1)) if n > 1)


__all__ = ["stage_parts", "accumulation", "ep_call_costs", "gather_call_costs", "etp_call_costs",
           "routing_group", "tp_calls", "group_in_node", "collective", "BUCKET_CAP_BYTES"]
