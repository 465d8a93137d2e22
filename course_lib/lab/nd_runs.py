"""Chapter 9's runs: one model trained from 0D to 4D, each layout checked against one device,
measured (losses, memory by category, step time, timeline) and predicted by the planner.

    ref = single_device(cfg, batch, steps)                       # the reference every layout meets
    ref = single_device(cfg, batch, steps, dtype=torch.float64)
    h100 = VirtualCluster("h100-sxm", gpus_per_node=8, dtype=torch.bfloat16)
    run = run_layout("3D", dict(dp=2, tp=2, pp=2), dict(microbatches=2), cfg, batch, steps, ref, h100)
    run.param_check, run.loss_check, run.memory[rank], run.step_time, run.spans
    est, sim = predict(run, h100.hw)                             # the planner on the same layout

Two launches per layout: every rank trains ``steps`` steps in float64 (exactness after AdamW
is the claim: course_lib.tolerance) and hands back its shards (:meth:`NDParallel.shards`);
then, on the virtual clock, one fp32 step under the memory tracker and one step whose spans
(virtual seconds on the modelled cluster, the same on every run) give the step time.
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

from course_lib import reference
from course_lib.lab import virtual_runs
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.launch import launch
from course_lib.parallel.compose import assemble_nd, check_layout
from course_lib.lab.virtual_runs import rank_step

LR = 1e-3


def _adamw(params):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=LR, weight_decay=0.1)


@dataclasses.dataclass
class Reference:
    losses: list
    state: dict
    grads: dict = dataclasses.field(default_factory=dict)  # the first step's (zeros where none)


def single_device(cfg, batch, steps, groups=1, frozen=(), dtype=torch.float32) -> Reference:
    """The one-device run (``groups``: MoE routing groups, one per rank and micro-batch;
    ``frozen``: names of parameters that do not train; ``dtype``: float64 where exactness
    after AdamW steps is the claim, see course_lib.tolerance). Keeps the first step's
    gradients too (``grads``): AdamW divides each update by its gradient's own scale, so only
    the gradients show a sum taken twice or a missing division."""
    model = TinyGPT(cfg, seed=0).to(dtype)
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    for block in model.blocks:
        if hasattr(block.mlp, "groups"):
            block.mlp.groups = groups
    opt, grads = _adamw(model.parameters()), {}

    def update(params):
        if not grads:    # the first step's gradients, under every name (a tied weight's too)
            grads.update({n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                          for n, p in model.named_parameters(remove_duplicate=False)})
        opt.step()
    state, losses = reference.train_gpt(model, reference.gpt_batches(cfg, batch=batch, steps=steps), update)
    return Reference(losses, state, grads)


def _rank(layout, kw, cfg_dict, batch, steps, dtype):
    """Train ``steps`` AdamW steps in ``dtype``: the losses and this rank's shards."""
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    cfg = GPTConfig(**cfg_dict)
    net = parallelize_nd(TinyGPT(cfg, seed=0).to(dtype), Mesh(**layout), **kw)
    opt = _adamw(net.parameters())
    losses = []
    for x, y in reference.gpt_batches(cfg, batch=batch, steps=steps):
        losses.append(net.step(x, y))
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, shards=net.shards())


@dataclasses.dataclass
class LayoutRun:
    name: str
    layout: dict
    kw: dict
    cfg: GPTConfig
    batch: int
    losses: list            # the step losses (the same on every rank), in ``dtype``
    loss_check: object      # tolerance.Comparison of the losses with one device's
    param_check: object     # tolerance.Comparison of the assembled parameters with one device's
    memory: list            # per rank: MemoryReport fields (bytes) of one fp32 step
    p2p_bytes: list         # per rank: pipeline point-to-point bytes sent in one step (payload counted)
    step_time: float        # virtual seconds of one step: first rank's start to last rank's end
    spans: list             # that step, every rank, virtual seconds
    cluster: object = None  # the VirtualCluster it was priced on
    kernels: list = None    # per rank: kernels its compute stream launched in that step

    @property
    def world_size(self) -> int:
        return check_layout(self.cfg, **self.layout).world_size

    def matches(self) -> bool:
        return bool(self.loss_check) and bool(self.param_check)


