"""Calibrate the planner on this machine and predict a real data-parallel run (chapter 10).

One ``launch`` of ``world_size`` gloo ranks measures, all ranks at once (so they share
the cores exactly as in training), between the training steps of 4:

1. the matmul rate: the tiny GPT's own matmuls (its linear layers, the head, and
   attention's batched QK^T and AV), forward and backward, FLOP/s per rank;
2. the memory bandwidth that small elementwise kernels reach (with autograd) on tensors
   of the activations' size, bytes/s per rank;
3. all-reduce times over a range of sizes, from which alpha and beta are fitted with
   ``costmodel.fit_alpha_beta`` (as in the collectives chapter);
4. the real thing: steps of data-parallel training of a tiny Llama-style GPT, from torch
   alone (the gradients all-reduced after backward, or during it with ``sync="overlap"``,
   torch's DDP): the planner imports nothing of ``parallel/``.

From 1-3 alone a :class:`Hardware` for "this machine" is built
(``planner.calibration.machine_hardware``), and ``estimate`` predicts 4, which is compared
with the measured step time.
"""
from __future__ import annotations

import dataclasses
import statistics

from course_lib import costmodel
from course_lib.launch import launch
from course_lib.planner.calibration import machine_hardware, model_spec
from course_lib.planner.estimate import estimate
from course_lib.planner.layout import Layout

ALLREDUCE_SIZES = (2**12, 2**15, 2**18, 2**20, 2**22)     # bytes (float32 buffers)
SYNC = ("bucketed", "overlap")                            # DDP after backward / overlapped with it


def _median_time(fn, repeats):
    import time
    fn()                                                   # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _data_parallel(module, sync):
    """Data parallelism as the planner models it, from torch alone (the planner sits below
    nothing it measures): "overlap", torch's DDP (bucket all-reduces during backward);
    "bucketed", every gradient in one all-reduce after backward (the course's DDP at this
    size: the tiny GPT fits one 25 MiB bucket). ``finish`` completes the step's sums."""
    import torch
    import torch.distributed as dist

    if sync == "overlap":
        return torch.nn.parallel.DistributedDataParallel(module), lambda: None

    def finish():
        grads = [q.grad for q in module.parameters() if q.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])         # (all parameters,)
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
    return module, finish


