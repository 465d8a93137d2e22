"""FSDP with the experts split over ep: ours against torch's ``fully_shard`` (FSDP2), one MoE layer.

    python benchmarks/fsdp_experts.py                      # 4 ranks (dp 4 x ep 2), gloo on this machine
    python benchmarks/fsdp_experts.py --hidden 256 --tokens 512 --rounds 9

One launch of 4 ranks holds the same expert-parallel MoE layer (``ExpertParallelMoE`` on
``Mesh(dp=4, ep=2)``: E experts, top-k, capacity factor 1.25, fp32, GeLU experts h -> 4h -> h)
sharded twice, as chapter 8 shards it:

  * "ours": ``FSDP(layer, units=[layer.experts], unit_dims={layer.experts: ("edp",)})``: the
    router over dp's 4 ranks, the experts (one unit) over the 2 ranks holding them;
  * "torch fully_shard": ``fully_shard(layer.experts, mesh=edp)`` with torchtitan's
    ``set_gradient_divide_factor(4)``, then ``fully_shard(layer, mesh=dp)``; on gloo also
    ``set_force_sum_reduction_for_comms(True)``: torch 2.13 divides an fp32 gradient by a
    custom factor inside the reduce-scatter (``ReduceOp.PREMUL_SUM``), which only NCCL has.

Each round times, interleaved, one step of each: forward + backward of ``tokens`` tokens per
rank and the gradients reduce-scattered to their shards. Reported: the median over rounds of
the slowest rank, the ratio, and each one's largest gradient difference from one device (the
same layer on every rank's tokens, each a routing group).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from course_lib.launch import launch  # noqa: E402

KINDS = ("ours", "torch fully_shard")


def _layer(hidden, n_experts, top_k, mesh):
    from course_lib.moe import MoE
    from course_lib.parallel.expert_parallel import ExpertParallelMoE
    return ExpertParallelMoE(MoE(hidden, 4 * hidden, n_experts, top_k, 1.25, seed=0), mesh)


def bench_rank(hidden, n_experts, top_k, tokens, rounds):
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from course_lib.parallel.fsdp import FSDP
    from course_lib.parallel.mesh import Mesh

    mesh = Mesh(dp=4, ep=2)                     # ep pairs (0, 1), (2, 3); edp (0, 2), (1, 3)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(dist.get_rank()))
    ours = _layer(hidden, n_experts, top_k, mesh)
    ours = FSDP(ours, mesh=mesh, dims="dp", units=[ours.experts], unit_dims={ours.experts: ("edp",)})
    theirs = _layer(hidden, n_experts, top_k, mesh)
    fully_shard(theirs.experts, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))["edp"])
    theirs.experts.set_gradient_divide_factor(4)    # the data's ranks, not the experts' group
    fully_shard(theirs, mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    for module in (theirs.experts, theirs):   # fp32 with a factor: NCCL's PREMUL_SUM, which gloo
        module.set_force_sum_reduction_for_comms(True)      # lacks; a SUM, then a division

    def step_ours():
        (ours(x)[0].sum() / tokens).backward()
        ours.finish_gradient_synchronization()

    def step_torch():
        (theirs(x)[0].sum() / tokens).backward()

    runs = {KINDS[0]: step_ours, KINDS[1]: step_torch}
    for run in runs.values():  # warm-up
        run()
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for kind, run in runs.items():
            for p in (ours if kind == KINDS[0] else theirs).parameters():
                p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            run()
            times[kind].append(time.perf_counter() - t0)
    # the last step's gradients, whole: ours gathered from the shards' rows, torch's DTensors
    grads = {"torch fully_shard": {n.replace("_fsdp_wrapped_module.", ""): p.grad.full_tensor()
                                   for n, p in theirs.named_parameters()}}
    mine = {}
    for u in ours.units:
        for (mod, attr, i) in u.owners:
            piece = u.pieces[i]
            full = piece.grad.new_zeros(u.slots[i].shape)
            start = u.rank * u.slots[i].chunk
            full[start:start + u.slots[i].rows] = piece.grad
            u.comm.all_reduce(full)                      # the group's rows side by side
            name = next(n for n, m in ours.module.named_modules() if m is mod)
            mine[f"{name}.{attr}" if name else attr] = full
    grads["ours"] = mine
    return times, grads, mesh.coord["ep"]


def reference(hidden, n_experts, top_k, tokens):
    """One device's gradients of the same loss (each rank's tokens a routing group), by name
    as an EP slot holds them: {ep slot: {name: gradient}}."""
    import torch

    from course_lib.moe import MoE
    one = MoE(hidden, 4 * hidden, n_experts, top_k, 1.25, seed=0)
    for r in range(4):
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(r))
        (one(x)[0].sum() / tokens / 4).backward()
    local = n_experts // 2
    out = {}
    for slot in range(2):
        g = {n: p.grad for n, p in one.named_parameters() if not n.startswith("experts.")}
        for j in range(local):
            for n, p in one.experts[slot * local + j].named_parameters():
                g[f"experts.{j}.{n}"] = p.grad
        out[slot] = g
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    ranks = launch(bench_rank, 4, args.hidden, args.experts, args.top_k, args.tokens, args.rounds, timeout=600)
    want = reference(args.hidden, args.experts, args.top_k, args.tokens)
    slowest = {k: [max(r[0][k][i] for r in ranks) for i in range(args.rounds)] for k in KINDS}
    med = {k: statistics.median(v) for k, v in slowest.items()}
    print(f"FSDP, experts split: dp 4 x ep 2, E={args.experts}, top-{args.top_k}, h={args.hidden}, "
          f"{args.tokens} tokens per rank, median of {args.rounds} rounds (slowest rank)")
    for kind in KINDS:
        worst = max(float((r[1][kind][n] - want[r[2]][n]).abs().max()) for r in ranks for n in want[r[2]])
        print(f"  {kind:<18} {med[kind] * 1e3:8.2f} ms   {med[kind] / med[KINDS[1]]:5.2f}x torch   "
              f"max |grad - one device| {worst:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
