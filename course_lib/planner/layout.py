"""A parallel layout (DP x TP x PP x CP; EP x ETP folded over a stage's DP x CP x TP) and its constraints.

:class:`Layout` is the one layout object (``course_lib.layout``): the ranks take the same one.

Ranks are numbered with TP innermost, then CP, then PP, then DP (the order of the
Llama 3 paper, Dubey et al. 2024, Sec. 3.3.2): the dimension that talks most sits
on the fastest links. A group is inside one node when its rank span fits in one
node; otherwise its ring crosses the network and runs at the network's speed.
The layout's ``order`` numbers them otherwise (DeepSpeed: PP outermost, so a pipeline
hop spans dp * cp * tp ranks): :func:`strides` follows it, as the Mesh does.
"""
from __future__ import annotations

import math

from course_lib.layout import CP_COMM, FOLDS, Layout, expert_fold, rank_order, rule_grad_reduce, rule_stage_layers
from course_lib.planner.formulas import RECOMPUTE, SCHEDULES
from course_lib.planner.presets import Hardware, ModelSpec
from course_lib.schedules import V_SCHEDULES, microbatch_group, stage_rank



def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def validate(model: ModelSpec, hw: Hardware, layout: Layout, n_gpus: int | None = None) -> None:
    """Raise ValueError naming the first violated constraint (nothing if the layout is valid).

    These are the hard constraints, the ones that make a layout impossible to run.
    Memory is a soft one: ``estimate`` reports a layout that does not fit instead.
    """
    for name in ("dp", "tp", "pp", "cp", "ep", "etp", "v", "micro_batch", "global_batch"):
        _positive_int(f"layout.{name}", getattr(layout, name))
    rank_order(layout.order, layout.sizes)      # each dim once, the dims of size > 1 all named
    s = layout.seq_len or model.seq_len
    _positive_int("seq_len", s)
    if n_gpus is not None and layout.n_gpus != n_gpus:
        raise ValueError(f"DP*TP*PP*CP must equal the GPU count: {layout.dp}*{layout.tp}*{layout.pp}*"
                         f"{layout.cp} = {layout.n_gpus}, not {n_gpus}")
    if layout.zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {layout.zero!r}")
    if layout.schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {layout.schedule!r}")
    if layout.recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {layout.recompute!r}")
    if model.n_heads % layout.tp:
        raise ValueError(f"TP must divide the attention heads: {model.n_heads} heads, TP = {layout.tp}")
    if model.n_kv_heads % layout.tp and layout.tp % model.n_kv_heads:
        raise ValueError(f"TP must divide the KV heads or be a multiple of them (KV heads replicated): "
                         f"{model.n_kv_heads} KV heads, TP = {layout.tp}")
    if model.ffn % layout.tp:
        raise ValueError(f"TP must divide the FFN size: ffn = {model.ffn}, TP = {layout.tp}")
    split = layout.stage_layers       # given: its ends may hold only the embedding / the head
    if layout.pp > model.n_layers and not split:
        raise ValueError(f"more pipeline stages than layers: PP = {layout.pp} > {model.n_layers} layers")
    if layout.schedule == "interleaved":
        if layout.pp < 2 or layout.v < 2:
            raise ValueError(f"the interleaved schedule needs PP >= 2 and v >= 2 chunks per stage, "
                             f"got PP = {layout.pp}, v = {layout.v}")
        if layout.pp * layout.v > model.n_layers and not split:
            raise ValueError(f"more pipeline chunks than layers: PP*v = {layout.pp * layout.v} > "
                             f"{model.n_layers} layers")
    elif layout.v != 1:
        raise ValueError(f"v (chunks per stage) > 1 needs schedule='interleaved', got {layout.schedule!r}")
    if layout.global_batch % (layout.dp * layout.micro_batch):
        raise ValueError(f"micro-batch x DP must divide the global batch: {layout.micro_batch} x {layout.dp} "
                         f"does not divide {layout.global_batch} sequences")
    m = layout.microbatches
    if layout.global_batch != layout.dp * layout.micro_batch * m:
        raise ValueError(f"global_batch={layout.global_batch} is not dp * micro_batch * microbatches = "
                         f"{layout.dp} * {layout.micro_batch} * {m}")
    if split:
        rule_stage_layers(model.n_layers, layout.pp * (2 if layout.schedule in V_SCHEDULES else layout.chunks), split)
    if layout.schedule in V_SCHEDULES and layout.pp * 2 > model.n_layers and not split:
        raise ValueError(f"{layout.schedule} runs two chunks per stage: PP*2 = {layout.pp * 2} > {model.n_layers} layers")
    if layout.schedule == "dualpipe-v" and m < 2 * layout.pp:
        raise ValueError(f"dualpipe-v needs at least 2p = {2 * layout.pp} micro-batches, got {m}")
    if layout.schedule == "interleaved" and layout.v > 1:
        microbatch_group(layout.pp, m)      # torch's rounds: m < 2 PP, or a multiple of m // PP
    rule_grad_reduce(layout)
    if layout.cp_comm not in CP_COMM:
        raise ValueError(f"cp_comm must be one of {CP_COMM}, got {layout.cp_comm!r}")
    if layout.fold_order not in FOLDS:
        raise ValueError(f"fold_order must be one of {tuple(FOLDS)}, got {layout.fold_order!r}")
    if s % layout.cp:
        raise ValueError(f"CP must divide the sequence length: seq_len = {s}, CP = {layout.cp}")
    if layout.ep > 1:
        if model.n_experts <= 1:
            raise ValueError(f"EP > 1 needs a mixture-of-experts model; {model.name} is dense")
        if model.n_experts % layout.ep:
            raise ValueError(f"EP must divide the experts: {model.n_experts} experts, EP = {layout.ep}")
    if layout.ep * layout.etp > 1:
        expert_fold(layout.sizes, layout.ep, layout.etp, layout.fold_order)   # tiles a stage's dp x cp x tp
        if model.n_experts <= 1:
            raise ValueError(f"ETP > 1 needs a mixture-of-experts model; {model.name} is dense")
        if model.ffn % layout.etp:
            raise ValueError(f"ETP must divide the expert width: ffn = {model.ffn}, ETP = {layout.etp}")


