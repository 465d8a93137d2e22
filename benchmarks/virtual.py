"""What the virtual GPU clock costs: the same program on the wall clock and on a virtual H100.

    python benchmarks/virtual.py [--repeats 5] [--world-size 4] [--programs ddp,1f1b,nd]

Three programs, each run ``--repeats`` times per clock, interleaved (wall, call-only, virtual,
virtual, call-only, wall, ...) so that a change in the machine's load hits all alike: DDP
training steps of TinyGPT (one bucket all-reduced per layer group, hooks overlapping
backward), a 1F1B pipeline step over 4 stages, and two steps of chapter 9's tiny Llama on
DP x TP (its layout table's run).
Each rank times its own work with ``time.perf_counter`` (process start and group set-up
excluded, the same for both clocks); a run's time is its slowest rank's. With more ranks
than cores, and other processes on them, wall time swings with the load: the CPU seconds the
ranks spent (``time.process_time``, summed over ranks) are printed beside it. Prints the
medians, the medians of each repeat's ratios (a repeat's three runs follow each other, in
turn forwards and backwards, so a change in the load between repeats cancels), and the aten
ops the ranks ran (a counting pass, not timed): the clock's cost per op.

What the virtual clock adds per rank: a Python ``__torch_dispatch__`` call per aten op
outside communication (pricing: a FLOP formula, the bytes of its tensors; a communication
call's own ops skip the mode), the members' ready times beside each collective (a MAX over
slots in a file the launch's ranks all map: :mod:`course_lib.virtual.exchange`), an 8-byte
header per point-to-point message. The first of these has a floor
that is torch's, not the clock's, so each program also runs on the wall clock under a mode
that only calls each op (``CallOnly``): any per-op dispatch mode costs at least that. The
last lines time the same floor in one process: one pipeline stage's forward and backward,
bare, under the call-only mode, and under the clock's mode. The ratio is about 1 + (that
cost per op) / (the program's CPU time per op): over 1.5x for the tiny ops of a
launch-bound program (chapter 9's model is 64 wide), near 1x for a GPU-sized step, whose
ops take milliseconds. So the target is on the clock's own cost: at most 1.15x over the
call-only floor (the wall clock's 1.5x bound is retired: the floor alone is 1.1-1.8x here).

Seen here (2 cores shared with other jobs, load 10-17, 5 repeats, three runs): the clock over
the floor 1.04-1.08x CPU (DDP), 1.02-1.04x (1F1B), 1.13-1.26x (chapter 9: over the target,
the same before and after the per-op memos); its wall ratios swung 0.7-1.4x with the load
(read the CPU column on a loaded machine). In one process the clock adds 3.5-5 us an op to
the call-only mode's 9-12 (6.3-7.3 before its memos: an op's kind by its C++ operator, its
bytes per dtype, its seconds per cost; a GEMM's FLOPs per shape). The rest is per
collective: its bookkeeping (lanes, NCCL's price, memoised per group) tens of us, and its
ready-time exchange. That was a 16-byte all-reduce on the backend: 250-400 us of CPU in a
rank's process (gloo's messages and threads), ~20-25 ms of the 20-50 a rank spends over the
floor in chapter 9 (100 collectives a rank, its TP all-reduces many and small); it cannot
ride on the real collective (a longer buffer changes how gloo chunks the sum, so the results
would no longer be the wall clock's). Now the members write their ready times into a shared
file and read each other's (the backend's all-reduce only where the ranks share no
directory, under torchrun): 4 ranks, pairs racing, 260 us of CPU an exchange on gloo, 44 on
the file (most of it the waits' sleeps; beside a collective, which has synchronised the
members already, it does not wait). Chapter 9's run, the same virtual times bit for bit:
0.94 -> 0.88 CPU s over the ranks (medians of 8, alternating); the clock over the floor
1.11-1.27x CPU before, 1.10-1.23x after (3-4 runs of 5-7 repeats each, load 10-17: the
noise here is as large as the change).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from course_lib import launch, reference  # noqa: E402
from course_lib.virtual import VirtualCluster  # noqa: E402


def ddp_steps(region=contextlib.nullcontext, steps=3):
    from course_lib.models import GPTConfig, TinyGPT
    from course_lib.parallel import DDP
    cfg = GPTConfig(vocab_size=64, seq_len=64, n_layers=4, hidden=128, n_heads=4)
    model = DDP(TinyGPT(cfg, seed=0), bucket_cap_mb=0.25)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = reference.gpt_batches(cfg, batch=8, steps=steps)
    started, cpu = time.perf_counter(), time.process_time()
    with region():
        for x, y in batches:
            _, loss = model(x, y, n_tokens=y.numel())
            loss.backward()
            model.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad()
    return time.perf_counter() - started, time.process_time() - cpu


def pipeline_step(region=contextlib.nullcontext, m=8, n_linear=8, h=256, b=32):
    import torch.nn as nn

    from course_lib.collectives.comm import Comm
    from course_lib import schedules as S
    from course_lib.parallel.pipeline import run_schedule
    comm = Comm(None, dim="pp")
    p = comm.size
    torch.manual_seed(comm.rank)
    stages = {comm.rank: nn.Sequential(*[nn.Sequential(nn.Linear(h, h), nn.ReLU()) for _ in range(n_linear)])}
    inputs = [torch.randn(b, h) for _ in range(m)]
    started, cpu = time.perf_counter(), time.process_time()
    with region():
        run_schedule(S.make_schedule("1f1b", p, m), stages, comm, p=p, m=m, inputs=inputs, targets=[None] * m,
                     loss_fn=lambda y, t: y.pow(2).mean(), act_shape=(b, h))
    return time.perf_counter() - started, time.process_time() - cpu


def nd_steps(region=contextlib.nullcontext, steps=2):
    """Chapter 9's tiny Llama on DP x TP (tp=2), as the notebook's layout table runs it."""
    from course_lib.gpt import GPTConfig, TinyGPT
    from course_lib.parallel import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layers=4, hidden=64, n_heads=4, n_kv_heads=2)
    world = torch.distributed.get_world_size()
    net = parallelize_nd(TinyGPT(cfg, seed=0), Mesh(dp=world // 2, tp=2) if world % 2 == 0 else Mesh(dp=world))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    batches = reference.gpt_batches(cfg, batch=8, steps=steps)
    started, cpu = time.perf_counter(), time.process_time()
    with region():
        for x, y in batches:
            net.step(x, y)
            opt.step()
            opt.zero_grad()
    return time.perf_counter() - started, time.process_time() - cpu


class CallOnly(TorchDispatchMode):
    """The floor of any per-op dispatch mode: each aten op through torch's Python round trip,
    called and nothing else (no pricing, no clock; communication's own ops included)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **kwargs) if kwargs else func(*args)


def count_ops(fn):
    """Aten ops one rank runs in the timed part of ``fn`` (communication's own included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func.namespace == "aten"
            return func(*args, **(kwargs or {}))
    fn(Count)
    return Count.n


def per_op_floor(repeats=15, n_linear=8, h=256, b=32):
    """Microseconds per aten op of one pipeline stage's forward and backward in this process:
    bare, and what a mode that only calls the op and the virtual clock's mode each add."""
    import torch.nn as nn

    from course_lib import trace

    torch.manual_seed(0)
    stage = nn.Sequential(*[nn.Sequential(nn.Linear(h, h), nn.ReLU()) for _ in range(n_linear)])
    x = torch.randn(b, h, requires_grad=True)

    def work(region=contextlib.nullcontext):
        with region():
            stage(x).pow(2).mean().backward()
    ops = count_ops(work)
    clock = VirtualCluster("h100-sxm", gpus_per_node=8).start(0, 1, trace.Recorder())
    modes = {"bare": contextlib.nullcontext, "call-only mode": CallOnly, "virtual clock": lambda: clock}
    times = {k: [] for k in modes}
    for _ in range(repeats):
        for name, mode in modes.items():
            with mode():
                started = time.process_time()
                for _ in range(4):
                    work()
            times[name].append((time.process_time() - started) / (4 * ops) * 1e6)
    return ops, {k: statistics.median(v) for k, v in times.items()}


def _paired(runs, base):
    """(wall, CPU) ratios of ``runs`` over ``base``: the median over repeats of each repeat's own."""
    return tuple(statistics.median(r[i] / b[i] for r, b in zip(runs, base)) for i in (0, 1))


PROGRAMS = {"ddp": ("DDP, 3 TinyGPT steps", ddp_steps), "1f1b": ("1F1B pipeline, one step", pipeline_step),
            "nd": ("chapter 9's DP x TP, 2 steps", nd_steps)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--programs", default=",".join(PROGRAMS),
                    help=f"comma-separated, of {', '.join(PROGRAMS)} (default: all)")
    args = ap.parse_args(argv)
    chosen = [p.strip() for p in args.programs.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PROGRAMS]
    if unknown or not chosen:
        ap.error(f"unknown programs {unknown}: choose from {', '.join(PROGRAMS)}")
    cluster = VirtualCluster("h100-sxm", gpus_per_node=8, dtype=torch.bfloat16)
    print(f"{args.world_size} ranks on {os.cpu_count()} cores, medians of {args.repeats} runs (seconds of "
          f"the slowest rank's work)")
    ratios, over_floor = {}, {}
    for name, fn in (PROGRAMS[p] for p in chosen):
        times = {"wall": [], "call-only": [], "virtual": []}
        ops = sum(launch(count_ops, args.world_size, fn, quiet=True))   # (also warms the forkserver and imports)
        runs = (("wall", None, ()), ("call-only", None, (CallOnly,)), ("virtual", cluster, ()))
        for i in range(args.repeats):
            for kind, clock, region in runs if i % 2 == 0 else runs[::-1]:   # (no clock always last)
                res = launch(fn, args.world_size, *region, clock=clock, quiet=True)
                times[kind].append((max(w for w, _ in res), sum(c for _, c in res)))
        (w_wall, w_cpu), (f_wall, f_cpu), (v_wall, v_cpu) = (
            [statistics.median(x[i] for x in times[k]) for i in (0, 1)] for k in times)
        ratios[name] = vw, vc = _paired(times["virtual"], times["wall"])
        fw, fc = _paired(times["call-only"], times["wall"])
        over_floor[name] = ow, oc = _paired(times["virtual"], times["call-only"])
        print(f"{name}:\n  wall clock run {w_wall:6.3f} s ({w_cpu:6.3f} CPU s)   virtual clock run {v_wall:6.3f} s "
              f"({v_cpu:6.3f} CPU s)   ratio {vw:4.2f}x ({vc:4.2f}x CPU)\n"
              f"  the floor, a call-only mode on the wall clock: {f_wall:6.3f} s ({f_cpu:6.3f} CPU s)   "
              f"ratio {fw:4.2f}x ({fc:4.2f}x CPU); the clock over it {ow:4.2f}x ({oc:4.2f}x CPU)\n"
              f"  {ops} aten ops over the ranks: {w_cpu / ops * 1e6:5.1f} us of CPU per op on the wall clock, "
              f"+{(v_cpu - w_cpu) / ops * 1e6:4.1f} us on the virtual clock")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ops, per_op = per_op_floor()
    torch.set_num_threads(threads)
    bare = per_op["bare"]
    print(f"one stage's forward and backward in this process ({ops} aten ops, 1 thread), CPU us per op: "
          f"bare {bare:.1f}, call-only mode +{per_op['call-only mode'] - bare:.1f}, "
          f"virtual clock +{per_op['virtual clock'] - bare:.1f}")
    worst = max(r for pair in ratios.values() for r in pair)
    wall, cpu = (max(pair[i] for pair in over_floor.values()) for i in (0, 1))
    print(f"worst ratio to the wall clock {worst:.2f}x; the clock over the call-only floor at worst "
          f"{wall:.2f}x ({cpu:.2f}x CPU) (target <= 1.15x)")
    return ratios, over_floor


if __name__ == "__main__":
    main()
