"""The plan's placement record (course_lib/parallel/placement.py) against what each rank holds.

Every rank builds a layout and hands back, per single-device name, its local tensor (before any
step: still the single-device values where it holds them) and its Placement. The record must
say exactly where the tensor sits: its box of the single-device tensor has the local shape and
the single-device values; ranks that differ only in a replicated dim hold the same values;
the FSDP shards of a tensor tile its rows. And the tags the TP layers put on tensors are read by
the plan only.
"""
import dataclasses
import pathlib
import re

import pytest
import torch

from course_lib import launch
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.parallel.mesh import MeshShape

CFG = GPTConfig(vocab_size=33, seq_len=8, n_layers=2, hidden=24, n_heads=6, n_kv_heads=2, ffn_hidden=18)
MOE = dataclasses.replace(CFG, n_experts=4, top_k=1)


def _held(cfg, dims, kw):
    from course_lib.parallel import Mesh, parallelize_nd
    mesh = Mesh(**dims)
    net = parallelize_nd(TinyGPT(cfg, seed=0).double(), mesh, **kw)
    local = {n: q.detach().clone() for n, q in net.named_parameters().items()}
    return dict(mesh.coord), local, net.placements


LAYOUTS = [
    (CFG, dict(dp=2, tp=2), dict(data="fsdp")),                                      # FSDP rows of TP slices
    (dataclasses.replace(CFG, tie_embeddings=True), dict(pp=2, tp=2), dict(microbatches=2)),
    (CFG, dict(cp=2, tp=2), dict(sequence_parallel=False, precision="bf16")),          # masters; K/V heads copied
    (MOE, dict(dp=4, ep=2), dict()),                                                  # experts over ep, edp
    (CFG, dict(dp=3), dict(data="fsdp")),                                             # uneven rows, 33 / 3
]


@pytest.mark.parametrize("cfg,dims,kw", LAYOUTS)
def test_the_record_says_where_each_rank_holds_each_parameter(cfg, dims, kw):
    full = dict(TinyGPT(cfg, seed=0).double().named_parameters(remove_duplicate=False))
    shape = MeshShape(**dims)
    per_rank = launch(_held, shape.world_size, cfg, dims, kw, threads=1)
    names = set()
    for coord, local, where in per_rank:
        assert local.keys() == where.keys()
        names |= set(local)
        for name, value in local.items():
            p = where[name]
            assert p.shape == tuple(full[name].shape), name
            offsets, lengths = p.box(value.shape)
            assert lengths == tuple(value.shape)
            want = full[name]
            for d, (o, n) in enumerate(zip(offsets, lengths)):
                assert o + n <= p.shape[d], (name, p)
                want = want.narrow(d, o, n)
            assert torch.equal(value, want.to(value.dtype)), f"{name}: the record's box holds other values"
            assert set(p.replicated) <= set(p.reduce) | {"tp"}, (name, p)
            assert (p.rows is None) == (not p.shard), (name, p)
    assert names == set(full)                                      # every parameter held somewhere
    for name in names:       # replicated dims: the same values; FSDP's shard dims: rows that tile
        holders = [(c, local[name], where[name]) for c, local, where in per_rank if name in local]
        for c, value, p in holders:
            for d in p.replicated:
                if d in ("edp", "tp"):
                    continue     # checked by the box: equal to the single-device values
                for c2, value2, p2 in holders:
                    if all(c2[k] == c[k] for k in c if k not in (d, "edp")) and c2[d] != c[d]:
                        assert p2 == p and torch.equal(value2, value), (name, d)
            if p.shard:
                tiles = sorted({(p2.rows[0], p2.rows[1]) for c2, _, p2 in holders
                                if all(c2[k] == c[k] for k in c if k not in p.shard + ("edp",))})
                rows = [r for start, n in tiles for r in range(start, start + n)]
                cut = p.shape[0] if p.tp is None or p.tp[0] != 0 else p.tp[2] - p.tp[1]
                assert rows == list(range(cut)), (name, tiles)


def test_tp_tags_are_read_by_the_plan_only():
    """``tp_shard`` / ``tp_copies`` (the TP layers' tags) and ``reduce_dims`` (the marks) are
    read by the plan's readers only (tp_plan.tp_slice_of, mesh.get_reduce_dims); everything
    else reads the Placement."""
    root = pathlib.Path(__file__).resolve().parents[1] / "course_lib"
    allowed = {"parallel/tensor_parallel.py", "parallel/vocab_parallel.py",    # the layers that tag
               "parallel/tp_plan.py", "parallel/mesh.py"}                      # the readers
    read = re.compile(r"""\.(tp_shard|tp_copies|reduce_dims)\b|attr\([^)]*["'](tp_shard|tp_copies|reduce_dims)["']""")
    found = [f"{path.relative_to(root)}:{i}: {line.strip()}"
             for path in sorted(root.rglob("*.py")) if str(path.relative_to(root)) not in allowed
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if read.search(line) and not line.lstrip().startswith("#")]
    assert not found, "\n".join(found)
    assert read.search('getattr(p, "tp_shard", None)') and read.search("q.reduce_dims")   # the pattern bites
