"""Chapter 9b's mixed-precision runs: every layout in full precision, bf16 and bf16 with fp32
reduction; bytes on the wire per mesh dimension; first-step gradients against an fp64 run.

    runs = precision_runs(cfg, {"dp2-tp2": (dict(dp=2, tp=2), {})}, batch=4, steps=3)
    runs["dp2-tp2"]["bf16"].losses, .grads (first step, whole), .calls {dim: [(op, name, bytes)]}
    side = torch_fsdp2_side_by_side(cfg, batch=4)   # ours vs fully_shard(mp_policy=...)

A rank builds ``parallelize_nd(TinyGPT(cfg), mesh, precision=...)`` (the model's dtype is the
masters'), trains ``steps`` AdamW steps, and logs every collective's payload through the mesh's
Comms (``Comm.log``) and the pipeline's sends (the schedule runner's count).
"""
from __future__ import annotations

import dataclasses

import torch

from course_lib import reference
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.launch import launch
from course_lib.parallel.compose import assemble_nd
from course_lib.parallel.mesh import MeshShape

LR = 1e-3


@dataclasses.dataclass
class PrecisionRun:
    losses: list
    grads: dict          # first step's gradients, assembled to single-device shapes (master dtype)
    state: dict          # parameters after the steps (master dtype)
    calls: dict          # {mesh dims: [(op, name, payload bytes)]} of the first step, rank 0
    held: dict = dataclasses.field(default_factory=dict)   # rank 0: bytes and dtypes of masters and model


def gradient_shards(net) -> dict:
    """{name: (gradient, tp slice)} of this rank, whole along FSDP's dims: the gradients put in
    the parameters' place for a moment, so :meth:`NDParallel.shards` gathers them as it
    gathers parameters."""
    params = [q for q in net.parameters()]
    kept = [q.detach().clone() for q in params]
    with torch.no_grad():
        for q in params:
            q.copy_(q.grad if q.grad is not None else torch.zeros_like(q))
        out = net.shards()
        for q, k in zip(params, kept):
            q.copy_(k)
    return out


def _rank(cfg_dict, cases, precisions, batch, steps, dtype):
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    cfg = GPTConfig(**cfg_dict)
    out = {}
    for case, (layout, kw) in cases.items():
        mesh = Mesh(**layout)
        for precision in precisions:
            net = parallelize_nd(TinyGPT(cfg, seed=0).to(dtype), mesh, precision=precision, **kw)
            opt = torch.optim.AdamW([q for q in net.parameters() if q.requires_grad], lr=LR, weight_decay=0.1)
            comms = [mesh.comm(d) for d in (("dp", "cp"), "dp", "cp", "tp") if mesh.size(d) > 1]
            losses, grads, calls = [], None, {}
            for x, y in reference.gpt_batches(cfg, batch=batch, steps=steps):
                for c in comms:
                    c.reset()
                losses.append(net.step(x, y))
                if grads is None:        # the step's calls first: gathering the gradients talks too
                    calls = {c.dim: [(k.op, k.name, k.payload) for k in c.log] for c in comms if c.log}
                    if mesh.sizes["pp"] > 1:
                        calls["pp"] = [("send", "activations and gradients", net.last_result.bytes_sent)]
                    grads = gradient_shards(net)
                opt.step()
                opt.zero_grad()
            held = {"master": (sum(q.numel() * q.element_size() for q in net.parameters()),
                               sorted({str(q.dtype) for q in net.parameters()})),
                    "model": (sum(q.numel() * q.element_size() for q in net.model_parameters()),
                              sorted({str(q.dtype) for q in net.model_parameters()}))}
            out[case, precision] = dict(losses=losses, grads=grads, state=net.shards(), calls=calls, held=held)
    return out


def precision_runs(cfg, cases, batch, steps, precisions=("full", "bf16", "bf16-reduce-fp32"),
                   dtype=torch.float32, world_size=4) -> dict:
    """{case: {precision: PrecisionRun}}: each case (layout, parallelize_nd keywords) on
    ``world_size`` ranks (every case's mesh has that many), one launch for all of them."""
    ranks = launch(_rank, world_size, dataclasses.asdict(cfg), cases, precisions, batch, steps, dtype,
                   threads=1, timeout=300)
    out = {}
    for case, (layout, _) in cases.items():
        shape = MeshShape(**layout)
        for precision in precisions:
            per = [r[case, precision] for r in ranks]
            out.setdefault(case, {})[precision] = PrecisionRun(
                per[0]["losses"], assemble_nd([p["grads"] for p in per], shape),
                assemble_nd([p["state"] for p in per], shape), per[0]["calls"], per[0]["held"])
    return out


def one_device(cfg, batch, steps, precision, dtype=torch.float32):
    """The single-device run of ``precision`` (course_lib.precision.mixed.train_mixed): a
    PrecisionRun with no calls."""
    from course_lib.precision.mixed import train_mixed

    state, losses, first = train_mixed(TinyGPT(cfg, seed=0).to(dtype), reference.gpt_batches(cfg, batch=batch,
                                       steps=steps), LR, precision)
    return PrecisionRun(losses, first, state, {})


def _torch_fsdp2(cfg_dict, batch, reduce_dtypes):
    """torch's FSDP2 (``fully_shard`` with ``MixedPrecisionPolicy``) on all ranks, one step per
    reduce dtype: the loss and the first step's whole gradients (fp32)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from course_lib.parallel.torch_nd import sum_gradients, torch_step
    from course_lib.precision.mixed import cast_buffers

    cfg = GPTConfig(**cfg_dict)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    x, y = reference.gpt_batches(cfg, batch=batch, steps=1)[0]
    out = {}
    for reduce in reduce_dtypes:
        model = TinyGPT(cfg, seed=0)
        cast_buffers(model, torch.bfloat16)     # FSDP2 casts parameters and inputs, not buffers (rotary)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        sum_gradients(model)
        loss = torch_step(model, x, y, mesh)
        grads = {n: q.grad.full_tensor() for n, q in model.named_parameters()}
        out[str(reduce).removeprefix("torch.")] = dict(loss=loss, grads=grads)
    return out


def torch_fsdp2_side_by_side(cfg, batch, world_size=2):
    """{"bfloat16" / "float32" (the reduce dtype): loss and first-step gradients} of torch's FSDP2."""
    return launch(_torch_fsdp2, world_size, dataclasses.asdict(cfg), batch, (torch.bfloat16, torch.float32),
                  threads=1, timeout=120)[0]


__all__ = ["PrecisionRun", "gradient_shards", "precision_runs", "one_device", "torch_fsdp2_side_by_side"]
