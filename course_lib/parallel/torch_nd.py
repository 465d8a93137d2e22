"""The 2-D case (DP x TP) with torch's own tools, next to our :func:`~course_lib.parallel.compose.parallelize_nd`.

    model = torch_parallelize_2d(TinyGPT(cfg, seed=0), dp=2, tp=2)    # inside launch(fn, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = torch_step(model, x, y)      # the GLOBAL batch (the same on every rank): the step's loss
    opt.step(); opt.zero_grad()

torchtitan's recipe (``parallelize_llama``), in its order:

1. ``init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))``: the same rank sets as
   our ``Mesh(dp=dp, tp=tp)`` (TP innermost).
2. **TP** (+ SP): ``parallelize_module`` on ``mesh["tp"]`` with the plan of
   :func:`~course_lib.parallel.tp_plan.torch_parallelize` (ColwiseParallel / RowwiseParallel /
   SequenceParallel / PrepareModuleInput; the logits stay vocabulary-split for ``loss_parallel``).
3. **DP**: ``fully_shard`` on ``mesh["dp"]``, each block then the root (FSDP2 on the TP DTensors:
   a parameter is ``Shard(0)`` over dp and its TP placement over tp), or, with ``fsdp=False``,
   ``replicate`` (torch's DDP rebuilt on FSDP2's machinery, DTensor-aware) the same way.

The loss is summed over this rank's tokens and divided by the GLOBAL token count, so the
gradient sums over dp ARE the single-device gradients: torch's default average over dp is
turned off (see :func:`sum_gradients`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.parallel.tp_plan import torch_parallelize
from course_lib.schedules import positive_int


def sum_gradients(model):
    """FSDP2 (and ``replicate``) average gradients over dp by default (ReduceOp.AVG, or a
    division). Our loss already divides by the global token count, so we want the plain SUM:
    ``set_gradient_divide_factor(1.0)`` on EVERY FSDP unit (it is not recursive) and
    ``set_force_sum_reduction_for_comms(True)``: without it a factor of 1 becomes
    ``ReduceOp.PREMUL_SUM(1.0)``, which gloo does not implement; with it the reduce-scatter is a
    SUM and the post-division by 1 is skipped (torch 2.13, ``_get_gradient_divide_factors``)."""
    from torch.distributed.fsdp import FSDPModule

    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_gradient_divide_factor(1.0)
            mod.set_force_sum_reduction_for_comms(True)


def torch_parallelize_2d(model, dp, tp, sequence_parallel=False, fsdp=True):
    """Make ``model`` (a course_lib Llama-block TinyGPT, the same on every rank) DP x TP with
    torch's own tools (module docstring), in place; returns it, with ``model.device_mesh``."""
    from torch.distributed.device_mesh import init_device_mesh

    if not isinstance(model, nn.Module) or not hasattr(model, "blocks"):
        raise TypeError(f"torch_parallelize_2d cuts a course_lib TinyGPT, got {type(model).__name__}")
    for name, value in (("dp", dp), ("tp", tp)):
        positive_int(name, value)
    world = dist.get_world_size()
    if dp * tp != world:
        raise ValueError(f"dp*tp = {dp}*{tp} = {dp * tp} ranks, but the world size is {world}: "
                         f"the product of the dimensions must equal it")
    cfg = model.config
    if cfg.block != "llama" or cfg.n_experts or cfg.tie_embeddings:
        raise ValueError("torch's plan here is the Llama one (untied, no experts): GPTConfig(block='llama')")
    if tp > 1 and (cfg.n_heads % tp or cfg.n_kv_heads % tp or cfg.ffn_hidden % tp or cfg.vocab_size % tp):
        raise ValueError(f"tp={tp} must divide the heads ({cfg.n_heads}), K/V heads ({cfg.n_kv_heads}), "
                         f"MLP width ({cfg.ffn_hidden}) and vocabulary ({cfg.vocab_size})")
    if tp > 1 and sequence_parallel and cfg.seq_len % tp:
        raise ValueError(f"sequence parallelism splits the {cfg.seq_len} tokens over tp={tp}: not divisible")
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        torch_parallelize(model, mesh["tp"], sequence_parallel)   # chapter 5's DTensor plan on mesh["tp"]
    if fsdp:
        from torch.distributed.fsdp import fully_shard as wrap
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate as wrap
    for block in model.blocks:            # each block its own unit (gathers / reductions overlap), then the root
        wrap(block, mesh=mesh["dp"])
    wrap(model, mesh=mesh["dp"])
    sum_gradients(model)
    model.device_mesh = mesh
    return model


def torch_step(model, x, y, mesh=None):
    """Forward and backward of this rank's DP rows of the GLOBAL batch ``x``, ``y`` (batch, seq)
    inside ``loss_parallel`` (the logits are vocabulary-split over tp); the loss is summed over
    the rank's tokens / the global token count. Returns the step's loss (the single-device
    value, on every rank). The caller steps the optimizer."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = model.device_mesh if mesh is None else mesh
    dp, me = mesh["dp"].size(), mesh["dp"].get_local_rank()
    if len(x) % dp:
        raise ValueError(f"the global batch ({len(x)} sequences) must be divisible by dp={dp}")
    n_tokens = int((y != -100).sum())
    x, y = x.chunk(dp)[me], y.chunk(dp)[me]                        # (batch / dp, seq)
    with loss_parallel():
        _, loss = model(x, y, n_tokens=n_tokens)
        loss.backward()
    loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().double().reshape(1)
    if dp > 1:
        dist.all_reduce(loss, group=mesh["dp"].get_group())       # the dp replicas' shares of the loss
    return float(loss)


__all__ = ["torch_parallelize_2d", "torch_step", "sum_gradients"]