def _measure_rank(cfg_kwargs, batch, steps, repeats, sync):
    """Runs on every rank. The rates are measured between the training steps, so both
    see the same load on the machine; all ranks run each phase together (barriers)."""
    import time

    import torch
    import torch.distributed as dist

    from course_lib.models import GPTConfig, TinyGPT

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**cfg_kwargs)
    tokens, s, d = batch * cfg.seq_len, cfg.seq_len, cfg.head_dim
    gen = torch.Generator().manual_seed(rank)
    # the model's own matmuls, forward and backward (autograd, as in training): each
    # linear layer of one transformer layer, the head, and attention's batched QK^T and AV
    shapes = [(cfg.hidden, cfg.hidden)] * 2 + [(cfg.hidden, cfg.n_kv_heads * d)] * 2 + \
        [(cfg.hidden, cfg.ffn_hidden)] * (2 if cfg.block == "llama" else 1) + \
        [(cfg.ffn_hidden, cfg.hidden), (cfg.hidden, cfg.vocab_size)]
    mats = [(torch.randn(tokens, k, generator=gen, requires_grad=True),
             torch.randn(k, n, generator=gen, requires_grad=True)) for k, n in shapes]
    q = torch.randn(batch * cfg.n_heads, s, d, generator=gen, requires_grad=True)
    k_t = torch.randn(batch * cfg.n_heads, d, s, generator=gen, requires_grad=True)
    flops = sum(6 * tokens * k * n for k, n in shapes) + 2 * 6 * batch * cfg.n_heads * s * s * d

    def matmuls():
        outs = [a @ b for a, b in mats]
        att = torch.bmm(q, k_t)                     # (b * heads, s, s)
        outs += [att, torch.bmm(att, q)]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    # the memory-bound side: a chain of elementwise kernels with autograd on a tensor of
    # the activations' size, (tokens, hidden) fp32; forward reads and writes each tensor
    # once, backward reads two and writes one: 5 tensor-sizes per kernel. On a CPU in
    # eager mode each small kernel also pays its dispatch, which this bandwidth includes.
    act = torch.randn(tokens, cfg.hidden, generator=gen, requires_grad=True)
    chain = 8

    def elementwise():
        y = act
        for _ in range(chain):
            y = torch.nn.functional.silu(y)
        y.backward(torch.ones_like(y))

    # alpha and beta: all-reduce times over a range of sizes
    ar = []
    for n in ALLREDUCE_SIZES:
        buf = torch.ones(n // 4)
        dist.barrier()
        ar.append((n, _median_time(lambda: dist.all_reduce(buf), repeats)))
    # data-parallel training of the tiny GPT, with the rates measured between steps
    torch.manual_seed(0)
    model, finish = _data_parallel(TinyGPT(cfg, seed=0), sync)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)          # random tokens: the timing does not care
    step_times, mm_times, copy_times = [], [], []
    for _ in range(steps + 1):                      # the first round warms up
        xy = torch.randint(0, cfg.vocab_size, (world, batch, cfg.seq_len + 1), generator=gen)[rank]
        x, y = xy[:, :-1], xy[:, 1:]
        dist.barrier()
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
        dist.barrier()
        mm_times.append(_median_time(matmuls, repeats))
        dist.barrier()
        copy_times.append(_median_time(elementwise, repeats))
    return {"matmul_flops": flops, "matmul_times": mm_times[1:], "copy_bytes": 5 * chain * act.numel() * 4,
            "copy_times": copy_times[1:], "allreduce": ar, "step_times": step_times[1:]}


def calibrate(cfg, world_size: int = 4, batch: int = 8, steps: int = 5, repeats: int = 5,
              sync: str = "bucketed", timeout: float = 120.0) -> dict:
    """Measure this machine and a real ``world_size``-rank DDP run; predict it.

    Returns measured numbers, the fitted alpha/beta, the Hardware built from them,
    the planner's Estimate, and ``predicted`` / ``measured`` step seconds.
    """
    if sync not in SYNC:  # before any rank starts
        raise ValueError(f"sync must be one of {SYNC}, got {sync!r}")
    res = launch(_measure_rank, world_size, dataclasses.asdict(cfg), batch, steps, repeats, sync,
                 timeout=timeout, quiet=True)
    rows = [costmodel.Measurement("ring_all_reduce", n, world_size, statistics.median(r["allreduce"][i][1]
                                                                                        for r in res))
            for i, n in enumerate(ALLREDUCE_SIZES)]
    def slowest(key):
        # a data-parallel step runs at the pace of its slowest rank: per round, the
        # slowest rank's time; then the median over rounds
        return statistics.median(max(r[key][k] for r in res) for k in range(steps))
    measured = {
        "matmul_flops": res[0]["matmul_flops"] / slowest("matmul_times"),
        "copy_bandwidth": res[0]["copy_bytes"] / slowest("copy_times"),
        "allreduce": rows,
        "fit": costmodel.fit_alpha_beta(rows),
        "step_time": slowest("step_times"),
    }
    hw = machine_hardware(measured, world_size)
    spec = model_spec(cfg)
    layout = Layout(dp=world_size, micro_batch=batch, global_batch=batch * world_size,
                    overlap_dp=(sync == "overlap"))
    est = estimate(spec, hw, layout)
    return {"measured": measured, "hardware": hw, "estimate": est, "predicted": est.step_time,
            "measured_step": measured["step_time"]}


__all__ = ["ALLREDUCE_SIZES", "SYNC", "calibrate"]
