"""Async TP on the virtual GPU clock: the exposed TP communication of one MLP layer, before
and after decomposing SP's collectives (:mod:`course_lib.parallel.async_tp`).

    h100 = VirtualCluster("h100-sxm", gpus_per_node=8)
    row = exposed_tp(4, dict(b=1, s=1024, h=512, f=8192), h100)   # {"plain": ..., "async": ..., ...}

One layer = a column layer (input="sequence") -> tanh -> a row layer (output="reduce_scatter"),
forward and backward, on t ranks inside one node. Plain SP keeps the gathered input for
backward (``keep_gathered``, as async TP keeps its chunks: the same communication per layer).
Exposed communication = the layer's virtual time - the same program's time with free links
(zero latency, infinite bandwidth: the compute alone, the chunked matmuls included).
The formulas beside it: plain = its collectives' NCCL times (nothing hides them); async =
the planner's :mod:`course_lib.planner.async_tp` (written apart from the clock), per
decomposed op (t - 1) max(0, hop - step), the hop its own NCCL point-to-point price of one
chunk, the step one ring step's compute as the free-links run measured it (the four ops:
forward all-gather under the column matmul, forward reduce-scatter under the row matmul,
backward all-gather under the row layer's dX and dW chunks, backward reduce-scatter under
the column layer's dX chunk).
At the sizes a CPU can run, async TP does not pay (benchmarks/async_tp.py prints why: eager
issue of t times more ops, hop latency, the kernel floor); the planner prices the sizes where
it does.
"""
from __future__ import annotations

import math

import torch

from course_lib.launch import launch
from course_lib.planner.async_tp import async_tp_hop, async_tp_layer
from course_lib.virtual import VirtualCluster
from course_lib.virtual.links import collective_time

OPS = ("fwd AG", "fwd RS", "bwd AG", "bwd RS")     # the decomposed ops, in the order they run


