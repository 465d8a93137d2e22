"""Expert-parallel MoE layer against the same MoE on one device, torch's all-to-all against ours.

    python benchmarks/expert_parallel.py                   # ep = 2 and 4, gloo on this machine
    python benchmarks/expert_parallel.py --ranks 2 --hidden 512 --tokens 1024 --rounds 9

For each EP size one launch times, in interleaved rounds, forward + backward of one MoE layer
(E experts, top-k, capacity factor 1.25, fp32, GeLU experts h -> 4h -> h) on ``tokens`` tokens
per rank:
  * "EP, torch all-to-all": ``ExpertParallelMoE(impl="torch")``: dispatch / combine by
    ``torch.distributed.all_to_all_single`` (gloo);
  * "EP, our all-to-all": ``impl="course"``: course_lib's pairwise all-to-all (send/recv);
  * "one device": ``MoE`` with all E experts over all ranks' tokens (routed in ep groups, the
    same capacities), run by every rank at the same time, so both share the cores alike.
Reported: the median over rounds of the slowest rank, the ratios, and each rank's rows.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from course_lib.launch import launch  # noqa: E402

KINDS = ("EP, torch all-to-all", "EP, our all-to-all", "one device")


def bench_rank(hidden, n_experts, top_k, tokens, rounds):
    import time

    import torch
    import torch.distributed as dist

    from course_lib.moe import MoE
    from course_lib.parallel.expert_parallel import ExpertParallelMoE
    from course_lib.parallel.mesh import Mesh

    n = dist.get_world_size()
    mesh = Mesh(dp=n, ep=n)
    x_all = torch.randn(tokens * n, hidden, generator=torch.Generator().manual_seed(0))
    x = x_all.chunk(n)[mesh.coord["ep"]]

    def moe():
        return MoE(hidden, 4 * hidden, n_experts, top_k, 1.25, seed=0)

    one = moe()
    layers = {impl: ExpertParallelMoE(moe(), mesh, impl=impl) for impl in ("torch", "course")}
    runs = {KINDS[0]: lambda: layers["torch"](x)[0].sum().backward(),
            KINDS[1]: lambda: layers["course"](x)[0].sum().backward(),
            KINDS[2]: lambda: one(x_all, groups=n)[0].sum().backward()}
    for run in runs.values():  # warm-up
        run()
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for kind, run in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            run()
            times[kind].append(time.perf_counter() - t0)
    layers["torch"].comm.reset()
    layers["torch"](x)
    rows = [c.payload // (hidden * 4) for c in layers["torch"].comm.log if c.name == "combine"][0]
    return times, rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    for n in args.ranks:
        res = launch(bench_rank, n, args.hidden, args.experts, args.top_k, args.tokens, args.rounds, timeout=600,
                     threads=max(1, (os.cpu_count() or 2) // n))
        med = {k: statistics.median(max(r[0][k][i] for r in res) for i in range(args.rounds)) for k in KINDS}
        print(f"EP={n}, E={args.experts}, top-{args.top_k}, h={args.hidden}, ffn={4 * args.hidden}, "
              f"{args.tokens} tokens/rank, fp32, forward+backward, median of {args.rounds} (slowest rank):")
        for kind in KINDS:
            t = med[kind]
            print(f"  {kind:<21} {t * 1e3:8.1f} ms   {t / med['one device']:5.2f}x one device"
                  f"   {t / med[KINDS[0]]:5.2f}x EP torch")
        print(f"  rows computed per rank: {[r[1] for r in res]}")


if __name__ == "__main__":
    main()
