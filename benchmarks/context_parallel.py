"""Ring attention and Ulysses side by side, and torch's own context parallelism where it runs.

    python benchmarks/context_parallel.py                  # 2 and 4 ranks, gloo on this machine
    python benchmarks/context_parallel.py --ranks 2 --seq 4096 --rounds 7

For each world size one launch times, in alternating rounds, forward + backward of causal
attention (b=1, a=8 heads, d=64, fp32) over a sequence split over the CP ranks: our ring
attention (zigzag), Ulysses (all-to-all), and the same full attention on one rank (every
rank computes the whole thing, the 1-device baselines): the plain one, which saves the (s, s)
probabilities, and the blockwise (FlashAttention-style) one, which saves O(s) and recomputes
them in backward (``course_lib.attention.blockwise_causal_attention``). Reported: the median over rounds of
the slowest rank, and the ratios. Then torch's
``torch.distributed.tensor.experimental.context_parallel`` is tried on the same inputs: on
CPU (torch 2.13) it raises, and the error it gives is printed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from course_lib.launch import launch  # noqa: E402


def bench_rank(seq, heads, rounds):
    import time

    import torch
    import torch.distributed as dist

    from course_lib.attention import blockwise_causal_attention, causal_attention
    from course_lib.parallel import context_parallel as cp
    from course_lib.parallel.mesh import Mesh

    mesh = Mesh(cp=dist.get_world_size())
    comm = mesh.comm("cp")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, 64, generator=g) for _ in range(3))
    pos = cp.zigzag_positions(seq, comm.size, comm.rank)
    local = [t.index_select(2, pos) for t in (q, k, v)]

    def run(kind):
        if kind.startswith("one device"):
            ts = [t.clone().requires_grad_() for t in (q, k, v)]
            blockwise = kind.endswith("blockwise")
            (blockwise_causal_attention(*ts, block=128) if blockwise else causal_attention(*ts)).sum().backward()
            return
        ts = [t.clone().requires_grad_() for t in local]
        f = cp.ring_attention if kind == "ring" else cp.ulysses_attention
        f(*ts, pos, comm).sum().backward()

    times = {k: [] for k in ("ring", "ulysses", "one device", "one device blockwise")}
    for _ in range(rounds):
        for kind in times:
            dist.barrier()
            t0 = time.perf_counter()
            run(kind)
            times[kind].append(time.perf_counter() - t0)
    return times, torch_context_parallel(q, k, v)


def torch_context_parallel(q, k, v):
    """torch's context_parallel on the same inputs: ('ok', seconds) or ('error', message)."""
    import time

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    bufs = [t.clone() for t in (q, k, v)]
    try:
        t0 = time.perf_counter()
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(*bufs, is_causal=True)
        return "ok", time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0]}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    for n in args.ranks:
        res = launch(bench_rank, n, args.seq, args.heads, args.rounds, timeout=400,
                     threads=max(1, (os.cpu_count() or 2) // n))
        med = {k: statistics.median(max(r[0][k][i] for r in res) for i in range(args.rounds)) for k in res[0][0]}
        print(f"CP={n}, seq={args.seq}, heads={args.heads}, d=64, fp32, forward+backward, median of "
              f"{args.rounds} (slowest rank):")
        for kind, t in med.items():
            print(f"  {kind:<21} {t * 1e3:8.1f} ms   {t / med['ring']:5.2f}x ring")
        status, detail = res[0][1]
        print(f"  torch context_parallel: {status}: {detail}")


if __name__ == "__main__":
    main()
