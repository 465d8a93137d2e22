"""N-D parallelism: the tiny GPT cut along every dimension of a mesh, by one plan.

    layout = Layout(dp=2, pp=2, cp=2, tp=2, global_batch=8, microbatches=2)
    check_layout(cfg, layout)                                      # before any rank starts
    net = parallelize_nd(TinyGPT(cfg, seed=0), Mesh(dp=2, pp=2, cp=2, tp=2), layout)
    net = parallelize_nd(TinyGPT(cfg, seed=0), Mesh(dp=2, pp=2, cp=2, tp=2), microbatches=2)  # the same
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    loss = net.step(x, y)          # the GLOBAL batch (the same on every rank): the step's loss
    opt.step(); opt.zero_grad()

:func:`parallelize_nd` is the plan, in torchtitan's order (``parallelize_llama`` +
``pipeline_llama``), each step one earlier chapter taking the Mesh and reading its own group
from it (``mesh.comm(dim)``); :class:`NDParallel` runs the step with the one pipeline runtime
(``pipeline.runtime``). The loss is a sum over each rank's tokens divided by the global token
count, so no gradient is ever divided by a degree: the sums ARE the single-device gradients.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from course_lib.layout import DATA, MESH_ORDER, Layout
from course_lib.parallel.context_parallel import context_parallel, cp_method_of, rule_context, rule_doc_ids, shard_positions
from course_lib.parallel.expert_parallel import ExpertParallelMoE, expert_tp_plan, rule_experts, token_index
from course_lib.parallel.fsdp import FSDP, rule_fsdp
from course_lib.parallel.grad_sync import GradSync
from course_lib.parallel.layout_rules import as_layout, check_layout, rule_fold_order, rule_names, rule_order
from course_lib.parallel.mesh import DIMS, EXPERT_DIMS, MeshShape, get_reduce_dims, set_reduce_dims
from course_lib.parallel.pipeline.rules import rule_batch, rule_pipeline
from course_lib.parallel.pipeline.runtime import PipelineRuntime
from course_lib.parallel.pipeline.stages import split_stages, tie_embeddings
from course_lib.parallel.placement import Placement, assemble_tp
from course_lib.parallel.tp_plan import PLAN, parallelize, rule_sequence, rule_tensor, tp_slice_of
from course_lib.parallel.zero_nd import ZeroSync, rule_zero
from course_lib.precision.mixed import MasterWeights, accumulates, cast_buffers, check_precision
from course_lib.recompute import set_recompute
from course_lib.schedules import SCHEDULES, validate


def parallelize_nd(model, mesh, layout: Layout = None, *, seed=0, dims_of=None, **keywords) -> "NDParallel":
    """The same single-device ``model`` on every rank -> this rank's part of it, on ``mesh``.
    ``layout``: a :class:`~course_lib.layout.Layout` (its dims the mesh's), or its fields as
    keywords: ``microbatches``, ``schedule``, ``v``, ``sequence_parallel`` (default True),
    ``cp_method``, ``cp_layout``, ``data`` ("ddp" / "fsdp" / "hsdp" with ``shard_size``), ``recompute`` (default: the model's
    own), ``precision``. ``dims_of(p, sizes, fsdp)``: step 6 (default :func:`data_dims`)."""
    if not isinstance(model, nn.Module) or not hasattr(model, "blocks"):
        raise TypeError(f"parallelize_nd cuts a course_lib TinyGPT, got {type(model).__name__}")
    if layout is None and keywords.get("recompute") is None:
        keywords["recompute"] = model.config.recompute
    L = as_layout(layout, dict(mesh.sizes, ep=mesh.ep, etp=mesh.etp), **keywords)
    L = rule_order(L, getattr(mesh, "order", MESH_ORDER), given=layout is not None or "order" in keywords)
    L = rule_fold_order(L, getattr(mesh, "fold_order", "dp_first"),
                        given=layout is not None or "fold_order" in keywords)
    if not isinstance(L.schedule, str):     # an action list: checked once, here (the rules and the
        L = L.with_(schedule=validate(L.schedule, L.pp, L.microbatches, L.v))   # runner take it as is)
    for rule in (rule_names, rule_pipeline):
        rule(model.config, L)
    stages = split_stages(model, mesh, L.v, L.schedule, L.stage_layers)   # 1. PP: this rank's stages
    for st in stages.values():
        apply_tp(st.part, mesh, L, seed)              # 2. TP (+ SP): matrices split over "tp"
        apply_cp(st.part, mesh, L)                    # 3. CP: attention a ring (or Ulysses) over "cp"
        apply_ep(st.part, mesh, L)                    # 4. EP: the experts on their own (folded) mesh
        set_recompute(st.part, L.recompute, st.layers)   # 5. what each block keeps for backward
    tie_embeddings(stages, mesh.sizes["pp"] * L.v)    # pp = 1, v > 1: embedding and head one weight again
    reduce = {}                                       # 6. the dims each gradient is summed over
    for st in stages.values():
        reduce.update(mark_reduce_dims(st, mesh, fsdp=L.data != "ddp" or L.zero > 0, dims_of=dims_of))
    before = {s: {n: (*tp_slice_of(q), reduce[id(q)]) for n, q in st.part.named_parameters(remove_duplicate=False)}
              for s, st in stages.items()}            # each TP slice and its sum dims (before FSDP)
    modules, grad_sync, master = apply_data_parallel(stages, mesh, L, reduce)   # 7. DDP or FSDP
    return NDParallel(stages, mesh, L, modules=modules, grad_sync=grad_sync, master=master,
                      placements=placements(stages, modules, mesh, before))   # where each parameter sits


def apply_tp(part, mesh, layout, seed=0):
    """Megatron's column / row split of every block (chapter 5) over mesh "tp"."""
    rule_tensor(part.config, layout)
    rule_sequence(part.config, layout)
    if mesh.sizes["tp"] > 1:   # an MoE's experts stay whole here: they have their own mesh (apply_ep)
        plan = expert_tp_plan(PLAN) if part.config.n_experts else None
        parallelize(part, mesh, sequence_parallel=layout.sp, seed=seed, plan=plan, async_tp=layout.async_tp)


def apply_cp(part, mesh, layout):
    """Every attention over mesh "cp" (chapter 7): a rank holds s / cp tokens."""
    rule_context(part.config, layout)
    if mesh.sizes["cp"] > 1:
        context_parallel(part, mesh.comm("cp"), cp_method_of(layout), layout.cp_layout)


def apply_ep(part, mesh, layout):
    """MoE variant (chapter 8): each block's experts on the expert mesh folded over this stage's
    dp x cp x tp ranks (E / ep experts per rank, each 1 / etp of its width); a routing group is
    one micro-batch of one DP rank (its aux loss weighted per step by :meth:`NDParallel.step`)."""
    rule_experts(part.config, layout)
    folded = mesh.ep * mesh.etp * mesh.sizes["cp"] * mesh.sizes["tp"] > 1
    for block in part.blocks:
        mlp = getattr(block, "mlp", None)
        if mlp is not None and hasattr(mlp, "aux_weight"):
            if folded:
                mlp.moe = ExpertParallelMoE(mlp.moe, mesh, dispatch=part.config.moe_dispatch)
            mlp.groups = 1


def data_dims(p, sizes, fsdp):
    """The dims ``p``'s gradient is summed over: its marks (tensor / expert parallelism) plus
    "cp" (every CP rank sees other tokens) and "dp"; an expert's marks are the ranks that hold
    it (``ExpertParallelMoE``). Dims of size 1 are left out (nothing to sum) unless FSDP
    shards over them."""
    marks = set(get_reduce_dims(p, ("dp",)))
    dims = marks if "edp" in marks else marks | {"cp", "dp"}
    keep = {"dp", "cp", "edp"} if fsdp else set()
    size = {"edp": sizes["dp"] // sizes.get("ep", 1), **sizes}
    return tuple(d for d in DIMS + EXPERT_DIMS if d in dims and (size.get(d, 1) > 1 or d in keep))


def mark_reduce_dims(stage, mesh, fsdp=False, dims_of=None) -> dict:
    """The dims each parameter of ``stage`` has its gradient summed over (``dims_of(p, sizes,
    fsdp)``, default :func:`data_dims`): {id(parameter): dims}, the plan's record that DDP and
    FSDP are handed; each parameter is marked too (``set_reduce_dims``), for chapter 5's readers."""
    sizes, dims = dict(mesh.sizes, **getattr(mesh, "expert_sizes", {"ep": mesh.ep})), {}
    for q in stage.parameters():
        dims[id(q)] = tuple((dims_of or data_dims)(q, sizes, fsdp))
        set_reduce_dims(q, dims[id(q)])
    return dims


def apply_data_parallel(stages, mesh, layout, reduce):
    """DP: a GradSync summing each gradient over its dims ``reduce`` ({id(parameter): dims}, the
    plan's), after the schedule ("ddp"); or each stage sharded over ("dp", "cp") (torchtitan's
    ``dp_shard_cp``), reduce-scattering, then summing over the rest of its dims ("fsdp"); "hsdp":
    sharded over ``shard_size`` dp ranks (x cp), the gradient shards all-reduced over the replicas.
    Mixed precision: FSDP's shards are the master weights (all-gathered in the compute dtype,
    gradients reduce-scattered in the reduce dtype); with DDP a :class:`MasterWeights` keeps
    them and the gradients are summed on the masters or on the 16-bit model (the reduce dtype).
    ZeRO-1/2 (``layout.zero``): DDP's replicas, a :class:`~course_lib.parallel.zero_nd.ZeroSync`
    in place of the GradSync (reduce-scatter over ("dp", "cp"), the optimizer on the owned slices).
    Returns ({stage: the module the schedule runs}, grad_sync or None, MasterWeights or None)."""
    rule_fsdp(next(iter(stages.values())).part.config, layout)
    rule_zero(next(iter(stages.values())).part.config, layout)
    compute, reduce_dtype = check_precision(layout.precision)
    if layout.data != "ddp":
        out = {}
        for s, st in stages.items():
            experts = expert_units(st, reduce)
            out[s] = FSDP(st, compute, reduce_dtype=reduce_dtype, mesh=mesh, dims=("dp", "cp"), reduce_dims=reduce,
                          units=list(st.part.blocks) + list(experts), unit_dims=experts, divisor=1,
                          shard_size=layout.shard_size, zeropp=layout.zeropp, gpus_per_node=layout.gpus_per_node)
        return out, None, None
    params = list({id(q): q for st in stages.values() for q in st.parameters()}.values())
    if layout.zero in (1, 2):                         # ZeRO-1/2: DDP's replicas, the optimizer sharded
        if compute is not None:
            for st in stages.values():
                cast_buffers(st, compute)
        zero = ZeroSync(params, mesh, reduce, layout.zero, compute=compute, reduce=reduce_dtype,
                        accumulate=accumulates(layout.precision),
                        chunks=chunk_of(stages) if layout.grad_reduce != "step" else None)
        return dict(stages), zero, None
    dims = {id(q): reduce[id(q)] for q in params}
    master = None
    if compute is not None:
        master = MasterWeights(params, compute, reduce_dtype, accumulate=accumulates(layout.precision))
        for st in stages.values():
            cast_buffers(st, compute)
        if master.reduce_on_master:
            dims = {id(master.of[i]): d for i, d in dims.items()}
            params = master.parameters()
    params = [q for q in params if dims[id(q)]]
    return dict(stages), (GradSync(params, mesh, divisor=1, dims=dims) if params else None), master


def expert_units(stage, reduce) -> dict:
    """{each block's experts (EP's :class:`LocalExperts`): the dims FSDP shards them over}: every
    rank holding them (their gradient's dims: "edp" and the stage dims outside the fold; w2's
    bias, also summed over "etp", sums its shard after). torchtitan: ``fully_shard(block.moe.
    experts, mesh=...)`` on the experts' own mesh, before ``fully_shard(block)``."""
    out = {}
    for block in stage.part.blocks:
        moe = getattr(getattr(block, "mlp", None), "moe", None)
        if isinstance(moe, ExpertParallelMoE):
            dims = [reduce[id(q)] for q in moe.experts.parameters()]
            out[moe.experts] = tuple(d for d in dims[0] if all(d in ds for ds in dims))
    return out


def chunk_of(stages) -> dict:
    """{id(parameter): the pipeline chunk (stage) that holds it}, for ZeRO's reductions chunk by
    chunk; a parameter of two chunks, or a tied embedding (summed over the pipeline after the
    schedule), belongs to none."""
    seen = {}
    for s, st in stages.items():
        for q in st.parameters():
            seen.setdefault(id(q), set()).add(s)
    tied = set()
    for st in stages.values():
        if st.part.config.tie_embeddings:
            tied |= {id(mod.weight) for mod in (getattr(st.part, "tok_emb", None), getattr(st.part, "lm_head", None))
                     if mod is not None}
    return {i: next(iter(s)) for i, s in seen.items() if len(s) == 1 and i not in tied}


def placements(stages, modules, mesh, before) -> dict:
    """{single-device name: :class:`Placement`} of this rank's parameters: ``before`` ({stage:
    {local name: (TP slice, copies, reduce dims)}}, read before FSDP replaced the tensors), FSDP's rows."""
    sizes, out = dict(mesh.sizes, ep=mesh.ep), {}
    for s, st in stages.items():
        rows = _fsdp_rows(modules[s]) if isinstance(modules[s], FSDP) else {}
        for local, q in st.part.named_parameters(remove_duplicate=False):
            where, copies, reduce = before[s][local]
            start, held, cut, shard = rows.get(id(q), (None, None, tuple(q.shape), ()))
            shape = tuple(where[3] if where and i == where[0] else n for i, n in enumerate(cut))
            replicated = tuple(d for d in reduce if d not in shard) + \
                (("tp",) if sizes["tp"] > 1 and (where is None or copies > 1) and "tp" not in reduce
                 and "edp" not in reduce else ())       # an expert: its copies are its reduce dims
            out[_model_name(local, st, mesh)] = Placement(shape, where, copies, shard,
                                                          None if start is None else (start, held), reduce,
                                                          replicated)
    return out


def _fsdp_rows(fsdp: FSDP) -> dict:
    """{id(shard parameter): (first global row, rows held, shape FSDP cut, the dims its unit shards
    over)}: rank r of the unit's group holds rows r*c..."""
    return {id(piece): (unit.rank * slot.chunk, slot.rows, tuple(slot.shape), unit.dims)
            for unit in fsdp.units for piece, slot in zip(unit.pieces, unit.slots)}


class NDParallel(PipelineRuntime):
    """The tiny GPT on a :class:`Mesh`, cut by :func:`parallelize_nd` as ``layout`` says;
    :meth:`step` takes the GLOBAL batch. With pp = 1 the schedule is plain gradient
    accumulation over ``layout.microbatches``. ``placements``: {single-device name:
    :class:`Placement`} of this rank's parameters."""

    def __init__(self, stages, mesh, layout, *, modules, grad_sync, placements, master=None):
        super().__init__(stages, mesh, schedule=layout.schedule, microbatches=layout.microbatches, v=layout.v,
                         modules=modules, grad_sync=grad_sync, master=master,
                         act_dtype=check_precision(layout.precision)[0])
        self.cfg, self.sizes = next(iter(stages.values())).part.config, dict(mesh.sizes, ep=mesh.ep)
        self.layout, self.placements = layout, placements
        self.sp, self.cp_layout = layout.sp and mesh.sizes["tp"] > 1, layout.cp_layout
        self.zero = grad_sync if isinstance(grad_sync, ZeroSync) else None   # ZeRO-1/2's sums and gathers
        if self.zero is not None and layout.grad_reduce != "step":   # chunk by chunk, in the schedule
            self.zero.reduce_in_rounds(layout.grad_reduce)
            self.runner.gradients_done = self.zero.gradients_done
            self.runner.gradients_starting = self.zero.gradients_starting

    def parameters(self):
        """This rank's parameters for the optimizer: under ZeRO-1/2 the slices it owns."""
        return self.zero.parameters() if self.zero else super().parameters()

    def local_batch(self, x, y, doc_ids=None):
        """This rank's part of the global batch: its DP rows, its CP tokens; + the positions."""
        c, s = self.mesh.coord, self.sizes
        rule_batch(len(x), s["dp"], self.m)
        x, y = x.chunk(s["dp"])[c["dp"]], y.chunk(s["dp"])[c["dp"]]
        pos = None
        if s["cp"] > 1:
            at = "cpu" if x.is_meta else x.device       # (a dry run's tokens have no values; positions do)
            pos = shard_positions(x.shape[1], s["cp"], c["cp"], self.cp_layout, at, doc_ids)
            x, y = x[:, pos], y[:, pos]
        return x, y, pos

    def step(self, x, y, doc_ids=None):
        """Forward and backward of the GLOBAL batch ``x``, ``y`` (batch, seq) (the same tensors on
        every rank; each takes its part), then every gradient sum the layout needs. Returns the
        step's loss (the single-device value, on every rank). ``doc_ids`` (seq,): the packing of
        every row (``TinyGPT(..., doc_ids=)``), no attention across documents."""
        n_tokens = int((y != -100).sum())
        device = self.parameters()[0].device
        doc_ids = rule_doc_ids(doc_ids, x.shape[1], self.cfg.seq_len, self.cp_layout, self.sizes["cp"])
        doc_ids = None if doc_ids is None else doc_ids.to("cpu" if device.type == "meta" else device)   # (as positions)
        x, y, pos = self.local_batch(x.to(device), y.to(device), doc_ids)
        if self.zero:           # the parameters the optimizer's slices hold; last step's gradients gone
            self.zero.begin_step()
        for st in self.stages.values():
            st.positions, st.doc_ids = pos, doc_ids
            for block in st.part.blocks:
                if hasattr(getattr(block, "mlp", None), "aux_weight"):  # one of dp * m routing groups
                    block.mlp.aux_weight = 1.0 / (self.sizes["dp"] * self.m)
                    if isinstance(block.mlp.moe, ExpertParallelMoE):   # its tokens' places in their group
                        block.mlp.moe.token_index = self.token_index(x, pos)
        seq = x.shape[1] // (self.sizes["tp"] if self.sp else 1)        # (b/m, s/cp[/tp], h) handed on
        return super().step(list(x.chunk(self.m)), list(y.chunk(self.m)), n_tokens,
                            act_shape=(len(x) // self.m, seq, self.cfg.hidden))

    def token_index(self, x, pos):
        """Where this rank's MoE tokens sit in their routing group (one micro-batch): CP's
        positions, then the sequence-parallel chunk (:func:`~course_lib.parallel.expert_parallel.token_index`)."""
        c, s = self.mesh.coord, self.sizes
        seq = x.shape[1] * s["cp"]
        at = "cpu" if x.is_meta else x.device          # (index arithmetic: on a dry run, on the host)
        pos = torch.arange(seq, device=at) if pos is None else pos
        return token_index(len(x) // self.m, seq, pos, s["tp"] if self.sp else 1, c["tp"])

    def named_parameters(self):
        """{name in the single-device model: this rank's parameter}, its ``.grad`` this rank's
        gradient (a TP slice, an FSDP shard: :attr:`placements` says where it sits)."""
        out = {}
        for st in self.stages.values():
            for local, q in st.part.named_parameters(remove_duplicate=False):
                out[_model_name(local, st, self.mesh)] = self.master.of[id(q)] if self.master else q
        return out

    def shards(self, grads: bool = False) -> dict:
        """{name in the single-device model: (tensor, Placement)}: this rank's parameters, full
        along FSDP's dims, with where they sit in the single-device tensor (see :func:`assemble_nd`).
        ``grads=True``: their gradients instead (zeros where none), once summed (after
        :meth:`step`); DDP only, FSDP keeps gradient shards."""
        out = {}
        if self.zero and not grads:     # the slices the optimizer updated, gathered (every rank calls it)
            self.zero.gather()
        for s, st in self.stages.items():
            mod = self.modules[s]
            if grads and (isinstance(mod, FSDP) or self.zero):
                raise ValueError("shards(grads=True) needs full gradients: FSDP and ZeRO-1/2 keep each rank's "
                                 "shard only")
            full = mod.gather_full_params() if isinstance(mod, FSDP) else None
            for local, q in st.part.named_parameters(remove_duplicate=False):
                q = self.master.of[id(q)] if self.master else q       # mixed precision: the master
                if grads:
                    value = torch.zeros_like(q) if q.grad is None else q.grad
                else:
                    value = q.detach() if full is None else full["part." + local]
                name = _model_name(local, st, self.mesh)
                out[name] = (value.clone(), self.placements[name])
        return out


def _model_name(local, st, mesh):
    """A stage's parameter name -> its name in the single-device model: ``blocks.j`` renumbered
    to the model's layer; an EP rank's j-th local expert -> its single-device index."""
    name = st.model_name(local)
    if ".moe.experts." not in name or mesh.ep == 1:
        return name
    head, rest = name.split(".moe.experts.", 1)
    j, tail = rest.split(".", 1)
    local_experts = st.part.config.n_experts // mesh.ep
    return f"{head}.moe.experts.{mesh.coord['ep'] * local_experts + int(j)}.{tail}"


def assemble_nd(per_rank, shape: MeshShape) -> dict:
    """The single-device state from every rank's :meth:`NDParallel.shards` (in rank order):
    pipeline stages and experts side by side, tensor-parallel slices concatenated (by each
    :class:`Placement`), one copy of what DP / CP replicate (checked equal to its copies,
    within float rounding)."""
    pieces = {}
    for rank, shards in enumerate(per_rank):
        c = shape.coords(rank)
        for name, (value, where) in shards.items():
            if ".moe.experts." in name:   # an expert: copies across edp and the dims outside the fold
                copy = (c["edp"],) + tuple(c[d] for d in ("dp", "cp", "tp") if d not in shape.fold)
                pieces.setdefault(name, {}).setdefault(copy, {})[c["etp"]] = (value, where)
            else:
                pieces.setdefault(name, {}).setdefault((c["dp"], c["cp"]), {})[c["tp"]] = (value, where)
    full = {}
    for name, replicas in pieces.items():
        tensors = [assemble_tp(list(by_tp.values())) for by_tp in replicas.values()]
        worst = max(float((t - tensors[0]).abs().max()) for t in tensors) if tensors[0].numel() else 0.0
        if worst > 1e-4 * (1 + float(tensors[0].abs().max())):
            raise AssertionError(f"{name}: the DP / CP copies differ by {worst:.3g}: a gradient was not summed "
                                 f"over every dimension its parameter is replicated on")
        full[name] = tensors[0]
    return full


__all__ = ["check_layout", "parallelize_nd", "apply_tp", "apply_cp", "apply_ep", "mark_reduce_dims",
           "apply_data_parallel", "expert_units", "data_dims", "placements", "NDParallel", "assemble_nd", "Layout",
           "Placement",
           "DATA", "SCHEDULES"]
