"""Async TP on the virtual clock (H100 SXM, 8 GPUs a node, bf16): the exposed TP communication
of one MLP layer (column -> tanh -> row, forward + backward) before and after decomposing
SP's all-gather and reduce-scatter, at tp = 2, 4, 8 inside a node, next to the formula
(course_lib.lab.async_tp_runs). Not a timed test: run it by hand.

    python benchmarks/async_tp.py

Measured here (virtual us per layer, tp = 2 / 4 / 8): small (s=64, h=256, f=1024) plain
125.6 / 125.6 / 128.0, async 302.2 / 521.6 / 960.3; medium (s=1024, h=512, f=8192) plain
169.9 / 156.8 / 153.8, async 302.2 / 521.6 / 960.3. At every size a CPU can run, async TP
does NOT pay: the layer is bound by the host issuing eager ops (12.32 us each, the preset's
recorded launch overhead) and by the hop latency (~7 us), and the decomposition multiplies
the ops by t. With the host's issue hidden, plain SP's exposed time equals its formula (the
NCCL collectives: 52.7 / 69.5 / 85.0 us, medium) and async TP hides most of it at tp=2
(13.6 us medium, 6.6 us wide against 34.8), but the t-fold smaller kernels (each >= the
2 us kernel floor) and the extra adds cost more than the communication hidden, so the
layer is still slower (medium 133.0 -> 207.7 us at tp=2). It pays where a chunk's matmul outlasts a hop and the ops are fused or
graph-captured (torch.compile / symm_mem's fused kernels): see planner.estimate's
``async_tp`` at Llama 3 70B (tests/test_async_tp.py).
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
