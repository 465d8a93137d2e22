"""ZeRO++ (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant
Model Training") on the course's FSDP: ``FSDP(..., zeropp=("hpz", "qwz", "qgz"))``, any subset.

    qwZ  the weight all-gather moves int8 blocks (``BLOCK`` = 256 values, one fp32 scale each),
         dequantized after the gather: every rank computes with the same dequantized weights.
    hpZ  after the forward each rank keeps 1/G of the gathered unit (G = ``gpus_per_node``, its
         node's ranks): the backward all-gather runs inside the node, never over the network.
         It is FSDP's ``reshard_after_forward=G`` (same arithmetic: exact).
    qgZ  the gradient reduce-scatter as two all-to-alls of int8 blocks, hierarchical: inside the
         node (to the rank with the same local index as the destination), dequantize and sum in
         fp32 (float64 if the gradients are), then across nodes, dequantize and sum again. The
         paper sends int4; here int8 (one quantizer for both), so its 4x becomes 4x vs fp32.

A node here: G consecutive members of FSDP's group (the planner's rank order puts consecutive
dp indexes on neighbouring GPUs, as HSDP's shard group); G must divide the group's size.
``gpus_per_node=None``: 8 (an H100 / H200 node) if it divides the group, else the whole group.

Block quantization, error bound (absmax per block, symmetric, int8 in [-127, 127]):
    scale = max|x_block| / 127,  q = round(x / scale),  deq = q * scale
    |x - deq| = scale * |x / scale - round(x / scale)| <= scale / 2 = max|x_block| / 254
(round-to-nearest; |x / scale| <= 127 so no value clips), plus 3 u max|x_block| for the
rounding of the scale, the division and the product in the scales' dtype (fp32: u = 2^-24). An all-zero block has scale 0 and
is sent as zeros, exactly. qgZ's sum over N ranks in two levels then errs by at most
    sum_r max|g_r block| / 254  (level 1, each rank's chunk)  +  sum_nodes max|partial block| / 254
plus the fp32 summation's own rounding (:func:`reduce_scatter_bound`).
"""
from __future__ import annotations

import torch

from course_lib.parallel.hsdp import block_sets, make_comms

ZEROPP = ("hpz", "qwz", "qgz")
BLOCK = 256
QMAX = 127
DEFAULT_NODE = 8


def check_zeropp(zeropp) -> tuple:
    """The ZeRO++ options as a sorted tuple of names from :data:`ZEROPP`; ValueError otherwise."""
    if isinstance(zeropp, str):
        zeropp = (zeropp,)
    if not isinstance(zeropp, (tuple, list, set, frozenset)):
        raise ValueError(f"zeropp must be a tuple of names from {ZEROPP}, got {zeropp!r}")
    unknown = [z for z in zeropp if z not in ZEROPP]
    if unknown:
        raise ValueError(f"zeropp: unknown {unknown}; ZeRO++'s parts are {ZEROPP} (any subset)")
    return tuple(z for z in ZEROPP if z in zeropp)


def node_size(group_size: int, gpus_per_node=None) -> int:
    """G, the ranks of one node inside FSDP's group of ``group_size``: ``gpus_per_node``, or 8
    if it divides the group, else the group (one node). G must divide the group."""
    if gpus_per_node is None:
        return DEFAULT_NODE if group_size % DEFAULT_NODE == 0 else group_size
    G = gpus_per_node
    if isinstance(G, bool) or not isinstance(G, int) or G < 1 or group_size % G:
        raise ValueError(f"zeropp: gpus_per_node={G!r} must be a positive int dividing the FSDP group's "
                         f"{group_size} ranks (hpZ / qgZ: whole nodes of G ranks)")
    return G


def rule_zeropp(cfg, layout):
    """ZeRO++ shards as ZeRO-3: data='fsdp' only; names known; the node divides dp * cp."""
    names = check_zeropp(layout.zeropp)
    if names and layout.data != "fsdp":
        raise ValueError(f"zeropp={names} is ZeRO-3's (FSDP's) communication: it needs data='fsdp', "
                         f"not data={layout.data!r}")
    if names:
        node_size(layout.dp * layout.cp, layout.gpus_per_node)


