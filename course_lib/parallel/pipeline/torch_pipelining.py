"""torch's own pipelining side by side: the same stages run by ``torch.distributed.pipelining``."""
from __future__ import annotations

import torch

from course_lib.parallel.pipeline.rules import partition_layers
from course_lib.parallel.pipeline.runtime import check_chunks, replica_rows, sum_tied_gradient
from course_lib.parallel.pipeline.stages import rank_stages
from course_lib.schedules import Action, V_SCHEDULES, chunks, positive_int


TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble", "zb-v": "ScheduleZBVZeroBubble",
                   "dualpipe-v": "ScheduleDualPipeV"}      # the last two: torch >= 2.6 / 2.9


class TorchPipeline:
    """The same stages run by ``torch.distributed.pipelining`` (PipelineStage + its schedule
    of the same name, :class:`PipelineParallel`'s names), for side-by-side checks and timings.
    Gradients are not rescaled (``scale_grads=False``): our loss is already divided by the
    global token count. torch's schedules leave a tied weight to the caller: we sum it as ours
    do (:func:`sum_tied_gradient`; on one rank it is one parameter, :func:`rank_stages`)."""

    def __init__(self, model, mesh, schedule="1f1b", microbatches: int = 4, v: int = 1):
        from torch.distributed import pipelining
        p, me = mesh.sizes["pp"], mesh.coord["pp"]
        schedule = check_chunks(v, schedule)
        if not isinstance(schedule, str):
            raise ValueError(f"TorchPipeline runs torch's schedules by name, one of {tuple(TORCH_SCHEDULES)}; "
                             f"got {type(schedule).__name__}")
        positive_int("microbatches", microbatches)
        if not hasattr(pipelining, TORCH_SCHEDULES[schedule]):
            raise ValueError(f"this torch ({torch.__version__}) has no {TORCH_SCHEDULES[schedule]}")
        v = chunks(schedule, v)                        # the V schedules: two chunks, in V order
        self.mesh, self.v, self.m = mesh, v, microbatches
        n_stages = p * v
        partition_layers(len(model.blocks), n_stages)
        self.stages = rank_stages(model, me, p, v, "v" if schedule in V_SCHEDULES else "loop")
        self.torch_stages = [pipelining.PipelineStage(st, s, n_stages, torch.device("cpu"), group=mesh.group("pp"))
                             for s, st in self.stages.items()]
        self.n_tokens = None
        last = self.stages.get(n_stages - 1)
        cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
        multi = schedule in ("interleaved", "zb-h1", *V_SCHEDULES)
        self.schedule = cls(self.torch_stages if multi else self.torch_stages[0], microbatches,
                            loss_fn=lambda out, t: last.loss(out, t, self.n_tokens),   # every rank: it
                            scale_grads=False)                                  # tells torch to run backward
        self.is_first, self.is_last = 0 in self.stages, last is not None
        tied = model.config.tie_embeddings and p > 1 and schedule not in V_SCHEDULES   # V: one rank holds both
        self.tied_comm = mesh.embedding_comm() if tied else None

    def parameters(self):
        return list({id(q): q for st in self.stages.values() for q in st.parameters()}.values())

    def actions(self):
        """torch's order of a multi-stage schedule (interleaved, zero bubble) as one list of our
        Actions per rank: its I (input gradient, W split off) is our B."""
        op = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
        return [[Action(op[b.computation_type.name], b.stage_index, b.microbatch_index)
                 for a in acts if a is not None for b in (a.sub_actions or (a,))]   # DualPipeV's F&B pairs
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


__all__ = ["TorchPipeline", "TORCH_SCHEDULES"]
