"""Hello from every rank: the smallest real distributed program.

    python -m course_lib.examples.hello --nproc 4          # course_lib.launch starts 4 ranks
    torchrun --nproc_per_node=2 -m course_lib.examples.hello            # gloo on CPU
    torchrun --nproc_per_node=8 -m course_lib.examples.hello --backend nccl   # one GPU per rank

The same ``launch`` call runs ``fn`` on this process only when torchrun started it.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from course_lib.launch import launch, under_torchrun


def hello(backend: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    x = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(x)  # 1 + 2 + ... + world
    expected = world * (world + 1) / 2
    assert float(x) == expected, (float(x), expected)
    print(f"hello from rank {rank} of {world} on {device} ({dist.get_backend()}): "
          f"all_reduce(rank + 1) = {float(x):g}", flush=True)
    return float(x)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    args = parser.parse_args(argv)
    world = None if under_torchrun() else args.nproc
    results = launch(hello, world, args.backend, backend=args.backend, timeout=120)
    if not under_torchrun() or int(os.environ["RANK"]) == 0:
        print(f"results in rank order: {list(results)}")


if __name__ == "__main__":
    main()
