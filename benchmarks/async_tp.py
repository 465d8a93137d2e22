"""Async TP on the virtual clock (H100 SXM, 8 GPUs a node, bf16): the exposed TP communication
of one MLP layer (column -> tanh -> row, forward + backward) before and after decomposing
SP's all-gather and reduce-scatter, at tp = 2, 4, 8 inside a node, next to the formula
(course_lib.lab.async_tp_runs). Not a timed test: run it by hand.

    python benchmarks/async_tp.py
"""
import sys

from course_lib.lab.async_tp_runs import table
from course_lib.virtual import VirtualCluster

SHAPES = {   # (b, s, h, f): CPU-feasible, since the virtual clock runs the real program
    "small": dict(b=1, s=64, h=256, f=1024),        # latency and host-issue bound
    "medium": dict(b=1, s=1024, h=512, f=8192),
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(SHAPES)
    cluster = VirtualCluster("h100-sxm", gpus_per_node=8)
    for line in table({n: SHAPES[n] for n in names}, cluster=cluster):
        print(line, flush=True)
