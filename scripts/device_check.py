"""The virtual GPU clock against the GPU this machine has: virtual / measured time.

    python scripts/device_check.py [--hardware h100-sxm] [--repeats 20] [--breakdown] [--save FILE]

Four workloads in bf16 that the kernel model was fitted on (``gpu_check.workloads``): a
8192^3 GEMM, a TinyGPT block forward and backward at h = 2048, s = 2048, b = 4, 1000
one-element additions (the host's issue interval) and a streaming add of 2 x 256 MiB; then
four it never saw (``gpu_check.unseen_workloads``): a GPT-2 block of another shape, the
SwiGLU MLP alone, attention alone and an AdamW step (foreach); the 12 GEMMs of one layer of
Korthikanti's 22B and 175B rows, back to back (``gpu_check.gemm_workloads``: the clock's GEMM
rate at the published rows' shapes); FlashAttention's causal forward and backward at three
published rows' shapes (``gpu_check.attention_workloads``: the clock's attention model, timed
back to back, since the host's dispatch of one call is longer than the kernel at the smaller
shapes); and one 256 MiB all-reduce over
NCCL when there are at least two GPUs. Virtual: the workload run once under the virtual clock
(:mod:`course_lib.virtual`, the preset named by ``--hardware`` or guessed from the device's
name); measured: CUDA events around the same workload, median of ``--repeats`` after warm-up.
On a GPU the fitted workloads are held to +-15%, the unseen ones to +-20% (said per row), the
kernel model is fitted again on this GPU (``gpu_check.fit_kernels``: the block's per-op profile
from torch.profiler, printed with ``--breakdown``), and a span recorded under
``launch(backend="nccl")`` is checked to report the GEMM's GPU time (CUDA events).
Every workload is priced twice, on the GPU's tensors and on the meta device's (shapes only, as
the dry run prices), and any difference is printed. ``--save FILE`` writes every figure to a
JSON file (a record like ``gpu_check.H100``).
Without CUDA it prints the virtual times (priced on the meta device: shapes only) and the
recorded H100 run against today's prices (``gpu_check.H100``).

The H200 record (``gpu_check.H200``, 2026-11-29) is the H200 preset's own fit; a second
H200 machine's run is ``gpu_check.H200_AFTER``. The H100 record (one H100 SXM, 2026-11-27):
the preset's constants are fitted on it
(``planner.presets``, their sources printed by ``VirtualCluster.describe()``). Priced by the
model of that day (roofline at 70% of peak, HBM at 100%, 4 us per kernel), virtual / measured
was: GEMM 1.15, block 0.72, tiny kernels 0.32, streaming add 0.88; priced now: 1.00, 0.90,
1.00, 1.00. The block's remaining 10%: the profiler's per-op device times add up to 11.2 of
its 12.1 ms between events (gaps between kernels, not modelled).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from course_lib import trace  # noqa: E402
from course_lib.launch import launch  # noqa: E402
from course_lib.virtual import VirtualCluster  # noqa: E402
from course_lib.virtual.gpu_check import (attention_workloads, breakdown, fit_kernels, gemm_workloads,  # noqa: E402
                                          measured_seconds, print_against_recorded, unseen_workloads,
                                          virtual_seconds, workloads)

FITTED, UNSEEN = 0.15, 0.20      # virtual / measured within 1 +- these

ALL_REDUCE_BYTES = 256 << 20
def _all_reduce(repeats):
    """Each rank: CUDA-event time of one all-reduce (median), or its virtual span under a clock."""
    import torch.distributed as dist

    from course_lib.collectives.comm import Comm
    comm = Comm(None, dim="dp")
    t = torch.ones(ALL_REDUCE_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    if trace.clock() is not None:
        comm.all_reduce(t)
        return [s.duration for s in trace.spans() if s.name == "all-reduce"][0]
    for _ in range(3):
        dist.all_reduce(t)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(t)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _gemm_span():
    """A rank under nccl: the span around one GEMM, read from CUDA events (trace.CudaEventClock)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    trace.reset()
    with trace.span("GEMM 8192^3"):
        a @ a
    return [s.duration for s in trace.spans() if s.name == "GEMM 8192^3"][0]


