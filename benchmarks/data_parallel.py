"""Our DDP and FSDP next to torch's, side by side in one run, on the tiny GPT.

    python benchmarks/data_parallel.py                 # 2 and 4 ranks, gloo on this machine
    python benchmarks/data_parallel.py --ranks 2 --steps 20 --hidden 256

For each world size one launch runs the four implementations on identical models and
data, in alternating rounds (ours, torch's, ours, ...), so machine noise hits both
alike. A step is forward + backward + gradient synchronisation + AdamW step. Reported:
the median step time per implementation and their ratio (goals: our DDP <= 1.15x torch's
DistributedDataParallel at 4 ranks, our FSDP <= 1.3x torch's fully_shard), and one
rank's bytes (model states after a step, and the peak during it) from course_lib.memory
(goal: FSDP within 10% of fully_shard).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from course_lib.launch import launch  # noqa: E402


def bench_rank(cfg, steps, rounds, batch):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from course_lib import memory, trace
    from course_lib.models import TinyGPT
    from course_lib.parallel import DDP, FSDP

    rank = dist.get_rank()

    def build(kind):
        model = TinyGPT(cfg, seed=0)
        if kind == "ours DDP":
            net = DDP(model)
        elif kind == "torch DDP":
            net = DistributedDataParallel(model)
        elif kind == "ours FSDP":
            net = FSDP(model)
        else:  # torch's FSDP2: each block, then the root, as ours
            for block in model.blocks:
                fully_shard(block)
            net = fully_shard(model)
        return net, torch.optim.AdamW(net.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen) for _ in range(4)]

    def step(net, opt, k):
        x = data[k % len(data)]
        _, loss = net(x[:, :-1], x[:, 1:])
        loss.backward()
        if hasattr(net, "finish_gradient_synchronization"):
            net.finish_gradient_synchronization()
        opt.step()

    kinds = ["ours DDP", "torch DDP", "ours FSDP", "torch FSDP"]
    built = {k: build(k) for k in kinds}
    times = {k: [] for k in kinds}
    mem = {}
    for k, (net, opt) in built.items():  # warm-up, then one measured step for memory
        for i in range(2):
            step(net, opt, i)
            opt.zero_grad()
        rep = memory.measure(lambda: step(net, opt, 0), net, opt)
        opt.zero_grad()
        mem[k] = (rep.model_states, rep.peak)
    for r in range(rounds):
        for k in (kinds if r % 2 == 0 else kinds[::-1]):
            net, opt = built[k]
            for i in range(steps):
                dist.barrier()
                t = time.perf_counter()
                step(net, opt, i)
                opt.zero_grad()
                times[k].append(time.perf_counter() - t)
    trace.reset()
    return {k: (statistics.median(times[k]), *mem[k]) for k in kinds}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args(argv)
    from course_lib.models import GPTConfig, n_params

    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, n_layers=args.layers, hidden=args.hidden,
                    n_heads=max(1, args.hidden // 64))
    from course_lib.models import TinyGPT

    P = n_params(TinyGPT(cfg))
    print(f"TinyGPT: {P / 1e6:.2f} M parameters, h={cfg.hidden}, L={cfg.n_layers}, s={cfg.seq_len}, "
          f"batch {args.batch}/rank, AdamW fp32; torch {torch.__version__}, {os.cpu_count()} cores\n")
    print(f"{'ranks':>5}  {'implementation':<15}{'median step':>12}{'vs torch':>10}"
          f"{'model states':>14}{'vs torch':>10}{'peak':>10}{'vs torch':>10}")
    for n in args.ranks:
        res = launch(bench_rank, n, cfg, args.steps, args.rounds, args.batch, timeout=1800)[0]
        for ours, theirs in (("ours DDP", "torch DDP"), ("ours FSDP", "torch FSDP")):
            for k in (ours, theirs):
                t, states, peak = res[k]
                t0, s0, p0 = res[theirs]
                print(f"{n:>5}  {k:<15}{t * 1e3:>10.1f}ms{t / t0:>9.2f}x"
                      f"{states / 2**20:>11.2f}MiB{states / s0:>9.2f}x{peak / 2**20:>7.1f}MiB{peak / p0:>9.2f}x")
        ratio = lambda a, b, i: res[a][i] / res[b][i]
        print(f"       goals: DDP step <= 1.15x: {ratio('ours DDP', 'torch DDP', 0) <= 1.15}; "
              f"FSDP step <= 1.3x: {ratio('ours FSDP', 'torch FSDP', 0) <= 1.3}; "
              f"FSDP model states within 10%: {abs(ratio('ours FSDP', 'torch FSDP', 1) - 1) <= 0.1}\n")


if __name__ == "__main__":
    main()
