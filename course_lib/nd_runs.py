"""Chapter 9's runs: one model trained from 0D to 4D, each layout checked against one device,
measured (losses, memory by category, step time, timeline) and predicted by the planner.

    ref = single_device(cfg, batch, steps)                       # the reference every layout meets
    run = run_layout("3D", dict(dp=2, tp=2, pp=2), dict(microbatches=2), cfg, batch, steps, ref)
    run.max_param_diff, run.loss_diff, run.memory[rank], run.step_time, run.spans
    hw = calibrated_hardware(cfg, world_size=8, batch=batch)     # this machine, 8 ranks at once
    est = predict(run, hw)                                       # the planner on the same layout

One ``launch`` per layout: every rank trains ``steps`` steps (traced), hands back its shards
(:meth:`NDParallel.shards`), then runs one more step under the memory tracker and a few
timed steps; only the last timed step's spans are kept, for the timeline.
"""
from __future__ import annotations

import dataclasses
import statistics

import torch

from course_lib import reference
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.launch import launch
from course_lib.parallel.compose import assemble_nd, check_layout

LR = 1e-3


def _adamw(params):
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=LR, weight_decay=0.1)


@dataclasses.dataclass
class Reference:
    losses: list
    state: dict


def single_device(cfg, batch, steps, groups=1) -> Reference:
    """The one-device run (``groups``: MoE routing groups, one per rank and micro-batch)."""
    model = TinyGPT(cfg, seed=0)
    for block in model.blocks:
        if hasattr(block.mlp, "groups"):
            block.mlp.groups = groups
    state, losses = reference.train_gpt(model, reference.gpt_batches(cfg, batch=batch, steps=steps),
                                        _adamw(model.parameters()))
    return Reference(losses, state)


def _rank(layout, kw, cfg_dict, batch, steps, timed):
    import time

    import torch.distributed as dist
    import torch.nn as nn

    from course_lib import memory, trace
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    cfg = GPTConfig(**cfg_dict)
    mesh = Mesh(**layout)
    net = parallelize_nd(TinyGPT(cfg, seed=0), mesh, **kw)
    opt = _adamw(net.parameters())
    batches = reference.gpt_batches(cfg, batch=batch, steps=steps)
    losses = []
    for x, y in batches:
        losses.append(net.step(x, y))
        opt.step()
        opt.zero_grad()
    shards = net.shards()
    x, y = batches[0]
    modules = nn.ModuleList(list(net.modules.values()))

    def step():
        net.step(x, y)
        opt.step()
    report = memory.measure(step, modules, opt)
    opt.zero_grad()
    times = []
    for _ in range(timed):
        dist.barrier()
        trace.reset()                           # keep the last timed step's spans only
        t0 = time.perf_counter()
        net.step(x, y)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    return dict(losses=losses, shards=shards, memory=dataclasses.asdict(report), times=times,
                p2p_bytes=net.last_result.bytes_sent if net.last_result else 0)


@dataclasses.dataclass
class LayoutRun:
    name: str
    layout: dict
    kw: dict
    cfg: GPTConfig
    batch: int
    losses: list            # the step losses (the same on every rank)
    loss_diff: float        # max |loss - one device's|
    max_param_diff: float   # max |parameter - one device's| after the steps
    memory: list            # per rank: MemoryReport fields (bytes)
    step_time: float        # median over timed steps of the slowest rank's time
    spans: list             # the last timed step, every rank
    elapsed: float          # the whole launch, seconds

    @property
    def world_size(self) -> int:
        return check_layout(self.cfg, **self.layout).world_size

    def matches(self, tol=1e-5) -> bool:
        return self.loss_diff <= tol and self.max_param_diff <= tol


