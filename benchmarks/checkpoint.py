"""Checkpoint cost: save, load and asynchronous save against the disk's own bandwidth, ours
next to torch.distributed.checkpoint.

    python benchmarks/checkpoint.py [--hidden 384] [--layers 4] [--ranks 2] [--repeats 3]

On ``--ranks`` ranks (dp FSDP, float32 AdamW), medians of ``--repeats``:
- the disk: writing the bytes one rank's shard holds, with fsync (what a save cannot beat);
- a step without a save; a synchronous ``save``; ``AsyncSaver.save`` (the blocking part:
  planning and the copy) and the step it overlaps; ``load`` into the same layout;
- the verdict: a synchronous save + a step against the blocking part + the step beside the
  writer. The asynchronous save pays only where the writer runs on what the step leaves idle
  (a spare core; on a GPU node the host's cores and the copy engine): on cores the step uses
  the writer slows the step down;
- torch's DCP (``dcp.save`` / ``dcp.async_save``) from FSDP2 (``fully_shard``) of the same model.
Bytes per second = the checkpoint's bytes / time. Wall-clock on this CPU: with more ranks than
cores the numbers say more about time-sharing than about the method (DESIGN.md).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from course_lib import launch, reference  # noqa: E402
from course_lib.gpt import GPTConfig, TinyGPT  # noqa: E402


def _disk(path, nbytes):
    """Seconds to write ``nbytes`` to a new file and fsync it."""
    data = os.urandom(min(nbytes, 2**24))
    t = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(data[:left])
            left -= len(data)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t
    os.remove(path)
    return elapsed


def _bench(cfg_dict, root, repeats):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from course_lib.checkpoint import AsyncSaver, load, save
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    cfg, rank, world = GPTConfig(**cfg_dict), dist.get_rank(), dist.get_world_size()
    x, y = reference.gpt_batches(cfg, batch=2 * world, steps=1)[0]
    net = parallelize_nd(TinyGPT(cfg, seed=0), Mesh(dp=world), data="fsdp")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step():
        dist.barrier()
        t = time.perf_counter()
        net.step(x, y), opt.step(), opt.zero_grad()
        return time.perf_counter() - t

    def timed(fn):
        dist.barrier()
        t = time.perf_counter()
        out = fn()
        dist.barrier()
        return time.perf_counter() - t, out

    step()
    saver, out = AsyncSaver(), {k: [] for k in ("step", "save", "load", "blocked", "overlapped", "disk",
                                                 "dcp_save", "dcp_blocked")}
    for i in range(repeats):
        out["step"].append(step())
        t, nbytes = timed(lambda: save(os.path.join(root, f"sync{i}"), net, opt))
        out["save"].append(t)
        out["load"].append(timed(lambda: load(os.path.join(root, f"sync{i}"), net, opt))[0])
        out["blocked"].append(timed(lambda: saver.save(os.path.join(root, f"async{i}"), net, opt))[0])
        out["overlapped"].append(step())
        saver.wait()
        out["disk"].append(_disk(os.path.join(root, f"disk{rank}"), nbytes))
    model = TinyGPT(cfg, seed=0)
    fully_shard(model)
    t_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(x, y, n_tokens=y.numel())[1].backward()
    t_opt.step()
    for i in range(repeats):
        msd, osd = get_state_dict(model, t_opt)
        out["dcp_save"].append(timed(lambda: dcp.save({"model": msd, "optim": osd},
                                                      checkpoint_id=os.path.join(root, f"dcp{i}")))[0])
        t, future = timed(lambda: dcp.async_save({"model": msd, "optim": osd},
                                                 checkpoint_id=os.path.join(root, f"dcpa{i}")))
        future.result()
        out["dcp_blocked"].append(t)
    return {k: statistics.median(v) for k, v in out.items()}, nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layers=args.layers, hidden=args.hidden, n_heads=6,
                    n_kv_heads=6)
    root = tempfile.mkdtemp()
    try:
        res = launch(_bench, args.ranks, dict(cfg.__dict__), root, args.repeats, threads=1, timeout=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    slowest = {k: max(r[0][k] for r in res) for k in res[0][0]}
    per_rank = max(r[1] for r in res)
    total = sum(r[1] for r in res)
    mib = lambda n, s: f"{n / s / 2**20:8.0f} MiB/s"
    print(f"{args.ranks} ranks, dp FSDP, fp32 AdamW, {total / 2**20:.1f} MiB of checkpoint "
          f"({per_rank / 2**20:.1f} MiB on the largest rank); medians of {args.repeats}, slowest rank")
    print(f"  disk (write + fsync one rank's bytes) {slowest['disk'] * 1e3:8.1f} ms {mib(per_rank, slowest['disk'])}")
    print(f"  step without a save                   {slowest['step'] * 1e3:8.1f} ms")
    print(f"  save (synchronous)                    {slowest['save'] * 1e3:8.1f} ms {mib(total, slowest['save'])}")
    print(f"  load (same layout)                    {slowest['load'] * 1e3:8.1f} ms {mib(total, slowest['load'])}")
    print(f"  async save: blocked                   {slowest['blocked'] * 1e3:8.1f} ms")
    print(f"  async save: the step it overlaps      {slowest['overlapped'] * 1e3:8.1f} ms")
    print(f"  torch DCP save (FSDP2)                {slowest['dcp_save'] * 1e3:8.1f} ms "
          f"{mib(total, slowest['dcp_save'])}")
    print(f"  torch DCP async_save: blocked         {slowest['dcp_blocked'] * 1e3:8.1f} ms")
    sync, beside = slowest["save"] + slowest["step"], slowest["blocked"] + slowest["overlapped"]
    print(f"  a synchronous save + a step           {sync * 1e3:8.1f} ms")
    print(f"  async: blocked + the step beside it   {beside * 1e3:8.1f} ms: the asynchronous save "
          f"{'saves' if beside < sync else 'costs'} {abs(sync - beside) * 1e3:.1f} ms here")


if __name__ == "__main__":
    main()
