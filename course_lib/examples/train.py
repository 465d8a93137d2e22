"""Train the tiny GPT data-parallel with our DDP, ZeRO-1, ZeRO-2 or FSDP.

    python -m course_lib.examples.train --parallel fsdp --nproc 4        # course_lib.launch starts 4 ranks
    torchrun --standalone --nproc_per_node=4 -m course_lib.examples.train --parallel zero2   # gloo, CPU
    torchrun --standalone --nproc_per_node=8 -m course_lib.examples.train --parallel fsdp --backend nccl \\
        --dtype bf16                                                    # one GPU per rank

Every rank draws the same global batch (same seed) and trains on its own rows; the loss
printed is the mean over ranks. The same ``launch`` call runs ``train`` on this process
only when torchrun started it.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from course_lib.launch import launch, under_torchrun

PARALLEL = ("ddp", "zero1", "zero2", "fsdp")


def train(parallel, steps=20, batch=8, seq_len=32, hidden=64, layers=2, lr=3e-3, dtype=None,
          backend="gloo", log_every=5):
    from course_lib.data import batches, byte_tokens, synthetic_text
    from course_lib.models import GPTConfig, TinyGPT
    from course_lib.parallel import DDP, FSDP, ShardedOptimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    if batch % world:
        raise ValueError(f"--batch ({batch}) must be divisible by the number of ranks ({world})")
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    cfg = GPTConfig(vocab_size=256, seq_len=seq_len, n_layers=layers, hidden=hidden, n_heads=4)
    model = TinyGPT(cfg, seed=0).to(device)
    if parallel == "ddp":
        net = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    elif parallel in ("zero1", "zero2"):
        net = model
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=int(parallel[-1]), lr=lr)
    elif parallel == "fsdp":
        net = FSDP(model, compute_dtype=dtype)
        opt = torch.optim.AdamW(net.parameters(), lr=lr)
    else:
        raise ValueError(f"--parallel must be one of {PARALLEL}, got {parallel!r}")
    tokens = byte_tokens(synthetic_text(20_000, seed=0))
    losses = []
    for step, (x, y) in enumerate(batches(tokens, batch, seq_len, seed=1, n_batches=steps)):
        rows = slice(rank * batch // world, (rank + 1) * batch // world)  # this rank's rows
        _, loss = net(x[rows].to(device), y[rows].to(device))
        loss.backward()
        if hasattr(net, "finish_gradient_synchronization"):
            net.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0 and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallel", choices=PARALLEL, nargs="+", default=["ddp"],
                        help="one or more, trained one after the other")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="FSDP compute dtype (master weights stay fp32)")
    args = parser.parse_args(argv)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    world = None if under_torchrun() else args.nproc
    for parallel in args.parallel:
        losses = launch(train, world, parallel, steps=args.steps, batch=args.batch, dtype=dtype,
                        backend=args.backend, timeout=600)[0]
        if not under_torchrun() or int(os.environ["RANK"]) == 0:
            print(f"{parallel}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps "
                  f"on {dist.get_world_size() if under_torchrun() else world} ranks", flush=True)


if __name__ == "__main__":
    main()
