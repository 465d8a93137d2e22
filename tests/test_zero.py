"""ZeRO-1 / ZeRO-2 (course_lib/parallel/zero.py) against plain AdamW on one device."""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import launch
from course_lib.models import MLP
from course_lib.parallel.zero import ShardedOptimizer
from course_lib.planner.formulas import collective_bytes_per_rank
from single_device import AWKWARD, LR, SIZES, STEPS, WD, make_data, train

FORMULA = {"reduce_scatter_tensor": "reduce_scatter", "all_gather_into_tensor": "all_gather", "all_reduce": "all_reduce"}
HEADERS = 2048  # bytes per call above the ring formula that message headers may add (N <= 4)

@functools.lru_cache(maxsize=None)
def reference(micro=1, tiny=False):
    model = nn.Linear(1, 1) if tiny else MLP(SIZES, seed=0, **AWKWARD)
    X, Y, perms = make_data()
    if tiny:
        with torch.no_grad():
            model.weight.fill_(0.5), model.bias.fill_(-0.25)
        X, Y = X[:, :1], Y[:, :1]
    return train(model, X, Y, perms, micro)


def rank_checks():
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    X, Y, perms = make_data()
    out = {}
    for stage in (1, 2):
        for micro, cap, tiny in ((1, 0.001, False), (2, 25, False), (1, 25, True)):
            if tiny:  # 2 elements: with 4 ranks, two of them own nothing
                model = nn.Linear(1, 1)
                with torch.no_grad():
                    model.weight.fill_(0.5 + rank), model.bias.fill_(-0.25)  # differs until broadcast
                x_all, y_all = X[:, :1], Y[:, :1]
            else:
                model = MLP(SIZES, seed=rank, **AWKWARD)
                x_all, y_all = X, Y
            opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, bucket_cap_mb=cap,
                                   lr=LR, weight_decay=WD)
            grads_kept = []
            for perm in perms:
                xs = x_all[perm].chunk(world)[rank].chunk(micro)
                ys = y_all[perm].chunk(world)[rank].chunk(micro)
                for x, y in zip(xs, ys):
                    (F.mse_loss(model(x), y) / micro).backward()
                grads_kept.append(sum(p.grad is not None for p in model.parameters()))
                opt.step()
                opt.zero_grad()
            state_numel = sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim())
            out[stage, micro, tiny] = dict(state=model.state_dict(), grads_kept=grads_kept, state_numel=state_numel)
        out["bytes", stage] = {impl: measured_step(stage, impl, X, Y) for impl in ("torch", "course")}
    return out


def measured_step(stage, impl, X, Y):
    """One step (one 25 MiB bucket) inside comm.measuring(): (op, payload, sent) per call."""
    import torch.distributed as dist

    from course_lib.collectives.comm import Comm

    rank, world = dist.get_rank(), dist.get_world_size()
    model = MLP(SIZES, seed=0, **AWKWARD)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=LR,
                           group=Comm(None, dim="dp", impl=impl))
    opt.comm.reset()
    with opt.comm.measuring():
        F.mse_loss(model(X.chunk(world)[rank]), Y.chunk(world)[rank]).backward()
        opt.step()
    return [(c.op, c.payload, c.sent) for c in opt.comm.log]


@pytest.fixture(scope="module")
def runs():
    return {n: launch(rank_checks, n, timeout=120) for n in (1, 2, 3, 4)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("micro,tiny", [(1, False), (2, False), (1, True)])
def test_matches_adamw(runs, world, stage, micro, tiny):
    ref = reference(micro, tiny)
    for result in runs[world]:
        got = result[stage, micro, tiny]["state"]
        for name in ref:
            if world == 1:
                assert torch.equal(got[name], ref[name]), name
            else:
                torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_state_and_gradients(runs, world):
    trainable = sum(p.numel() for p in MLP(SIZES, **AWKWARD).parameters() if p.requires_grad)
    unused = SIZES[-1]  # never used: no Adam state anywhere, as on one device
    for stage in (1, 2):
        numel = [r[stage, 1, False]["state_numel"] for r in runs[world]]
        assert sum(numel) == 2 * (trainable - unused)  # exp_avg + exp_avg_sq, each element once
        assert max(numel) < 2 * trainable  # ... split over the ranks
    # ZeRO-2 frees every full-size gradient during backward: none is left for step()
    assert all(k == 0 for k in runs[world][0][2, 1, False]["grads_kept"])
    assert all(k > 0 for k in runs[world][0][1, 1, False]["grads_kept"])


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_bytes_measured_next_to_the_ring_formula(runs, world, stage):
    """reduce-scatter (gradients) + all-gather (parameters) + the 'used' flags: our ring sends
    2 (N-1)/N of the (padded) gradient bytes, as DDP, plus headers; gloo's reduce-scatter
    sends as much as its all-reduce, so gloo's ZeRO sends about 3 (N-1)/N."""
    params = [p for p in MLP(SIZES, **AWKWARD).parameters() if p.requires_grad]
    padded = -(-sum(p.numel() for p in params) // world) * world * 4
    expected = [("reduce_scatter_tensor", padded), ("all_reduce", 4 * len(params)), ("all_gather_into_tensor", padded)]
    for result in runs[world]:
        for impl in ("torch", "course"):
            calls = result["bytes", stage][impl]
            assert [(op, payload) for op, payload, _ in calls] == expected
            for op, payload, sent in calls:
                formula = collective_bytes_per_rank(FORMULA[op], payload, world)
                if impl == "torch" and op == "reduce_scatter_tensor":
                    formula = collective_bytes_per_rank("all_reduce", payload, world)  # gloo's way
                assert 0 <= sent - formula <= HEADERS, (impl, op, sent, formula)


def test_bad_input():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="stage"):
        ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=3)
    with pytest.raises(TypeError, match="optimizer_cls"):
        ShardedOptimizer(model.parameters(), "adamw")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ShardedOptimizer(model.parameters(), torch.optim.AdamW, bucket_cap_mb=0)
