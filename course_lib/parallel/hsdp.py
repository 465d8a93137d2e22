"""HSDP's groups: FSDP sharded over S ranks, replicated over R = N / S (torch's ``fully_shard``
on a 2-D mesh ``(replicate, shard)``; torchtitan's ``dp_replicate`` x ``dp_shard``).

The N = R * S ranks of one FSDP group (``mesh.rank_sets(dims)``, the outermost dim outermost)
are cut in consecutive blocks: with the planner's rank order (TP innermost, DP outermost), a
block of S data-parallel indexes sits on neighbouring GPUs, inside a node when S (times the
inner dims) fits in one. So

    shard group      S consecutive members: the all-gathers and the reduce-scatter (NVLink)
    replicate group  the members at the same place in every block: one all-reduce of the
                     gradient SHARD (1/S of the gradient) per unit and step (the network)

``reshard_after_forward=k`` cuts the shard group again into blocks of k (torch's
``mesh.view(-1, k)``): the backward all-gather stays inside those k ranks.
``dist.new_group`` is collective: every rank builds every block, in the same order.
"""
from __future__ import annotations

import torch.distributed as dist

from course_lib.collectives.comm import Comm


def rule_hsdp(cfg, layout):
    """``data="hsdp"`` needs ``shard_size`` S dividing dp (R = dp / S replicas); a shard size
    means HSDP: refused with data="ddp" or "fsdp"."""
    S = layout.shard_size
    if layout.data != "hsdp":
        if S is not None:
            raise ValueError(f"shard_size={S} shards FSDP over S of the dp ranks and replicates over the "
                             f"rest: that is data='hsdp', not data={layout.data!r}")
        return
    if S is None:
        raise ValueError("data='hsdp' needs shard_size=S: FSDP shards over S ranks and replicates over "
                         "R = dp / S (Mesh(dp=R * S))")
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise ValueError(f"shard_size must be a positive int, got {S!r}")
    if layout.dp % S:
        raise ValueError(f"shard_size={S} must divide dp={layout.dp}: dp = R * S, R replicas of "
                         f"S-way FSDP")


def block_sets(rank_sets, block):
    """Each set cut in consecutive blocks of ``block`` members -> (blocks, strided sets): the
    shard groups and the replicate groups (member i of every block), in a fixed order."""
    blocks, strided = [], []
    for ranks in rank_sets:
        if len(ranks) % block:
            raise ValueError(f"a group of {len(ranks)} ranks does not cut into blocks of {block}")
        mine = [ranks[i:i + block] for i in range(0, len(ranks), block)]
        blocks += mine
        strided += [list(group) for group in zip(*mine)]
    return blocks, strided


def make_comms(sets, dim, impl="torch", mesh=None):
    """This rank's Comm of the rank ``sets`` (each a list of global ranks): ``mesh.comm_of_sets``
    where the mesh builds them (a :class:`~course_lib.parallel.mesh.Mesh`, the dry run's), else
    one ``dist.new_group`` per set (collective: every rank, same order)."""
    if hasattr(mesh, "comm_of_sets"):
        return mesh.comm_of_sets(sets, dim, impl)
    rank, mine = dist.get_rank(), None
    for ranks in sets:
        group = dist.new_group(ranks) if len(ranks) < dist.get_world_size() else None
        if rank in ranks:
            mine = group
    return Comm(mine, dim=dim, impl=impl)


def every_group(mesh, dims, comm):
    """The rank sets of ``comm``'s group and of its twins on the other ranks: the mesh's own
    ``rank_sets(dims)`` when ``comm`` is its group along ``dims``, else one all-gather of every
    rank's group (a group=... stand-in, an HSDP shard group the mesh does not name)."""
    if hasattr(mesh, "rank_sets") and list(comm.ranks) == list(mesh.ranks(dims)):
        return mesh.rank_sets(dims)
    sets = [None] * dist.get_world_size()
    dist.all_gather_object(sets, comm.ranks)
    return [list(t) for t in sorted({tuple(t) for t in sets})]


def fsdp_rank_sets(mesh, dims):
    """The rank sets of FSDP's groups: ``mesh.rank_sets(dims)`` for a Mesh; for a one-group
    stand-in, the world (the only one whose other groups this rank can name)."""
    if hasattr(mesh, "rank_sets"):
        return mesh.rank_sets(dims)
    if mesh.group(dims) is not None:
        raise ValueError("HSDP / reshard_after_forward=int cut FSDP's group into blocks: pass mesh=Mesh(...) "
                         "(or group=None: the world)")
    return [list(range(dist.get_world_size()))]


def hsdp_comms(mesh, dims, shard_size, impl="torch"):
    """(shard Comm, replicate Comm, every shard group's ranks) of this rank. ``shard_size`` S counts indexes of the first
    of ``dims`` (dp): the shard group is S of them times the other dims (dp_shard x cp)."""
    sets = fsdp_rank_sets(mesh, dims)
    first = mesh.sizes[dims[0]] if hasattr(mesh, "rank_sets") else len(sets[0])
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1 or first % shard_size:
        raise ValueError(f"FSDP: shard_size={shard_size!r} must be a positive int dividing {dims[0]}={first} "
                         f"(HSDP: {dims[0]} = R * S)")
    blocks, strided = block_sets(sets, shard_size * len(sets[0]) // first)
    return (make_comms(blocks, f"{dims[0]}_shard", impl, mesh),
            make_comms(strided, f"{dims[0]}_replicate", impl, mesh), blocks)


def reshard_comm(shard_sets, size, dim, impl="torch", mesh=None):
    """The Comm of this rank's block of ``size`` consecutive members of its shard group
    (``reshard_after_forward=size``), from every shard group's global ranks ``shard_sets``."""
    blocks, _ = block_sets(shard_sets, size)
    return make_comms(blocks, f"{dim}_reshard{size}", impl, mesh)


__all__ = ["rule_hsdp", "block_sets", "make_comms", "every_group", "hsdp_comms", "reshard_comm",
           "fsdp_rank_sets"]
