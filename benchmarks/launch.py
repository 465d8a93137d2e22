"""How long does it take to run a trivial distributed function on N ranks?

    python benchmarks/launch.py [--repeats 5] [--sizes 1 2 4 8]

Side by side in one run, medians of ``--repeats``: course_lib.launch (forkserver,
the default), course_lib.launch with spawn, torch.multiprocessing.spawn, and
torch.multiprocessing.start_processes with fork. Every variant does the same work
in each rank: build a gloo process group through a FileStore, one barrier, return.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as tmp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from course_lib import launch  # noqa: E402


def trivial():
    dist.barrier()
    return dist.get_rank()


def torch_worker(rank, world_size, store_path):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    dist.destroy_process_group()


def run_torch(world_size, start_method):
    with tempfile.TemporaryDirectory() as d:
        tmp.start_processes(torch_worker, args=(world_size, os.path.join(d, "store")), nprocs=world_size,
                            start_method=start_method, join=True)


def time_it(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    variants = {
        "course_lib.launch": lambda n: launch(trivial, n, quiet=True),
        "course_lib.launch (spawn)": lambda n: launch(trivial, n, quiet=True, start_method="spawn"),
        "mp.spawn": lambda n: run_torch(n, "spawn"),
        "start_processes(fork)": lambda n: run_torch(n, "fork"),
    }
    launch(trivial, 2, quiet=True)  # start the forkserver once, as a notebook's first launch does
    print(f"median wall time of {args.repeats} runs (s), {os.cpu_count()} cores")
    print(f"{'ranks':>5} " + " ".join(f"{name:>26}" for name in variants) + f" {'launch / mp.spawn':>18}")
    for n in args.sizes:
        row = {name: time_it(lambda: fn(n), args.repeats) for name, fn in variants.items()}
        ratio = row["course_lib.launch"] / row["mp.spawn"]
        print(f"{n:>5} " + " ".join(f"{row[name]:>26.3f}" for name in variants) + f" {ratio:>18.2f}")


if __name__ == "__main__":
    main()