def run_layout(name, layout, kw, cfg, batch, steps, ref: Reference, cluster, dtype=torch.float64) -> LayoutRun:
    """Train ``cfg`` on ``layout`` (checked before any rank starts) in ``dtype`` and compare with
    ``ref`` (trained in the same dtype) within course_lib.tolerance's AdamW bound; then time one
    fp32 step of the same layout on ``cluster`` (a VirtualCluster) and measure its memory."""
    from course_lib import tolerance

    shape = check_layout(cfg, **layout, batch=batch, **kw)
    res = launch(_rank, shape.world_size, layout, kw, dataclasses.asdict(cfg), batch, steps, dtype,
                 threads=1, timeout=300)
    full = assemble_nd([r["shards"] for r in res], shape)
    bounds = dict(dtype=dtype, optimizer="adamw", steps=steps, lr=LR)
    param_check = tolerance.compare(full, ref.state, **bounds)
    loss_check = min((tolerance.compare(r["losses"], ref.losses, **bounds) for r in res), key=bool)
    timed = launch(rank_step, shape.world_size, layout, kw, dataclasses.asdict(cfg), batch, True,
                   threads=1, timeout=300, clock=cluster)
    steps_ = [s for s in timed.spans if s.name == "step"]
    step_time = max(s.end for s in steps_) - min(s.start for s in steps_)
    return LayoutRun(name, layout, kw, cfg, batch, res[0]["losses"], loss_check, param_check,
                     [r["memory"] for r in timed], [r["p2p_bytes"] for r in timed], step_time,
                     [s for s in timed.spans if s.name != "step"], cluster, [r["kernels"] for r in timed])


def predict(run: LayoutRun, hardware, runtime="course"):
    """The planner's estimate and simulated timeline of the run's layout on ``hardware``, as the
    course's runtime runs it (``runtime="course"``; "megatron": the published systems')."""
    from course_lib.planner import simulate

    est = virtual_runs.planner_estimate(run.cfg, run.layout, run.kw, run.batch, hardware, runtime)
    return est, simulate(est.model, est.hardware, est.layout, runtime=runtime)


def _torch_side_by_side(dp, tp, cfg_dict, batch, steps, timed):
    """Ours (``parallelize_nd``, FSDP) and torch's (``torch_nd``: init_device_mesh +
    parallelize_module + fully_shard) on the same DP x TP layout, trained then timed in
    alternation: losses, median step time (this rank) and memory of one step for each."""
    import time

    import torch.distributed as dist
    import torch.nn as nn

    from course_lib import memory
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.torch_nd import torch_parallelize_2d, torch_step

    cfg = GPTConfig(**cfg_dict)
    ours = parallelize_nd(TinyGPT(cfg, seed=0), Mesh(dp=dp, tp=tp), data="fsdp", sequence_parallel=True)
    theirs = torch_parallelize_2d(TinyGPT(cfg, seed=0), dp, tp, sequence_parallel=True, fsdp=True)
    nets = {"ours": (lambda x, y: ours.step(x, y), _adamw(ours.parameters()), nn.ModuleList(ours.modules.values())),
            "torch": (lambda x, y: torch_step(theirs, x, y), _adamw(theirs.parameters()), theirs)}
    batches = reference.gpt_batches(cfg, batch=batch, steps=steps)
    out = {k: {"losses": [], "times": []} for k in nets}
    for x, y in batches:
        for k, (step, opt, _) in nets.items():
            out[k]["losses"].append(step(x, y))
            opt.step()
            opt.zero_grad()
    x, y = batches[0]
    for k, (step, opt, module) in nets.items():
        out[k]["memory"] = dataclasses.asdict(memory.measure(lambda: (step(x, y), opt.step()), module, opt))
        opt.zero_grad()
    for i in range(timed):
        for k in (list(nets) if i % 2 == 0 else list(nets)[::-1]):   # alternate who goes first
            step, opt, _ = nets[k]
            dist.barrier()
            t0 = time.perf_counter()
            step(x, y)
            opt.step()
            opt.zero_grad()
            out[k]["times"].append(time.perf_counter() - t0)
    return out


def torch_side_by_side(cfg, batch, steps, dp=2, tp=2, timed=6) -> dict:
    """{"ours" / "torch": losses, step times (the slowest rank per step), memory per rank}."""
    res = launch(_torch_side_by_side, dp * tp, dp, tp, dataclasses.asdict(cfg), batch, steps, timed,
                 threads=1, timeout=300)
    return {k: {"losses": res[0][k]["losses"],
                "step_time": statistics.median(max(r[k]["times"][i] for r in res) for i in range(timed)),
                "memory": [r[k]["memory"] for r in res]} for k in ("ours", "torch")}


def planner_memory(est) -> dict:
    """The planner's bytes per GPU in this course's fp32 terms. Model states are 16 bytes per
    parameter in both conventions (bf16 weight + bf16 gradient + fp32 master, momentum and
    variance; or fp32 weight + fp32 gradient + fp32 momentum and variance); activations and
    communication buffers are bf16 in the planner and fp32 here: twice the bytes."""
    states = est.memory["params"] + est.memory["grads_after_step"] + est.memory["optimizer"]   # after the step
    return {"states": states, "peak": states + 2 * (est.memory["activations"] + est.memory["temporaries"])}


def measured_memory(run: LayoutRun) -> dict:
    """The busiest rank's bytes: model states by category, and the peak of the step."""
    worst = max(run.memory, key=lambda r: r["peak"])
    return {"params": worst["parameters"], "grads": worst["gradients"], "optimizer": worst["optimizer_state"],
            "peak": worst["peak"]}


__all__ = ["Reference", "single_device", "LayoutRun", "run_layout",
           "predict", "planner_memory", "measured_memory", "torch_side_by_side"]
