"""The planner's communication formulas: what each rank sends, and how long a ring takes.

Re-exported by :mod:`course_lib.planner.formulas` (one namespace for every formula).
"""
from __future__ import annotations

import math

from course_lib import costmodel
from course_lib import nccl_tuning as T


# ---- communication: what each rank sends, and how long a ring takes -------------------

def collective_bytes_per_rank(kind: str, n_bytes: float, N: int) -> float:
    """Bytes each rank sends in a bandwidth-optimal (ring) collective on N ranks.

    ``n_bytes`` is the size of the whole tensor (the all-reduce input, the all-gather
    output, the reduce-scatter input). all_gather / reduce_scatter / all_to_all:
    (N-1)/N n (each rank sends the N-1 pieces it is responsible for, each n/N);
    all_reduce = reduce_scatter + all_gather: 2 (N-1)/N n (Patarasuk & Yuan 2009).
    send_recv: n. Never (N-1) n: that is a rank sending the whole tensor N-1 times.
    """
    if kind not in ("send_recv", "all_gather", "reduce_scatter", "all_to_all", "all_reduce"):
        raise ValueError(f"unknown collective {kind!r}")
    return costmodel.volume_per_rank(kind, n_bytes, N)


def ring_steps(kind: str, N: int) -> int:
    """Ring steps of a collective: N-1 for all_gather / reduce_scatter / all_to_all
    (pairwise), 2(N-1) for all_reduce, 1 for send_recv, 0 when N == 1."""
    if kind == "send_recv":
        return 1
    if N <= 1:
        return 0
    return (2 if kind == "all_reduce" else 1) * (N - 1)


def collective_time(kind: str, n_bytes: float, N: int, alpha: float, bandwidth: float) -> float:
    """alpha-beta time of a ring collective (Hockney 1994; Thakur et al. 2005):
    steps x alpha + bytes per rank / bandwidth. All N ranks send their n/N chunk at
    the same time in every step, so a ring all-reduce costs 2(N-1) alpha +
    2(N-1)/N n / B, not N-1 full transfers one after another. The cost functions
    are course_lib.costmodel's (the collectives chapter fits alpha and beta to them)."""
    if N <= 1 and kind != "send_recv":
        return 0.0
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    algorithm = _RING_ALGORITHM.get(kind)
    if algorithm is None:
        raise ValueError(f"unknown collective {kind!r}")
    return costmodel.cost(algorithm, n_bytes, N, alpha, 1.0 / bandwidth)