def guess_hardware(name: str) -> str:
    for key, preset in (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb")):
        if key in name:
            return preset
    return "h100-sxm"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default=None,
                    help="planner preset (default: from the device's name)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--breakdown", action="store_true",
                    help="print the block's time per aten op, virtual vs measured")
    ap.add_argument("--save", default=None, help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if gpu else "no GPU"
    preset = args.hardware or guess_hardware(name)
    cluster = VirtualCluster(preset, gpus_per_node=8, dtype=torch.bfloat16)
    print(f"device: {name}; torch {torch.__version__}")
    print(cluster.describe())
    device = "cuda" if gpu else "meta"
    rows, bound, on_meta = [], {}, {}
    for tolerance, make in ((FITTED, workloads), (UNSEEN, unseen_workloads), (UNSEEN, gemm_workloads),
                            (UNSEEN, attention_workloads)):
        meta = make("meta")
        for label, (setup, run) in make(device).items():
            virtual = virtual_seconds(cluster, setup, run)
            measured = (measured_seconds(setup, run, args.repeats, back_to_back=make is attention_workloads)
                        if gpu else None)
            rows.append((label, virtual, measured))
            bound[label] = tolerance
            on_meta[label] = virtual_seconds(cluster, *meta[label]) if gpu else virtual
    n = torch.cuda.device_count() if gpu else 0
    if n >= 2:
        measured = max(launch(_all_reduce, n, args.repeats, backend="nccl", quiet=True))
        virtual = max(launch(_all_reduce, n, args.repeats, backend="nccl", clock=cluster,
                             quiet=True))
        rows.append((f"all-reduce 256 MiB on {n} GPUs (NCCL)", virtual, measured))
    if gpu:  # the spans of a launch under nccl report GPU time (CUDA events), not issue time
        span = launch(_gemm_span, 1, backend="nccl", quiet=True)[0]
        print(f"span of one GEMM under launch(backend='nccl'): {span * 1e3:.3f} ms "
              f"(CUDA events; span / measured {span / rows[0][2]:.2f})")
    moved = {k: v / on_meta[k] for k, v, _ in rows if k in on_meta and v != on_meta[k]}
    print("priced on the meta device (shapes only), the same workloads cost the same: "
          + ("every one" if not moved else ", ".join(f"{k}: GPU / meta {r:.4f}" for k, r in moved.items())))
    for label, virtual, measured in rows:
        line = f"{label:50s} virtual {virtual * 1e3:9.3f} ms"
        if measured is not None:
            ratio = virtual / measured
            line += f"   measured {measured * 1e3:9.3f} ms   virtual / measured {ratio:5.2f}"
            if label in bound:
                line += f"   within +-{bound[label]:.0%}: {abs(ratio - 1) <= bound[label]}"
        print(line)
    record = dict(device=name, torch=torch.__version__, preset=preset,
                  rows=[dict(label=k, virtual=v, measured=m) for k, v, m in rows],
                  virtual_on_meta=on_meta)
    if gpu:
        record["span_over_events"] = span / rows[0][2]
        record["issue_interval"] = next(m for k, _, m in rows if k == "1000 tiny kernels") / 1000
        label, (setup, run) = next((k, w) for k, w in workloads("cuda").items() if k.startswith("block"))
        if args.breakdown:
            print(f"{label}, per aten op (torch.profiler, self device time):")
        record["breakdown"] = breakdown(cluster, setup, run, show=args.breakdown)
        fit = fit_kernels(cluster.hw, record)
        record["fitted"] = fit
        print("the kernel model fitted to this GPU (the preset's in brackets): " + ", ".join(
            f"{k} {v:.3g} [{cluster.kernels.efficiency.get(k, cluster.hw.launch_overhead):.3g}]"
            for k, v in fit.items()))
        if n < 2:
            print("all-reduce: one GPU, nothing to reduce across (needs 2+ GPUs for NCCL)")
    else:
        print("no GPU: virtual times only (priced on the meta device); "
              "run this on a CUDA machine to compare")
        print_against_recorded(cluster)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(record, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
