"""Chapter 6's pipeline parallelism: the layers in stages, one (or v) per rank, micro-batches in flight.

    pipe = PipelineParallel(TinyGPT(cfg, seed=0), Mesh(dp=2, pp=2), schedule="1f1b", microbatches=4)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    loss = pipe.step(x, y)     # the global batch on every rank (NDParallel's contract); its loss
    opt.step(); opt.zero_grad()

* :func:`naive_model_parallel_step`: one batch, one stage busy at a time;
* :class:`PipelineParallel`: the stages (``stages``), data parallelism around them, run by the
  one pipeline runtime (``runtime``: schedule, tied embedding, gradient sums, loss).
"""
from __future__ import annotations

import torch

from course_lib import trace
from course_lib.parallel.grad_sync import GradSync
from course_lib.parallel.mesh import set_reduce_dims
from course_lib.parallel.pipeline.rules import partition_layers
from course_lib.parallel.pipeline.runtime import PipelineRuntime, check_chunks, replica_rows
from course_lib.parallel.pipeline.stages import split_stages
from course_lib.schedules import chunks, positive_int


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


class PipelineParallel(PipelineRuntime):
    """A TinyGPT cut into p * v stages along the mesh's "pp" dimension, trained by a schedule
    (the :class:`PipelineRuntime`), with data parallelism around it over "dp".

    schedule: "gpipe", "1f1b", "interleaved" (v chunks per rank), "zb-h1", "zb-v", "dualpipe-v"
        (two chunks per rank in V order; any case, torch's "GPipe", "1F1B", "Interleaved1F1B",
        "ZBVZeroBubble", "DualPipeV" too), or an explicit action list per pp rank (``schedules``),
        validated before it runs. v > 1 with another schedule: ValueError.
    microbatches: m; each DP replica's batch is cut into m equal micro-batches.
    """

    def __init__(self, model, mesh, schedule="1f1b", microbatches: int = 4, v: int = 1):
        schedule = check_chunks(v, schedule)                    # a name: the course's spelling
        positive_int("microbatches", microbatches)
        v = chunks(schedule, v)                                 # "zb-v", "dualpipe-v": two, in V order
        partition_layers(len(model.blocks), mesh.sizes["pp"] * v)   # more stages than layers: ValueError
        stages = split_stages(model, mesh, v, schedule)         # tied on one rank: one parameter
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


__all__ = ["naive_model_parallel_step", "PipelineParallel"]
