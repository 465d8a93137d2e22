"""Pipeline parallelism: the layers cut into stages, one (or v) per rank, micro-batches in flight.

    pipe = PipelineParallel(TinyGPT(cfg, seed=0), Mesh(dp=2, pp=2), schedule="1f1b", microbatches=4)
    loss = pipe.step(x, y)     # the global batch on every rank (NDParallel's contract); its loss

Each module imports only those above it in this table (tests/test_imports.py checks it), and
the schedules themselves, as data, are :mod:`course_lib.schedules` (shared with the planner):

    rules              the pipeline's rules (layers per stage, the schedule for (p, m, v), zb-h1's
                       limits, the batch in micro-batches): check_layout's and the code's
    stages             the tiny GPT in stages (GPTStage, split_stages, tied embeddings), MLPStage
    runner             ScheduleRunner: any valid action list over send / recv; zero bubble's B and W
    runtime            PipelineRuntime, the one pipeline step under chapters 6 and 9: schedule,
                       tied embedding, gradient sums, loss
    pipeline_parallel  chapter 6: naive model parallelism, PipelineParallel (DP around PP)
    torch_pipelining   TorchPipeline: the same stages run by torch.distributed.pipelining
"""
from course_lib.parallel.pipeline.pipeline_parallel import PipelineParallel, naive_model_parallel_step
from course_lib.parallel.pipeline.rules import partition_layers, rule_batch, rule_pipeline, splits_weight_gradients
from course_lib.parallel.pipeline.runner import (ScheduleRunner, StepResult, backward_input, backward_weight,
                                                 measured_costs, run_schedule)
from course_lib.parallel.pipeline.runtime import (PipelineRuntime, check_chunks, embedding_group, replica_rows,
                                                  sum_tied_gradient)
from course_lib.parallel.pipeline.stages import GPTStage, MLPStage, gpt_stage, rank_stages, split_stages, tie_embeddings
from course_lib.parallel.pipeline.torch_pipelining import TORCH_SCHEDULES, TorchPipeline

__all__ = ["GPTStage", "gpt_stage", "MLPStage", "rank_stages", "split_stages", "tie_embeddings", "partition_layers",
           "rule_pipeline", "rule_batch", "splits_weight_gradients",
           "ScheduleRunner", "StepResult", "run_schedule", "backward_input", "backward_weight", "measured_costs",
           "PipelineRuntime", "sum_tied_gradient", "check_chunks", "replica_rows", "embedding_group",
           "naive_model_parallel_step", "PipelineParallel", "TorchPipeline", "TORCH_SCHEDULES"]
