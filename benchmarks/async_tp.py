"""Async TP on the virtual clock (H100 SXM, 8 GPUs a node, bf16): the exposed TP communication
of one MLP layer (column -> tanh -> row, forward + backward) before and after decomposing
SP's all-gather and reduce-scatter, at tp = 2, 4, 8 inside a node, next to the formula
(course_lib.lab.async_tp_runs). Not a timed test: run it by hand.

    python benchmarks/async_tp.py

Measured here (virtual us per layer, tp = 2 / 4 / 8). Eager: plain small 125.6 / 125.6 /
128.0, medium 169.9 / 156.8 / 153.8; async 277.6 / 472.3 / 861.7 small and 278.6 / 472.3 /
861.7 medium: at every size a CPU can run, async TP does NOT pay eagerly, the layer being
bound by the host issuing eager ops (12.32 us each, the preset's recorded launch overhead)
and the decomposition multiplying the ops by t (the difference against free links is not an
exposed time there: the host's pace shapes both runs, and for async it comes out negative,
-7.8 / -10.2 / -15.0 us; not analysed further). With the host's issue
hidden, both exposed times equal their formulas at every row (plain: NCCL's collectives,
medium 52.7 / 69.5 / 85.0 us; async: the planner's (t - 1) max(0, hop - step) per decomposed
op, medium 13.6 / 57.6 / 199.8 us, wide 6.6 / 40.6 / 110.0): async hides most of plain's at
tp=2, exposes more at tp=8 where every step is shorter than a hop, and the layer is slower at
every row (medium 133.0 -> 203.7 us at tp=2): the t-fold smaller kernels (each >= the 2 us
kernel floor) and the extra adds cost more than the communication hidden. It pays where a
chunk's matmul outlasts a hop and the ops are fused or graph-captured (torch.compile /
symm_mem's fused kernels): see planner.estimate's ``async_tp`` at Llama 3 70B
(tests/test_async_tp.py).
"""
import sys

import torch

from course_lib.lab.async_tp_runs import table
from course_lib.virtual import VirtualCluster

SHAPES = {   # (b, s, h, f): CPU-feasible, since the virtual clock runs the real program
    "small": dict(b=1, s=64, h=256, f=1024),        # latency and host-issue bound
    "medium": dict(b=1, s=1024, h=512, f=8192),
    "wide": dict(b=1, s=512, h=256, f=32768),       # long matmul steps per hop
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(SHAPES)
    eager = VirtualCluster("h100-sxm", gpus_per_node=8)
    graphed = VirtualCluster(eager.hw.with_(launch_overhead=0.0), 8, torch.bfloat16)
    for title, cluster in (("eager (the host issues an op every 12.32 us)", eager),
                           ("host issue hidden (CUDA graphs / torch.compile)", graphed)):
        print(title)
        for line in table({n: SHAPES[n] for n in names}, cluster=cluster):
            print(line, flush=True)
