"""Chapter 9's runs: one model trained from 0D to 4D, each layout checked against one device,
measured (losses, memory by category, step time, timeline) and predicted by the planner.

    ref = single_device(cfg, batch, steps)                       # the reference every layout meets
    run = run_layout("3D", dict(dp=2, tp=2, pp=2), dict(microbatches=2), cfg, batch, steps, ref)
    run.max_param_diff, run.loss_diff, run.memory[rank], run.step_time, run.spans
    hw, alone = calibrated_hardware(cfg, world_size=8, batch=batch)   # this machine, 8 ranks at once
    est, sim = predict(run, hw)                                  # the planner on the same layout

One ``launch`` per layout: every rank trains ``steps`` steps (traced), hands back its shards
(:meth:`NDParallel.shards`), then runs one more step under the memory tracker and a few
timed steps; only the last timed step's spans are kept, for the timeline.
"""
from __future__ import annotations

import dataclasses
import os
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


def single_device(cfg, batch, steps, groups=1, frozen=(), dtype=torch.float32) -> Reference:
    """The one-device run (``groups``: MoE routing groups, one per rank and micro-batch;
    ``frozen``: names of parameters that do not train; ``dtype``: float64 where exactness
    after AdamW steps is the claim, see course_lib.tolerance)."""
    model = TinyGPT(cfg, seed=0).to(dtype)
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
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
    times, cpu = [], []
    for _ in range(timed):
        dist.barrier()
        trace.reset()                           # keep the last timed step's spans only
        t0, c0 = time.perf_counter(), time.process_time()
        net.step(x, y)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)    # every thread of the rank: its compute, gloo's threads
    dist.barrier()
    return dict(losses=losses, shards=shards, memory=dataclasses.asdict(report), times=times, cpu=cpu,
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
    p2p_bytes: list         # per rank: pipeline point-to-point bytes sent in one step (payload counted)
    step_time: float        # median over timed steps of the slowest rank's time
    spans: list             # the last timed step, every rank
    elapsed: float          # the whole launch, seconds
    cpu_time: float = 0.0   # CPU seconds of one step summed over ranks (median over timed steps)

    @property
    def world_size(self) -> int:
        return check_layout(self.cfg, **self.layout).world_size

    def cores_busy(self, cores=None) -> float:
        """The fraction of the cores the step kept busy: CPU seconds over ranks / (cores x step
        time), cores = min(ranks, this machine's). Near 1: the step took as long as the cores
        needed for all the ranks' work, whatever the order of its messages."""
        cores = min(self.world_size, cores or os.cpu_count() or 1)
        return self.cpu_time / (cores * self.step_time)

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
    cpu_time = statistics.median(sum(r["cpu"][k] for r in res) for k in range(timed))
    return LayoutRun(name, layout, kw, cfg, batch, res[0]["losses"], loss_diff, diff,
                     [r["memory"] for r in res], [r["p2p_bytes"] for r in res], step_time, res.spans, res.elapsed,
                     cpu_time)


def calibrated_hardware(cfg, world_size, batch, cores=None, alone=None):
    """The planner's Hardware for this machine with ``world_size`` ranks of one thread each.

    Two calibrations (``course_lib.planner.calibration``): the all-reduce alpha-beta with
    ``world_size`` ranks at once (a message waits for its peer to be scheduled: that is in the
    fit), and the matmul rate and elementwise bandwidth of one rank per core (``alone``: the
    2-rank calibration, measured once and reused). A calibration times short bursts, which a
    rank can run on a core of its own even when there are more ranks than cores; in a training
    step every rank computes at once, so with N ranks on C cores each gets C / N of a core:
    the rates are scaled by min(1, C / N). Returns (Hardware, the alone one)."""
    from course_lib.planner import calibration

    cores = cores or os.cpu_count() or 1
    run = lambda n: calibration.calibrate(cfg, world_size=n, batch=max(1, batch // n), steps=2, repeats=3,
                                          timeout=300)["hardware"]
    alone = alone or run(2)
    hw = run(world_size) if world_size > 2 else alone
    share = min(1.0, cores / world_size)
    return dataclasses.replace(hw, name=f"this CPU, {world_size} ranks on {cores} cores",
                               peak_flops=alone.peak_flops * share, hbm_bandwidth=alone.hbm_bandwidth * share), alone


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
    states = est.memory["params"] + est.memory["grads"] + est.memory["optimizer"]
    return {"states": states, "peak": states + 2 * (est.memory["activations"] + est.memory["temporaries"])}


def measured_memory(run: LayoutRun) -> dict:
    """The busiest rank's bytes: model states by category, and the peak of the step."""
    worst = max(run.memory, key=lambda r: r["peak"])
    return {"params": worst["parameters"], "grads": worst["gradients"], "optimizer": worst["optimizer_state"],
            "peak": worst["peak"]}


__all__ = ["Reference", "single_device", "LayoutRun", "run_layout", "calibrated_hardware", "planner_layout",
           "predict", "planner_memory", "measured_memory", "torch_side_by_side"]
