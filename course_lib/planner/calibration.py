"""Calibrate the planner on this machine and predict a real data-parallel run.

One ``launch`` of ``world_size`` gloo ranks measures, all ranks at once (so they share
the cores exactly as in training):

1. the matmul rate: the tiny GPT's own GEMM shapes, forward, FLOP/s per rank;
2. the memory bandwidth: a large copy, bytes/s per rank;
3. all-reduce times over a range of sizes, from which alpha and beta are fitted with
   ``costmodel.fit_alpha_beta`` (as in the collectives chapter);
4. the real thing: steps of the course's data-parallel training (``DDP`` from
   ``course_lib.parallel.data_parallel``, gradients all-reduced after backward; a plain
   per-parameter all-reduce if that module is absent) of a tiny Llama-style GPT.

From 1-3 alone a :class:`Hardware` for "this machine" is built, and ``estimate``
predicts 4, which is compared with the measured step time.
"""
from __future__ import annotations

import dataclasses
import statistics

from course_lib import costmodel
from course_lib.planner.estimate import estimate
from course_lib.planner.layout import Layout
from course_lib.planner.presets import Hardware, ModelSpec

ALLREDUCE_SIZES = (2**12, 2**15, 2**18, 2**20, 2**22)     # bytes (float32 buffers)


def model_spec(cfg) -> ModelSpec:
    """A planner ModelSpec for a course_lib.models.GPTConfig (same shapes)."""
    gpt2 = cfg.block == "gpt2"
    return ModelSpec("tiny GPT", cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden,
                     cfg.vocab_size, cfg.seq_len, mlp="gelu" if gpt2 else "swiglu",
                     tied=cfg.tie_embeddings, bias=gpt2, norm="layernorm" if gpt2 else "rmsnorm",
                     learned_pos=cfg.seq_len if gpt2 else 0)


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
    """The course's DDP when it is there, else a per-parameter all-reduce wrapper."""
    try:
        from course_lib.parallel.data_parallel import DDP
    except ImportError:
        import torch.distributed as dist

        class PerParameterDP:
            def __init__(self, m):
                self.module = m
                for p in m.parameters():                 # start from rank 0's weights
                    dist.broadcast(p.data, 0)

            def __call__(self, *args):
                return self.module(*args)

            def parameters(self):
                return self.module.parameters()

            def finish_gradient_synchronization(self):
                world = dist.get_world_size()
                for p in self.module.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad /= world
        return PerParameterDP(module)
    return DDP(module, sync=sync)


def _measure_rank(cfg_kwargs, batch, steps, repeats, sync):
    """Runs on every rank: the three measurements, then the training steps."""
    import time

    import torch
    import torch.distributed as dist

    from course_lib.models import GPTConfig, TinyGPT

    rank = dist.get_rank()
    cfg = GPTConfig(**cfg_kwargs)
    tokens = batch * cfg.seq_len
    # 1. matmul rate on the model's GEMMs: (tokens, h) x (h, out) for each linear layer
    shapes = [(cfg.hidden, cfg.hidden)] * 2 + [(cfg.hidden, cfg.n_kv_heads * cfg.head_dim)] * 2 + \
        [(cfg.hidden, cfg.ffn_hidden)] * (2 if cfg.block == "llama" else 1) + [(cfg.ffn_hidden, cfg.hidden)] + \
        [(cfg.hidden, cfg.vocab_size)]
    gen = torch.Generator().manual_seed(rank)
    mats = [(torch.randn(tokens, k, generator=gen), torch.randn(k, n, generator=gen)) for k, n in shapes]
    flops = sum(2 * tokens * k * n for k, n in shapes)
    dist.barrier()
    t_mm = _median_time(lambda: [a @ b for a, b in mats], repeats)
    # 2. memory bandwidth: copy 32 MiB (read + write)
    src, dst = torch.randn(2**23), torch.empty(2**23)
    dist.barrier()
    t_copy = _median_time(lambda: dst.copy_(src), repeats)
    # 3. all-reduce times
    ar = []
    for n in ALLREDUCE_SIZES:
        buf = torch.ones(n // 4)
        dist.barrier()
        ar.append((n, _median_time(lambda: dist.all_reduce(buf), repeats)))
    # 4. data-parallel training of the tiny GPT
    torch.manual_seed(0)
    model = _data_parallel(TinyGPT(cfg, seed=0), sync)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)          # random tokens: the timing does not care
    step_times = []
    for _ in range(steps + 1):
        xy = torch.randint(0, cfg.vocab_size, (dist.get_world_size(), batch, cfg.seq_len + 1), generator=gen)[rank]
        x, y = xy[:, :-1], xy[:, 1:]
        dist.barrier()
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
    return {"matmul_flops": flops / t_mm, "copy_bandwidth": 2 * src.numel() * 4 / t_copy,
            "allreduce": ar, "step_times": step_times[1:]}


def machine_hardware(measured: dict, world_size: int) -> Hardware:
    """A Hardware for this machine from the measurements (medians over the ranks).
    Activations and gradients are fp32 here: the planner's bf16 byte counts are
    doubled through the bandwidths (half the bandwidth, the same seconds)."""
    fit = measured["fit"]
    return Hardware(
        name="this CPU", peak_flops=measured["matmul_flops"], hbm_bytes=64 * 2**30,
        hbm_bandwidth=measured["copy_bandwidth"] / 2, nvlink_bandwidth=fit.bandwidth / 2,
        network_bandwidth=fit.bandwidth / 2, gpus_per_node=world_size, matmul_efficiency=1.0,
        nvlink_efficiency=1.0, network_efficiency=1.0, nvlink_latency=fit.alpha, network_latency=fit.alpha,
        fused_attention=False)          # the tiny GPT writes attention out: its scores go through memory


def calibrate(cfg, world_size: int = 4, batch: int = 8, steps: int = 5, repeats: int = 5,
              sync: str = "bucketed", timeout: float = 120.0) -> dict:
    """Measure this machine and a real ``world_size``-rank DDP run; predict it.

    Returns measured numbers, the fitted alpha/beta, the Hardware built from them,
    the planner's Estimate, and ``predicted`` / ``measured`` step seconds.
    """
    from course_lib.launch import launch

    res = launch(_measure_rank, world_size, dataclasses.asdict(cfg), batch, steps, repeats, sync,
                 timeout=timeout, quiet=True)
    rows = [costmodel.Measurement("ring_all_reduce", n, world_size, statistics.median(r["allreduce"][i][1]
                                                                                        for r in res))
            for i, n in enumerate(ALLREDUCE_SIZES)]
    measured = {
        "matmul_flops": statistics.median(r["matmul_flops"] for r in res),
        "copy_bandwidth": statistics.median(r["copy_bandwidth"] for r in res),
        "allreduce": rows,
        "fit": costmodel.fit_alpha_beta(rows),
        # a step ends when the slowest rank is done
        "step_time": statistics.median(max(r["step_times"][k] for r in res) for k in range(steps)),
    }
    hw = machine_hardware(measured, world_size)
    spec = model_spec(cfg)
    layout = Layout(dp=world_size, micro_batch=batch, global_batch=batch * world_size,
                    overlap_dp=(sync == "overlap"))
    est = estimate(spec, hw, layout)
    return {"measured": measured, "hardware": hw, "estimate": est, "predicted": est.step_time,
            "measured_step": measured["step_time"]}