def nccl_time(hw, kind: str, nbytes: float, n: int, nodes: int) -> tuple[float, float]:
    """(seconds, seconds its bytes take) of one NCCL collective as NCCL's own tuning model prices
    it to choose (NCCL 2.19-2.21 ``src/graph/tuning.cc``; the published constants in
    :mod:`course_lib.nccl_tuning`): each algorithm (the ring; the tree too for an all-reduce)
    with each protocol (LL, LL128, Simple) costs latency + bytes / algorithm bandwidth, and the
    fastest is the one NCCL runs. ``nbytes``: the whole buffer (all-reduce's tensor, all-gather's
    output, reduce-scatter's input), on ``n`` ranks over ``nodes`` nodes.

    - bandwidth: the link's (``hw.link``: NVLink inside a node, the network across), times the
      protocol's share (LL a quarter on a ring across nodes or in an all-reduce, capped by
      llMaxBw; LL128 0.92, 0.7 with one GPU per node); a ring's algorithm bandwidth is that
      times n / its steps, a tree's half of 0.92 of it;
    - latency: baseLat, plus per ring step hwLat of its link, the steps that cross the network
      at the network's (an all-reduce's 2 x nodes of its 2 (n - 1), NCCL's ``nInterSteps``), the
      others at NVLink's or at least the NIC's overhead (x3 for Simple); a tree's 2 (its depth
      in the node + log2 nodes); the latencies scale with the preset's alpha (``Hardware.
      nvlink_latency``, ``network_latency``: hwLat of a Simple ring step); an all-reduce's
      Simple ring across nodes x 1.9 from 64 KiB x n / 16 (the "plateau effect of ring")."""
    if n <= 1:
        return 0.0, 0.0
    if kind == "all_reduce":
        steps, crossing, algorithms = 2 * (n - 1), (2 * nodes if nodes > 1 else 0), ("ring", "tree")
    elif kind in ("all_gather", "reduce_scatter"):
        steps, crossing, algorithms = n - 1, nodes - 1, ("ring",)
    else:
        raise ValueError(f"NCCL's tuning model prices all_reduce, all_gather, reduce_scatter; got {kind!r}")
    us_nvlink = 1e-6 * hw.nvlink_latency / T.PRESET_ALPHA_IS["nvlink"]
    us_net = 1e-6 * hw.network_latency / T.PRESET_ALPHA_IS["net"]
    link = hw.link(nodes == 1)[1]
    ll_cap = T.LL_MAX_BW[min(nodes, 4) if nodes != 3 else 4]
    best = None
    for algo in algorithms:
        for i, proto in enumerate(T.PROTOCOLS):
            on_node = T.HW_LATENCY["nvlink"][algo][i] * us_nvlink * (1.8 if nodes > 1 and proto == "LL" else 1)
            off_node = T.HW_LATENCY["net"][algo][i] * us_net
            base = T.BASE_LATENCY[algo][i] * (us_nvlink if nodes == 1 else us_net)
            if algo == "ring":
                share = {"LL": T.RING_LL[0 if nodes > 1 or kind == "all_reduce" else 1],
                         "LL128": T.RING_LL128[0 if n / nodes < 2 else 1], "Simple": 1.0}[proto]
                bus = min(ll_cap, link * share) if proto == "LL" else link * share
                algbw = bus * n / steps
                if nodes > 1:
                    on_node = max(on_node, T.NET_OVERHEAD * us_net * 1e6 * (3 if proto == "Simple" else 1))
                latency = base + (steps - crossing) * on_node + crossing * off_node
                if proto == "Simple" and nodes > 1 and kind == "all_reduce" and nbytes >= n / 16 * 65536:
                    latency *= T.RING_PLATEAU
            else:
                bus = link * T.TREE_BUS
                if proto == "LL":
                    bus = min(bus * T.TREE_LL, ll_cap)
                elif proto == "LL128":
                    bus *= T.TREE_LL128[0 if nodes == 1 else 1]
                algbw = bus / 2
                latency = base + 2 * ((n // nodes - 1) * on_node + int(math.log2(nodes)) * off_node)
            data = nbytes / algbw
            if best is None or latency + data < best[0]:
                best = (latency + data, data)
    return best


def all_to_all_time(n_bytes: float, N: int, local: int, intra: tuple, inter: tuple) -> float:
    """An all-to-all of ``n_bytes`` (one rank's input, n/N to each member) over N ranks of which
    ``local`` (this one included) share its node: its pairwise exchanges with the other local
    members on NVLink, ``intra`` = (alpha, B/s), and with the rest on the network, ``inter``,
    the two at once (NCCL posts every pair's send and receive together, each link class its own
    lanes): the longer of (local - 1)(alpha + n/N / B) and (N - local)(alpha' + n/N / B'). With
    every member on one side it is :func:`collective_time`'s pairwise all-to-all."""
    if N <= 1:
        return 0.0
    part = n_bytes / N
    on_node = (local - 1) * (intra[0] + part / intra[1]) if local > 1 else 0.0
    off_node = (N - local) * (inter[0] + part / inter[1]) if N > local else 0.0
    return max(on_node, off_node)


_RING_ALGORITHM = {"all_reduce": "ring_all_reduce", "all_gather": "ring_all_gather",
                   "reduce_scatter": "ring_reduce_scatter", "all_to_all": "pairwise_all_to_all",
                   "send_recv": "point_to_point"}


# ---- communication volume per dimension (bytes one rank sends) ---------------------------

def tp_bytes_per_layer(s, b, h, t, sp=False, recompute="none", dtype_bytes=2, cp=1) -> float:
    """Tensor parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022): bytes one rank
    sends per layer per micro-batch. TP is not communication-free: the row-parallel
    outputs must be summed. Without SP: 2 all-reduces of (s/cp, b, h) forward (after
    attention and after the MLP) and 2 backward (the column-parallel inputs' grads).
    With SP each all-reduce becomes a reduce-scatter + an all-gather: same volume.
    Full recomputation runs the forward's 2 again; selective recomputes inside the
    attention core and adds none."""
    n = s * b * h * dtype_bytes / cp
    n_allreduce = 4 + (2 if recompute == "full" else 0)
    return n_allreduce * collective_bytes_per_rank("all_reduce", n, t)


def cp_bytes_per_layer(s, b, kv_dim, cp, dtype_bytes=2, algorithm="ring") -> float:
    """Context parallelism: bytes one rank sends per layer per micro-batch. K and V of the
    whole sequence are KV = 2 s b kv_dim bytes-per-value; each rank holds KV/cp.

    ``"ring"`` (ring attention, Liu et al. 2023, as built in the CP chapter, whose messages
    the chapter-10 notebook counts): forward passes its K/V block cp-1 hops, (cp-1)/cp KV;
    backward passes the K/V blocks again (cp-1 hops) and a dK/dV accumulator that travels
    with them and comes home after cp hops: (2cp-1)/cp KV. In all (3cp-2)/cp KV.
    ``"all_gather"`` (Llama 3): all-gather K and V forward and again backward, reduce-scatter
    dK and dV: 3 (cp-1)/cp KV."""
    if algorithm not in ("ring", "all_gather"):
        raise ValueError(f"algorithm must be 'ring' or 'all_gather', got {algorithm!r}")
    if cp <= 1:
        return 0.0
    kv = 2 * s * b * kv_dim * dtype_bytes               # K and V of the whole sequence
    if algorithm == "all_gather":
        return 3 * collective_bytes_per_rank("all_gather", kv, cp)
    return (3 * cp - 2) / cp * kv


def pp_bytes_per_microbatch(s, b, h, t=1, sp=False, dtype_bytes=2, cp=1) -> float:
    """Pipeline parallelism: a stage sends its output activation (s/cp, b, h) forward
    and the input gradient of the same shape backward, per micro-batch; with SP
    each TP rank sends its 1/t slice (Narayanan et al. 2021's scatter/gather)."""
    return 2 * s * b * h * dtype_bytes / cp / (t if sp else 1)


def dp_bytes_per_step(n_params_local, dp, zero_stage=0, grad_bytes=2, param_bytes=2,
                      microbatches=1, root_params=0, reduce_scatter="ring") -> float:
    """Data parallelism over dp ranks, for the n_params_local this rank's replica
    holds. Stage 0: one all-reduce of the gradients, 2(N-1)/N of the model. ZeRO-1:
    its two halves, a reduce-scatter of the gradients and an all-gather of the
    updated parameters, the same bytes. ZeRO-2 keeps only its gradient shard, so it
    reduce-scatters after every micro-batch. ZeRO-3 also all-gathers the parameters
    in forward and again in backward, every micro-batch (Rajbhandari et al. 2020,
    Sec. 7: 1.5x the bytes of DP with one micro-batch), except FSDP's root unit
    (``root_params``: embeddings, final norm, head), which stays gathered from forward
    to backward. ``reduce_scatter="all_reduce"``: a library whose reduce-scatter is an
    all-reduce keeping a piece (gloo's, measured in chapter 4) sends twice its bytes."""
    if reduce_scatter not in ("ring", "all_reduce"):
        raise ValueError(f"reduce_scatter must be 'ring' or 'all_reduce', got {reduce_scatter!r}")
    P = float(n_params_local)
    rs = collective_bytes_per_rank("reduce_scatter" if reduce_scatter == "ring" else "all_reduce",
                                   P * grad_bytes, dp)
    ag = collective_bytes_per_rank("all_gather", P * param_bytes, dp)
    if zero_stage == 0:
        return collective_bytes_per_rank("all_reduce", P * grad_bytes, dp)
    if zero_stage == 1:
        return rs + ag
    if zero_stage == 2:
        return microbatches * rs + ag
    root = collective_bytes_per_rank("all_gather", root_params * param_bytes, dp)
    return microbatches * (2 * ag - root + rs)


def hsdp_bytes_per_step(n_params_local, shard, replicas, grad_bytes=2, param_bytes=2,
                        microbatches=1) -> float:
    """HSDP: FSDP over ``shard`` ranks (all-gather in forward and backward, reduce-scatter
    every micro-batch, inside the shard group), then the gradient SHARD, P / shard of it, all-
    reduced over ``replicas`` ranks (torch's ``fully_shard`` on a 2-D mesh). Per rank:
    m (2 AG_S(P) + RS_S(P)) + m AR_R(P / S): the replicas move 1/S of what DDP's all-reduce
    moves; ``shard`` = dp is FSDP, ``shard`` = 1 is DDP plus nothing gathered."""
    P = float(n_params_local)
    fsdp = dp_bytes_per_step(P, shard, 3, grad_bytes, param_bytes, microbatches) if shard > 1 else 0.0
    replicate = collective_bytes_per_rank("all_reduce", P / shard * grad_bytes, replicas) if replicas > 1 else 0.0
    return fsdp + microbatches * replicate


def moe_dispatch_payloads(tokens, h, top_k, ep, etp=1, dispatch="all_to_all", dtype_bytes=2) -> dict:
    """{collective: payload bytes} of one MoE layer's forward on one rank with ``tokens``
    tokens, every assignment kept (dropless), as the Comm logs them (all-to-all: its input;
    all-gather: its output; reduce-scatter: its input). ``"all_to_all"``: dispatch and
    combine, the token's row once per chosen expert (T k h); with etp > 1 the rows an expert
    gets (T k, expected) all-gathered over etp and the partial outputs reduce-scattered.
    ``"all_gather"``: the tokens of the ep x etp group on every rank (N T h), reduce-scattered
    back (N T h). Router weights, expert ids and counts (a few bytes a token) left out."""
    if dispatch == "all_gather":
        n = ep * etp
        return {"all_gather": n * tokens * h * dtype_bytes, "reduce_scatter": n * tokens * h * dtype_bytes}
    rows = tokens * top_k * h * dtype_bytes
    out = {"all_to_all": 2 * rows}
    if etp > 1:
        out.update(all_gather=etp * rows, reduce_scatter=etp * rows)
    return out


def moe_dispatch_bytes(tokens, h, top_k, ep, etp=1, dispatch="all_to_all", dtype_bytes=2) -> float:
    """Bytes one rank sends for one MoE layer's forward (the backward sends the same again):
    each payload of :func:`moe_dispatch_payloads` on its group, the ring's (N-1)/N of it (an
    all-to-all: the rows for the other ep - 1 ranks, in expectation over a balanced router)."""
    group = {"all_to_all": ep, "all_gather": ep * etp if dispatch == "all_gather" else etp}
    group["reduce_scatter"] = group["all_gather"]
    return sum(collective_bytes_per_rank(kind, n, group[kind])
               for kind, n in moe_dispatch_payloads(tokens, h, top_k, ep, etp, dispatch, dtype_bytes).items())


QUANT_BYTES = 1 + 4 / 256   # ZeRO++'s int8 value plus its share of one fp32 scale per 256


def zeropp_bytes_per_step(n_params_local, dp, zeropp=(), gpus_per_node=8, grad_bytes=2, param_bytes=2,
                          microbatches=1) -> dict:
    """ZeRO-3 with ZeRO++ (Wang et al. 2023) over dp ranks in nodes of G = ``gpus_per_node``:
    {"inter": bytes one rank sends across nodes, "intra": inside its node} per step, ring
    volumes (:func:`collective_bytes_per_rank`), every micro-batch:

        forward all-gather   AG_dp(P q)        q = 1 + 4/256 bytes with qwZ, else param_bytes
        backward all-gather  AG_G(P p) in node with hpZ (the secondary shard), else AG_dp(P q)
        gradients            qgZ: A2A_G(P q) in node, then A2A_{dp/G}(P q / G) across nodes;
                             else RS_dp(P grad_bytes)

    A group inside one node (dp <= G) counts as "intra" whole. The paper's count (3M for
    ZeRO-3, 0.75M for ZeRO++ with fp16 weights, int8 weights, int4 gradients) is the all-
    gather outputs and all-to-all inputs; the course's qgZ sends int8, not int4."""
    P, G = float(n_params_local), gpus_per_node
    if dp <= 1:
        return {"inter": 0.0, "intra": 0.0}
    G = min(G, dp)
    if dp % G:
        raise ValueError(f"gpus_per_node={gpus_per_node} must divide dp={dp} (ZeRO++'s nodes)")
    out = {"inter": 0.0, "intra": 0.0}
    net = "inter" if dp > G else "intra"
    q = QUANT_BYTES if "qwz" in zeropp else param_bytes
    out[net] += collective_bytes_per_rank("all_gather", P * q, dp)
    if "hpz" in zeropp:
        out["intra"] += collective_bytes_per_rank("all_gather", P * param_bytes, G)
    else:
        out[net] += collective_bytes_per_rank("all_gather", P * q, dp)
    if "qgz" in zeropp:
        out["intra"] += collective_bytes_per_rank("all_to_all", P * QUANT_BYTES, G)
        out[net] += collective_bytes_per_rank("all_to_all", P * QUANT_BYTES / G, dp // G) if dp > G else 0.0
    else:
        out[net] += collective_bytes_per_rank("reduce_scatter", P * grad_bytes, dp)
    return {k: microbatches * v for k, v in out.items()}


def ep_bytes_per_layer(s, b, h, ep, top_k=1, dtype_bytes=2, cp=1, etp=1, dispatch="all_to_all") -> float:
    """Expert parallelism (Lepikhin et al. 2020): each token's hidden state goes to its
    top_k experts and comes back, an all-to-all each way forward and each way
    backward: 4 all-to-alls of (s/cp, b, top_k, h) (or the all-gather dispatch, and
    expert tensor parallelism: :func:`moe_dispatch_bytes`, forward and backward)."""
    return 2 * moe_dispatch_bytes(s * b / cp, h, top_k, ep, etp, dispatch, dtype_bytes)
