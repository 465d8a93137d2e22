"""Pipeline parallelism: the layers cut into stages, one (or v) per rank, micro-batches in flight.

    pipe = PipelineParallel(TinyGPT(cfg, seed=0), Mesh(dp=2, pp=2), schedule="1f1b", microbatches=4)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    loss = pipe.step(x, y)     # the global batch on every rank (NDParallel's contract); its loss
    opt.step(); opt.zero_grad()

* :func:`partition_layers`, :class:`GPTStage`, :func:`split_stages`, :class:`MLPStage`: the
  model in stages (stage 0 also embeds, the last stage also holds the norm, the head and the loss);
* :func:`naive_model_parallel_step`: one batch, one stage busy at a time;
* :class:`PipelineParallel`: the stages, data parallelism around them, run by the one
  pipeline runtime (``pipeline_runtime``: schedule, tied embedding, gradient sums, loss);
* :class:`TorchPipeline`: the same stages run by ``torch.distributed.pipelining``.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import trace
from course_lib.parallel.grad_sync import GradSync
from course_lib.parallel.layout_rules import partition_layers, positive_int, rule_batch
from course_lib.parallel.mesh import set_reduce_dims
from course_lib.parallel.pipeline_runtime import PipelineRuntime, sum_tied_gradient
from course_lib.schedules import Action, schedule_name


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

    positions = None    # context parallelism: this rank's tokens' positions, set per step

    def forward(self, x):  # first: idx (b, s) int64, else (b, s, h) -> (b, s, h); last: logits
        if self.first:
            x = self.part.embed(x, self.positions)
        for block in self.part.blocks:
            x = block(x, self.positions)
        return self.part.head(x) if self.last else x.contiguous()    # sent as is: buffers are dense

    def loss(self, logits, targets, n_tokens):
        return self.part.loss(logits, targets, n_tokens)

    def model_name(self, local: str) -> str:
        """A name in this stage -> its name in the whole model (``blocks.j`` renumbered)."""
        if local.startswith("blocks."):
            _, j, rest = local.split(".", 2)
            return f"blocks.{self.layers[int(j)]}.{rest}"
        return local

    def named_in_model(self) -> dict:
        """{name in the whole model: parameter}."""
        return {self.model_name(n): q for n, q in self.part.named_parameters(remove_duplicate=False)}


def gpt_stage(model, stage: int, n_stages: int) -> GPTStage:
    return GPTStage(model, stage, n_stages)


def rank_stages(model, rank: int, p: int, v: int = 1) -> dict:
    """{virtual stage: GPTStage} of pp rank ``rank``: stages rank, rank + p, ... of p * v. Each is
    a copy of the model, so where the first and the last stage both live on this rank (p = 1
    with v > 1 chunks), a tied embedding / LM head would become two matrices training apart:
    they are made one parameter again, as in the model (autograd adds both stages' gradients)."""
    n_stages = p * v
    return tie_embeddings({s: GPTStage(model, s, n_stages) for s in range(rank, n_stages, p)}, n_stages)


def tie_embeddings(stages, n_stages):
    """Where this rank holds the first and the last stage of a tied model: the last stage's head
    becomes the first stage's embedding again (call it again after a dimension replaced them)."""
    st = next(iter(stages.values()))
    if st.part.config.tie_embeddings and n_stages > 1 and 0 in stages and n_stages - 1 in stages:
        stages[n_stages - 1].part.lm_head.weight = stages[0].part.tok_emb.weight
    return stages


def split_stages(model, mesh, v: int = 1) -> dict:
    """PP: this rank's stages of ``model`` cut into pp * v (:func:`rank_stages`)."""
    return rank_stages(model, mesh.coord["pp"], mesh.sizes["pp"], v)


def _check_chunks(v, schedule):
    """v: an integer >= 1, and > 1 only for the interleaved schedule (or an explicit action list).
    Returns the schedule, a name in the course's spelling."""
    positive_int("v (chunks per rank)", v)
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


def replica_rows(x, y, mesh, m: int):
    """This DP replica's rows of the global batch ``x``, ``y`` (batch, seq), and the step's
    global count of target tokens (-100: ignored), which divides every micro-batch's loss."""
    if len(y) != len(x):
        raise ValueError(f"the batch has {len(x)} rows and its targets {len(y)}")
    dp, d = mesh.sizes.get("dp", 1), mesh.coord.get("dp", 0)
    rule_batch(len(x), dp, m)
    return x.chunk(dp)[d], y.chunk(dp)[d], int((y != -100).sum())


def embedding_group(mesh):
    """Megatron-LM's embedding group: the first and last stage ranks of every (dp, cp, tp), which
    both hold the tied embedding / LM-head matrix. Made by the mesh with its other groups;
    a Comm on those two ranks, None elsewhere."""
    return mesh.embedding_comm()


class PipelineParallel(PipelineRuntime):
    """A TinyGPT cut into p * v stages along the mesh's "pp" dimension, trained by a schedule
    (the :class:`PipelineRuntime`), with data parallelism around it over "dp".

    schedule: "gpipe", "1f1b", "interleaved" (v chunks per rank), "zb-h1" (any case; torch's
        "GPipe", "1F1B", "Interleaved1F1B" too), or an explicit action list per pp rank
        (``schedules``), validated before it runs. v > 1 with another schedule: ValueError.
    microbatches: m; each DP replica's batch is cut into m equal micro-batches.
    """

    def __init__(self, model, mesh, schedule="1f1b", microbatches: int = 4, v: int = 1):
        schedule = _check_chunks(v, schedule)                   # a name: the course's spelling
        positive_int("microbatches", microbatches)
        partition_layers(len(model.blocks), mesh.sizes["pp"] * v)   # more stages than layers: ValueError
        stages = split_stages(model, mesh, v)                   # tied on one rank: one parameter
        params = list({id(q): q for st in stages.values() for q in st.parameters()}.values())
        set_reduce_dims(params, ("dp",))
        grad_sync = GradSync(params, mesh, divisor=1) if mesh.sizes["dp"] > 1 else None
        super().__init__(stages, mesh, schedule=schedule, microbatches=microbatches, v=v, grad_sync=grad_sync)

    def step(self, x, y):
        """Forward + backward of every micro-batch by the schedule, then the gradient sums.
        x, y: the GLOBAL batch (batch, seq), the same on every rank (NDParallel's contract):
        each DP replica takes its rows. Returns the loss of the whole step (every rank)."""
        x, y, n_tokens = replica_rows(x, y, self.mesh, self.m)
        hidden = next(iter(self.stages.values())).part.config.hidden
        return super().step(list(x.chunk(self.m)), list(y.chunk(self.m)), n_tokens,
                            act_shape=(len(x) // self.m, x.shape[1], hidden))


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
        positive_int("microbatches", microbatches)
        self.mesh, self.v, self.m = mesh, v, microbatches
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
        self.tied_comm = mesh.embedding_comm() if model.config.tie_embeddings and p > 1 else None

    def parameters(self):
        return list({id(q): q for st in self.stages.values() for q in st.parameters()}.values())

    def actions(self):
        """torch's order of a multi-stage schedule (interleaved, zero bubble) as one list of our
        Actions per rank: its I (input gradient, W split off) is our B."""
        op = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
        return [[Action(op[a.computation_type.name], a.stage_index, a.microbatch_index) for a in acts if a is not None]
                for _, acts in sorted(self.schedule.pipeline_order.items())]

    def step(self, x, y):
        """Returns the sum of this rank's micro-batch losses (0 where the last stage is not).
        x, y: the GLOBAL batch, on every rank, as :class:`PipelineParallel` takes it (each rank
        checks that its rows cut into the micro-batches: torch fails on the last stage only,
        leaving the others waiting). torch's schedules do no DP: with dp > 1 the caller sums."""
        x, y, n_tokens = replica_rows(x, y, self.mesh, self.m)
        self.n_tokens, losses = n_tokens, []
        args = (x,) if self.is_first else ()
        self.schedule.step(*args, target=y if self.is_last else None, losses=losses)
        sum_tied_gradient(self.tied_comm, self.stages)
        return float(sum(loss.detach() for loss in losses)) if losses else 0.0


__all__ = ["TorchPipeline", "replica_rows", "rank_stages", "split_stages", "tie_embeddings", "embedding_group", "sum_tied_gradient", "partition_layers",
           "GPTStage", "gpt_stage", "MLPStage", "naive_model_parallel_step", "PipelineParallel"]
