"""Async TP's exposed communication, derived from the schedule the course's ring runs
(:mod:`course_lib.parallel.async_tp`; written apart from it and from the virtual clock,
which tests/test_async_tp.py checks it against).

**The schedule.** A decomposed all-gather + matmul on t ranks runs t steps. At step i a
rank posts the next hop (send the chunk it holds to the next rank, receive the previous
rank's), multiplies the chunk it holds, then waits for the hop. Step 0 multiplies the
rank's OWN chunk, which needs nothing from the others, so the first hop hides under it; the
last step multiplies the last chunk to arrive and sends nothing. A decomposed matmul +
reduce-scatter is the mirror: step 0 computes the partial sum of one chunk and sends it;
each later step computes the next chunk's partial sum while the running sum of that chunk
arrives, waits, adds it and sends it on; the last step's sum stays home. In both, t - 1 hops
each run beside one step's matmul, and nothing else waits on the network:

    step i ends at  start_i + max(step, hop)        (i < t - 1; all ranks alike)
    exposed         = (t - 1) max(0, hop - step)     per decomposed op

``step`` is the compute between posting a hop and waiting for it (one chunk's matmuls, for
the weight-gradient ring also its accumulation), ``hop`` one point-to-point message of one
chunk (b s h / t elements): latency + bytes / bandwidth (:func:`async_tp_hop`). Latency-bound
(small chunks) the hop is nearly constant in t while the step shrinks as 1/t, so a larger t
exposes more; bandwidth-bound both shrink as 1/t and only their difference shows.

Not in it: the add after a reduce-scatter hop and the concatenation of the gathered chunks
(compute, counted as compute), and contention with other traffic on the same links.
"""
from __future__ import annotations

# NCCL's point-to-point time (src/graph/tuning.cc, NCCL 2.19-2.21): one ring step of its
# table, baseLat + hwLat + bytes / bandwidth. Simple protocol above 16 KiB
# (NCCL_P2P_LL_THRESHOLD), LL up to it (a quarter of the bandwidth, at most llMaxBw).
# Microseconds, (base, hw) per protocol and link; the preset's alpha is hwLat[.][RING][SIMPLE],
# so every latency scales by alpha / that value.
P2P_LL_MAX_BYTES = 16 << 10
P2P_LATENCY_US = {"nvlink": {"LL": (6.6, 0.6), "Simple": (8.4, 3.4)},
                  "net": {"LL": (6.6, 2.7), "Simple": (8.4, 14.0)}}
P2P_LL_MAX_BW = {"nvlink": 87.7e9, "net": 39.0e9}       # llMaxBws: one node; two nodes


def async_tp_hop(hw, nbytes: float, intra_node: bool = True) -> float:
    """Seconds of one point-to-point message of ``nbytes`` on ``hw`` (a planner Hardware), as
    NCCL prices it: latency (the protocol's baseLat + hwLat) + bytes / bandwidth."""
    kind = "nvlink" if intra_node else "net"
    alpha, bw = hw.link(intra_node)
    scale = alpha / (P2P_LATENCY_US[kind]["Simple"][1] * 1e-6)
    proto = "LL" if nbytes <= P2P_LL_MAX_BYTES else "Simple"
    latency = sum(P2P_LATENCY_US[kind][proto]) * 1e-6 * scale
    if proto == "LL":
        bw = min(bw / 4, P2P_LL_MAX_BW[kind])
    return latency + nbytes / bw


def nccl_all_to_all(hw, nbytes: float, n: int, local: int, latency: bool = True) -> float:
    """Seconds of NCCL's all-to-all of ``nbytes`` (one rank's input, n / N to each member) over
    ``n`` ranks of which ``local`` (this one included) share its node: a group of point-to-point
    sends and receives, every pair posted at once (``ncclGroupStart``/``End``), so one message's
    latency (its protocol's, on the network where the group leaves the node) and the longer of
    the bytes on NVLink ((local - 1) parts) and on the network ((n - local) parts), each link
    class its own lanes at its bandwidth. Priced as one alpha per pair in turn (the published
    systems' sequential exchange), an ep 2 dispatch on H100s was 3.4 us of latency where NCCL's
    table gives 11.8 (a Simple message on NVLink). ``latency=False``: the bytes' seconds alone
    (what it holds the links for)."""
    if n <= 1:
        return 0.0
    part = nbytes / n
    inside = local == n
    kind = "nvlink" if inside else "net"
    alpha = hw.link(inside)[0]
    scale = alpha / (P2P_LATENCY_US[kind]["Simple"][1] * 1e-6)
    seconds = sum(P2P_LATENCY_US[kind]["LL" if part <= P2P_LL_MAX_BYTES else "Simple"]) * 1e-6 * scale
    on_node = (local - 1) * part / hw.link(True)[1]
    off_node = (n - local) * part / hw.link(False)[1]
    return (seconds if latency else 0.0) + max(on_node, off_node)


def async_tp_exposed(hop: float, step: float, t: int) -> float:
    """Exposed seconds of one decomposed collective on ``t`` ranks (module doc): t - 1 hops,
    each beside one step's compute ``step``; the first hop hides under the rank's own chunk."""
    return (t - 1) * max(0.0, hop - step)


def async_tp_layer(hop: float, steps, t: int) -> float:
    """Exposed seconds of a layer's decomposed collectives: ``steps`` holds one step's compute
    per decomposed op (all of them move chunks of the same b s h / t elements)."""
    return sum(async_tp_exposed(hop, s, t) for s in steps)


def transformer_steps(gemm, T: float, h: float, qkv: float, up: float, ffn: float, t: int,
                      dense_mlp: bool = True) -> tuple[list, list]:
    """(forward, backward) step compute of a transformer layer's decomposed ops under TP + SP,
    ``gemm(M, N, K)`` pricing one GEMM, ``T`` tokens of the micro-batch, column outputs
    ``qkv`` (W_q, W_k, W_v) and ``up`` (W_1, W_3), ``ffn`` the row input of W_2. Forward: the
    all-gather under Q K V, the reduce-scatter under W_o, the all-gather under W_1 (W_3), the
    reduce-scatter under W_2. Backward: a row layer's input gradient is an all-gather ring
    whose steps also compute the weight gradient's chunk; a column layer's a reduce-scatter
    ring of dX chunks (its weight gradient runs after, on the kept chunks). An MoE MLP
    (``dense_mlp`` False) routes between its collectives: its two ops hide nothing."""
    n = T / t                                       # the tokens of one chunk
    fwd = [gemm(n, qkv / t, h), gemm(n, h, h / t)]
    bwd = [gemm(n, h / t, h) + gemm(h / t, h, n), gemm(n, h, qkv / t)]
    if dense_mlp:
        fwd += [gemm(n, up / t, h), gemm(n, h, ffn / t)]
        bwd += [gemm(n, ffn / t, h) + gemm(ffn / t, h, n), gemm(n, h, up / t)]
    else:
        fwd += [0.0, 0.0]
        bwd += [0.0, 0.0]
    return fwd, bwd


__all__ = ["nccl_all_to_all", "async_tp_hop", "async_tp_exposed", "async_tp_layer", "transformer_steps",
           "P2P_LATENCY_US", "P2P_LL_MAX_BYTES", "P2P_LL_MAX_BW"]
