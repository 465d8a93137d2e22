"""ZeRO-1 / ZeRO-2 (course_lib/parallel/zero.py) against plain AdamW on one device, in float64
(exactness after AdamW steps is the claim: course_lib.tolerance); bytes in fp32."""
import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import launch, tolerance
from course_lib.models import MLP
from course_lib.parallel.zero import ShardedOptimizer
from course_lib.planner.formulas import collective_bytes_per_rank
from sections import assert_no_error, run_sections
from single_device import AWKWARD, LR, SIZES, STEPS, WD, assert_trained_like, exact, make_data, train

FORMULA = {"reduce_scatter_tensor": "reduce_scatter", "all_gather_into_tensor": "all_gather", "all_reduce": "all_reduce"}
HEADERS = 2048  # bytes per call above the ring formula that message headers may add (N <= 4)

@functools.lru_cache(maxsize=None)
def reference(micro=1, tiny=False):
    with exact():
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
    out = {}
    for stage in (1, 2):
        with exact():
            out.update(_train_stage(stage, rank, world))
        X, Y, _ = make_data()
        out["bytes", stage] = {impl: measured_step(stage, impl, X, Y) for impl in ("torch", "course")}
    return out


def _train_stage(stage, rank, world):
    X, Y, perms = make_data()
    out = {}
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
        if world == 1:
            for name in ref:
                assert torch.equal(got[name], ref[name]), name
        assert_trained_like(got, ref)


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


# ------------------------------------------------------------------ torch's ZeroRedundancyOptimizer conventions
def two_part_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _subgroup_section(out, rank, sub):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from course_lib.collectives.comm import Comm

    # sharded over a subgroup: equal to torch's DDP + ZeroRedundancyOptimizer on that subgroup
    base = two_part_model(seed=rank // 2)  # the two pairs train different models
    kw = dict(lr=0.05, weight_decay=0.1)
    theirs = DistributedDataParallel(copy.deepcopy(base), process_group=sub)
    models = {"torch": theirs.module}
    opts = {"torch": ZeroRedundancyOptimizer(theirs.parameters(), torch.optim.AdamW, process_group=sub, **kw)}
    for stage, group in ((1, sub), (2, Comm(sub, dim="dp"))):
        models[stage] = copy.deepcopy(base)
        opts[stage] = ShardedOptimizer(models[stage].parameters(), torch.optim.AdamW, process_group=group,
                                       stage=stage, bucket_cap_mb=1e-4, **kw)
    for step in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        for key, model in models.items():
            (theirs if key == "torch" else model)(x).square().mean().backward()
            opts[key].step()
            opts[key].zero_grad()
    out["subgroup"] = {key: [p.detach().clone() for p in m.parameters()] for key, m in models.items()}


def _defaults_section(out, rank, sub):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    # param_groups carry the inner optimizer's defaults, as torch's
    ours = ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.Adam)
    zro = ZeroRedundancyOptimizer(nn.Linear(2, 2).parameters(), torch.optim.Adam)
    out["defaults"] = (sorted(ours.param_groups[0]), sorted(zro.param_groups[0]), ours.param_groups[0]["lr"])
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose
        warnings.simplefilter("ignore")
        torch.optim.lr_scheduler.StepLR(ours, step_size=1, gamma=0.5).step()
    out["scheduled lr"] = ours.param_groups[0]["lr"]


def _checkpoint_section(out, rank, sub):
    import torch.distributed as dist

    # checkpoints: consolidate on rank 1, next to one device; load on every rank, resharded
    X, Y, perms = make_data()
    model = MLP(SIZES, seed=0, **AWKWARD)
    ref = copy.deepcopy(model)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=1, bucket_cap_mb=0.001, lr=LR, weight_decay=WD)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)

    def train_step(perm, *pairs):
        for m, o in pairs:
            if m is ref:
                F.mse_loss(m(X[perm]), Y[perm]).backward()
            else:
                F.mse_loss(m(X[perm].chunk(4)[rank]), Y[perm].chunk(4)[rank]).backward()
            o.step()
            o.zero_grad()

    for perm in perms[:2]:
        train_step(perm, (model, opt), (ref, ref_opt))
    try:
        opt.state_dict()
    except RuntimeError as exc:
        out["state_dict before consolidating"] = str(exc)
    opt.consolidate_state_dict(to=1)
    try:
        out["state_dict"] = opt.state_dict()
    except RuntimeError as exc:
        out["state_dict"] = f"RuntimeError: {exc}"
    out["ref state_dict"] = copy.deepcopy(ref_opt.state_dict())  # (its tensors go on changing)
    saved = [out["state_dict"]]
    dist.broadcast_object_list(saved, src=1)  # as a checkpoint file would
    try:
        opt.load_state_dict(opt.local.state_dict())  # one rank's slice is not a checkpoint
    except ValueError as exc:
        out["load a slice"] = str(exc)
    resumed = copy.deepcopy(model)
    resumed_opt = ShardedOptimizer(resumed.parameters(), torch.optim.AdamW, stage=2, lr=1.0)  # other layout, lr
    resumed_opt.load_state_dict(saved[0])
    out["resumed lr"] = resumed_opt.param_groups[0]["lr"]
    from_ref = copy.deepcopy(ref)
    from_ref_opt = ShardedOptimizer(from_ref.parameters(), torch.optim.AdamW, stage=1, lr=LR, weight_decay=WD)
    from_ref_opt.load_state_dict(ref_opt.state_dict())  # a single-device optimizer's checkpoint
    for perm in perms[2:]:
        train_step(perm, (model, opt), (ref, ref_opt), (resumed, resumed_opt), (from_ref, from_ref_opt))
    try:
        opt.state_dict()
        out["state_dict after a step"] = "returned"
    except RuntimeError as exc:  # the consolidated copy is stale: never returned silently
        out["state_dict after a step"] = str(exc)
    out["resumed"] = {key: m.state_dict() for key, m in (("uninterrupted", model), ("resumed", resumed),
                                                        ("from one device", from_ref), ("one device", ref))}


