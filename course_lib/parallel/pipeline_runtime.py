"""The one pipeline runtime under chapters 6 (:class:`~course_lib.parallel.pipeline.PipelineParallel`)
and 9 (:class:`~course_lib.parallel.compose.NDParallel`): one training step of this rank's stages.

    runtime = PipelineRuntime(stages, mesh, schedule="1f1b", microbatches=4)   # validated once
    loss = runtime.step(xs, ys, n_tokens, act_shape=(b, s, h))   # this rank's micro-batches

What communicates, in order: the schedule's activations and gradients over "pp"
(:class:`~course_lib.parallel.pipeline_executor.ScheduleRunner`); the tied embedding's gradient
over Megatron's embedding group (first and last stage); every other gradient summed over the
dims it is replicated on (GradSync) or reduce-scattered (FSDP); the loss summed over the ranks
that hold a part of it.
"""
from __future__ import annotations

import torch

from course_lib.parallel.fsdp import FSDP
from course_lib.parallel.pipeline_executor import ScheduleRunner
from course_lib.schedules import make_schedule, schedule_name


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


class PipelineRuntime:
    """This pp rank's ``stages`` {virtual stage: GPTStage} trained by a schedule on ``mesh``.

    schedule: a name ("gpipe", "1f1b", "interleaved" with ``v``, "zb-h1"; torch's spellings too)
        or an action list per pp rank, validated once, here.
    modules: {stage: what the schedule runs} (the stage, or its FSDP wrapper); default the stages.
    grad_sync: a GradSync over the parameters that need a sum after the schedule, or None.
    loss_dims: the mesh dims whose ranks hold parts of the loss (the last stages, each its tokens).
    """

    def __init__(self, stages, mesh, *, schedule="1f1b", microbatches=1, v=1, modules=None, grad_sync=None,
                 loss_dims=("dp", "pp", "cp")):
        p = mesh.sizes["pp"]
        if isinstance(schedule, str):
            schedule = make_schedule(schedule_name(schedule, v), p, microbatches, v)
        self.stages, self.modules = stages, dict(stages) if modules is None else modules
        self.mesh, self.p, self.m, self.v, self.grad_sync = mesh, p, microbatches, v, grad_sync
        self.runner = ScheduleRunner(schedule, self.modules, mesh.comm("pp"), p=p, m=microbatches, v=v)
        self.schedule = self.runner.schedule = schedule
        cfg = next(iter(stages.values())).part.config
        tied = bool(cfg.tie_embeddings) and p > 1          # p = 1: the stages share one parameter
        self.embedding_comm = mesh.embedding_comm() if tied else None
        self.loss_dims = tuple(d for d in loss_dims if mesh.sizes[d] > 1)
        self.last_result = None

    def parameters(self):
        """This rank's parameters (shards where a dimension splits them), each once."""
        return list({id(q): q for mod in self.modules.values() for q in mod.parameters()}.values())

    def step(self, xs, ys, n_tokens, act_shape):
        """Forward and backward of the micro-batches ``xs``, ``ys`` (token ids, (b, s) each) by
        the schedule; then every gradient sum the layout needs. n_tokens: the step's GLOBAL
        count of targets; act_shape: (b, s', h) of what stages hand on. Returns the step's loss."""
        last = self.stages.get(self.p * self.v - 1)
        dtype = next(q.dtype for q in self.parameters() if q.is_floating_point())    # the model's
        res = self.runner.step(xs, ys, (lambda out, t: last.loss(out, t, n_tokens)) if last else None,
                               act_shape=act_shape, act_dtype=dtype)
        self.last_result = res
        sum_tied_gradient(self.embedding_comm, self.stages)        # tied: the two stages' parts
        if self.grad_sync is not None:
            self.grad_sync.start()
            self.grad_sync.finish()
        for mod in self.modules.values():
            if isinstance(mod, FSDP):
                mod.finish_gradient_synchronization()
        device = self.parameters()[0].device                        # NCCL talks in GPU tensors
        loss = torch.tensor([sum(res.losses.values())], dtype=torch.float64, device=device)
        if self.loss_dims:      # each last stage holds its tokens' loss / the global count: sum them
            self.mesh.comm(self.loss_dims).all_reduce(loss, name="all-reduce loss")
        return float(loss)


__all__ = ["PipelineRuntime", "sum_tied_gradient"]
