"""HSDP (course_lib/parallel/hsdp.py, FSDP's ``shard_size``) against one device and torch.

FSDP sharded over S ranks, replicated over R: one launch of 6 ranks (R x S = 2 x 3: odd S;
3 x 2: odd R; 6 x 1; an uneven split; TinyGPT through ``parallelize_nd(data="hsdp")`` on
3 x 2; torch's ``fully_shard`` on a 2-D mesh (2, 3) beside ours). AdamW runs are
compared in float64 within course_lib.tolerance's bound; the first step's gradient shards too
(AdamW hides a gradient summed instead of averaged). Bytes: the replicas all-reduce the
gradient SHARD (1/S of it), never the whole gradient.
"""
import functools

import pytest
import torch
import torch.nn as nn

from course_lib import launch, reference, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.lab.nd_runs import LR as GPT_LR, single_device
from course_lib.models import MLP
from course_lib.parallel.compose import check_layout
from single_device import AWKWARD, SIZES, STEPS, assert_trained_like, exact, first_step_grads, make_data, train

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layers=2, hidden=16, n_heads=2, n_kv_heads=1)
GPT_BATCH = 12


class Uneven(nn.Module):
    """(5, 3) and (2, 5) weights: on S = 2, 3 + 2 and 1 + 1 rows; on S = 3, 2 + 2 + 1 and 1 + 1 + 0."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([nn.Linear(16, 5), nn.Linear(5, 32)])

    def forward(self, x):
        return self.layers[1](torch.tanh(self.layers[0](x)))


def build(kind, seed):
    if kind == "uneven":
        return Uneven(seed)
    return MLP(SIZES, seed=seed, **(AWKWARD if kind == "mlp" else {}))   # "plain": torch's side too


@functools.lru_cache(maxsize=None)
def reference_of(kind):
    """Final state and first-step gradients of one device (float64, AdamW)."""
    with exact():
        X, Y, perms = make_data()
        grads = first_step_grads(build(kind, 0), X, Y, perms)
        return train(build(kind, 0), X, Y, perms), grads


def hsdp_mlp(kind, shard_size, rank, world, torch_side=False):
    """STEPS AdamW steps of FSDP(shard_size=S) on this rank's rows: the full state, the first
    step's gradient shards (with their rows) and one step's collectives per group."""
    from course_lib.parallel.fsdp import FSDP

    model = build(kind, seed=rank)                     # rank 0's values are broadcast
    net = FSDP(model, shard_size=shard_size)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    X, Y, perms = make_data()
    out = {"log": {}}
    for step, (x, y) in enumerate(reference.shuffled(X, Y, perms)):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        comms = [c for c in (net.comm, net.replicate) if c is not None]
        for c in comms:
            c.reset()
        reference.mse_loss(net, x, y).backward()
        net.finish_gradient_synchronization()
        if step == 0:
            out["log"] = {c.dim: [(op, payload) for op, _, payload, _ in c.log] for c in comms}
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            out["units"] = [(u.numel, u.grad_numel, len(u.trainable)) for u in net.units]
            out["norm"] = float(net.clip_grad_norm_(1e9))
        opt.step()
        opt.zero_grad()
    out["rows"] = {n: (net.comm.rank * s.chunk, s.rows) for u in net.units
                   for n, s in zip(_names(model, u), u.slots)}
    out["state"] = net.full_state_dict()
    out["shard"] = (net.comm.size, net.replicate.size, net.comm.ranks, net.replicate.ranks)
    if torch_side:
        out["torch"] = torch_hsdp(world // shard_size, shard_size, rank, world)
    return out


def _names(model, unit):
    ids = {id(p): n for n, p in reversed(list(model.named_parameters()))}
    return [ids.get(id(piece), f"?{i}") for i, piece in enumerate(unit.pieces)]


def torch_hsdp(R, S, rank, world):
    """torch's fully_shard on the 2-D mesh (replicate R, shard S), same model, data, AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    model = build("plain", 0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    X, Y, perms = make_data()
    for x, y in reference.shuffled(X, Y, perms):
        reference.mse_loss(model, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def hsdp_gpt(shard_size):
    """parallelize_nd(data="hsdp") on Mesh(dp=world): losses, shards, first-step shard grads."""
    import torch.distributed as dist

    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    net = parallelize_nd(TinyGPT(CFG, seed=0).double(), Mesh(dp=dist.get_world_size()), data="hsdp",
                         shard_size=shard_size)
    opt = torch.optim.AdamW(net.parameters(), lr=GPT_LR, weight_decay=0.1)
    losses, grads = [], None
    for x, y in reference.gpt_batches(CFG, batch=GPT_BATCH, steps=STEPS):
        losses.append(net.step(x, y))
        if grads is None:
            grads = {n: (q.grad.clone(), net.placements[n].rows) for n, q in net.named_parameters().items()}
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, shards=net.shards(), grads=grads, layout=net.layout.describe())


