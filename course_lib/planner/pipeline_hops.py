"""Each pipeline hop priced on its own link: NVLink when its two ranks share a node, the network
when they do not.

The clock maps global rank ``r`` to node ``r // gpus_per_node``; the layout's rank order
(:func:`.layout.strides`) says which global ranks a pipeline's stages are. In the course's
default order (dp outermost) a pipeline spans ``tp * cp * pp`` consecutive ranks, so on
several nodes some hops stay inside a node and only the ones at a node's edge cross; with the
pipeline outermost (DeepSpeed's order) every hop crosses. A stage's send time is the mean of
the hops it sends on (forward to the next stage, backward to the previous; the interleaved
schedule's wrap-around from the last stage to the first), so that the number of sends a stage
makes per micro-batch (:func:`.formulas.p2p_sends`) times it is what those sends cost.

A hop is on the network if it crosses nodes in any of the layout's pipelines (one per
coordinate of the other dims): the slowest pipeline paces the step.
"""
from __future__ import annotations

from course_lib.planner import formulas as F
from course_lib.planner.layout import Layout, strides
from course_lib.planner.presets import Hardware


def _bases(layout: Layout, gpus_per_node: int) -> set:
    """The first ranks of every pipeline, modulo ``gpus_per_node`` (whether ``base + i * stride``
    and ``base + j * stride`` share a node depends only on the base's place in its node)."""
    stride, sizes, out = strides(layout), layout.sizes, {0}
    for d in stride:
        if d != "pp":
            out = {(b + i * stride[d]) % gpus_per_node for b in out for i in range(sizes[d])}
    return out


def hop_in_node(layout: Layout, hw: Hardware, a: int, b: int) -> bool:
    """True if pipeline stages ``a`` and ``b`` are on one node in every pipeline of ``layout``."""
    g, s = hw.gpus_per_node, strides(layout)["pp"]
    return all((r + a * s) // g == (r + b * s) // g for r in _bases(layout, g))


def neighbours(layout: Layout, stage: int) -> list:
    """The stages ``stage`` sends to: the next (activations) and the previous (gradients); an
    interleaved schedule (v > 1 chunks, one loop) wraps around, the last stage's chunk feeding the
    first stage's next one; a V schedule (its turn inside one rank) and 1F1B do not."""
    p = layout.pp
    if layout.chunks > 1 and layout.schedule not in F.V_SCHEDULES:
        return [(stage + 1) % p, (stage - 1) % p]
    return [n for n in (stage + 1, stage - 1) if 0 <= n < p]


def alpha_beta_hop(hw: Hardware, nbytes: float, intra_node: bool) -> float:
    """One message on the link's alpha and achievable bandwidth (the published systems' price)."""
    return F.collective_time("send_recv", nbytes, 2, *hw.link(intra_node))


def stage_send_time(layout: Layout, hw: Hardware, stage: int, nbytes: float, hop=alpha_beta_hop) -> float:
    """Seconds of one send from ``stage`` of ``nbytes``: the mean over the hops it sends on, each
    priced by ``hop(hw, nbytes, intra_node)`` on NVLink or the network by its own two ranks'
    nodes (0 when pp = 1). The course's runtime passes NCCL's point-to-point price
    (:func:`.async_tp.async_tp_hop`), the one the virtual clock charges a message."""
    hops = neighbours(layout, stage) if layout.pp > 1 else []
    if not hops:
        return 0.0
    times = [hop(hw, nbytes, hop_in_node(layout, hw, stage, n)) for n in hops]
    return sum(times) / len(times)


__all__ = ["hop_in_node", "neighbours", "alpha_beta_hop", "stage_send_time"]