def _layer(t, shapes):
    """On each rank, per shape: (plain SP seconds, async TP seconds, one step's compute per
    decomposed op), forward + backward of the layer, virtual."""
    import torch.nn as nn

    from course_lib import trace
    from course_lib.collectives.comm import Comm
    from course_lib.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    comm = Comm(dim="tp")
    rec, out = trace.recorder(), []
    for shape in shapes:
        torch.manual_seed(0)
        b, s, h, f = shape["b"], shape["s"], shape["h"], shape["f"]
        fc, proj = nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)
        x = torch.randn(b, s // t, h, requires_grad=True)          # (b, s/t, h): my tokens
        seconds = []
        for async_tp in (False, True):
            col = ColumnParallelLinear(fc, comm, input="sequence", keep_gathered=True, async_tp=async_tp,
                                       check=False)
            row = RowParallelLinear(proj, comm, output="reduce_scatter", async_tp=async_tp, check=False)
            comm.barrier()                                          # every clock at the same time
            clock, first = trace.clock(), len(rec.spans)
            start = clock.now()
            y = row(torch.tanh(col(x)))                             # (b, s/t, h)
            y.backward(torch.ones_like(y))
            clock.settle()
            seconds.append(max(clock.now(), clock.comm_free) - start)
        steps = [sp.duration for sp in rec.spans[first:] if sp.name.startswith("async TP:") and "step" in sp.name]
        out.append((*seconds, [max(steps[i * t:(i + 1) * t]) for i in range(len(OPS))]))
    return out


def _runs(t, shapes, cluster) -> list:
    """Per shape, the slowest rank's (plain, async) seconds and its steps: one launch."""
    ranks = launch(_layer, t, t, list(shapes), clock=cluster, threads=1)
    return [(max(r[k][0] for r in ranks), max(r[k][1] for r in ranks),
             [max(r[k][2][i] for r in ranks) for i in range(len(OPS))]) for k in range(len(shapes))]


def layer_seconds(t, shape, cluster) -> tuple:
    """The slowest rank's virtual seconds for one layer (forward + backward) on ``cluster``:
    (plain SP, async TP), one launch."""
    return tuple(_runs(t, [shape], cluster)[0][:2])


def free_links(cluster) -> VirtualCluster:
    """``cluster`` with communication free (no latency, infinite bandwidth): compute alone."""
    hw = cluster.hw.with_(nvlink_latency=0.0, nvlink_bandwidth=math.inf, network_latency=0.0,
                          network_bandwidth=math.inf)
    return VirtualCluster(hw, cluster.gpus_per_node, cluster.dtype)


def formula(t, shape, cluster, steps) -> dict:
    """Exposed seconds predicted: plain = 2 all-gathers + 2 reduce-scatters of (b, s, h) as
    NCCL runs them (forward: AG, RS; backward: RS of dX, AG of dY); async = the planner's
    sum over the 4 decomposed ops of (t - 1) max(0, hop - step), ``steps`` one step's
    compute per op (:data:`OPS`), the hop the planner's price of one chunk's message."""
    b, s, h = shape["b"], shape["s"], shape["h"]
    nbytes = b * s * h * cluster.dtype.itemsize                     # the gathered activation
    ranks = range(t)
    plain = 2 * collective_time(cluster, "all_gather", nbytes, ranks) + \
        2 * collective_time(cluster, "reduce_scatter", nbytes, ranks)
    hop = async_tp_hop(cluster.hw, nbytes / t, intra_node=True)
    return {"plain": plain, "async": async_tp_layer(hop, steps, t), "hop": hop, "steps": list(steps)}


def exposed_tps(t, shapes, cluster) -> list[dict]:
    """:func:`exposed_tp` of several shapes at tp=``t``: two launches (the links, free links)."""
    if t > cluster.gpus_per_node:
        raise ValueError(f"exposed_tp measures TP inside one node: tp={t} > gpus_per_node={cluster.gpus_per_node}")
    for shape in shapes:
        if shape["s"] % t or shape["f"] % t:
            raise ValueError(f"s={shape['s']} and f={shape['f']} must be divisible by tp={t}")
    rows = []
    for shape, real, free in zip(shapes, _runs(t, shapes, cluster), _runs(t, shapes, free_links(cluster))):
        out = {}
        for i, mode in enumerate(("plain", "async")):
            out[mode], out["compute_" + mode], out["total_" + mode] = real[i] - free[i], free[i], real[i]
        out["formula"] = formula(t, shape, cluster, free[2])
        rows.append(out)
    return rows


def exposed_tp(t, shape, cluster) -> dict:
    """Exposed TP communication of one layer at tp=``t``, plain SP and async TP, with the compute
    (free links) and the formula: {"plain", "async", "compute_plain", "compute_async",
    "total_plain", "total_async", "formula"}."""
    return exposed_tps(t, [shape], cluster)[0]


def table(shapes: dict, tps=(2, 4, 8), cluster=None) -> list[str]:
    """Lines of a table (76 columns): per shape and tp, exposed microseconds plain / async /
    formulas, and the layer's time both ways."""
    cluster = cluster or VirtualCluster("h100-sxm", gpus_per_node=8)
    lines = [f"{'shape':>8} {'tp':>3}  exposed TP comm, us: plain (formula)  async (formula)"
             f"  layer us: plain  async"]
    for t in tps:
        for name, r in zip(shapes, exposed_tps(t, list(shapes.values()), cluster)):
            fm = r["formula"]
            lines.append(f"{name:>8} {t:>3}  {r['plain'] * 1e6:>8.1f} ({fm['plain'] * 1e6:6.1f})"
                         f"  {r['async'] * 1e6:>8.1f} ({fm['async'] * 1e6:6.1f})"
                         f"  {r['total_plain'] * 1e6:>8.1f} {r['total_async'] * 1e6:>8.1f}")
    return lines


__all__ = ["OPS", "exposed_tp", "exposed_tps", "layer_seconds", "free_links", "formula", "table"]
