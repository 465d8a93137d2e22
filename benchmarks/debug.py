"""What chapter 11's debugging tools cost: the flight recorder (always on) and the desync check.

    python benchmarks/debug.py                    # 2 ranks, gloo, our DDP on the tiny GPT
    python benchmarks/debug.py --ranks 4 --rounds 8

One launch; in each rank the same DDP model trains, the settings taking turns step by step:
the flight recorder off, on (the default of every launch), and on with the desync check (one extra
all-gather of 256 bytes per collective). Reported: the median step per setting and its cost
relative to "off" (goal: recorder < 5% of a DDP step), for the default buckets (25 MiB: few
collectives per step) and for tiny buckets (one all-reduce per parameter: the most calls a
step can make); then the recorder's own cost per call, timed in one process.
A step is forward + backward + gradient synchronisation + AdamW step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import timeit

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from course_lib.launch import launch  # noqa: E402

SETTINGS = ("off", "recorder", "recorder + desync")


def bench_rank(cfg, steps, rounds, batch, bucket_mb):
    import torch.distributed as dist

    from course_lib import trace
    from course_lib.debug import flight_recorder
    from course_lib.models import TinyGPT
    from course_lib.parallel import DDP

    ring = flight_recorder.recorder()             # the one launch installed in this rank
    net = DDP(TinyGPT(cfg, seed=0), bucket_cap_mb=bucket_mb)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen) for _ in range(4)]
    calls = {}

    def step(k):
        x = data[k % len(data)]
        _, loss = net(x[:, :-1], x[:, 1:])
        loss.backward()
        net.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()

    def setting(name):
        flight_recorder.install(None if name == "off" else ring, desync=name.endswith("desync"))

    times = {s: [] for s in SETTINGS}
    for i in range(2):
        step(i)
    for r in range(rounds * steps):   # the settings take turns step by step: load drifts hit all alike
        order = SETTINGS[r % 3:] + SETTINGS[:r % 3]
        for s in order:
            setting(s)
            before = ring.index
            dist.barrier()
            t = time.perf_counter()
            step(r)
            times[s].append(time.perf_counter() - t)
            calls[s] = ring.index - before
    setting("recorder")
    trace.reset()
    return {s: statistics.median(times[s]) for s in SETTINGS}, calls["recorder"]


def per_call_cost(n=20000):
    """Seconds the recorder adds to one collective: the hook with a ring vs without (one process)."""
    from types import SimpleNamespace

    from course_lib.debug import flight_recorder as fr
    comm = SimpleNamespace(dim="dp", ranks=[0, 1, 2, 3], size=4)
    args, kwargs = (torch.zeros(1024),), {"op": torch.distributed.ReduceOp.SUM}

    def call():
        fr.completed(fr.collective(comm, "all_reduce", args, kwargs, False), None)
    fr.install(None)
    off = min(timeit.repeat(call, number=n, repeat=5)) / n
    ring = fr.install(fr.FlightRecorder(None, rank=0))
    on = min(timeit.repeat(call, number=n, repeat=5)) / n
    ring.close()
    fr.install(None)
    return on - off


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and setting (turns)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args(argv)
    from course_lib.models import GPTConfig, TinyGPT, n_params

    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, n_layers=args.layers, hidden=args.hidden,
                    n_heads=max(1, args.hidden // 64))
    print(f"TinyGPT: {n_params(TinyGPT(cfg)) / 1e6:.2f} M parameters, our DDP on {args.ranks} ranks (gloo), "
          f"batch {args.batch}/rank; torch {torch.__version__}, {os.cpu_count()} cores; medians of "
          f"{args.rounds * args.steps} steps per setting, settings interleaved\n")
    print(f"{'buckets':>8} {'calls/step':>10}  {'setting':<19}{'median step':>12}{'vs off':>9}")
    for bucket_mb, label in ((25, "25 MiB"), (1e-6, "1/param")):
        res, calls = launch(bench_rank, args.ranks, cfg, args.steps, args.rounds, args.batch, bucket_mb,
                            timeout=1800)[0]
        for s in SETTINGS:
            print(f"{label:>8} {calls:>10.0f}  {s:<19}{res[s] * 1e3:>10.2f}ms{(res[s] / res['off'] - 1) * 100:>8.1f}%")
        print(f"{'':>8} goal: recorder < 5% of a step: {res['recorder'] / res['off'] - 1 < 0.05}\n")
    print(f"the recorder's own cost per call (one process, best of 5): {per_call_cost() * 1e6:.1f} us")


if __name__ == "__main__":
    main()