def _add_param_group_section(out, rank, sub):
    # add_param_group: new parameters are sharded and updated, as on one device
    for stage in (1, 2):
        net, one = two_part_model(seed=3), two_part_model(seed=3)
        o = ShardedOptimizer(net[0].parameters(), torch.optim.AdamW, stage=stage, lr=0.05)
        o_one = torch.optim.AdamW(one[0].parameters(), lr=0.05)
        for k in range(3):
            if k == 1:
                o.add_param_group({"params": net[2].parameters(), "lr": 0.1})
                o_one.add_param_group({"params": one[2].parameters(), "lr": 0.1})
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(k))
            net(x.chunk(4)[rank]).square().sum().backward()
            one(x).square().sum().div(4).backward()
            o.step(), o_one.step()
            o.zero_grad(), o_one.zero_grad()
        out["add_param_group", stage] = (net.state_dict(), one.state_dict())


def convention_checks():
    """One 4-rank launch: subgroups next to torch's ZeroRedundancyOptimizer, param_groups'
    defaults, checkpoints (consolidate / state_dict / load), add_param_group."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    sub = pairs[rank // 2]
    sections = dict(subgroup=_subgroup_section, defaults=_defaults_section, checkpoint=_checkpoint_section,
                    add_param_group=_add_param_group_section)
    with exact():                                   # float64: AdamW runs compared after several steps
        return run_sections(sections, out, rank, sub)   # a failing section fails its own test


@pytest.fixture(scope="module")
def conventions():
    return launch(convention_checks, 4, timeout=120)


def test_process_group_subgroups_match_torch(conventions):
    """process_group= is the group it shards over: two pairs of ranks, two different models,
    each equal to torch's DDP + ZeroRedundancyOptimizer on its pair (before: the world group)."""
    assert_no_error(conventions, "subgroup")
    for result in conventions:
        for stage in (1, 2):
            tolerance.assert_matches(result["subgroup"][stage], result["subgroup"]["torch"],
                                     optimizer="adamw", steps=3, lr=0.05)
    pair0, pair1 = conventions[0]["subgroup"][1], conventions[2]["subgroup"][1]
    assert not torch.equal(pair0[0], pair1[0])


def test_param_groups_carry_the_optimizer_defaults(conventions):
    assert_no_error(conventions, "defaults")
    for result in conventions:
        ours, zro, lr = result["defaults"]
        assert ours == zro and lr == 1e-3
        assert result["scheduled lr"] == 5e-4  # StepLR works (before: KeyError 'lr')


def test_checkpoint_round_trip(conventions):
    """consolidate_state_dict(to=1) + state_dict() on rank 1 is the single-device AdamW's state
    dict; loaded on every rank (into another layout, or from one device's) training goes on
    as if never interrupted."""
    assert_no_error(conventions, "checkpoint")
    assert all("consolidate_state_dict" in r["state_dict before consolidating"] for r in conventions)
    assert all(r["state_dict"].startswith("RuntimeError") for k, r in enumerate(conventions) if k != 1)
    ours, ref = conventions[1]["state_dict"], conventions[1]["ref state_dict"]
    assert ours["param_groups"] == ref["param_groups"]
    assert sorted(ours["state"]) == sorted(ref["state"])  # the unused parameter has no state in either
    for index, state in ref["state"].items():
        assert sorted(ours["state"][index]) == sorted(state)
        tolerance.assert_matches({k: ours["state"][index][k] for k in state}, state, optimizer="adamw", steps=2,
                                 lr=LR, what=f"state {index}")
    for result in conventions:
        assert "consolidate_state_dict" in result["state_dict after a step"]
        assert "not one rank's self.local.state_dict()" in result["load a slice"], result["load a slice"]
        assert result["resumed lr"] == LR
        runs = result["resumed"]
        assert_trained_like(runs["resumed"], runs["uninterrupted"], "resumed in another layout")
        assert_trained_like(runs["from one device"], runs["one device"], "resumed from one device's checkpoint")
        assert_trained_like(runs["uninterrupted"], runs["one device"], "uninterrupted")


@pytest.mark.parametrize("stage", [1, 2])
def test_add_param_group(conventions, stage):
    assert_no_error(conventions, "add_param_group")
    for result in conventions:
        ours, one = result["add_param_group", stage]
        tolerance.assert_matches(ours, one, optimizer="adamw", steps=3, lr=0.1)


def test_torch_keyword_arguments():
    """Checked before any communication: the inner optimizer's own TypeError, torch's flags."""
    params = nn.Linear(2, 2).parameters
    with pytest.raises(TypeError, match="lrr"):
        ShardedOptimizer(params(), torch.optim.SGD, lr=0.1, lrr=1)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        ShardedOptimizer(params(), torch.optim.SGD, lr=-1)
    with pytest.raises(ValueError, match="parameters_as_bucket_view"):
        ShardedOptimizer(params(), torch.optim.SGD, parameters_as_bucket_view=True, lr=0.1)
    with pytest.raises(ValueError, match="overlap_with_ddp"):
        ShardedOptimizer(params(), torch.optim.SGD, None, False, True, lr=0.1)
    with pytest.raises(ValueError, match="process_group"):
        ShardedOptimizer(params(), torch.optim.SGD, process_group=object(), group=object(), lr=0.1)