def layers_per_chunk(model: ModelSpec, layout: Layout) -> list[int]:
    """Transformer layers of each model chunk, in chunk order (pp x chunks of them; a V
    schedule's 2 pp): the layout's ``stage_layers``, else as even as possible, the extra layers
    to the middle chunks (the first holds the embedding, the last the LM head)."""
    if layout.stage_layers:
        return list(layout.stage_layers)
    chunks = layout.pp * (2 if layout.schedule in V_SCHEDULES else layout.chunks)
    base, extra = divmod(model.n_layers, chunks)
    per_chunk = [base] * chunks
    order = sorted(range(chunks), key=lambda c: (abs(c - (chunks - 1) / 2), c))
    for c in order[:extra]:
        per_chunk[c] += 1
    return per_chunk


def layers_per_stage(model: ModelSpec, layout: Layout) -> list[int]:
    """Transformer layers on each pipeline stage (all chunks): :func:`layers_per_chunk` summed
    over the chunks each rank holds (``schedules.stage_rank``: a V schedule's two in V order)."""
    placement = "v" if layout.schedule in V_SCHEDULES else "loop"
    per_rank = [0] * layout.pp
    for c, n in enumerate(layers_per_chunk(model, layout)):
        per_rank[stage_rank(c, layout.pp, placement)] += n
    return per_rank


def holds_head(layout: Layout, stage: int) -> bool:
    """Does pp rank ``stage`` hold the last chunk (the final norm, the LM head, the loss)? The
    last rank; under a V schedule rank 0, which holds the first chunk and the last
    (``schedules.stage_rank``: chunk 2p - 1 is rank 0's)."""
    if layout.schedule in V_SCHEDULES:
        return stage == stage_rank(2 * layout.pp - 1, layout.pp, "v")
    return stage == layout.pp - 1


def strides(layout: Layout) -> dict:
    """{dim: how many ranks apart two neighbours along ``dim`` are}, in the layout's rank order
    (default: tp 1, cp tp, pp tp * cp, dp tp * cp * pp; :class:`~course_lib.parallel.mesh.MeshShape`)."""
    out, stride = {}, 1
    for d in reversed(rank_order(layout.order, layout.sizes)):
        out[d], stride = stride, stride * layout.sizes[d]
    return out


