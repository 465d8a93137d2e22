"""Our pipeline schedules next to torch.distributed.pipelining's, side by side in one run.

    python benchmarks/pipeline.py                      # p=2, m=8, the tiny GPT, gloo on this machine
    python benchmarks/pipeline.py --ranks 4 --microbatches 8 --hidden 256 --rounds 5

One launch builds, for every schedule (GPipe, 1F1B, interleaved 1F1B with v=2, ZB-H1), our
``PipelineParallel`` and torch's ``TorchPipeline`` (PipelineStage + its schedule of the same
name: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)
on identical stages and data, and times one step (forward + backward of every micro-batch,
gradients in place) in alternating rounds (ours, torch's, ours, ...), so machine noise hits
both alike. Reported: the median step time of each and their ratio (goal: <= 1.3x), and one
rank's point-to-point bytes per step. One intra-op thread per rank.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from course_lib.launch import launch  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))


def bench_rank(cfg, m, rounds, batch):
    import torch.distributed as dist

    from course_lib import reference
    from course_lib.models import TinyGPT
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.pipeline import PipelineParallel, TorchPipeline

    mesh = Mesh(pp=dist.get_world_size())
    x, y = reference.gpt_batches(cfg, batch=batch, steps=1)[0]
    out = {}
    for name, v in SCHEDULES:
        pipes = {"ours": PipelineParallel(TinyGPT(cfg, seed=0), mesh, name, microbatches=m, v=v),
                 "torch": TorchPipeline(TinyGPT(cfg, seed=0), mesh, name, microbatches=m, v=v)}
        times = {k: [] for k in pipes}
        for r in range(rounds + 1):                      # round 0 warms up (torch infers shapes)
            for k, pipe in pipes.items():
                dist.barrier()
                t0 = time.perf_counter()
                pipe.step(x, y, n_tokens=y.numel())
                dist.barrier()
                if r:
                    times[k].append(time.perf_counter() - t0)
                for q in pipe.parameters():
                    q.grad = None
        out[name] = {k: statistics.median(t) for k, t in times.items()}
        out[name]["bytes"] = pipes["ours"].last_result.bytes_sent
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    from course_lib.models import GPTConfig
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, n_layers=args.layers, hidden=args.hidden, n_heads=4)
    res = launch(bench_rank, args.ranks, cfg, args.microbatches, args.rounds, args.batch, threads=1, timeout=600)
    print(f"p={args.ranks}, m={args.microbatches}, TinyGPT(hidden={args.hidden}, layers={args.layers}, "
          f"seq={args.seq}), batch {args.batch}, 1 thread per rank, median of {args.rounds} steps")
    print(f"{'schedule':<12} {'ours ms':>9} {'torch ms':>9} {'ratio':>7} {'p2p bytes (rank 0)':>20}")
    for name, _ in SCHEDULES:
        ours = max(r[name]["ours"] for r in res)          # a step ends when its slowest rank does
        theirs = max(r[name]["torch"] for r in res)
        print(f"{name:<12} {ours * 1e3:9.1f} {theirs * 1e3:9.1f} {ours / theirs:7.2f} {res[0][name]['bytes']:>20,}")


if __name__ == "__main__":
    main()