def run_layout(name, layout, kw, cfg, batch, steps, ref: Reference, timed=3) -> LayoutRun:
    """Train ``cfg`` on ``layout`` (checked before any rank starts), compare with ``ref``."""
    shape = check_layout(cfg, **layout, batch=batch, **kw)
    res = launch(_rank, shape.world_size, layout, kw, dataclasses.asdict(cfg), batch, steps, timed,
                 threads=1, timeout=300)
    full = assemble_nd([r["shards"] for r in res], shape)
    missing = set(ref.state) ^ set(full)
    if missing:
        raise AssertionError(f"{name}: parameters on one side only: {sorted(missing)}")
    diff = max(float((full[n] - w).abs().max()) for n, w in ref.state.items())
    loss_diff = max(abs(a - b) for r in res for a, b in zip(r["losses"], ref.losses))
    step_time = statistics.median(max(r["times"][k] for r in res) for k in range(timed))
    return LayoutRun(name, layout, kw, cfg, batch, res[0]["losses"], loss_diff, diff,
                     [r["memory"] for r in res], step_time, res.spans, res.elapsed)


def calibrated_hardware(cfg, world_size, batch):
    """The planner's Hardware for this machine with ``world_size`` ranks running at once
    (``course_lib.planner.calibration``: matmul rate, elementwise bandwidth, all-reduce
    alpha-beta, all measured by every rank together, so they share the cores as in training).
    One rank (0D) has nothing to fit alpha and beta on: it takes the 2-rank calibration, whose
    ranks also get one core each (ranks run one thread)."""
    from course_lib.planner import calibration

    return calibration.calibrate(cfg, world_size=max(2, world_size), batch=max(1, batch // world_size), steps=2,
                                 repeats=2, timeout=300)["hardware"]


def planner_layout(run: LayoutRun):
    """The planner's Layout of a run: the same dims, micro-batches, schedule, ZeRO-3 for FSDP."""
    from course_lib.planner import Layout

    s = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, "ep": 1, **run.layout}
    m = run.kw.get("microbatches", 1)
    return Layout(dp=s["dp"], tp=s["tp"], pp=s["pp"], cp=s["cp"], ep=s["ep"],
                  zero=3 if run.kw.get("data") == "fsdp" else 0,
                  sp=run.kw.get("sequence_parallel", True) and s["tp"] > 1,
                  schedule=run.kw.get("schedule", "1f1b"), v=run.kw.get("v", 1),
                  micro_batch=run.batch // (s["dp"] * m), global_batch=run.batch, overlap_dp=False)


def predict(run: LayoutRun, hardware):
    """The planner's estimate and simulated timeline of the run's layout on ``hardware``."""
    from course_lib.planner import estimate, simulate
    from course_lib.planner.calibration import model_spec

    spec = model_spec(run.cfg)
    if run.cfg.n_experts:
        spec = spec.with_(n_experts=run.cfg.n_experts, top_k=run.cfg.top_k)
    layout = planner_layout(run)
    return estimate(spec, hardware, layout), simulate(spec, hardware, layout)


def planner_memory(est) -> dict:
    """The planner's bytes per GPU in this course's fp32 terms. Model states are 16 bytes per
    parameter in both conventions (bf16 weight + bf16 gradient + fp32 master, momentum and
    variance; or fp32 weight + fp32 gradient + fp32 momentum and variance); activations and
    communication buffers are bf16 in the planner and fp32 here: twice the bytes."""
    states = est.memory["params"] + est.memory["grads"] + est.memory["optimizer"]
    return {"states": states, "peak": states + 2 * (est.memory["activations"] + est.memory["temporaries"])}


def measured_memory(run: LayoutRun) -> dict:
    """The busiest rank's bytes: model states by category, and the peak of the step."""
    worst = max(run.memory, key=lambda r: r["peak"])
    return {"params": worst["parameters"], "grads": worst["gradients"], "optimizer": worst["optimizer_state"],
            "peak": worst["peak"]}


__all__ = ["Reference", "single_device", "LayoutRun", "run_layout", "calibrated_hardware", "planner_layout",
           "predict", "planner_memory", "measured_memory"]
