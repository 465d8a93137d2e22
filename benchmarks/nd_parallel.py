"""Our N-D composition next to torch's own on the 2-D case (DP x TP), side by side in one run.

    python benchmarks/nd_parallel.py                          # dp=2 x tp=2 on 4 ranks, gloo
    python benchmarks/nd_parallel.py --hidden 256 --rounds 4 --profile

One launch of dp*tp ranks (1 intra-op thread each) builds eight models from the same
single-device weights: ours (``compose.parallelize_nd(model, Mesh(dp, tp), data=...,
sequence_parallel=...)``) and torch's (``torch_nd.torch_parallelize_2d``: init_device_mesh +
parallelize_module on mesh["tp"] + fully_shard, or replicate, on mesh["dp"]), each with FSDP
and DDP, without and with sequence parallelism. A step is forward + backward (+ every gradient
sum) + AdamW on the GLOBAL batch (each rank takes its DP rows). The implementations run in
alternating rounds (forward order, then reversed) so machine noise hits all alike; reported:
the median step time (slowest rank per step), the ratio ours / torch's (goal: <= 1.3x), and
each rank's bytes from ``course_lib.memory.measure`` (a TorchDispatchMode following every
storage the step's ops create, DTensors by their local shard; it sees a DTensor op's output,
not the scratch tensors inside its sharding rules, e.g. loss_parallel's): model states after
the step (rank 0), and the peak during it (the largest rank, then every rank). ``--profile``: torch.profiler's self CPU time of one step on rank 0 by kind
(communication incl. waiting: torch's c10d ops and FSDP ranges, our f / g / SP autograd
Functions that hold our collectives; matmuls; DTensor's Python dispatch; the rest) and the
three costliest ops.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from course_lib.launch import launch  # noqa: E402

KINDS = [f"{impl} {data}{' +SP' if sp else ''}" for data in ("FSDP", "DDP") for sp in (False, True)
         for impl in ("ours", "torch")]
BUCKETS = {  # profiler op name (lower case) contains -> bucket; ours talk inside their autograd Functions
    "comm": ("c10d", "gloo", "all_gather", "reduce_scatter", "all_reduce", "allreduce", "broadcast", "wait_tensor",
             "toparallel", "fromparallel", "sequenceparallel", "fsdp::"),
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "dtensor": ("pythonsubclass", "_wrap_tensor_autograd", "redistribute"),   # DTensor's Python dispatch
}


def bench_rank(cfg, dp, tp, steps, rounds, batch, profile):
    import torch
    import torch.distributed as dist

    from course_lib import memory, trace
    from course_lib.models import TinyGPT
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.torch_nd import torch_parallelize_2d, torch_step

    mesh = Mesh(dp=dp, tp=tp)

    def build(kind):
        impl, data, sp = kind.split()[0], kind.split()[1].lower(), kind.endswith("+SP")
        model = TinyGPT(cfg, seed=0)
        if impl == "ours":
            net = parallelize_nd(model, mesh, data=data, sequence_parallel=sp)
            params, fn = net.parameters(), net.step
            held = torch.nn.ModuleList(net.modules.values())   # NDParallel is no Module: its stages
        else:
            net = torch_parallelize_2d(model, dp, tp, sequence_parallel=sp, fsdp=data == "fsdp")
            params, fn, held = net.parameters(), (lambda x, y, net=net: torch_step(net, x, y)), net
        return fn, torch.optim.AdamW(params, lr=1e-3), held

    gen = torch.Generator().manual_seed(0)  # the GLOBAL batches, the same on every rank
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen) for _ in range(4)]

    def step(fn, opt, k):
        x = data[k % len(data)]
        fn(x[:, :-1], x[:, 1:])
        opt.step()

    built = {k: build(k) for k in KINDS}
    mem, prof = {}, {}
    for k, (fn, opt, held) in built.items():   # warm-up, one step for memory, one under the profiler
        for i in range(2):
            step(fn, opt, i)
            opt.zero_grad()
        rep = memory.measure(lambda: step(fn, opt, 0), held, opt)
        opt.zero_grad()
        mem[k] = (rep.model_states, rep.peak)
        if profile:
            prof[k] = _profile(lambda: step(fn, opt, 1))
            opt.zero_grad()
    times = {k: [] for k in KINDS}
    for r in range(rounds):
        for k in (KINDS if r % 2 == 0 else KINDS[::-1]):
            fn, opt, _ = built[k]
            for i in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                step(fn, opt, i)
                opt.zero_grad()
                elapsed = torch.tensor(time.perf_counter() - t0)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
                times[k].append(elapsed.item())
    trace.reset()
    return {k: (statistics.median(times[k]), *mem[k], prof.get(k)) for k in KINDS}


def _profile(fn):
    """Self CPU time (s) of one call of ``fn`` by bucket (BUCKETS, else "other")."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    out = {b: 0.0 for b in (*BUCKETS, "other")}
    events = sorted(p.key_averages(), key=lambda ev: -ev.self_cpu_time_total)
    out["top"] = ", ".join(f"{ev.key} {ev.self_cpu_time_total / 1e3:.0f}ms" for ev in events[:3])
    for ev in events:
        name = ev.key.lower()
        bucket = next((b for b, keys in BUCKETS.items() if any(s in name for s in keys)), "other")
        out[bucket] += ev.self_cpu_time_total / 1e6
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="time of one step by op kind")
    args = parser.parse_args(argv)
    import torch

    from course_lib.models import GPTConfig, TinyGPT, n_params

    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, n_layers=args.layers, hidden=args.hidden,
                    n_heads=max(4, args.hidden // 64))
    n = args.dp * args.tp
    print(f"TinyGPT (Llama block): {n_params(TinyGPT(cfg)) / 1e6:.2f} M parameters, h={cfg.hidden}, "
          f"a={cfg.n_heads}, f={cfg.ffn_hidden}, L={cfg.n_layers}, s={cfg.seq_len}, global batch {args.batch}, "
          f"AdamW fp32; dp={args.dp} x tp={args.tp} = {n} ranks, 1 thread each; torch {torch.__version__}, "
          f"{os.cpu_count()} cores; median of {args.rounds} x {args.steps} interleaved steps\n")
    res = launch(bench_rank, n, cfg, args.dp, args.tp, args.steps, args.rounds, args.batch, args.profile,
                 threads=1, timeout=3000, quiet=True)
    r0 = res[0]
    print(f"{'implementation':<16}{'median step':>12}{'ours/torch':>11}{'model states':>14}{'peak (max)':>12}"
          f"{'ours/torch':>11}   peak per rank (MiB)")
    goals = []
    peak = {k: max(r[k][2] for r in res) for k in KINDS}
    for i in range(0, len(KINDS), 2):
        ours, theirs = KINDS[i], KINDS[i + 1]
        for k in (ours, theirs):
            t, states, _, _ = r0[k]
            t0 = r0[theirs][0]
            print(f"{k:<16}{t * 1e3:>10.1f}ms{t / t0:>10.2f}x{states / 2**20:>11.2f}MiB{peak[k] / 2**20:>9.1f}MiB"
                  f"{peak[k] / peak[theirs]:>10.2f}x   " + " / ".join(f"{r[k][2] / 2**20:.1f}" for r in res))
        goals.append((ours.split(" ", 1)[1], r0[ours][0] / r0[theirs][0]))
    print("\ngoal (ours <= 1.3x torch's step time): " +
          "; ".join(f"{m}: {ratio:.2f}x {'met' if ratio <= 1.3 else 'NOT met'}" for m, ratio in goals))
    if args.profile:
        print(f"\none step, rank 0, self CPU seconds by kind (torch.profiler):\n{'implementation':<16}" +
              "".join(f"{b:>11}" for b in (*BUCKETS, "other")))
        for k in KINDS:
            print(f"{k:<16}" + "".join(f"{r0[k][3][b]:>10.3f}s" for b in (*BUCKETS, "other")) +
                  f"   top: {r0[k][3]['top']}")


if __name__ == "__main__":
    main()
