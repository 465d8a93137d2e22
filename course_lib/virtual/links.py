"""What a message and a collective cost on the virtual cluster: NCCL's own model, and links
that fill.

**Lanes.** Every GPU has four lanes, each one direction of one link: NVLink send, NVLink
receive (through the NVSwitch: one per GPU, whoever the peer is), NIC send, NIC receive. A
transfer occupies the lanes it crosses for ``bytes / bandwidth``, and the lane keeps every
transfer's bytes (:class:`Lane`: each in the earliest gap long enough), so splitting a
message never beats its bandwidth time, two sends one way on one link take twice as long as
one, and a send does not slow a receive (the other direction's lane). Collectives occupy the
lanes of every member for the bytes their algorithm moves through each.
Transfers of different streams that want a lane at the same time share it (:meth:`Lane.shared`):
a GPU's concurrent NCCL kernels interleave their channels' packets on the link, so a small
transfer issued beside a large one is slowed, not held until the large one's last byte (which
first come, first served, the clock's rule until 2026-11-29, did: a 29 us all-to-all then
waited 2 ms behind an FSDP prefetch). The rule, processor sharing (each transfer on a lane an
equal part of it): every transfer still on the lane delays a newcomer by the lane time it has
left or the newcomer's own, the less, so a small one beside a large one takes twice its time
and three equal ones issued at once end as first come, first served ends them; never longer
than first come, first served would make it. One crossing two shared lanes (a message: the sender's send
lane, the receiver's receive lane) is slowed by the busier, not by both. Left out: the one
already on the lane is not slowed in turn (its end was priced when it was issued). A stream's
own order stays: a pair's messages, a communicator's collectives, one after another.

**Collectives of the backend** (torch's: gloo stands in for NCCL) are priced by NCCL's own
tuning model (``src/graph/tuning.cc``, NCCL 2.19-2.21: ``baseLat``, ``hwLat``, the protocol
bandwidth factors), which NCCL uses to choose an algorithm per call: for each algorithm
(ring; tree for all-reduce) and protocol (LL, LL128, Simple), ``latency + bytes /
algorithm bandwidth``, the fastest wins. The latencies scale with the preset's alpha
(``Hardware.nvlink_latency``, ``network_latency``: NCCL's Ring/Simple ``hwLat``), so a
preset with alpha 0 has no latency; the bus bandwidth is the preset's achievable one.
Left out: NVLS/CollNet (switch offload), the tree's per-size correction factors. NCCL's
channels appear once: as the SMs a collective's kernel holds beside compute (:mod:`.contention`).

**Point-to-point** (``send``/``recv``, and every collective built from them, the course's
rings and trees included: they are priced from their own messages) costs one ring step of
the same table: ``baseLat + hwLat + bytes / bandwidth``, the fastest protocol. torch's NCCL
backend runs point-to-point between two ranks on a communicator of their own: messages from
one rank to one peer run one after another, each paying its latency.
"""
from __future__ import annotations

import functools
import math

# NCCL src/graph/tuning.cc (2.19-2.21): the constants (course_lib.nccl_tuning, data the planner
# reads too; the arithmetic below is the clock's own)
from course_lib.nccl_tuning import (BASE_LATENCY, HW_LATENCY, LL_MAX_BW, NET_OVERHEAD, P2P_LL_THRESHOLD,
                                    PRESET_ALPHA_IS, PROTOCOLS, RING_LL, RING_LL128, RING_PLATEAU, TREE_BUS,
                                    TREE_LL, TREE_LL128)


class Lane:
    """One direction of one link of one GPU: the intervals it is busy, in virtual seconds."""
    __slots__ = ("busy", "ends")
    KEEP = 256          # intervals remembered (older ones end long before anything still asked)

    def __init__(self):
        self.busy: list[tuple[float, float]] = []    # sorted by start
        self.ends = 0.0     # no interval ends later (a bound: a released one may have ended it)

    def earliest(self, ready: float, duration: float) -> float:
        """The first time >= ``ready`` from which the lane is free for ``duration``."""
        t = ready
        if t >= self.ends:  # every interval ended by then (the scan below would skip them all)
            return t
        for s, e in self.busy:
            if e <= t:
                continue
            if s >= t + duration:
                break
            t = e
        return t

    def shared(self, ready: float, duration: float) -> tuple[float, float]:
        """(start, slot) of a transfer of ``duration`` seconds ready at ``ready``, sharing the lane
        with the transfers on it rather than waiting behind them (processor sharing: each of the
        transfers on the lane gets an equal part of its bandwidth): each one still on it delays
        the newcomer by the lane time it has left, or by the newcomer's own, the less; never more
        than first come, first served would (``slot``, :meth:`earliest`: where its bytes are
        reserved, so later transfers still find every byte on the lane)."""
        slot = self.earliest(ready, duration)
        if slot == ready:
            return ready, slot
        delay = 0.0
        for s, e in self.busy:
            if e > ready and s < slot:
                delay += min(e - max(s, ready), duration)
        return ready + min(slot - ready, delay), slot

    def reserve(self, start: float, duration: float) -> None:
        if duration <= 0:
            return
        busy = self.busy
        i = len(busy)
        while i and busy[i - 1][0] > start:
            i -= 1
        busy.insert(i, (start, start + duration))
        if start + duration > self.ends:
            self.ends = start + duration
        if len(busy) > self.KEEP:
            del busy[:len(busy) - self.KEEP]

    def release(self, start: float, duration: float) -> None:
        """Forget a reservation made with the same arguments (a tentative one, moved)."""
        try:
            self.busy.remove((start, start + duration))
        except ValueError:
            pass