def rank_checks(cases, gpt=None, torch_case=None):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    with exact():
        for kind, S in cases:
            out[kind, S] = hsdp_mlp(kind, S, rank, world, torch_side=(kind, S) == torch_case)
    if gpt:
        out["gpt"] = hsdp_gpt(gpt)
    return out


@pytest.fixture(scope="module")
def runs():   # one launch: R x S = 2 x 3 (odd S), 3 x 2 (odd R), 6 x 1; torch on 2 x 3; the GPT on 3 x 2
    return {6: launch(rank_checks, 6, [("mlp", 3), ("mlp", 2), ("mlp", 1), ("uneven", 3), ("plain", 3)], 2,
                      ("plain", 3), threads=1, timeout=180)}


ALL = [(6, "mlp", 3), (6, "mlp", 2), (6, "mlp", 1), (6, "uneven", 3), (6, "plain", 3)]


@pytest.mark.parametrize("world, kind, S", ALL)
def test_hsdp_matches_one_device(runs, world, kind, S):
    state, grads = reference_of(kind)
    for rank, result in enumerate(runs[world]):
        got = result[kind, S]
        assert got["shard"][:2] == (S, world // S)
        assert_trained_like(got["state"], state, what=f"rank {rank} R x S = {world // S} x {S}")
        rows = got["rows"]   # the first step's gradient shard: this rank's rows of the mean gradient
        want = {n: grads[n][rows[n][0]:rows[n][0] + rows[n][1]] for n in got["grads"]}
        tolerance.assert_matches(got["grads"], want, what="first-step gradient shards")
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
        assert got["norm"] == pytest.approx(float(norm), rel=1e-12)   # clip: each shard counted once


@pytest.mark.parametrize("world, kind, S", ALL)
def test_shard_groups_are_consecutive_ranks_replicas_strided(runs, world, kind, S):
    for rank, result in enumerate(runs[world]):
        size, replicas, shard_ranks, replicate_ranks = result[kind, S]["shard"]
        assert shard_ranks == list(range(rank // S * S, rank // S * S + S))     # inside a node
        assert replicate_ranks == list(range(rank % S, world, S))               # across nodes


@pytest.mark.parametrize("world, kind, S", ALL)
def test_replicas_all_reduce_the_shard_only(runs, world, kind, S):
    """Per unit and step: all-gather (S * shard), reduce-scatter (S * (grad shard + flags)) over
    the S shard ranks, then one all-reduce of (grad shard + flags) over the R replicas: 1/S of
    the gradient crosses the replicas, not all of it."""
    for result in runs[world]:
        got = result[kind, S]
        units, log = [u for u in got["units"] if u[2]], got["log"]   # units with something to train
        shard_log, rep_log = log["dp_shard"], log.get("dp_replicate", [])
        assert [op for op, _ in shard_log].count("reduce_scatter_tensor") == len(units)
        rs = [b for op, b in shard_log if op == "reduce_scatter_tensor"]
        assert sorted(rs) == sorted(S * (G + T) * 8 for _, G, T in units)
        if world // S > 1:
            assert sorted(b for _, b in rep_log) == sorted((G + T) * 8 for _, G, T in units)
            assert all(op == "all_reduce" for op, _ in rep_log)
        else:
            assert rep_log == []


def test_torch_fully_shard_on_a_2d_mesh_agrees(runs):
    for result in runs[6]:
        theirs, mine = result["plain", 3]["torch"], result["plain", 3]["state"]
        assert set(mine) == set(theirs)
        tolerance.assert_matches(mine, theirs, optimizer="adamw", steps=STEPS, lr=1e-2, what="ours vs torch")


def test_parallelize_nd_hsdp_matches_one_device(runs):
    from course_lib.parallel.compose import assemble_nd
    from course_lib.parallel.mesh import MeshShape

    ref = single_device(CFG, GPT_BATCH, STEPS, groups=6, dtype=torch.float64)
    ranks = [r["gpt"] for r in runs[6]]
    assert ranks[0]["layout"].startswith("DP6(HSDP 3x2)")
    for r in ranks:
        tolerance.assert_matches(r["losses"], ref.losses, optimizer="adamw", steps=STEPS, lr=GPT_LR, what="losses")
        want = {n: ref.grads[n][rows[0]:rows[0] + rows[1]] for n, (_, rows) in r["grads"].items()}
        tolerance.assert_matches({n: g for n, (g, _) in r["grads"].items()}, want, what="first-step shards")
    full = assemble_nd([r["shards"] for r in ranks], MeshShape(dp=6))
    tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=STEPS, lr=GPT_LR)


@pytest.mark.parametrize("kw, message", [
    (dict(dp=4, data="hsdp"), "needs shard_size"),
    (dict(dp=4, data="hsdp", shard_size=3), "must divide dp=4"),
    (dict(dp=6, data="hsdp", shard_size=4), "must divide dp=6"),
    (dict(dp=4, data="fsdp", shard_size=2), "is data='hsdp'"),
    (dict(dp=4, data="ddp", shard_size=2), "that is data='hsdp'"),
    (dict(dp=4, data="hsdp", shard_size=0), "positive int"),
    (dict(dp=4, data="hsdp", shard_size=2.0), "positive int"),
])
def test_bad_hsdp_layouts_are_refused_before_any_rank_starts(kw, message):
    with pytest.raises(ValueError, match=message):
        check_layout(CFG, **kw)


def test_hsdp_layout_fields():
    L = check_layout(CFG, dp=6, data="hsdp", shard_size=3)
    assert L.world_size == 6
    from course_lib.layout import Layout
    layout = Layout.of(dp=6, data="hsdp", shard_size=3)
    assert (layout.data, layout.zero, layout.shard_size) == ("hsdp", 3, 3)
    assert Layout.of(layout, data="fsdp").data == "fsdp"


def test_planner_prices_hsdp_between_fsdp_and_ddp():
    """hsdp_bytes_per_step: S = dp is FSDP's bytes, S = 1 DDP's all-reduce; in between the
    replicas all-reduce P / S. On 2 and 4 nodes of 8 H100s (llama3-8b, 4 sequences a GPU):
    FSDP across nodes exposes its all-gathers, HSDP (S = 8, inside the node) hides them, and
    holds more than FSDP but a fraction of DDP's memory."""
    from course_lib import planner
    from course_lib.layout import Layout
    from course_lib.planner.formulas import collective_bytes_per_rank, dp_bytes_per_step, hsdp_bytes_per_step

    P = 1e6
    assert hsdp_bytes_per_step(P, 16, 1) == dp_bytes_per_step(P, 16, 3)
    assert hsdp_bytes_per_step(P, 1, 16) == collective_bytes_per_rank("all_reduce", 2 * P, 16)
    assert hsdp_bytes_per_step(P, 8, 2, microbatches=2) == \
        dp_bytes_per_step(P, 8, 3, microbatches=2) + 2 * collective_bytes_per_rank("all_reduce", 2 * P / 8, 2)
    for nodes in (2, 4):
        n = 8 * nodes
        est = {d: planner.estimate("llama3-8b", "h100-sxm", Layout.of(dp=n, global_batch=4 * n, micro_batch=1,
                                                                    data=d, **({"shard_size": 8} if d == "hsdp" else {})))
               for d in ("ddp", "fsdp", "hsdp")}
        assert est["hsdp"].step_time < est["fsdp"].step_time
        assert est["fsdp"].memory["total"] < est["hsdp"].memory["total"] < est["ddp"].memory["total"]
        assert est["hsdp"].time.get("zero", 0.0) < 0.1 * est["fsdp"].time["zero"]
