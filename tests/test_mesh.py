"""The named mesh (course_lib/parallel/mesh.py): rank order, groups, neighbours, bad shapes,
and the same rank sets as torch's init_device_mesh."""
import pytest
import torch

from course_lib import launch
from course_lib.parallel.mesh import DIMS, Mesh, MeshShape
from course_lib.planner.layout import Layout

SHAPES = [dict(dp=2, pp=2, cp=1, tp=2), dict(dp=1, pp=3, cp=1, tp=1), dict(dp=2, pp=1, cp=2, tp=1),
          dict(dp=4, tp=2, ep=2), dict(dp=3, pp=1, cp=1, tp=1)]


def test_rank_order_is_the_planners():
    """TP innermost, then CP, PP, DP: rank = ((dp*pp + p)*cp + c)*tp + t."""
    m = MeshShape(dp=2, pp=3, cp=2, tp=2)
    for rank in range(m.world_size):
        c = m.coords(rank)
        assert rank == ((c["dp"] * 3 + c["pp"]) * 2 + c["cp"]) * 2 + c["tp"]
        assert m.rank_of(**{d: c[d] for d in DIMS}) == rank
    assert m.rank_sets("tp")[:2] == [[0, 1], [2, 3]]
    assert m.rank_sets("dp")[0] == [0, 12]
    assert m.rank_sets(("dp", "cp"))[0] == [0, 2, 12, 14]  # flattened: dp outer, cp inner


def test_expert_groups_are_carved_out_of_dp():
    m = MeshShape(dp=4, tp=2, ep=2)
    assert m.rank_sets("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]   # consecutive dp indexes
    assert m.rank_sets("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # same expert shard
    assert m.size("ep") * m.size("edp") == m.size("dp")


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=0), "dp must be an integer >= 1"), (dict(tp=1.5), "tp must be an integer"),
    (dict(dp=3, ep=2), r"ep \* etp = 2 \* 1 must divide dp \* cp \* tp = 3")])
def test_bad_shapes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MeshShape(**kwargs)


def test_bad_dimension_names():
    m = MeshShape(dp=2, tp=2)
    with pytest.raises(ValueError, match="unknown mesh dimension"):
        m.rank_sets("sp")
    with pytest.raises(ValueError, match="parts of 'dp'"):
        m.rank_sets(("dp", "ep"))
    with pytest.raises(ValueError, match="outside the mesh"):
        m.rank_of(tp=2)


def build_and_compare(shape):
    """On every rank: our mesh, torch's init_device_mesh on (dp, pp, cp, tp), and an all-reduce
    over each of our groups (the sum of the member ranks proves who is in it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = Mesh(**shape)
    dm = init_device_mesh("cpu", tuple(mesh.sizes[d] for d in DIMS), mesh_dim_names=DIMS)
    out = {"coord": mesh.coord, "neighbours": (mesh.pp_prev, mesh.pp_next), "ranks": {}, "torch": {}, "sums": {}}
    for dims in [*DIMS, ("dp", "cp"), ("pp", "tp"), ("dp", "pp", "cp", "tp")] + (["ep", "edp"] if mesh.ep > 1 else []):
        out["ranks"][dims] = mesh.ranks(dims)
        t = torch.tensor([float(dist.get_rank())])
        mesh.comm(dims).all_reduce(t)
        out["sums"][dims] = t.item()
        if dims in DIMS:
            out["torch"][dims] = dist.get_process_group_ranks(dm.get_group(dims))
            out.setdefault("spelling", []).append(   # torch's DeviceMesh accessors, ours and torch's
                ((dist.get_process_group_ranks(mesh.get_group(dims)), mesh.get_local_rank(dims), mesh.size(dims)),
                 (out["torch"][dims], dm.get_local_rank(dims), dm.size(dm.mesh_dim_names.index(dims)))))
        elif dims in (("dp", "cp"), ("pp", "tp")):
            out["torch"][dims] = dist.get_process_group_ranks(dm[dims]._flatten().get_group())
    out["coordinates"] = (mesh.get_coordinate(), dm.get_coordinate(), mesh.size(), dm.size())
    out["comm_dim"] = mesh.comm(("dp", "cp")).dim
    emb = mesh.embedding_comm()
    out["embedding"] = None if emb is None else emb.ranks
    layout = Layout(dp=mesh.sizes["dp"], pp=mesh.sizes["pp"], cp=mesh.sizes["cp"], tp=mesh.sizes["tp"], ep=mesh.ep)
    out["from_layout"] = Mesh.from_layout(layout).ranks(("dp", "tp"))
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_groups_match_init_device_mesh(shape):
    results = launch(build_and_compare, MeshShape(**shape).world_size, shape, timeout=120)
    ref = MeshShape(**shape)
    for rank, out in enumerate(results):
        assert out["coord"] == ref.coords(rank)
        for dims, torch_ranks in out["torch"].items():
            assert out["ranks"][dims] == torch_ranks, dims
        for dims, ranks in out["ranks"].items():
            assert rank in ranks and out["sums"][dims] == sum(ranks), dims
        c = ref.coords(rank)
        prev = ref.rank_of(dp=c["dp"], pp=c["pp"] - 1, cp=c["cp"], tp=c["tp"]) if c["pp"] else None
        nxt = ref.rank_of(dp=c["dp"], pp=c["pp"] + 1, cp=c["cp"], tp=c["tp"]) if c["pp"] < ref.sizes["pp"] - 1 else None
        assert out["neighbours"] == (prev, nxt)
        assert out["comm_dim"] == "dp+cp"
        for ours, theirs in out["spelling"]:
            assert ours == theirs
        ours, theirs, n, n_torch = out["coordinates"]
        assert ours == list(theirs) and n == n_torch
        pipeline = next(s for s in ref.rank_sets("pp") if rank in s)   # the embedding group: its two ends
        assert out["embedding"] == (sorted({pipeline[0], pipeline[-1]}) if rank in (pipeline[0], pipeline[-1]) else None)
        assert out["from_layout"] == next(s for s in ref.rank_sets(("dp", "tp")) if rank in s)


def wrong_world():
    Mesh(dp=2, tp=2)


def test_mesh_must_cover_the_world():
    with pytest.raises(Exception, match=r"dp\*pp\*cp\*tp = world size"):
        launch(wrong_world, 3, timeout=60)