def _scale(hw, kind: str) -> float:
    alpha = hw.nvlink_latency if kind == "nvlink" else hw.network_latency
    return alpha / PRESET_ALPHA_IS[kind]


def bus_bandwidth(hw, kind: str) -> float:
    """Achievable bus bandwidth per GPU and direction (B/s): the preset's link x efficiency."""
    return hw.link(kind == "nvlink")[1]


@functools.lru_cache(maxsize=4096)      # (a step repeats the same few sizes: price each once)
def nccl_collective(hw, op: str, nbytes: float, n_ranks: int, n_nodes: int):
    """NCCL's model of one collective: (seconds, seconds of it that the bytes take, name of
    the algorithm/protocol chosen). ``nbytes`` is NCCL's size: the whole buffer (all-reduce's
    tensor, all-gather's output, reduce-scatter's input, broadcast's tensor)."""
    if n_ranks <= 1:
        return 0.0, 0.0, "none"
    kind = "nvlink" if n_nodes == 1 else "net"
    scale_intra, scale_net = _scale(hw, "nvlink"), _scale(hw, "net")
    bw = bus_bandwidth(hw, kind)
    ppn = n_ranks / n_nodes
    ll_cap = LL_MAX_BW[1 if n_nodes == 1 else 2 if n_nodes == 2 else 4]   # llMaxBws: N1, N2, N4+
    if op == "all_reduce":
        nsteps, inter = 2 * (n_ranks - 1), (2 * n_nodes if n_nodes > 1 else 0)
    elif op in ("all_gather", "reduce_scatter"):
        nsteps, inter = n_ranks - 1, n_nodes - 1
    elif op == "broadcast":
        nsteps, inter = n_ranks, n_nodes
    else:
        raise ValueError(f"NCCL's model has no collective {op!r}")
    best = None
    for algo in ("ring", "tree") if op == "all_reduce" else ("ring",):
        for p, proto in enumerate(PROTOCOLS):
            bus = bw
            if algo == "ring":
                if proto == "LL":
                    bus = min(ll_cap, bus * RING_LL[0 if (n_nodes > 1 or op == "all_reduce") else 1])
                elif proto == "LL128":
                    bus = bus * RING_LL128[0 if ppn < 2 else 1]
                algbw = bus * (n_ranks / nsteps if op != "broadcast" else 1.0)
            else:
                bus = bus * TREE_BUS
                if proto == "LL":
                    bus = min(bus * TREE_LL, ll_cap)
                elif proto == "LL128":
                    bus = bus * TREE_LL128[0 if n_nodes == 1 else 1]
                algbw = bus * 0.5
            base = BASE_LATENCY[algo][p] * 1e-6 * (scale_intra if n_nodes == 1 else scale_net)
            intra = HW_LATENCY["nvlink"][algo][p] * 1e-6 * scale_intra
            net = HW_LATENCY["net"][algo][p] * 1e-6 * scale_net
            if n_nodes > 1 and proto == "LL":
                intra *= 1.8
            if algo == "ring":
                if op == "broadcast":
                    lat = base + nsteps * (intra if n_nodes == 1 else net)
                else:
                    if n_nodes > 1:
                        intra = max(intra, NET_OVERHEAD * scale_net * (3 if proto == "Simple" else 1))
                    lat = base + (nsteps - inter) * intra + inter * net
            else:
                lat = base + 2 * ((n_ranks // n_nodes - 1) * intra + int(math.log2(n_nodes)) * net)
            data = nbytes / algbw if algbw != math.inf else 0.0
            if (algo == "ring" and proto == "Simple" and n_nodes > 1 and op == "all_reduce"
                    and nbytes >= n_ranks / 16 * 65536):
                lat *= RING_PLATEAU                       # NCCL's "plateau effect of ring"
            t = lat + data
            if best is None or t < best[0]:
                best = (t, data, f"{algo}/{proto}")
    return best


def collective_time(cluster, op: str, nbytes: float, ranks) -> float:
    """NCCL's time for collective ``op`` ("all_reduce", "all_gather", "reduce_scatter",
    "broadcast") of ``nbytes`` over the global ``ranks`` of a ``VirtualCluster``: the price the
    clock gives that call when nothing else holds its links."""
    ranks = list(ranks)
    nodes = len({cluster.node(r) for r in ranks})
    return nccl_collective(cluster.hw, op, nbytes, len(ranks), nodes)[0]


def p2p_time(hw, nbytes: float, intra_node: bool):
    """One message between two GPUs: (latency seconds, bandwidth seconds). One ring step of
    NCCL's table: LL up to 16 KiB (NCCL_P2P_LL_THRESHOLD), Simple above."""
    kind = "nvlink" if intra_node else "net"
    p = 0 if nbytes <= P2P_LL_THRESHOLD else 2
    scale = _scale(hw, kind)
    lat = (BASE_LATENCY["ring"][p] + HW_LATENCY[kind]["ring"][p]) * 1e-6 * scale
    bw = bus_bandwidth(hw, kind)
    if p == 0:
        bw = min(bw * 0.25, LL_MAX_BW[1 if intra_node else 2])
    return lat, (nbytes / bw if bw != math.inf else 0.0)


def all_to_all_time(hw, nbytes: float, n_ranks: int, local: int, n_nodes: int):
    """NCCL's all-to-all: grouped point-to-point, every pair at once. ``nbytes`` = one rank's
    input, sent in equal parts to every rank: (seconds, bytes-seconds on NVLink, on the NIC)."""
    if n_ranks <= 1:
        return 0.0, 0.0, 0.0
    part = nbytes / n_ranks
    lat, _ = p2p_time(hw, part, n_nodes == 1)
    nv = (local - 1) * part / bus_bandwidth(hw, "nvlink") if local > 1 else 0.0
    net = (n_ranks - local) * part / bus_bandwidth(hw, "net") if n_nodes > 1 else 0.0
    return lat + max(nv, net), nv, net


def lane_bytes(op: str, nbytes: float, n_ranks: int) -> float:
    """Bytes one member sends (and receives) in the bandwidth-optimal algorithm of ``op``."""
    if n_ranks <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n_ranks - 1) / n_ranks * nbytes
    if op in ("all_gather", "reduce_scatter"):
        return (n_ranks - 1) / n_ranks * nbytes
    return nbytes                                    # broadcast: the chain forwards it whole


def describe(hw) -> list[str]:
    """The link model's constants and their sources, one line each (76 columns)."""
    nv, net = bus_bandwidth(hw, "nvlink"), bus_bandwidth(hw, "net")
    return [
        f"  NVLink:  {hw.nvlink_bandwidth / 1e9:g} GB/s a direction x {hw.nvlink_efficiency:g}"
        f" = {nv / 1e9:g} GB/s a lane",
        f"  network: {hw.network_bandwidth / 1e9:g} GB/s a direction x {hw.network_efficiency:g}"
        f" = {net / 1e9:g} GB/s a lane",
        f"  latency: NCCL's tuning model (tuning.cc baseLat, hwLat), a ring step",
        f"    with Simple {hw.nvlink_latency * 1e6:g} us on NVLink, {hw.network_latency * 1e6:g} us"
        f" on the network",
        "  streams: one per communicator, one per peer for send/recv",
    ] + _sm_lines(hw)


def _sm_lines(hw) -> list[str]:
    """The SMs a collective's kernel holds (:mod:`.contention`), where ``hw`` states them."""
    if not (getattr(hw, "nccl_channels", 0) and hw.sm_count):
        return []
    import textwrap
    source = dict(hw.sources).get("nccl_channels", "assumed")
    return [f"  SMs: a collective holds up to {hw.nccl_channels} of the {hw.sm_count} (a CTA a channel);",
            "    a GEMM beside it runs its tiles on the others"] + \
        textwrap.wrap(source + "]", 76, initial_indent="      [", subsequent_indent="       ")


__all__ = ["Lane", "nccl_collective", "collective_time", "p2p_time", "all_to_all_time", "lane_bytes", "describe",
           "BASE_LATENCY", "HW_LATENCY", "PROTOCOLS"]
