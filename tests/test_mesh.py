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


def megatron_expert_groups(tp, cp, dp, pp, ep, etp):
    """Megatron-Core's expert groups, written from its rank generator's rule and not from the
    course's mesh: the world in order tp-cp-dp-pp (tp fastest, pp outermost) for attention, the
    same ranks read as etp-ep-edp-pp for the experts (``order="tp-ep-dp-pp"``): rank = etp_i +
    etp * (ep_i + ep * (edp_i + edp * pp_i)). {"ep": groups, "etp": ..., "edp": ...}."""
    edp = tp * cp * dp // (ep * etp)
    sizes = {"etp": etp, "ep": ep, "edp": edp, "pp": pp}
    names = ("etp", "ep", "edp", "pp")
    groups = {}
    for dim in ("ep", "etp", "edp"):
        out = {}
        for rank in range(tp * cp * dp * pp):
            coords, r = {}, rank
            for d in names:
                r, coords[d] = divmod(r, sizes[d])
            key = tuple(coords[d] for d in names if d != dim)
            out.setdefault(key, []).append(rank)
        groups[dim] = sorted(out.values())
    return groups


@pytest.mark.parametrize("tp, cp, dp, pp, ep, etp", [(2, 1, 8, 8, 8, 1), (2, 1, 8, 2, 4, 2), (4, 2, 2, 2, 4, 2),
                                                    (8, 1, 4, 1, 8, 1), (2, 1, 3, 2, 2, 1), (1, 2, 6, 1, 4, 1)])
def test_tp_first_fold_is_megatron_cores(tp, cp, dp, pp, ep, etp):
    """fold_order="tp_first" with PP outermost (Megatron's rank order) builds the ep, etp and
    edp groups Megatron-Core's rank generator builds (an EP of 8 over TP 2 x DP 4: 8
    consecutive ranks, one node); the default fold builds them inside DP instead."""
    shape = MeshShape(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, etp=etp, order=("pp", "dp", "cp", "tp"),
                      fold_order="tp_first")
    want = megatron_expert_groups(tp, cp, dp, pp, ep, etp)
    assert shape.rank_sets("ep") == want["ep"]
    assert shape.rank_sets("etp") == want["etp"]
    assert sorted(shape.rank_sets(shape.expert_replicas())) == want["edp"]   # the ranks holding an expert
    if (tp, dp, ep) == (2, 8, 8):
        assert shape.rank_sets("ep")[0] == list(range(8))
        assert MeshShape(dp=dp, pp=pp, tp=tp, ep=ep, order=("pp", "dp", "cp", "tp")).rank_sets("ep")[0] == \
            list(range(0, 16, 2))                                    # dp first: the tp-0 ranks of 2 nodes


def test_fold_order_is_checked():
    with pytest.raises(ValueError, match="fold_order must be one of"):
        MeshShape(dp=2, ep=2, fold_order="dp")
    with pytest.raises(ValueError, match="fold_order .tp_first. differs from the mesh's .dp_first."):
        launch(_parallelize_tp_first, 2, timeout=60)


def _parallelize_tp_first():
    from course_lib.gpt import GPTConfig, TinyGPT
    from course_lib.parallel.compose import parallelize_nd
    cfg = GPTConfig(vocab_size=16, seq_len=8, n_layers=1, hidden=8, n_heads=2, ffn_hidden=8, n_experts=2, top_k=1)
    parallelize_nd(TinyGPT(cfg, seed=0), Mesh(dp=2, ep=2), Layout(dp=2, ep=2, fold_order="tp_first"))


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
    with pytest.raises(ValueError, match="expert dims are folded over"):
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


def test_the_planners_expert_groups_are_the_meshs():
    """planner.layout's arithmetic (fold_offsets, expert_replica_offsets: no rank sets built)
    places rank 0's ep, etp and expert-holder groups where the mesh does, for both fold orders,
    every rank order and folds over one, two and three dims."""
    import itertools

    from course_lib.layout import FOLDS
    from course_lib.planner.layout import expert_replica_offsets, fold_offsets
    orders = [None, ("pp", "dp", "cp", "tp"), ("tp", "cp", "pp", "dp"), ("cp", "dp", "tp", "pp")]
    seen = 0
    for dp, cp, tp, ep, etp, order, fold in itertools.product((1, 2, 3, 4), (1, 2), (1, 2, 4), (1, 2, 4), (1, 2),
                                                              orders, sorted(FOLDS)):
        if ep * etp == 1 or (dp * cp * tp) % (ep * etp):
            continue
        shape = MeshShape(dp=dp, pp=2, cp=cp, tp=tp, ep=ep, etp=etp, order=order, fold_order=fold)
        layout = Layout(dp=dp, pp=2, cp=cp, tp=tp, ep=ep, etp=etp, global_batch=dp, order=order, fold_order=fold)
        group = lambda dims: sorted(next(s for s in shape.rank_sets(dims) if 0 in s))
        assert sorted(fold_offsets(layout, "ep")) == group("ep"), (shape.describe(), "ep")
        assert sorted(fold_offsets(layout, "etp")) == group("etp"), (shape.describe(), "etp")
        replicas = shape.expert_replicas()
        assert sorted(expert_replica_offsets(layout)) == group(replicas), (shape.describe(), replicas)
        assert sorted(expert_replica_offsets(layout, etp=True)) == group(replicas + ("etp",)), shape.describe()
        seen += 1
    assert seen > 300