def hpz_groups(world_size: int, gpus_per_node: int):
    """ZeRO++'s groups over one FSDP group of N = ``world_size`` ranks in nodes of G
    (rank = node * G + local), as FSDP(zeropp=...) builds them -> (primary, secondary, holds):

        primary    [[0 .. N-1]]: the primary partition, over every rank (ZeRO-3's shards;
                   the forward all-gather, qwZ's, crosses nodes)
        secondary  the G consecutive ranks of each node: hpZ's partition, whose all-gather
                   (backward) never leaves the node
        holds      holds[r]: the ranks whose primary shards rank r keeps after forward,
                   chunk ``local`` of G of the gathered unit: N / G consecutive ranks"""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"hpz_groups: world_size must be a positive int, got {world_size!r}")
    G = node_size(world_size, gpus_per_node)
    primary = [list(range(world_size))]
    secondary, _ = block_sets(primary, G)
    per = world_size // G
    holds = [list(range(r % G * per, (r % G + 1) * per)) for r in range(world_size)]
    return primary, secondary, holds


# ------------------------------------------------------------------ block quantization
def quantize(x, block: int = BLOCK):
    """x (n,) float -> (q (ceil(n / block) * block,) int8, scales (ceil(n / block),) float32;
    float64 input keeps float64 scales). Padding is zeros."""
    flat = x.reshape(-1)
    nb = -(-flat.numel() // block)
    padded = flat.new_zeros(nb * block)
    padded[:flat.numel()] = flat
    blocks = padded.view(nb, block)
    sdtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    scales = blocks.abs().amax(dim=1).to(sdtype) / QMAX                     # (nb,)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks.to(sdtype) / safe[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.view(-1), scales


def dequantize(q, scales, numel: int, dtype, block: int = BLOCK):
    """The inverse: (numel,) in ``dtype``, each element within scale / 2 of the original."""
    deq = q.view(-1, block).to(scales.dtype) * scales[:, None]
    return deq.view(-1)[:numel].to(dtype)


def quantization_bound(x, block: int = BLOCK):
    """Per element: max|x_block| (1 / 254 + 3 u), the bound :func:`quantize` keeps: half a step,
    plus the rounding of scale, x / scale and q * scale (u of the scales' dtype, each <= u m)."""
    flat = x.reshape(-1)
    nb = -(-flat.numel() // block)
    padded = flat.new_zeros(nb * block)
    padded[:flat.numel()] = flat.abs()
    u = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps / 2
    m = padded.view(nb, block).amax(dim=1).double()
    return (m * (1 / (2 * QMAX) + 3 * u)).repeat_interleave(block)[:flat.numel()]


class Done:
    """What FSDP waits on: the quantized collectives here run to completion when called."""

    def wait(self):
        return None


# ------------------------------------------------------------------ qwZ
def quantized_all_gather(comm, gathered, send, name="all-gather"):
    """qwZ: ``gathered`` (N * S,) <- every rank's ``send`` (S,), through int8 blocks and scales
    (two all-gathers: N * (S_pad + 4 S_pad / BLOCK) bytes instead of N * S * itemsize)."""
    N, S = comm.size, send.numel()
    q, scales = quantize(send)
    q_all = q.new_empty(N * q.numel())
    s_all = scales.new_empty(N * scales.numel())
    comm.all_gather_into_tensor(q_all, q, name=f"{name} (int8)")
    comm.all_gather_into_tensor(s_all, scales, name=f"{name} (scales)")
    deq = dequantize(q_all, s_all, N * q.numel(), gathered.dtype).view(N, q.numel())
    gathered.view(N, S).copy_(deq[:, :S])
    return Done()


# ------------------------------------------------------------------ qgZ
def node_comms(comm, G: int, impl="torch", sets=None, mesh=None):
    """(intra-node Comm, inter-node Comm) of this rank: FSDP's group ``comm`` cut in blocks of
    G consecutive members (nodes), and the members with the same local index in every node.
    ``sets``: every FSDP group's global ranks (None: one all-gather of them); ``mesh``: builds
    the Comms (:func:`~course_lib.parallel.hsdp.make_comms`). Collective: every rank builds
    every group."""
    if sets is None:
        import torch.distributed as dist

        sets = [None] * dist.get_world_size()
        dist.all_gather_object(sets, comm.ranks)
        sets = [list(s) for s in sorted({tuple(s) for s in sets})]
    blocks, strided = block_sets(sets, G)
    return make_comms(blocks, f"{comm.dim}_node", impl, mesh), make_comms(strided, f"{comm.dim}_across", impl, mesh)


def _quantized_all_to_all(comm, chunks, name):
    """chunks (P, C) float, row j for member j -> (P, C) float32+ received (row j from member j),
    each chunk sent as int8 blocks + scales."""
    P, C = chunks.shape
    qs = [quantize(c) for c in chunks]
    q = torch.cat([a for a, _ in qs])
    s = torch.cat([b for _, b in qs])
    q_in, s_in = torch.empty_like(q), torch.empty_like(s)
    comm.all_to_all_single(q_in, q, name=f"{name} (int8)")
    comm.all_to_all_single(s_in, s, name=f"{name} (scales)")
    nb = s.numel() // P
    return torch.stack([dequantize(q_in.view(P, -1)[j], s_in.view(P, nb)[j], C, s.dtype) for j in range(P)])


def quantized_reduce_scatter(intra, inter, out, packed, name="reduce-scatter"):
    """qgZ: ``out`` (C,) <- the sum over FSDP's N = nodes * G ranks of their row ``rank`` of
    ``packed`` (N, C), members in node-major order. Level 1: all-to-all inside the node of int8
    (nodes, C) slabs, summed; level 2: all-to-all across nodes of int8 (C,) rows, summed."""
    G, nodes = intra.size, inter.size
    C = packed.shape[1]
    slabs = packed.reshape(nodes, G, C).transpose(0, 1).reshape(G, nodes * C)   # slab j -> local j
    partial = _quantized_all_to_all(intra, slabs, f"{name} in node").sum(0)   # (nodes * C,)
    mine = _quantized_all_to_all(inter, partial.view(nodes, C), f"{name} across nodes").sum(0)
    out.copy_(mine)
    return Done()


def reduce_scatter_bound(packed_of_every_rank, G: int, rank: int):
    """The derived bound on |qgZ - exact sum| for row ``rank`` (C,): level 1's quantization of
    each slab member j of node a sent (max|block| / 254, blocks over the whole slab), level 2's
    of each node's partial row (its blocks' max|exact| + level-1 error, / 254), plus 2 N u of
    the summation. ``packed_of_every_rank``: [(N, C)] as every rank passed it."""
    N = len(packed_of_every_rank)
    nodes, me_node, me_local = N // G, rank // G, rank % G
    C = packed_of_every_rank[0].shape[1]
    u = torch.finfo(packed_of_every_rank[0].dtype).eps / 2
    bound = torch.zeros(C, dtype=torch.float64, device="cpu")          # host-side arithmetic
    for a in range(nodes):
        level1 = torch.zeros(C, dtype=torch.float64, device="cpu")
        partial = torch.zeros(C, dtype=torch.float64, device="cpu")
        for j in range(G):
            src = packed_of_every_rank[a * G + j].double()
            slab = src.view(nodes, G, C)[:, me_local].reshape(-1)   # what it sent to local me_local
            level1 += quantization_bound(slab).view(nodes, C)[me_node]
            partial += src[rank]
        bound += level1 + quantization_bound(partial.abs() + level1)
    terms = sum(p.double().abs()[rank] for p in packed_of_every_rank)
    return bound + 2 * N * u * (terms + bound)


__all__ = ["ZEROPP", "BLOCK", "check_zeropp", "node_size", "rule_zeropp", "quantize", "dequantize",
           "quantization_bound", "hpz_groups", "quantized_all_gather", "node_comms", "quantized_reduce_scatter",
           "reduce_scatter_bound", "Done"]
