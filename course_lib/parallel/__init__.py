"""Parallelism from scratch, one file per dimension, each checked against one device.

    mesh              Mesh: named dimensions (dp, pp, cp, tp; ep inside dp), every group made once,
                      one Comm per group; which dims each parameter's gradient is reduced over
    grad_sync         GradSync: gradients summed over their reduce dims, in buckets (start / finish, hooks)
    data_parallel     DDP: replicate, average gradients (textbook loop, bucketed, overlapped)
    zero              ShardedOptimizer: ZeRO-1 (optimizer state) and ZeRO-2 (+ gradients)
    fsdp              FSDP: ZeRO-3 (+ parameters), each parameter sharded along dim 0 (fully_shard's shapes)
    comm_ops          Megatron's f, g and the sequence-parallel pair as autograd functions
    tensor_parallel   ColumnParallelLinear, RowParallelLinear, sequence parallelism, dropout streams
    vocab_parallel    vocabulary-parallel embedding and cross-entropy
    tp_plan           parallelize(model, mesh): the tiny GPT cut by a plan
    pipeline/         stages of the tiny GPT; ScheduleRunner: any valid action list (course_lib.schedules)
                      over send / recv, zero bubble's B and W; the one pipeline step (PipelineRuntime);
                      PipelineParallel (tied embeddings, DP around PP); torch's pipelining side by side
    context_parallel  ring attention (zigzag), Ulysses
    expert_parallel   MoE dispatch / combine over expert-parallel ranks
    layout_rules      check_layout: every dimension's rules for an N-D layout (course_lib.layout.Layout)
    placement         Placement: where a parameter sits on a rank, the plan's one record
    compose           parallelize_nd: the plan (PP -> TP -> CP -> EP -> DP/FSDP), NDParallel
"""
# (context_parallel the function is not re-exported: it would hide the module of the same name)
from course_lib.layout import Layout
from course_lib.parallel.compose import NDParallel, assemble_nd, parallelize_nd
from course_lib.parallel.context_parallel import ring_attention, ulysses_attention
from course_lib.parallel.data_parallel import DDP, average_gradients
from course_lib.parallel.expert_parallel import ExpertParallelMoE
from course_lib.parallel.fsdp import FSDP
from course_lib.parallel.grad_sync import GradSync, OverlappedGradSync
from course_lib.parallel.layout_rules import check_layout
from course_lib.parallel.mesh import Mesh, MeshShape, get_reduce_dims, set_reduce_dims
from course_lib.parallel.pipeline import PipelineParallel
from course_lib.parallel.placement import Placement
from course_lib.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from course_lib.parallel.tp_plan import parallelize
from course_lib.parallel.zero import ShardedOptimizer

__all__ = ["Mesh", "MeshShape", "set_reduce_dims", "get_reduce_dims", "DDP", "average_gradients", "GradSync",
           "OverlappedGradSync", "ShardedOptimizer", "FSDP", "ColumnParallelLinear", "RowParallelLinear",
           "parallelize", "PipelineParallel", "ring_attention", "ulysses_attention",
           "ExpertParallelMoE", "parallelize_nd", "check_layout", "assemble_nd", "NDParallel", "Layout", "Placement"]
