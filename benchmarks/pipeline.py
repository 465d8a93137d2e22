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

    python benchmarks/pipeline.py --bubble             # the measured bubble once compute dominates

``--bubble``: every schedule on p=2 ranks, m=8, with equal stages big enough that compute
dominates (``--stage-layers`` ``--hidden`` x ``--hidden`` Linear+ReLU layers per rank, default 4 of
4096, on micro-batches of ``--rows`` rows, default 64; interleaved: 2 chunks of half of them). Stage 0's
input requires a gradient, so its backward does the same GEMMs as the other stages', split
(ZB-H1) or not (the formula assumes equal stages; without it stage 0 skips one GEMM of its
backward). The schedules run in rotated order each round, so the load of the machine hits them
alike. Per
step and rank, the bubble is the formula's: the idle fraction of the step (first forward to
last backward, over all ranks) outside the rank's F, B and W; reported: the median over steps
of the mean over ranks and the fastest step's (the one least disturbed by the machine's other
work), next to the formula at (F, B, W) = (1, 2, 1) and at the measured times, the trace
replayed on the schedule with free messages, the same replay with the costs measured between actions
(``pipeline.runner.measured_costs``: per-action overhead and message latency), and the
planner's simulator with those costs as its per-message time.
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
                pipe.step(x, y)
                dist.barrier()
                if r:
                    times[k].append(time.perf_counter() - t0)
                for q in pipe.parameters():
                    q.grad = None
        out[name] = {k: statistics.median(t) for k, t in times.items()}
        out[name]["bytes"] = pipes["ours"].last_result.bytes_sent
    return out


