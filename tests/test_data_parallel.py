"""DDP (course_lib/parallel/data_parallel.py) against single-device training on the full batch.

One launch per world size runs every check of that size (a launch is cheap, a rank that
builds its first optimizer is not), and the parent compares with the reference: the
textbook loop, bucketed and overlapped DDP, our ring driving DDP, gradient accumulation
(in order, and a pipeline's F, F, B, B), explicit start / finish; bytes measured.
"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import launch
from course_lib.models import MLP
from course_lib.parallel.data_parallel import DDP
from course_lib.planner.formulas import collective_bytes_per_rank
from single_device import AWKWARD, LR, SIZES, STEPS, WD, make_data, train

VERSIONS = ("textbook", "bucketed", "overlapped", "ours", "FFBB", "start/finish")
HEADERS = 2048  # bytes per call above the ring formula that message headers may add (measured: < 1.8 KiB, N <= 4)
BIG = (128, 256, 128, 256)  # the bytes check: one 1.2 MB bucket, headers negligible next to it


@functools.lru_cache(maxsize=None)
def reference(micro=1):
    """Single device, full batch, AdamW with weight decay."""
    X, Y, perms = make_data()
    return train(MLP(SIZES, seed=0, **AWKWARD), X, Y, perms, micro)


def train_version(version, micro, mesh, X, Y, perms):
    """Train the awkward MLP with one version of gradient averaging; return its state."""
    import torch.distributed as dist

    from course_lib.parallel.data_parallel import average_gradients, broadcast_module_states

    rank, world = dist.get_rank(), dist.get_world_size()
    model = MLP(SIZES, seed=rank, **AWKWARD)  # different on every rank until the broadcast
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    if version == "textbook":
        comm = mesh.comm("dp")
        broadcast_module_states(model, comm)
    elif version == "ours":  # our ring all-reduce under DDP
        ddp = DDP(model, bucket_cap_mb=0.001, group=mesh.comm("dp", impl="course"))
    else:
        ddp = DDP(model, bucket_cap_mb=0.001, mesh=mesh, overlap=version in ("overlapped", "FFBB"))
    for perm in perms:
        xs, ys = X[perm].chunk(world)[rank].chunk(micro), Y[perm].chunk(world)[rank].chunk(micro)
        if version == "textbook":
            for x, y in zip(xs, ys):
                (F.mse_loss(model(x), y) / micro).backward()
            average_gradients(model, comm)
        elif version == "FFBB":  # a pipeline's order: every forward, then every backward
            losses = [F.mse_loss(ddp(x), y) / micro for x, y in zip(xs, ys)]
            with ddp.no_sync():
                for loss in losses[:-1]:
                    loss.backward()
            losses[-1].backward()
            ddp.finish_gradient_synchronization()
        else:
            for k, (x, y) in enumerate(zip(xs, ys)):
                if k < micro - 1:
                    with ddp.no_sync():
                        (F.mse_loss(ddp(x), y) / micro).backward()
                else:
                    (F.mse_loss(ddp(x), y) / micro).backward()
                    if version == "start/finish":
                        ddp.start_gradient_synchronization()
                    ddp.finish_gradient_synchronization()
        assert model.unused.grad is None  # nobody used it: no gradient, as on one device
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def measured_step(mesh, impl):
    """One overlapped DDP step of a larger MLP inside comm.measuring(): (payload, sent) per call."""
    import torch.distributed as dist

    from course_lib import trace

    rank, world = dist.get_rank(), dist.get_world_size()
    model = MLP(BIG, seed=0)
    ddp = DDP(model, group=mesh.comm("dp", impl=impl))
    x = torch.randn(2 * world, BIG[0], generator=torch.Generator().manual_seed(0)).chunk(world)[rank]
    ddp.comm.reset()
    trace.reset()
    with ddp.comm.measuring():
        ddp(x).square().mean().backward()
        ddp.finish_gradient_synchronization()
    return dict(calls=[(c.op, c.payload, c.sent) for c in ddp.comm.log],
                dims={s.dim for s in trace.spans() if s.kind == "comm"})


def rank_checks():
    import torch.distributed as dist

    from course_lib.parallel.mesh import Mesh

    mesh = Mesh(dp=dist.get_world_size())
    X, Y, perms = make_data()
    out = {(v, micro): train_version(v, micro, mesh, X, Y, perms) for v in VERSIONS for micro in (1, 2)}
    out["bytes"] = {impl: measured_step(mesh, impl) for impl in ("torch", "course")}
    # forgetting finish_gradient_synchronization() is an error, not silently unsynced gradients
    ddp = DDP(MLP(SIZES, seed=0), mesh=mesh)
    ddp(X[:2]).sum().backward()
    try:
        ddp(X[:2])
    except RuntimeError as exc:
        out["forgot_finish"] = str(exc)
    ddp.finish_gradient_synchronization()
    return out


@pytest.fixture(scope="module")
def runs():
    return {n: launch(rank_checks, n, timeout=120) for n in (1, 2, 3, 4)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("micro", [1, 2])
def test_matches_single_device(runs, world, version, micro):
    ref = reference(micro)
    for rank, result in enumerate(runs[world]):
        got = result[version, micro]
        assert list(got) == list(ref)
        for name in ref:
            if world == 1:  # one rank: the very same arithmetic
                assert torch.equal(got[name], ref[name]), name
            else:
                torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-6, msg=name)
        if rank:  # replicas stay bit-identical
            for name in ref:
                assert torch.equal(got[name], runs[world][0][version, micro][name])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bytes_measured_next_to_the_ring_formula(runs, world):
    """Each rank sends 2 (N-1)/N of every bucket (gradients + one flag per parameter), plus
    a few hundred bytes of message headers per call: gloo's ring and ours alike."""
    model = MLP(BIG)
    payload = 4 * sum(p.numel() + 1 for p in model.parameters())  # one 25 MiB bucket
    formula = collective_bytes_per_rank("all_reduce", payload, world)
    for result in runs[world]:
        for impl in ("torch", "course"):
            [(op, logged, sent)] = result["bytes"][impl]["calls"]
            assert (op, logged) == ("all_reduce", payload)
            assert 0 <= sent - formula <= HEADERS, (impl, sent, formula)
            assert result["bytes"][impl]["dims"] == {"dp"}  # every comm span carries its dimension


def test_forgotten_finish(runs):
    assert "finish_gradient_synchronization" in runs[2][0]["forgot_finish"]


@pytest.mark.parametrize("cap", [0, -1, float("nan"), True])
def test_bad_bucket_cap(cap):
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DDP(nn.Linear(2, 2), bucket_cap_mb=cap)


def test_bad_modules():
    with pytest.raises(ValueError, match="no parameters"):
        DDP(nn.ReLU())
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="frozen"):
        DDP(frozen)
    two_devices = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        DDP(two_devices)
    with pytest.raises(TypeError):
        DDP(lambda x: x)
