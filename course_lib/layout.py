"""One layout object, from the planner to the ranks (torchtitan's ``ParallelismConfig``).

    layout = Layout(dp=2, tp=2, pp=2, sp=True, global_batch=8, microbatches=2)
    check_layout(cfg, layout)                         # every rule, before any rank starts
    net = parallelize_nd(model, Mesh(dp=2, tp=2, pp=2), layout)
    est = planner.estimate(spec, "h100-sxm", layout)  # the same object, priced

Plain values only (no torch), so the planner and ``parallel/`` both import it. Keyword calls
(``parallelize_nd(model, mesh, microbatches=2)``, ``check_layout(cfg, dp=2, ...)``) build one
with :meth:`Layout.of`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

BATCH = ("global_batch", "micro_batch", "microbatches")
GRAD_REDUCE = ("step", "chunk", "round")   # when ZeRO-2 reduce-scatters a pipeline chunk's sums
RUNTIME_NAMES = {"sequence_parallel": "sp", "batch": "global_batch",   # parallelize_nd's keywords
                 "cp_balance": "cp_layout"}


@dataclass(frozen=True)
class Layout:
    """How one training step is spread over dp * tp * pp * cp GPUs (EP inside DP).

    The batch: ``global_batch`` sequences, each DP rank runs global_batch / dp of them as
    ``microbatches`` micro-batches of ``micro_batch`` sequences (the pipeline's micro-batches,
    or gradient accumulation): global_batch = dp * micro_batch * microbatches. Give any two
    (or one: the others default to 1 micro-batch of 1 sequence); the third follows.
    ``zero``: the ZeRO stage (0-3) over the dp * cp ranks that hold the same parameters; the
    ranks run 0 (DDP: ``data == "ddp"``), 1 and 2 (DDP's replicas, the optimizer state and, for
    2, the gradients sharded: :mod:`course_lib.parallel.zero_nd`) or 3 (FSDP: ``data == "fsdp"``;
    with ``shard_size`` S, HSDP: ``data == "hsdp"``, sharded over S of the dp ranks, replicated
    over dp / S).
    ``schedule``: a name (course_lib.schedules, torch's spellings too) or an action list per
    pipeline rank; ``v`` model chunks per stage (interleaved). ``stage_layers``: the layers of
    each of the pp * chunks virtual stages, in model order ((): balanced); the first may hold only
    the embedding and the last only the head (Llama 3's chunks: :func:`split_with_ends`).
    ``sp``: sequence parallelism with TP; ``async_tp``: its collectives decomposed under the
    matmuls (needs sp and tp > 1). ``recompute``: a policy, or one per block.
    ``precision``: a name of course_lib.precision.mixed. ``overlap_dp``: the planner prices
    the gradient reduction under the last backward (bucketed DDP / ZeRO). ``grad_reduce``
    (ZeRO-2 under a pipeline, :data:`GRAD_REDUCE`): when a chunk's gradient sums are
    reduce-scattered and freed: "step", once after the schedule (Megatron-LM 2021-22);
    "chunk", as soon as that chunk's last backward has run, under the backwards still to come
    (torch's pipelining with FSDP2, Megatron-Core's ``overlap_grad_reduce``); "round", after each
    round of N micro-batch backwards through it (Llama 3's flexible N: ``schedules.microbatch_group``).
    Context parallelism: ``cp_comm`` is how K/V move, ``"ring"`` (ring attention, as the CP
    chapter builds it, or Ulysses: ``cp_method``) or ``"all_gather"`` (Llama 3's: K/V
    all-gathered, dK/dV reduce-scattered; ``cp_method`` stays "ring");
    ``cp_method`` ("ring" / "ulysses") and ``cp_layout`` ("zigzag" / "contiguous" /
    "documents": the zigzag of every packed document; keyword ``cp_balance``) are what the
    ranks run. Experts: ``ep`` x ``etp`` (expert parallel x expert tensor parallel) fold
    over one stage's dp x cp x tp ranks (Megatron-Core's MoE parallel folding; ep * etp must
    divide dp * cp * tp); the rest of those ranks hold copies of the same experts.
    ``fold_order`` (:data:`FOLDS`): where the fold takes its ranks first, "dp_first" (an EP
    inside DP, the course's chapters) or "tp_first" (Megatron-Core's: the innermost ranks, so
    with ``order=("pp", "dp", "cp", "tp")`` an expert group stays on one node's NVLink).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sp: bool = False
    schedule: object = "1f1b"
    v: int = 1
    micro_batch: int = None           # see the class docstring: two of the three batch fields
    global_batch: int = None
    recompute: object = "none"
    seq_len: int | None = None        # None: the model's training sequence length
    overlap_dp: bool = True
    async_tp: bool = False            # needs sp and tp > 1 (tp_plan.rule_sequence)
    etp: int = 1                      # expert tensor parallel: the experts' own TP, folded like ep
    cp_comm: str = "ring"
    microbatches: int = None
    cp_method: str = "ring"
    cp_layout: str = "zigzag"
    precision: str = "full"
    shard_size: int | None = None     # HSDP: FSDP over S dp ranks, replicated over dp / S
    zeropp: tuple = ()                # ZeRO++ on FSDP: any of ("hpz", "qwz", "qgz")
    gpus_per_node: int | None = None  # ZeRO++'s node: G consecutive FSDP ranks (None: 8 or all)
    documents: tuple = ()             # packed documents' lengths per sequence (sum = seq_len); (): one.
                                      # The planner and the dry run read it; a real step takes doc_ids=
    order: tuple | None = None        # the ranks' order, outermost first (:func:`rank_order`); None:
                                      # MESH_ORDER (dp, pp, cp, tp); DeepSpeed's ("pp", "dp", "tp")
    stage_layers: tuple = ()          # layers per virtual stage, model order; (): balanced
    grad_reduce: str = "step"         # ZeRO-2 under a pipeline: "step", "chunk" or "round"
    fold_order: str = "dp_first"      # the expert fold takes dp first, or tp first (Megatron-Core's)
    given: frozenset = field(default=frozenset(), repr=False, compare=False)   # batch fields given

    def __post_init__(self):
        given = self.given or frozenset(f for f in BATCH if getattr(self, f) is not None)
        if not isinstance(self.documents, tuple):
            object.__setattr__(self, "documents", tuple(int(n) for n in self.documents))
        if isinstance(self.order, list):                           # hashable, one spelling
            object.__setattr__(self, "order", tuple(self.order))
        if isinstance(self.stage_layers, list):        # hashable; the pipeline's rule checks it
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        if isinstance(self.zeropp, (list, set, frozenset, str)):   # hashable, one spelling
            object.__setattr__(self, "zeropp", (self.zeropp,) if isinstance(self.zeropp, str) else tuple(self.zeropp))
        gb, mb, m, dp = self.global_batch, self.micro_batch, self.microbatches, self.dp
        if gb is None:
            mb, m = mb or 1, m or 1
            gb = dp * mb * m
        elif m is None:
            mb = mb or 1
            m = gb // (dp * mb) if isinstance(dp * mb, int) and dp * mb > 0 else 0
        elif mb is None:
            mb = gb // (dp * m) if isinstance(dp * m, int) and dp * m > 0 else 0
        for name, value in zip(BATCH, (gb, mb, m)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "given", frozenset(given))

    @classmethod
    def of(cls, layout=None, **fields) -> "Layout":
        """A :class:`Layout` from a layout, keywords (``parallelize_nd``'s spellings too:
        ``sequence_parallel``, ``batch``, ``data="fsdp"``), or a layout with keywords changed."""
        fields = {RUNTIME_NAMES.get(k, k): v for k, v in fields.items()}
        if fields.get("global_batch") is None:        # no batch: the batch fields say micro-batches only
            fields.pop("global_batch", None)
        data = fields.pop("data", None)
        if data is not None:
            if data not in DATA:
                raise ValueError(f"data must be one of {DATA}, got {data!r}")
            fields["zero"] = 0 if data == "ddp" else 3
            if data == "hsdp" and fields.get("shard_size", getattr(layout, "shard_size", None)) is None:
                raise ValueError("data='hsdp' needs shard_size=S: FSDP shards over S ranks and replicates "
                                 "over R = dp / S (Mesh(dp=R * S))")
            if data == "fsdp" and fields.get("shard_size") is not None:
                raise ValueError(f"shard_size={fields['shard_size']} with data='fsdp': FSDP over S of the dp "
                                 f"ranks, replicated over the rest, is data='hsdp'")
            if data != "hsdp":
                fields.setdefault("shard_size", None)     # a layout's HSDP turned into DDP / FSDP
        if layout is None:
            return cls(**fields)
        if not isinstance(layout, cls):
            raise TypeError(f"expected a Layout, got {type(layout).__name__}")
        return layout.with_(**fields) if fields else layout

    @property
    def data(self) -> str:
        """How the ranks hold the data-parallel copies: "fsdp" (ZeRO-3), "hsdp" (ZeRO-3 over
        ``shard_size`` ranks, replicated over the rest) or "ddp"."""
        if self.zero == 3:
            return "fsdp" if self.shard_size is None else "hsdp"
        return "ddp"

    @property
    def sizes(self) -> dict:
        return {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp, "ep": self.ep}

    @property
    def n_gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline stage (1 unless interleaved)."""
        return self.v if self.schedule == "interleaved" else 1

    def with_(self, **changes) -> "Layout":
        """This layout with ``changes``; the batch fields not given are derived again."""
        given = self.given | {f for f in BATCH if changes.get(f) is not None}
        keep = {f: None for f in BATCH if f not in given}
        return replace(self, **{**keep, **changes, "given": frozenset(given)})

    def describe(self) -> str:
        dims = [f"DP{self.dp}" + (f"(HSDP {self.dp // self.shard_size}x{self.shard_size})" if self.data == "hsdp"
                                  else f"(ZeRO-{self.zero})" if self.zero else ""),
                f"TP{self.tp}" + ("+SP" if self.sp and self.tp > 1 else ""),
                f"PP{self.pp}" + (f"({self.schedule}" + (f", v={self.v}" if self.chunks > 1 else "") + ")"
                                  if self.pp > 1 else ""),
                f"CP{self.cp}" + ("(all-gather)" if self.cp > 1 and self.cp_comm == "all_gather" else
                                  "(Ulysses)" if self.cp > 1 and self.cp_method == "ulysses" else "")]
        if self.zero == 2 and self.grad_reduce != "step":
            dims[0] += f" reduced per {self.grad_reduce}"
        if self.ep > 1:
            dims.append(f"EP{self.ep}")
        if self.etp > 1:
            dims.append(f"ETP{self.etp}")
        if self.ep * self.etp > 1 and self.fold_order != "dp_first":
            dims[-1] += f"(folded {self.fold_order.replace('_', ' ')})"
        return " x ".join(dims) + f", mbs {self.micro_batch}, gbs {self.global_batch}, recompute {self.recompute}"


FOLD_ORDER = ("dp", "cp", "tp")     # the fold takes its ranks from these, dp first
FOLDS = {"dp_first": FOLD_ORDER,     # Layout.fold_order: the dims the fold takes, in turn
         "tp_first": ("tp", "cp", "dp")}   # Megatron-Core's: etp, ep, edp over tp, cp, dp
MESH_ORDER = ("dp", "pp", "cp", "tp")   # the ranks' default order, outermost -> innermost (TP innermost)


def rank_order(order=None, sizes=None) -> tuple:
    """The mesh's four dimensions, outermost -> innermost, as ``order`` numbers the ranks
    (None: :data:`MESH_ORDER`). Each name once; a dimension left out must have size 1 in
    ``sizes`` (it changes no rank: it goes innermost). DeepSpeed's PipeModelDataParallelTopology
    is ``("pp", "dp", "tp")``: its axes pipe, data, model, row-major. TypeError / ValueError
    naming the rule."""
    if order is None:
        return MESH_ORDER
    if isinstance(order, str) or not isinstance(order, (tuple, list)):
        raise TypeError(f"order must be a tuple of mesh dimensions, outermost first (e.g. "
                        f"('pp', 'dp', 'tp')), got {order!r}")
    unknown = [d for d in order if d not in MESH_ORDER]
    if unknown:
        raise ValueError(f"order: unknown mesh dimension(s) {unknown}; the ranks are ordered over {MESH_ORDER}")
    if len(set(order)) != len(order):
        raise ValueError(f"order {tuple(order)} names a dimension twice: name each once, outermost first")
    missing = [d for d in MESH_ORDER if d not in order]
    left_out = [f"{d}={sizes[d]}" for d in missing if sizes is not None and sizes.get(d, 1) != 1]
    if left_out:
        raise ValueError(f"order {tuple(order)} leaves out {', '.join(left_out)}: name every dimension of "
                         f"size > 1 (a left-out one has size 1)")
    return tuple(order) + tuple(missing)


def expert_fold(sizes: dict, ep: int, etp: int = 1, fold_order: str = "dp_first") -> tuple:
    """The dims of one stage the expert mesh folds over: the shortest run of dp, cp, tp (in
    ``fold_order``'s turn, :data:`FOLDS`: dp first, or tp first as Megatron-Core) whose ranks
    ``ep * etp`` divides. ValueError naming the rule if the stage's dp x cp x tp does not tile
    into expert meshes, or the fold order is not one of :data:`FOLDS`."""
    if fold_order not in FOLDS:
        raise ValueError(f"fold_order must be one of {tuple(FOLDS)}, got {fold_order!r}")
    folded, dims = 1, FOLDS[fold_order]
    for i, d in enumerate(dims):
        folded *= sizes.get(d, 1)
        if folded % (ep * etp) == 0:
            return dims[:i + 1]
    raise ValueError(f"the expert mesh folds over one stage's dp x cp x tp ranks: ep * etp = {ep} * {etp} "
                     f"must divide dp * cp * tp = {sizes.get('dp', 1)} * {sizes.get('cp', 1)} * "
                     f"{sizes.get('tp', 1)} = {folded}")


def rule_grad_reduce(layout) -> None:
    """``grad_reduce`` one of :data:`GRAD_REDUCE`; other than "step" only with ZeRO-2, which frees
    a chunk's gradient sums once sent (ZeRO-1 keeps the whole gradients to the step anyway;
    FSDP sends its own in the backward). The ranks (``zero_nd.rule_zero``) and the planner
    (``planner.layout.validate``) both apply it."""
    if layout.grad_reduce not in GRAD_REDUCE:
        raise ValueError(f"grad_reduce must be one of {GRAD_REDUCE}, got {layout.grad_reduce!r}")
    if layout.grad_reduce != "step" and layout.zero != 2:
        raise ValueError(f"grad_reduce={layout.grad_reduce!r} frees a chunk's gradient sums once reduce-scattered: "
                         f"that is ZeRO-2 (zero=2), got zero={layout.zero}")


# The pipeline's split, in plain arithmetic: the ranks (parallel.pipeline.rules.partition_layers)
# and the planner (planner.layout) both apply it.
def rule_stage_layers(n_layers: int, n_stages: int, stage_layers) -> None:
    """A given split: one count per virtual stage, summing to the model's layers; a stage with
    no layer must hold something else, so only the first (the embedding) or the last (the head,
    the final norm and the loss) may have none."""
    if not isinstance(stage_layers, tuple) or not all(isinstance(n, int) and not isinstance(n, bool)
                                                      for n in stage_layers):
        raise TypeError(f"stage_layers must be a tuple of layer counts (ints), got {stage_layers!r}")
    if len(stage_layers) != n_stages:
        raise ValueError(f"stage_layers gives {len(stage_layers)} stages, the pipeline has pp * chunks = "
                         f"{n_stages}")
    if any(n < 0 for n in stage_layers) or sum(stage_layers) != n_layers:
        raise ValueError(f"stage_layers {stage_layers} must be counts >= 0 summing to the model's "
                         f"{n_layers} layers (sum {sum(stage_layers)})")
    empty = [i for i, n in enumerate(stage_layers) if n == 0 and 0 < i < n_stages - 1]
    if empty:
        raise ValueError(f"stage_layers leaves virtual stage {empty[0]} empty of everything: only the first "
                         f"(the embedding) and the last (the head) may hold no layer")


def split_with_ends(n_layers: int, n_stages: int, embedding: int = 1, head: int = 1) -> tuple:
    """Layers per virtual stage when the embedding counts as ``embedding`` layers and the head
    (final norm, output, loss) as ``head``: n_layers + embedding + head slots cut balanced, the
    ends' slots taken by them (torchtitan's ``input_weight`` / ``output_weight``; Megatron-LM's
    ``--account-for-embedding-in-pipeline-split`` / ``-loss-``). Llama 3 405B: 126 layers on 16 x 8
    stages -> (0, 1, ..., 1, 0), "the first model chunk on the first stage has only the embedding"."""
    n_slots = n_layers + embedding + head
    if n_stages > n_slots:
        raise ValueError(f"more pipeline stages ({n_stages}) than layers, embedding and head ({n_slots})")
    base, extra = divmod(n_slots, n_stages)
    slots = [base + (i < extra) for i in range(n_stages)]   # the first extra stages one more (shard_range)
    slots[0] -= embedding
    slots[-1] -= head
    if min(slots) < 0:
        raise ValueError(f"{n_layers} layers on {n_stages} stages: the first or the last stage has fewer slots "
                         f"than the embedding ({embedding}) or the head ({head}) weighs")
    return tuple(slots)


DATA = ("ddp", "fsdp", "hsdp")
CP_COMM = ("ring", "all_gather")   # Layout.cp_comm: how K/V move (the planner and the ranks both read it)

__all__ = ["Layout", "DATA", "CP_COMM", "FOLD_ORDER", "FOLDS", "MESH_ORDER", "expert_fold", "rank_order", "rule_stage_layers",
           "split_with_ends"]
