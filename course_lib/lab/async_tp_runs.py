"""Async TP on the virtual GPU clock: the exposed TP communication of one MLP layer, before
and after decomposing SP's collectives (:mod:`course_lib.parallel.async_tp`).

    h100 = VirtualCluster("h100-sxm", gpus_per_node=8)
    row = exposed_tp(4, dict(b=1, s=1024, h=512, f=8192), h100)   # {"plain": ..., "async": ..., ...}

One layer = a column layer (input="sequence") -> tanh -> a row layer (output="reduce_scatter"),
forward and backward, on t ranks inside one node. Plain SP keeps the gathered input for
backward (``keep_gathered``, as async TP keeps its chunks: the same communication per layer).
Exposed communication = the layer's virtual time - the same program's time with free links
(zero latency, infinite bandwidth: the compute alone, the chunked matmuls included).
The formula beside it: plain = its collectives' NCCL times (nothing hides them); async = per
decomposed op, the first hop plus, at each of the other t - 1 steps, max(0, hop - the step's
matmul), the hop a point-to-point message of one chunk (:func:`virtual.links.p2p_time`).
At the sizes a CPU can run, async TP does not pay (benchmarks/async_tp.py prints why: eager
issue of t times more ops, hop latency, the kernel floor); the planner prices the sizes where
it does (``planner.costs.async_tp_exposed``).
"""
from __future__ import annotations

import math

import torch

from course_lib.launch import launch
from course_lib.planner.costs import async_tp_exposed
from course_lib.virtual import VirtualCluster
from course_lib.virtual.links import collective_time, p2p_time


def _layer(t, shape):
    """On each rank: the layer's virtual seconds (forward + backward), plain SP then async TP."""
    import torch.nn as nn

    from course_lib import trace
    from course_lib.collectives.comm import Comm
    from course_lib.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    comm = Comm(dim="tp")
    torch.manual_seed(0)
    b, s, h, f = shape["b"], shape["s"], shape["h"], shape["f"]
    fc, proj = nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)
    x = torch.randn(b, s // t, h, requires_grad=True)              # (b, s/t, h): my tokens
    seconds = []
    for async_tp in (False, True):
        col = ColumnParallelLinear(fc, comm, input="sequence", keep_gathered=True, async_tp=async_tp, check=False)
        row = RowParallelLinear(proj, comm, output="reduce_scatter", async_tp=async_tp, check=False)
        comm.barrier()                                              # every clock at the same time
        clock = trace.clock()
        start = clock.now()
        y = row(torch.tanh(col(x)))                                 # (b, s/t, h)
        y.backward(torch.ones_like(y))
        clock.settle()
        seconds.append(max(clock.now(), clock.comm_free) - start)
    return seconds


def layer_seconds(t, shape, cluster) -> tuple:
    """The slowest rank's virtual seconds for one layer (forward + backward) on ``cluster``:
    (plain SP, async TP), one launch."""
    ranks = launch(_layer, t, t, shape, clock=cluster, threads=1)
    return tuple(max(r[i] for r in ranks) for i in range(2))


def free_links(cluster) -> VirtualCluster:
    """``cluster`` with communication free (no latency, infinite bandwidth): compute alone."""
    hw = cluster.hw.with_(nvlink_latency=0.0, nvlink_bandwidth=math.inf, network_latency=0.0,
                          network_bandwidth=math.inf)
    return VirtualCluster(hw, cluster.gpus_per_node, cluster.dtype)


def formula(t, shape, cluster, compute_async) -> dict:
    """Exposed seconds predicted: plain = 2 all-gathers + 2 reduce-scatters of (b, s, h)
    (forward: AG, RS; backward: RS of dX, AG of dY); async = 4 decomposed ops, each
    first hop + (t - 1) max(0, hop - step), ``step`` = compute_async / (4 t) (the chunk matmuls
    spread evenly over the 4 ops' t steps)."""
    b, s, h = shape["b"], shape["s"], shape["h"]
    nbytes = b * s * h * cluster.dtype.itemsize                     # the gathered activation
    ranks = range(t)
    plain = 2 * collective_time(cluster, "all_gather", nbytes, ranks) + \
        2 * collective_time(cluster, "reduce_scatter", nbytes, ranks)
    hop = sum(p2p_time(cluster.hw, nbytes / t, True))
    step = compute_async / (4 * t)
    return {"plain": plain, "async": 4 * async_tp_exposed(hop, compute_async / 4, t), "hop": hop, "step": step}


def exposed_tp(t, shape, cluster) -> dict:
    """Exposed TP communication of one layer at tp=``t``, plain SP and async TP, with the compute
    (free links) and the formula: {"plain", "async", "compute_plain", "compute_async", "formula"}."""
    if t > cluster.gpus_per_node:
        raise ValueError(f"exposed_tp measures TP inside one node: tp={t} > gpus_per_node={cluster.gpus_per_node}")
    if shape["s"] % t or shape["f"] % t:
        raise ValueError(f"s={shape['s']} and f={shape['f']} must be divisible by tp={t}")
    free = free_links(cluster)
    out = {}
    for mode, total, compute in zip(("plain", "async"), layer_seconds(t, shape, cluster), layer_seconds(t, shape, free)):
        out[mode], out["compute_" + mode], out["total_" + mode] = total - compute, compute, total
    out["formula"] = formula(t, shape, cluster, out["compute_async"])
    return out


def table(shapes: dict, tps=(2, 4, 8), cluster=None) -> list[str]:
    """Lines of a table (76 columns): per shape and tp, exposed microseconds plain / async /
    formulas, and the layer's time both ways."""
    cluster = cluster or VirtualCluster("h100-sxm", gpus_per_node=8)
    lines = [f"{'shape':>8} {'tp':>3}  exposed TP comm, us: plain (formula)  async (formula)"
             f"  layer us: plain  async"]
    for name, shape in shapes.items():
        for t in tps:
            r = exposed_tp(t, shape, cluster)
            fm = r["formula"]
            lines.append(f"{name:>8} {t:>3}  {r['plain'] * 1e6:>8.1f} ({fm['plain'] * 1e6:6.1f})"
                         f"  {r['async'] * 1e6:>8.1f} ({fm['async'] * 1e6:6.1f})"
                         f"  {r['total_plain'] * 1e6:>8.1f} {r['total_async'] * 1e6:>8.1f}")
    return lines


__all__ = ["exposed_tp", "layer_seconds", "free_links", "formula", "table"]