def equal_stage(stage, n_layers, hidden):
    """``n_layers`` Linear(hidden, hidden) + ReLU, weights ~ N(0, 1/hidden): equal stages."""
    import torch
    gen = torch.Generator().manual_seed(stage)
    layers = []
    for _ in range(n_layers):
        lin = torch.nn.Linear(hidden, hidden)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / hidden**0.5)
        layers += [lin, torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def bubble_rank(hidden, rows, m, rounds, jobs, layers=2):
    """Every job once per round (order rotated), round 0 a warm-up: {job: [this rank's spans per step]}."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from course_lib import trace
    from course_lib import schedules as S
    from course_lib.collectives.comm import Comm
    from course_lib.parallel.pipeline import ScheduleRunner

    p, me = dist.get_world_size(), dist.get_rank()
    comm = Comm(None, dim="pp")
    xs = [torch.randn(rows, hidden, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(m)]
    stages = {job: {s: equal_stage(s, layers // job[1], hidden) for s in range(me, p * job[1], p)} for job in jobs}
    built = {(name, v): (ScheduleRunner(S.make_schedule(name, p, m, v), stages[name, v], comm, p=p, m=m, v=v,
                                        act_shape=(rows, hidden)), stages[name, v]) for name, v in jobs}
    out = {job: [] for job in jobs}
    for r in range(rounds + 1):
        for k in range(len(jobs)):
            name, v = job = jobs[(k + r) % len(jobs)]
            runner, stages = built[job]
            dist.barrier()
            t0 = trace.now()
            runner.step(xs, xs, lambda o, t: (o - t).pow(2).sum())
            dist.barrier()
            if r:    # on this machine's clock (perf_counter is system-wide), not the rank's own zero
                shift = trace.recorder().origin
                out[job].append([dataclasses.replace(s, start=s.start + shift, end=s.end + shift)
                                 for s in trace.spans() if s.start >= t0])
            for q in [x for x in xs] + [q for st in stages.values() for q in st.parameters()]:
                q.grad = None
    return out


def planner_bubble(name, v, m, latency_in_forwards):
    """The planner's simulator on equal stages, ideal hardware except a per-message time of
    ``latency_in_forwards`` times its own forward: its bubble, the formula's way."""
    from course_lib import schedules as S
    from course_lib.planner import HARDWARE, Layout, ModelSpec, simulate
    even = ModelSpec("even", 48, 1024, 16, 16, 4096, 2, 1024)      # equal stages, a 2-token vocabulary
    layout = Layout(pp=2, schedule=name, v=v, global_batch=m)
    hw = HARDWARE["h100-sxm"].with_(nvlink_latency=0, network_latency=0, nvlink_bandwidth=1e30,
                                    network_bandwidth=1e30, elementwise_passes=0)
    t_f = next(s.end - s.start for s in simulate(even, hw, layout) if s.kind == "compute" and s.name.startswith("F"))
    spans = simulate(even, hw.with_(nvlink_latency=latency_in_forwards * t_f), layout)
    return S.bubble([s for s in spans if s.kind == "compute" and s.name[:1] in ("F", "B")])


def bubble_main(args):
    import statistics

    from course_lib import schedules as S
    from course_lib.parallel.pipeline import measured_costs

    jobs = tuple((name, v) for name, v in SCHEDULES if name in args.schedules)
    m = args.microbatches
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    res = launch(bubble_rank, 2, args.hidden, args.rows, m, args.rounds, jobs, args.stage_layers, threads=1, timeout=1800)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"p=2, m={m}, {args.stage_layers} x Linear({args.hidden}, {args.hidden}) per rank, {args.rows} rows per micro-batch, "
          f"1 thread per rank, {args.rounds} steps each; load average before {load0:.1f}, after {load:.1f} "
          f"on {os.cpu_count()} cores (other processes' work lengthens steps and gaps alike)")
    print("bubble = idle fraction of the step per rank, mean over ranks; 'fastest': the fastest step's, "
          "'median': over steps; at F,B,W: the formula at the measured times (ZB-H1's depends on them; the others' do not); rel.: fastest / at F,B,W - 1; imbal.: how much longer one rank computed than the other in that step (equal stages: the machine's doing); replay: the step's own action times on the schedule with free messages; "
          "+costs: and with its measured per-action overhead and message latency; planner: "
          "planner.simulate with that latency (in forwards) as its per-message time")
    print(f"{'schedule':<12}{'fastest':>8}{'median':>8}{'formula':>8}{'at F,B,W':>9}{'rel.':>6}{'imbal.':>7}{'replay':>8}{'+costs':>8}{'planner':>8}"
          f"{'F ms':>7}{'B ms':>7}{'W ms':>6}{'ovh us':>8}{'lat us':>7}{'send us':>8}{'ready us':>9}")
    parts = []
    for name, v in jobs:
        rows = []
        sched = S.make_schedule(name, 2, m, v)
        for spans0, spans1 in zip(res[0][name, v], res[1][name, v]):
            spans = spans0 + spans1
            c = measured_costs(spans, sched, 2, v)
            comp = [s for s in spans if s.kind == "compute"]
            t = {op: statistics.median(s.end - s.start for s in comp if s.name[0] == op) for op in "FBW"
                 if any(s.name[0] == op for s in comp)}
            free = S.simulate(sched, 2, v, durations=c["durations"])
            costs = S.simulate(sched, 2, v, durations=c["durations"], t_comm=c["t_comm"], t_overhead=c["t_overhead"])
            step = max(s.end for s in comp) - min(s.start for s in comp)
            busy = [sum(s.end - s.start for s in comp if s.rank == r) for r in (0, 1)]
            rows.append(dict(step=step, measured=S.bubble(comp), free=S.bubble(free), costs=S.bubble(costs), t=t,
                             imbalance=max(busy) / min(busy) - 1,
                             **{k: c[k] for k in ("t_overhead", "t_comm", "t_send", "t_recv_ready")}))
        fastest = min(rows, key=lambda r: r["step"])
        med = lambda k: statistics.median(r[k] for r in rows)
        t = fastest["t"]
        formula = S.formula_bubble(name, 2, m, v)
        at_times = S.formula_bubble(name, 2, m, v, t["F"], t["B"] + t.get("W", 0.0), t.get("W", 0.0))
        planner = f"{planner_bubble(name, v, m, fastest['t_comm'] / t['F']):8.3f}" if name != "zb-h1" else f"{'-':>8}"
        print(f"{name:<12}{fastest['measured']:8.3f}{med('measured'):8.3f}{formula:8.3f}"
              f"{at_times:9.3f}{fastest['measured'] / at_times - 1:+6.0%}{fastest['imbalance']:7.1%}{fastest['free']:8.3f}{fastest['costs']:8.3f}{planner}"
              f"{t['F'] * 1e3:7.1f}{t['B'] * 1e3:7.1f}{t.get('W', 0) * 1e3:6.1f}"
              + "".join(f"{fastest[k] * 1e6:{w}.0f}" for k, w in (("t_overhead", 8), ("t_comm", 7), ("t_send", 8),
                                                                  ("t_recv_ready", 9))))
        parts.append((name, fastest["free"] - formula, fastest["costs"] - fastest["free"],
                      fastest["measured"] - fastest["costs"]))
    print("measured - formula, fastest step, split: uneven action times (replay - formula), overhead and latency "
          "(+costs - replay), not explained by them (measured - +costs)")
    for name, uneven, costs, rest in parts:
        print(f"  {name:<12} {uneven:+.3f} {costs:+.3f} {rest:+.3f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bubble", action="store_true", help="measure the bubble of equal stages (p=2) instead")
    ap.add_argument("--rows", type=int, default=64, help="--bubble: rows per micro-batch")
    ap.add_argument("--stage-layers", type=int, default=4, help="--bubble: Linear layers per rank (even)")
    ap.add_argument("--schedules", nargs="+", default=[name for name, _ in SCHEDULES])
    args = ap.parse_args(argv)
    if args.bubble:
        if args.hidden == 256:
            args.hidden = 4096
        return bubble_main(args)
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
