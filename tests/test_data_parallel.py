"""DDP (course_lib/parallel/data_parallel.py) against single-device training on the full batch.

One launch per world size runs every check of that size (a launch is cheap, a rank that
builds its first optimizer is not), and the parent compares with the reference.
"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import launch
from course_lib.models import MLP
from course_lib.parallel.data_parallel import DDP, SYNC_MODES, assign_buckets
from single_device import AWKWARD, LR, SIZES, STEPS, WD, make_data, train

@functools.lru_cache(maxsize=None)
def reference(micro=1):
    """Single device, full batch, AdamW with weight decay."""
    X, Y, perms = make_data()
    return train(MLP(SIZES, seed=0, **AWKWARD), X, Y, perms, micro)


def rank_checks():
    """Everything one rank runs: each sync mode, gradient accumulation, bytes and spans."""
    import torch.distributed as dist

    from course_lib import trace

    rank, world = dist.get_rank(), dist.get_world_size()
    X, Y, perms = make_data()
    out = {}
    for sync in SYNC_MODES:
        for micro in (1, 2):
            model = MLP(SIZES, seed=rank, **AWKWARD)  # different on every rank until the broadcast
            ddp = DDP(model, bucket_cap_mb=0.001, sync=sync)  # 1 KiB buckets: several of them
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
            ddp.comm.reset()
            trace.reset()
            for perm in perms:
                xs, ys = X[perm].chunk(world)[rank].chunk(micro), Y[perm].chunk(world)[rank].chunk(micro)
                for k, (x, y) in enumerate(zip(xs, ys)):
                    if k < micro - 1:
                        with ddp.no_sync():
                            (F.mse_loss(ddp(x), y) / micro).backward()
                    else:
                        (F.mse_loss(ddp(x), y) / micro).backward()
                        ddp.finish_gradient_synchronization()
                assert model.unused.grad is None  # nobody used it: no gradient, as on one device
                opt.step()
                opt.zero_grad()
            spans = trace.spans()
            out[sync, micro] = dict(state=model.state_dict(), sent=ddp.comm.bytes_sent(),
                                    comm_spans=sum(s.kind == "comm" for s in spans))
    # forgetting finish_gradient_synchronization() is an error, not silently unsynced gradients
    ddp = DDP(MLP(SIZES, seed=0))
    ddp(X[:2]).sum().backward()
    try:
        ddp(X[:2])
        out["forgot_finish"] = None
    except RuntimeError as exc:
        out["forgot_finish"] = str(exc)
    ddp.finish_gradient_synchronization()
    return out


@pytest.fixture(scope="module")
def runs():
    return {n: launch(rank_checks, n, timeout=120) for n in (1, 2, 3, 4)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("sync", SYNC_MODES)
@pytest.mark.parametrize("micro", [1, 2])
def test_matches_single_device(runs, world, sync, micro):
    ref = reference(micro)
    for rank, result in enumerate(runs[world]):
        got = result[sync, micro]["state"]
        assert list(got) == list(ref)
        for name in ref:
            if world == 1:  # one rank: the very same arithmetic
                assert torch.equal(got[name], ref[name]), name
            else:
                torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-6, msg=name)
        if rank:  # replicas stay bit-identical
            for name in ref:
                assert torch.equal(got[name], runs[world][0][sync, micro]["state"][name])


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_sent_is_2P(runs, world):
    """A ring all-reduce makes each rank send 2 (N-1)/N of the gradient bytes, every step."""
    model = MLP(SIZES, **AWKWARD)
    trainable = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    flags = sum(1 for p in model.parameters() if p.requires_grad) * 4  # the "who used what" int32s
    per_step = 2 * (world - 1) / world * (trainable + flags)
    sent = runs[world][0]["overlap", 1]["sent"]
    assert sent == pytest.approx(STEPS * per_step)


def test_overlap_records_comm_spans(runs):
    result = runs[2][0]
    assert result["overlap", 1]["comm_spans"] >= STEPS * 2  # several buckets per step
    assert "finish_gradient_synchronization" in runs[2][0]["forgot_finish"]


def test_assign_buckets_reverse_order_and_cap():
    params = [torch.zeros(n) for n in (10, 20, 30, 5, 5)]  # 40, 80, 120, 20, 20 bytes
    assert assign_buckets(params, 130) == [[4, 3], [2], [1, 0]]
    assert assign_buckets(params, 100) == [[4, 3], [2], [1], [0]]
    assert assign_buckets(params, 0) == [[4], [3], [2], [1], [0]]  # per parameter
    assert assign_buckets(params, 10**9) == [[4, 3, 2, 1, 0]]
    mixed = [torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2)]
    assert assign_buckets(mixed, 10**9) == [[2], [1], [0]]  # one dtype per flat buffer


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
    with pytest.raises(ValueError, match="sync"):
        DDP(nn.Linear(2, 2), sync="sometimes")
