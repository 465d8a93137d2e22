"""The one pipeline runtime under chapters 6 (:class:`~course_lib.parallel.pipeline.PipelineParallel`)
and 9 (:class:`~course_lib.parallel.compose.NDParallel`): one training step of this rank's stages.

    runtime = PipelineRuntime(stages, mesh, schedule="1f1b", microbatches=4)   # validated once
    loss = runtime.step(xs, ys, n_tokens, act_shape=(b, s, h))   # this rank's micro-batches

What communicates, in order: the schedule's activations and gradients over "pp"
(:class:`~course_lib.parallel.pipeline.runner.ScheduleRunner`); the tied embedding's gradient
over Megatron's embedding group (first and last stage); every other gradient summed over the
dims it is replicated on (GradSync) or reduce-scattered (FSDP), each finished by the one call
DDP and FSDP share; the loss summed over the ranks that hold a part of it.
"""
from __future__ import annotations

import torch

from course_lib.parallel.pipeline.rules import rule_batch
from course_lib.parallel.pipeline.runner import ScheduleRunner
from course_lib.schedules import chunks, make_schedule, positive_int, schedule_name


def check_chunks(v, schedule):
    """v: an integer >= 1, and > 1 only for the interleaved schedule (or an explicit action list).
    Returns the schedule, a name in the course's spelling."""
    positive_int("v (chunks per rank)", v)
    return schedule_name(schedule, v) if isinstance(schedule, str) else schedule


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


def sum_tied_gradient(comm, stages, master=None):
    """First stage: the embedding's gradient; last stage: the LM head's, the same matrix.
    Both apply the sum, so both copies stay equal. ``master``: {id(model weight): the master
    whose gradient is summed} (mixed precision reducing in the masters' dtype)."""
    if comm is None:
        return
    st = stages[min(stages)] if min(stages) == 0 else stages[max(stages)]
    w = st.part.tok_emb.weight if st.first else st.part.lm_head.weight
    w = master[id(w)] if master else w
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    comm.all_reduce(w.grad)


class PipelineRuntime:
    """This pp rank's ``stages`` {virtual stage: GPTStage} trained by a schedule on ``mesh``.

    schedule: a name ("gpipe", "1f1b", "interleaved" with ``v``, "zb-h1"; torch's spellings too)
        or an action list per pp rank, validated once, by the runner (one ``validate`` returned
        already, as ``parallelize_nd`` passes it, is taken as is).
    modules: {stage: what the schedule runs}: the stage, or a wrapper that sums its own gradients
        (FSDP, DDP: ``finish_gradient_synchronization()`` after the schedule); default the stages.
    grad_sync: a GradSync over the parameters that need a sum after the schedule, or None.
    loss_dims: the mesh dims whose ranks hold parts of the loss (the last stages, each its tokens).
    master: a :class:`~course_lib.precision.mixed.MasterWeights` (mixed precision): the
        optimizer's parameters, copied into the 16-bit model before each step, given the
        gradients after it (before the sums if they reduce in the masters' dtype).
    act_dtype: of what stages hand on (default: the dtype of the modules' parameters).
    overlap_fb: run each F&B pair of the schedule (``runner.fb_pairs``: DualPipeV's) as one
        overlapped pair on a virtual clock (``runner.overlap_fb``, settable between steps).
    """

    def __init__(self, stages, mesh, *, schedule="1f1b", microbatches=1, v=1, modules=None, grad_sync=None,
                 loss_dims=("dp", "pp", "cp"), master=None, act_dtype=None, overlap_fb=False):
        p = mesh.sizes["pp"]
        if isinstance(schedule, str):
            v = chunks(schedule, v)                              # the V schedules: two chunks
            schedule = make_schedule(schedule, p, microbatches, v)
        self.stages, self.modules = stages, dict(stages) if modules is None else modules
        self.mesh, self.p, self.m, self.v, self.grad_sync = mesh, p, microbatches, v, grad_sync
        # the gradient sums after the schedule, each call: launch what is left, wait, leave p.grad summed
        self.gradient_sums = [grad_sync.finish] if grad_sync is not None else []
        self.gradient_sums += [mod.finish_gradient_synchronization for s, mod in self.modules.items()
                               if mod is not stages[s]]
        self.runner = ScheduleRunner(schedule, self.modules, mesh.comm("pp"), p=p, m=microbatches, v=v,
                                     overlap_fb=overlap_fb)
        self.schedule = self.runner.schedule                # the action lists, validated
        cfg = next(iter(stages.values())).part.config
        tied = bool(cfg.tie_embeddings) and p > 1 and self.schedule.placement == "loop"
        # p = 1, or a V (first and last stage on rank 0): the stages share one parameter
        self.embedding_comm = mesh.embedding_comm() if tied else None
        self.loss_dims = tuple(d for d in loss_dims if mesh.sizes[d] > 1)
        self.last_result = None
        self.master, self.act_dtype = master, act_dtype

    def model_parameters(self):
        """The parameters the stages compute with (shards where a dimension splits them), each once."""
        return list({id(q): q for mod in self.modules.values() for q in mod.parameters()}.values())

    def parameters(self):
        """This rank's parameters for the optimizer: the master weights under mixed precision."""
        return self.master.parameters() if self.master else self.model_parameters()

    def step(self, xs, ys, n_tokens, act_shape):
        """Forward and backward of the micro-batches ``xs``, ``ys`` (token ids, (b, s) each) by
        the schedule; then every gradient sum the layout needs. n_tokens: the step's GLOBAL
        count of targets; act_shape: (b, s', h) of what stages hand on. Returns the step's loss."""
        last = self.stages.get(self.p * self.v - 1)
        dtype = self.act_dtype or next(q.dtype for q in self.model_parameters() if q.is_floating_point())
        if self.master:
            self.master.to_model()                                  # this step's 16-bit weights
        res = self.runner.step(xs, ys, (lambda out, t: last.loss(out, t, n_tokens)) if last else None,
                               act_shape=act_shape, act_dtype=dtype)
        self.last_result = res
        on_master = self.master is not None and self.master.reduce_on_master
        if on_master:
            self.master.to_master()                                 # sum the gradients in the masters' dtype
        main = getattr(self.grad_sync, "main_grads", None)   # (ZeRO summing in its own fp32 buffers)
        sum_tied_gradient(self.embedding_comm, self.stages,
                          self.master.of if on_master else main.holders() if main is not None else None)
        for finish in self.gradient_sums:
            finish()
        if self.master and not on_master:
            self.master.to_master()                                 # summed in 16 bits, then widened
        device = self.model_parameters()[0].device                  # NCCL talks in GPU tensors
        loss = torch.tensor([sum(res.losses.values())], dtype=torch.float64, device=device)
        if self.loss_dims:      # each last stage holds its tokens' loss / the global count: sum them
            self.mesh.comm(self.loss_dims).all_reduce(loss, name="all-reduce loss")
        return float(loss)


__all__ = ["PipelineRuntime", "sum_tied_gradient", "check_chunks", "replica_rows", "embedding_group"]
