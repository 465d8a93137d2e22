"""Pipeline parallelism: the layers cut into stages, one (or v) per rank, micro-batches in flight.

    pipe = PipelineParallel(TinyGPT(cfg, seed=0), Mesh(dp=2, pp=2), schedule="1f1b", microbatches=4)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    loss = pipe.step(x, y, n_tokens)     # this DP replica's batch; the loss of the whole step
    opt.step(); opt.zero_grad()

* :func:`partition_layers`, :func:`gpt_stage`, :class:`MLPStage`: the model in stages
  (stage 0 also embeds, the last stage also holds the norm, the head and the loss);
* :func:`naive_model_parallel_step`: one batch, one stage busy at a time;
* :class:`PipelineParallel`: a schedule (``schedules.py``, checked by ``validate`` on every
  rank before anything runs) executed by ``pipeline_executor.run_schedule``, then the
  gradient sums the layout needs: the tied embedding over its two stages (Megatron-LM's
  "embedding group": the first and last stage ranks), then data parallelism (GradSync).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import trace
from course_lib.collectives.comm import Comm, TrafficCounter
from course_lib.parallel.grad_sync import GradSync
from course_lib.parallel.mesh import set_reduce_dims
from course_lib.parallel.pipeline_executor import run_schedule
from course_lib.parallel.schedules import make_schedule, schedule_name, validate


def partition_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous, balanced: the first ``n_layers % n_stages`` stages get one layer more."""
    if n_stages > n_layers:
        raise ValueError(f"more pipeline stages ({n_stages}) than layers ({n_layers}): every stage needs a layer")
    q, r = divmod(n_layers, n_stages)
    starts = [i * q + min(i, r) for i in range(n_stages + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(n_stages)]


class GPTStage(nn.Module):
    """Stage ``stage`` of ``n_stages`` of a TinyGPT: a copy that keeps only its blocks (and
    the embedding on the first stage, the final norm + head on the last). Its methods are
    the model's own (``embed``, ``blocks``, ``head``), so the arithmetic is the same."""

    def __init__(self, model, stage: int, n_stages: int):
        super().__init__()
        layers = partition_layers(len(model.blocks), n_stages)[stage]
        self.first, self.last = stage == 0, stage == n_stages - 1
        part = copy.deepcopy(model)             # a tied lm_head stays tied to tok_emb inside it
        part.blocks = nn.ModuleList(part.blocks[i] for i in layers)
        if not self.first:
            part.tok_emb = None
            if hasattr(part, "pos_emb"):
                part.pos_emb = None
        if not self.last:
            part.norm = part.lm_head = None
        self.part, self.layers = part, layers

    def forward(self, x):  # first: idx (b, s) int64, else (b, s, h) -> (b, s, h); last: logits
        if self.first:
            x = self.part.embed(x)
        for block in self.part.blocks:
            x = block(x)
        return self.part.head(x) if self.last else x

    def loss(self, logits, targets, n_tokens):
        return self.part.loss(logits, targets, n_tokens)

    def named_in_model(self) -> dict:
        """{name in the whole model: parameter} (``blocks.j`` renumbered to the model's layer)."""
        out = {}
        for name, q in self.part.named_parameters(remove_duplicate=False):
            if name.startswith("blocks."):
                _, j, rest = name.split(".", 2)
                name = f"blocks.{self.layers[int(j)]}.{rest}"
            out[name] = q
        return out


def gpt_stage(model, stage: int, n_stages: int) -> GPTStage:
    return GPTStage(model, stage, n_stages)


def rank_stages(model, rank: int, p: int, v: int = 1, stage_cls=GPTStage) -> dict:
    """{virtual stage: stage_cls} of pp rank ``rank``: stages rank, rank + p, ... of p * v. Each is
    a copy of the model, so where the first and the last stage both live on this rank (p = 1
    with v > 1 chunks), a tied embedding / LM head would become two matrices training apart:
    they are made one parameter again, as in the model (autograd adds both stages' gradients)."""
    n_stages = p * v
    stages = {s: stage_cls(model, s, n_stages) for s in range(rank, n_stages, p)}
    if model.config.tie_embeddings and n_stages > 1 and 0 in stages and n_stages - 1 in stages:
        stages[n_stages - 1].part.lm_head.weight = stages[0].part.tok_emb.weight
    return stages


def _check_chunks(v, schedule):
    """v: an integer >= 1, and > 1 only for the interleaved schedule (or an explicit action list).
    Returns the schedule, a name in the course's spelling."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"v (chunks per rank) must be an integer >= 1, got {v!r}")
    return schedule_name(schedule, v) if isinstance(schedule, str) else schedule


class MLPStage(nn.Module):
    """Layers [a, b) of a course_lib ``MLP``. The model applies ReLU after every layer but
    its last, so a stage that ends inside the model must END with a ReLU: a split that
    drops it at the cut computes another function (one of the course's source notes does)."""

    def __init__(self, mlp, layers: range, keep_relu_at_cut: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(mlp.layers[i]) for i in layers)
        self.relu_after = [i < len(mlp.layers) - 1 for i in layers]
        if not keep_relu_at_cut:                    # the bug, kept to show what it changes
            self.relu_after[-1] = False

    def forward(self, x):  # (batch, in) -> (batch, out)
        for layer, relu in zip(self.layers, self.relu_after):
            x = layer(x)
            x = F.relu(x) if relu else x
        return x


def naive_model_parallel_step(stage, comm, x, y, loss_fn, act_shape):
    """Model parallelism without micro-batches: rank r waits for rank r-1's activation, runs
    its layers, sends on; the last rank computes the loss and the gradients walk back. One
    rank computes at a time. Returns the loss on the last rank (None elsewhere)."""
    r, p = comm.rank, comm.size
    if r > 0:
        x = torch.empty(act_shape, device=next(stage.parameters()).device)
        with trace.span("recv activation", "comm", "pp"):
            comm.recv(x, r - 1)
        x.requires_grad_()
    with trace.span("forward", "compute", "pp"):
        out = stage(x)
    if r < p - 1:
        comm.send(out.detach().contiguous(), r + 1)        # activation forward
        grad = torch.empty_like(out)
        with trace.span("recv gradient", "comm", "pp"):
            comm.recv(grad, r + 1)                         # its gradient, back
        with trace.span("backward", "compute", "pp"):
            out.backward(grad)
        loss = None
    else:
        with trace.span("backward", "compute", "pp"):
            loss = loss_fn(out, y)
            loss.backward()
    if r > 0:
        comm.send(x.grad.contiguous(), r - 1)              # gradient of my input, back
    return None if loss is None else float(loss.detach())


def embedding_group(mesh):
    """Megatron-LM's embedding group: the first and last stage ranks of every (dp, cp, tp), which
    both hold the tied embedding / LM-head matrix. Made by the mesh with its other groups;
    a Comm on those two ranks, None elsewhere."""
    return mesh.embedding_comm()


def sum_tied_gradient(comm, stages):
    """First stage: the embedding's gradient; last stage: the LM head's, the same matrix.
    Both apply the sum, so both copies stay equal."""
    if comm is None:
        return
    st = stages[min(stages)] if min(stages) == 0 else stages[max(stages)]
    w = st.part.tok_emb.weight if st.first else st.part.lm_head.weight
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    comm.all_reduce(w.grad)


class PipelineParallel:
    """A TinyGPT cut into p * v stages along the mesh's "pp" dimension, trained by a schedule.

    schedule: "gpipe", "1f1b", "interleaved" (v chunks per rank), "zb-h1" (any case; torch's
        "GPipe", "1F1B", "Interleaved1F1B" too), or an explicit action list per pp rank
        (``schedules``), validated before it runs. v > 1 with another schedule: ValueError.
    microbatches: m; each DP replica's batch is cut into m equal micro-batches.
    """

    def __init__(self, model, mesh, schedule="1f1b", microbatches: int = 4, v: int = 1):
        p, m = mesh.sizes["pp"], microbatches
        self.mesh, self.p, self.m, self.v = mesh, p, m, v
        schedule = _check_chunks(v, schedule)                   # a name: the course's spelling
        n_stages = p * v
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"microbatches must be an integer >= 1, got {m!r}")
        partition_layers(len(model.blocks), n_stages)           # more stages than layers: ValueError
        if isinstance(schedule, str):
            schedule = make_schedule(schedule, p, m, self.v)      # m that a schedule refuses: ValueError
        self.schedule = validate(schedule, p, m, self.v)        # every rank checks the whole schedule
        me = mesh.coord["pp"]
        self.stages = rank_stages(model, me, p, v)             # tied on one rank: one parameter
        self.comm = Comm(mesh.group("pp"), TrafficCounter(), dim="pp")
        self.tied = bool(model.config.tie_embeddings) and p > 1
        self.embedding_comm = embedding_group(mesh) if self.tied else None
        params = self.parameters()
        for q in params:
            set_reduce_dims(q, ("dp",))
        self.grad_sync = GradSync(params, mesh, divisor=1) if mesh.sizes["dp"] > 1 else None
        self.last_result = None

    def parameters(self):
        seen = {}
        for st in self.stages.values():
            for q in st.parameters():
                seen.setdefault(id(q), q)
        return list(seen.values())

    def step(self, x, y, n_tokens: int):
        """Forward + backward of every micro-batch by the schedule, then the gradient sums.
        x, y: (batch, seq) of this DP replica; n_tokens: the step's GLOBAL token count.
        Returns the loss of the whole step (the same on every rank)."""
        if len(x) % self.m:
            raise ValueError(f"a batch of {len(x)} rows does not cut into microbatches={self.m} equal ones")
        xs, ys = list(x.chunk(self.m)), list(y.chunk(self.m))
        last = self.stages.get(self.p * self.v - 1)
        b = len(xs[0])
        hidden = next(iter(self.stages.values())).part.config.hidden
        res = run_schedule(self.schedule, self.stages, self.comm, p=self.p, m=self.m, v=self.v,
                           inputs=xs, targets=ys, act_shape=(b, x.shape[1], hidden),
                           loss_fn=(lambda out, t: last.loss(out, t, n_tokens)) if last else None)
        self.last_result = res
        sum_tied_gradient(self.embedding_comm, self.stages)    # tied: sum the two stages' parts
        if self.grad_sync is not None:
            self.grad_sync.start()
            self.grad_sync.finish()
        loss = torch.tensor([sum(res.losses.values())], dtype=torch.float64,
                            device=self.parameters()[0].device)          # NCCL talks in GPU tensors
        # only the last stages hold losses, each its replica's (sum / global tokens): sum them all
        self.mesh.comm(("dp", "pp", "cp")).all_reduce(loss, name="all-reduce loss")
        return float(loss)


TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble"}


class TorchPipeline:
    """The same stages run by ``torch.distributed.pipelining`` (PipelineStage + its schedule
    of the same name, :class:`PipelineParallel`'s names), for side-by-side checks and timings.
    Gradients are not rescaled (``scale_grads=False``): our loss is already divided by the
    global token count. torch's schedules leave a tied weight to the caller: we sum it as ours
    do (:func:`sum_tied_gradient`; on one rank it is one parameter, :func:`rank_stages`)."""

    def __init__(self, model, mesh, schedule="1f1b", microbatches: int = 4, v: int = 1):
        from torch.distributed import pipelining
        p, me = mesh.sizes["pp"], mesh.coord["pp"]
        schedule = _check_chunks(v, schedule)
        if not isinstance(schedule, str):
            raise ValueError(f"TorchPipeline runs torch's schedules by name, one of {tuple(TORCH_SCHEDULES)}; "
                             f"got {type(schedule).__name__}")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")
        self.v, self.m = v, microbatches
        n_stages = p * v
        partition_layers(len(model.blocks), n_stages)
        self.stages = rank_stages(model, me, p, v)
        self.torch_stages = [pipelining.PipelineStage(st, s, n_stages, torch.device("cpu"), group=mesh.group("pp"))
                             for s, st in self.stages.items()]
        self.n_tokens = None
        last = self.stages.get(n_stages - 1)
        cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
        multi = schedule in ("interleaved", "zb-h1")
        self.schedule = cls(self.torch_stages if multi else self.torch_stages[0], microbatches,
                            loss_fn=lambda out, t: last.loss(out, t, self.n_tokens),   # every rank: it
                            scale_grads=False)                                  # tells torch to run backward
        self.is_first, self.is_last = 0 in self.stages, last is not None
        self.tied_comm = embedding_group(mesh) if model.config.tie_embeddings and p > 1 else None

    def parameters(self):
        return list({id(q): q for st in self.stages.values() for q in st.parameters()}.values())

    def step(self, x, y, n_tokens: int):
        """Returns the sum of this rank's micro-batch losses (0 where the last stage is not).
        x, y: the batch, on every rank (each checks that it cuts into the micro-batches: torch
        fails on the last stage only, leaving the others waiting)."""
        if len(x) % self.m or len(y) != len(x):
            raise ValueError(f"a batch of {len(x)} rows (targets: {len(y)}) does not cut into "
                             f"microbatches={self.m} equal ones")
        self.n_tokens, losses = n_tokens, []
        args = (x,) if self.is_first else ()
        self.schedule.step(*args, target=y if self.is_last else None, losses=losses)
        sum_tied_gradient(self.tied_comm, self.stages)
        return float(sum(loss.detach() for loss in losses)) if losses else 0.0


__all__ = ["TorchPipeline", "rank_stages", "embedding_group", "sum_tied_gradient", "partition_layers", "GPTStage", "gpt_stage", "MLPStage", "naive_model_parallel_step",
           "PipelineParallel"]