def group_span(layout: Layout, dim: str) -> int:
    """How many consecutive ranks one group of ``dim`` spans: its stride times its size (in the
    layout's rank order, default TP, CP, PP, DP innermost first; the expert dims "ep" / "etp"
    folded over DP, CP and TP, numbered in that rank order: :class:`~course_lib.parallel.mesh.MeshShape`)."""
    if dim in ("ep", "etp"):
        return max(fold_offsets(layout, dim)) + 1
    return strides(layout)[dim] * layout.sizes[dim]


def fold_offsets(layout: Layout, dim: str = "ep") -> list:
    """The rank offsets from its first member of each member of one group of the expert mesh,
    folded over DP, CP and TP (in ``layout.fold_order``'s turn) and numbered in the layout's rank
    order (:func:`group_span`): "ep" (its members etp fold indices apart), "etp", or "expert
    mesh" (all ep x etp of them)."""
    step = layout.etp if dim == "ep" else 1                        # fold-index step between members
    count = {"ep": layout.ep, "etp": layout.etp, "expert mesh": layout.ep * layout.etp}[dim]
    return _fold_index_offsets(layout, [k * step for k in range(count)])


def _fold_index_offsets(layout: Layout, indexes) -> list:
    """The rank offsets of the ranks at these indexes along the expert fold (innermost fastest)."""
    stride, sizes = strides(layout), layout.sizes
    fold = sorted(expert_fold(sizes, layout.ep, layout.etp, layout.fold_order), key=stride.get)   # innermost first
    out = []
    for index in indexes:
        offset = 0
        for d in fold:                                             # the member's coordinates
            index, i = divmod(index, sizes[d])
            offset += i * stride[d]
        out.append(offset)
    return out


def expert_replica_offsets(layout: Layout, etp: bool = False) -> list:
    """The rank offsets of the ranks of a stage holding the same expert as its first rank
    (``MeshShape.expert_replicas``: "edp", the fold's indexes ep x etp apart, times every rank
    of the dims outside the fold); ``etp``: with its etp peers too (w2's bias's group)."""
    fold = expert_fold(layout.sizes, layout.ep, layout.etp, layout.fold_order)
    mesh = layout.ep * layout.etp
    edp = math.prod(layout.sizes[d] for d in fold) // mesh
    out = _fold_index_offsets(layout, [j * mesh + t for j in range(edp) for t in range(layout.etp if etp else 1)])
    stride = strides(layout)
    for d in ("dp", "cp", "tp"):
        if d not in fold:
            out = [o + i * stride[d] for o in out for i in range(layout.sizes[d])]
    return out


def expert_holders(layout: Layout) -> int:
    """The ranks of a stage holding the same experts (the same etp slices): the stage's
    dp x cp x tp ranks over the expert mesh's ep x etp ("edp" and the dims outside the fold,
    ``MeshShape.expert_replicas``); DDP sums an expert's gradient over them, FSDP shards it."""
    return max(1, layout.dp * layout.cp * layout.tp // (layout.ep * layout.etp))


def expert_zero_group(layout: Layout) -> tuple:
    """(ranks, dims summed after) of an expert's ZeRO-1/2 group as the course's ranks shard it
    (``parallel/zero_nd.shard_dims``): every rank holding the same expert, the fold's "edp" and
    the dims outside the fold (:func:`expert_holders`), nothing summed after (w2's bias under
    etp: over etp too, ``zero_sync``), as Megatron-Core's distributed optimizer shards over its
    expert-data-parallel group. With tp = cp = 1: dp / (ep etp)."""
    expert_fold(layout.sizes, layout.ep, layout.etp, layout.fold_order)     # (ValueError naming the rule)
    return expert_holders(layout), ()


def intra_node(layout: Layout, hw: Hardware, dim: str) -> bool:
    """True if every ring of ``dim`` stays inside one node (NVLink)."""
    return group_span(layout, dim) <= hw.gpus_per_node
