"""N-D parallelism: one function that cuts the tiny GPT along every dimension of a mesh.

    check_layout(cfg, dp=2, pp=2, cp=2, tp=2, batch=8, microbatches=2)   # before any rank starts
    net = parallelize_nd(TinyGPT(cfg, seed=0), Mesh(dp=2, pp=2, cp=2, tp=2), microbatches=2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    loss = net.step(x, y)          # the GLOBAL batch (the same on every rank): the step's loss
    opt.step(); opt.zero_grad()

The order is torchtitan's (``parallelize_llama`` + ``pipeline_llama``), each step one of the
earlier chapters, applied to the same single-device model on every rank:

1. **PP** cuts the layers into stages; this rank keeps the stages of its "pp" coordinate.
2. **TP** (+ SP) splits each stage's matrices over "tp" (:func:`~course_lib.parallel.tp_plan.parallelize`).
3. **CP** makes each attention a ring (or Ulysses) over "cp": a rank holds ``s / cp`` tokens.
4. **EP** (MoE variant) keeps ``E / ep`` experts per rank, tokens dispatched over "ep" (inside dp).
5. **DP**: every gradient is summed over the dimensions where its parameter is replicated and
   sees other data: ("dp", "cp") for all, + "tp" for sequence-parallel norms, ("edp", "cp")
   for experts (:class:`~course_lib.parallel.grad_sync.GradSync`), or **FSDP** shards each stage
   over ("dp", "cp") (torchtitan's ``dp_shard_cp``) and reduce-scatters instead.

The loss is a sum over each rank's tokens divided by the global token count, so no gradient
is ever divided by a degree: the sums ARE the single-device gradients.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from course_lib.collectives.comm import Comm, TrafficCounter
from course_lib.parallel.context_parallel import LAYOUTS, context_parallel, shard_positions
from course_lib.parallel.expert_parallel import ExpertParallelMoE
from course_lib.parallel.fsdp import FSDP
from course_lib.parallel.grad_sync import GradSync
from course_lib.parallel.mesh import DIMS, MeshShape, get_reduce_dims, set_reduce_dims
from course_lib.parallel.pipeline import GPTStage, partition_layers, sum_tied_gradient
from course_lib.parallel.pipeline_executor import run_schedule
from course_lib.parallel.schedules import make_schedule, validate
from course_lib.parallel.tensor_parallel import head_rows
from course_lib.parallel.tp_plan import parallelize

DATA = ("ddp", "fsdp")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def check_layout(cfg, *, dp=1, pp=1, cp=1, tp=1, ep=1, world_size=None, batch=None, microbatches=1, v=1,
                 schedule="1f1b", sequence_parallel=True, cp_method="ring", cp_layout="zigzag",
                 data="ddp") -> MeshShape:
    """Every constraint the layout puts on the model and the batch, checked in plain arithmetic
    (no process group: call it before starting ranks). ValueError naming the first violated one;
    returns the :class:`MeshShape`."""
    shape = MeshShape(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep)
    if world_size is not None and world_size != shape.world_size:
        raise ValueError(f"the layout dp*pp*cp*tp = {dp}*{pp}*{cp}*{tp} = {shape.world_size} ranks, but the "
                         f"world size is {world_size}: the product of the dimensions must equal it")
    if data not in DATA:
        raise ValueError(f"data must be one of {DATA}, got {data!r}")
    if isinstance(schedule, str) and schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES} (or an action list), got {schedule!r}")
    if cp_method not in ("ring", "ulysses") or cp_layout not in LAYOUTS:
        raise ValueError(f"cp_method must be 'ring' or 'ulysses' and cp_layout one of {LAYOUTS}, "
                         f"got {cp_method!r}, {cp_layout!r}")
    for name, value in (("microbatches", microbatches), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    v = v if schedule == "interleaved" else 1
    partition_layers(cfg.n_layers, pp * v)                    # more stages than layers: ValueError
    if isinstance(schedule, str):
        make_schedule(schedule, pp, microbatches, v)          # m a schedule refuses: ValueError
    if tp > 1:
        head_rows(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, tp, 0)   # heads (and K/V heads) over tp
        if cfg.n_experts:
            raise ValueError("the MoE variant's experts are not tensor-parallel here: split them with ep "
                             "(inside dp) and keep tp=1")
        if cfg.ffn_hidden % tp:
            raise ValueError(f"the MLP width {cfg.ffn_hidden} is not divisible by tp={tp}")
        if cfg.vocab_size < tp:
            raise ValueError(f"a vocabulary of {cfg.vocab_size} rows cannot be split over tp={tp}")
    tokens = cfg.seq_len
    if cp > 1:
        parts = 2 * cp if cp_layout == "zigzag" else cp
        if cfg.seq_len % parts:
            raise ValueError(f"context parallelism ({cp_layout}) cuts the sequence into {parts} chunks: "
                             f"seq_len={cfg.seq_len} must be divisible by {parts}")
        if cp_method == "ulysses" and (cfg.n_heads // tp % cp or cfg.n_kv_heads < tp * cp):
            raise ValueError(f"Ulysses over cp={cp} needs the local heads ({cfg.n_heads}/tp={tp}) and K/V "
                             f"heads divisible by cp")
        if cfg.n_experts:
            raise ValueError("the MoE variant routes each rank's tokens as one group: keep cp=1 with experts "
                             "(a CP shard is not a contiguous group of the single-device batch)")
        if cfg.dropout:
            raise ValueError("context parallelism here has no attention dropout (Llama trains without)")
        tokens = cfg.seq_len // cp
    if tp > 1 and sequence_parallel and tokens % tp:
        raise ValueError(f"sequence parallelism splits each rank's {tokens} tokens over tp={tp}: not divisible")
    if ep > 1:
        if not cfg.n_experts:
            raise ValueError(f"ep={ep} splits experts, but the model has none (GPTConfig(n_experts=...))")
        if cfg.n_experts % ep:
            raise ValueError(f"the number of experts ({cfg.n_experts}) must be divisible by ep={ep}")
    if data == "fsdp" and schedule == "zb-h1":
        raise ValueError("zb-h1 computes weight gradients outside autograd: it does not run under FSDP here "
                         "(use data='ddp')")
    if data == "fsdp" and cfg.tie_embeddings and pp > 1:
        raise ValueError("a tied embedding split over two pipeline stages is summed between them; with FSDP "
                         "that is not supported here: untie it or use data='ddp'")
    if batch is not None:
        if batch % dp:
            raise ValueError(f"the global batch ({batch} sequences) must be divisible by dp={dp}")
        if (batch // dp) % microbatches:
            raise ValueError(f"each DP replica's {batch // dp} sequences must cut into microbatches="
                             f"{microbatches} equal ones")
    return shape


class NDStage(GPTStage):
    """A pipeline stage whose layers see their tokens' absolute positions (context parallelism:
    a rank holds a zigzag shard of the sequence). ``positions`` is set per step."""

    positions = None

    def forward(self, x):  # first: idx (b, s/cp); else (b, s/cp[/tp], h); last: logits (b, s/cp, V[/tp])
        if self.first:
            x = self.part.embed(x, self.positions)
        for block in self.part.blocks:
            x = block(x, self.positions)
        return self.part.head(x) if self.last else x.contiguous()   # sent as is: recv buffers are dense


def _data_dims(p, sizes, fsdp):
    """The dims ``p``'s gradient is summed over: its marks (tensor / expert parallelism) plus
    "cp" (every CP rank sees other tokens) and "dp" (or "edp" for an expert). Dims of size 1
    are left out (nothing to sum) unless FSDP shards over them."""
    marks = set(get_reduce_dims(p, ("dp",)))
    dims = marks | {"cp"} | ({"dp"} if "edp" not in marks else set())
    keep = {"dp", "cp"} if fsdp else set()
    order = DIMS + ("edp",)
    size = {"edp": sizes["dp"] // sizes.get("ep", 1), **sizes}
    return tuple(d for d in order if d in dims and (size[d] > 1 or d in keep))


class NDParallel:
    """The tiny GPT on a :class:`Mesh`, cut along all its dimensions (see the module docstring).

    schedule: pipeline schedule ("1f1b", "gpipe", "interleaved" with ``v``, "zb-h1"); with pp = 1
        it is plain gradient accumulation over ``microbatches``.
    sequence_parallel: TP's activations between regions split along the sequence.
    data: "ddp" (GradSync after the schedule) or "fsdp" (each stage sharded over ("dp", "cp")).
    """

    def __init__(self, model, mesh, *, microbatches=1, schedule="1f1b", v=1, sequence_parallel=True,
                 cp_method="ring", cp_layout="zigzag", data="ddp", seed=0):
        cfg = model.config
        sizes = dict(mesh.sizes, ep=mesh.ep)
        check_layout(cfg, **sizes, microbatches=microbatches, v=v, schedule=schedule,
                     sequence_parallel=sequence_parallel, cp_method=cp_method, cp_layout=cp_layout, data=data)
        self.mesh, self.cfg, self.sizes, self.m = mesh, cfg, sizes, microbatches
        self.p, self.v = sizes["pp"], (v if schedule == "interleaved" else 1)
        self.sp, self.cp_layout, self.data = sequence_parallel and sizes["tp"] > 1, cp_layout, data
        n_stages = self.p * self.v
        me = mesh.coord["pp"]
        # 1. PP: this rank's stages (copies of the model keeping their layers)
        stages = {s: NDStage(model, s, n_stages) for s in range(me, n_stages, self.p)}
        both_ends = bool(cfg.tie_embeddings) and n_stages > 1 and 0 in stages and n_stages - 1 in stages
        if both_ends and data == "fsdp":  # (pp = 1 with v > 1 chunks) one weight in two FSDP units
            raise ValueError("tied embeddings with the first and the last stage on one rank (pp=1, v>1) "
                             "need data='ddp': FSDP would shard the one weight twice")
        for st in stages.values():
            if sizes["tp"] > 1:                            # 2. TP (+ SP)
                parallelize(st.part, mesh, sequence_parallel=self.sp, seed=seed)
            if sizes["cp"] > 1:                            # 3. CP
                context_parallel(st.part, mesh.comm("cp"), cp_method, cp_layout)
            self._experts(st, mesh, sizes)                 # 4. EP
            for q in st.parameters():                      # 5. the dims each gradient is summed over
                set_reduce_dims(q, _data_dims(q, sizes, data == "fsdp"))
        if both_ends:   # the stages are copies: the embedding and the head become one weight again
            stages[n_stages - 1].part.lm_head.weight = stages[0].part.tok_emb.weight
        self.stages = stages
        self._tp_shard = {s: {local: getattr(q, "tp_shard", None)            # before FSDP replaces them
                              for local, q in st.part.named_parameters(remove_duplicate=False)}
                          for s, st in stages.items()}
        self.schedule = validate(make_schedule(schedule, self.p, microbatches, self.v)
                                 if isinstance(schedule, str) else schedule, self.p, microbatches, self.v)
        self.pp_comm = Comm(mesh.group("pp"), TrafficCounter(), dim="pp")
        self.tied = bool(cfg.tie_embeddings) and self.p > 1
        self.embedding_comm = mesh.embedding_comm() if self.tied else None
        if data == "fsdp":
            dims = ("dp", "cp")
            self.modules = {s: FSDP(st, mesh=mesh, dims=dims, units=list(st.part.blocks), divisor=1)
                            for s, st in stages.items()}
            self.grad_sync = None
        else:
            self.modules = dict(stages)
            params = [q for q in self.parameters() if get_reduce_dims(q, ())]
            self.grad_sync = GradSync(params, mesh, divisor=1) if params else None
        self.last_result = None

    @staticmethod
    def _experts(st, mesh, sizes):
        """MoE variant: each block's experts split over "ep"; every call routes this rank's tokens
        as one group, its load-balancing loss weighted by its share of the step's tokens."""
        for block in st.part.blocks:
            mlp = getattr(block, "mlp", None)
            if mlp is not None and hasattr(mlp, "aux_weight"):
                if sizes["ep"] > 1:
                    mlp.moe = ExpertParallelMoE(mlp.moe, mesh)
                mlp.groups = 1

    def parameters(self):
        """This rank's parameters (shards where a dimension splits them), each once."""
        mods = getattr(self, "modules", self.stages)
        return list({id(q): q for mod in mods.values() for q in mod.parameters()}.values())

    def local_batch(self, x, y):
        """This rank's part of the global batch: its DP rows, its CP tokens; + the positions."""
        c, s = self.mesh.coord, self.sizes
        if len(x) % s["dp"] or (len(x) // s["dp"]) % self.m:
            raise ValueError(f"a global batch of {len(x)} sequences must cut into dp={s['dp']} replicas of "
                             f"microbatches={self.m} equal micro-batches")
        x, y = x.chunk(s["dp"])[c["dp"]], y.chunk(s["dp"])[c["dp"]]
        pos = None
        if s["cp"] > 1:
            pos = shard_positions(x.shape[1], s["cp"], c["cp"], self.cp_layout).to(x.device)
            x, y = x[:, pos], y[:, pos]
        return x, y, pos

    def step(self, x, y):
        """Forward and backward of the GLOBAL batch ``x``, ``y`` (batch, seq) (the same tensors on
        every rank; each takes its part), then every gradient sum the layout needs. Returns the
        step's loss (the single-device value, on every rank)."""
        n_tokens = int((y != -100).sum())
        device = self.parameters()[0].device
        x, y, pos = self.local_batch(x.to(device), y.to(device))
        for st in self.stages.values():
            st.positions = pos
        for st in self.stages.values():
            for block in st.part.blocks:
                if hasattr(getattr(block, "mlp", None), "aux_weight"):  # this call's share of the tokens
                    block.mlp.aux_weight = 1.0 / (self.sizes["dp"] * self.sizes["cp"] * self.m)
        xs, ys = list(x.chunk(self.m)), list(y.chunk(self.m))
        seq = x.shape[1] // (self.sizes["tp"] if self.sp else 1)
        last = self.stages.get(self.p * self.v - 1)
        res = run_schedule(self.schedule, self.modules, self.pp_comm, p=self.p, m=self.m, v=self.v,
                           inputs=xs, targets=ys, act_shape=(len(xs[0]), seq, self.cfg.hidden),
                           loss_fn=(lambda out, t: last.loss(out, t, n_tokens)) if last else None)
        self.last_result = res
        sum_tied_gradient(self.embedding_comm, self.stages)      # tied: the two stages' parts
        if self.grad_sync is not None:
            self.grad_sync.start()
            self.grad_sync.finish()
        for mod in self.modules.values():
            if isinstance(mod, FSDP):
                mod.finish_gradient_synchronization()
        loss = torch.tensor([sum(res.losses.values())], dtype=torch.float64, device=device)  # NCCL: on the GPU
        dims = tuple(d for d in ("dp", "pp", "cp") if self.sizes[d] > 1)
        if dims:  # the last stages hold the losses, each of its tokens / the global count
            self.mesh.comm(dims).all_reduce(loss, name="all-reduce loss")
        return float(loss)

    def shards(self) -> dict:
        """{name in the single-device model: (tensor, tp_shard)}: this rank's parameters, full
        along FSDP's dims, with where they sit in the single-device tensor (see :func:`assemble_nd`)."""
        out = {}
        for s, st in self.stages.items():
            mod = self.modules[s]
            full = mod.gather_full_params() if isinstance(mod, FSDP) else None
            for local, q in st.part.named_parameters(remove_duplicate=False):
                value = q.detach() if full is None else full["part." + local]
                out[_model_name(local, st, self.mesh)] = (value.clone(), self._tp_shard[s][local])
        return out


def _model_name(local, st, mesh):
    """A stage's parameter name -> its name in the single-device model: ``blocks.j`` renumbered
    to the model's layer; an EP rank's j-th local expert -> its single-device index."""
    name = local
    if name.startswith("blocks."):
        _, j, rest = name.split(".", 2)
        name = f"blocks.{st.layers[int(j)]}.{rest}"
    if ".moe.experts." not in name or mesh.ep == 1:
        return name
    head, rest = name.split(".moe.experts.", 1)
    j, tail = rest.split(".", 1)
    local_experts = st.part.config.n_experts // mesh.ep
    return f"{head}.moe.experts.{mesh.coord['ep'] * local_experts + int(j)}.{tail}"


def assemble_nd(per_rank, shape: MeshShape) -> dict:
    """The single-device state from every rank's :meth:`NDParallel.shards` (in rank order):
    pipeline stages and experts side by side, tensor-parallel slices concatenated, one copy of
    what DP / CP replicate (checked equal to its copies, within float rounding)."""
    pieces = {}
    for rank, shards in enumerate(per_rank):
        c = shape.coords(rank)
        for name, (value, where) in shards.items():
            pieces.setdefault(name, {}).setdefault((c["edp"], c["cp"]), {})[c["tp"]] = (value, where)
    full = {}
    for name, replicas in pieces.items():
        tensors = []
        for by_tp in replicas.values():
            first, where = by_tp[0]
            if where is None:
                tensors.append(first)
                continue
            dim, _, _, size = where
            out = first.new_zeros([size if i == dim else n for i, n in enumerate(first.shape)])
            for value, (_, start, stop, _) in by_tp.values():
                out.narrow(dim, start, stop - start).copy_(value)
            tensors.append(out)
        worst = max(float((t - tensors[0]).abs().max()) for t in tensors) if tensors[0].numel() else 0.0
        if worst > 1e-4 * (1 + float(tensors[0].abs().max())):
            raise AssertionError(f"{name}: the DP / CP copies differ by {worst:.3g}: a gradient was not summed "
                                 f"over every dimension its parameter is replicated on")
        full[name] = tensors[0]
    return full


def parallelize_nd(model, mesh, **kw) -> NDParallel:
    """``NDParallel(model, mesh, **kw)``: PP -> TP -> CP -> EP -> DP/FSDP, in torchtitan's order."""
    if not isinstance(model, nn.Module) or not hasattr(model, "blocks"):
        raise TypeError(f"parallelize_nd cuts a course_lib TinyGPT, got {type(model).__name__}")
    return NDParallel(model, mesh, **kw)


__all__ = ["check_layout", "NDStage", "NDParallel", "parallelize_nd", "assemble_nd", "DATA", "SCHEDULES"]
