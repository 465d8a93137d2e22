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

from course_lib import launch, tolerance
from course_lib.models import MLP
from course_lib.parallel.data_parallel import DDP
from course_lib.planner.formulas import collective_bytes_per_rank
from sections import assert_no_error, run_sections
from single_device import AWKWARD, LR, SIZES, STEPS, WD, assert_trained_like, exact, first_step_grads, make_data, train

VERSIONS = ("textbook", "bucketed", "overlapped", "ours", "FFBB", "start/finish")
HEADERS = 2048  # bytes per call above the ring formula that message headers may add (measured: < 1.8 KiB, N <= 4)
BIG = (128, 256, 128, 256)  # the bytes check: one 1.2 MB bucket, headers negligible next to it


@functools.lru_cache(maxsize=None)
def reference(micro=1):
    """Single device, full batch, AdamW with weight decay, float64; and step 1's gradients."""
    with exact():
        X, Y, perms = make_data()
        return (train(MLP(SIZES, seed=0, **AWKWARD), X, Y, perms, micro),
                first_step_grads(MLP(SIZES, seed=0, **AWKWARD), X, Y, perms, micro))


def train_version(version, micro, mesh, X, Y, perms):
    """Train the awkward MLP with one version of gradient averaging; return its state and
    step 1's gradients (AdamW would hide a gradient summed instead of averaged)."""
    import torch.distributed as dist

    from course_lib.parallel.data_parallel import average_gradients, broadcast_module_states

    rank, world = dist.get_rank(), dist.get_world_size()
    model = MLP(SIZES, seed=rank, **AWKWARD)  # different on every rank until the broadcast
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    grads = None
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
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return model.state_dict(), grads


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
    with exact():                                  # float64: exactness after AdamW steps is the claim
        X, Y, perms = make_data()
        out = {(v, micro): train_version(v, micro, mesh, X, Y, perms) for v in VERSIONS for micro in (1, 2)}
    X, Y, perms = make_data()
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
    ref, ref_grads = reference(micro)
    for rank, result in enumerate(runs[world]):
        got, grads = result[version, micro]
        assert list(got) == list(ref)
        if world == 1:  # one rank: the very same arithmetic
            for name in ref:
                assert torch.equal(got[name], ref[name]), name
        tolerance.assert_matches(grads, ref_grads, what="step 1's gradients")
        assert_trained_like(got, ref)
        if rank:  # replicas stay bit-identical
            for name in ref:
                assert torch.equal(got[name], runs[world][0][version, micro][0][name])


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


# ------------------------------------------------------------------ torch's DDP conventions
def bn_model():
    return nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def buffers_of(model):
    return {name: b.clone() for name, b in model.named_buffers()}


def _buffers_section(out, rank):
    import copy

    from torch.nn.parallel import DistributedDataParallel

    # BatchNorm: ours (broadcast_buffers=True / False) next to torch's DDP, rank-dependent data
    base = bn_model()
    ours, theirs = DDP(copy.deepcopy(base)), DistributedDataParallel(copy.deepcopy(base))
    local = DDP(copy.deepcopy(base), broadcast_buffers=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs, local)]
    out["steps"] = []
    for step in range(3):
        x = torch.randn(4, 2, generator=torch.Generator().manual_seed(10 * step + rank)) * (rank + 1) + rank
        for m, opt in zip((ours, theirs, local), opts):
            m(x).square().mean().backward()
            if m is not theirs:
                m.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad()
        out["steps"].append([buffers_of(m.module) for m in (ours, theirs, local)])
    ours.comm.reset()
    for m in (ours, theirs, local):
        m.eval()
        with torch.no_grad():
            m(x)  # follows a training forward: sends rank 0's buffers (torch's rule) ...
            m(x)  # ... follows a no_grad forward: sends nothing
    out["eval"] = [buffers_of(m.module) for m in (ours, theirs, local)]
    out["eval calls"] = [c.name for c in ours.comm.log]
    out["params"] = [[p.detach().clone() for p in m.module.parameters()] for m in (ours, theirs)]
    mlp = DDP(MLP(SIZES, seed=0))  # non-persistent or no buffers: a forward sends nothing
    mlp.comm.reset()
    mlp(torch.zeros(2, SIZES[0]))
    out["mlp forward calls"] = len(mlp.comm.log)


def _keywords_section(out, rank):
    import torch.distributed as dist

    # torch's keyword arguments
    def attempt(key, build):
        try:
            out[key] = build()
        except (TypeError, ValueError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"

    attempt("process_group", lambda: DDP(nn.Linear(2, 2), process_group=dist.group.WORLD).comm.size)
    attempt("process_group and group", lambda: DDP(nn.Linear(2, 2), process_group=dist.group.WORLD,
                                                   group=dist.group.WORLD))
    attempt("torch flags", lambda: type(DDP(nn.Linear(2, 2), device_ids=None, output_device=None,
                                            find_unused_parameters=True, static_graph=True,
                                            gradient_as_bucket_view=True)).__name__)
    attempt("device_ids on cpu", lambda: DDP(nn.Linear(2, 2), device_ids=[0]))
    attempt("device_ids positional", lambda: DDP(nn.Linear(2, 2), [0]))
    attempt("flag not bool", lambda: DDP(nn.Linear(2, 2), find_unused_parameters="yes"))


def _bucket_view_section(out, rank):
    # gradient_as_bucket_view: True (ours): p.grad IS the bucket; False: a copy of its own
    x = torch.full((2, 3), float(rank + 1))
    for view in (True, False):
        m = DDP(nn.Linear(3, 1), gradient_as_bucket_view=view)
        m(x).sum().backward()
        m.finish_gradient_synchronization()
        kept = m.module.weight.grad
        value = kept.clone()
        m.zero_grad(set_to_none=True)
        m(3 * x).sum().backward()
        m.finish_gradient_synchronization()
        out["bucket view", view] = dict(first=value, kept_changed=not torch.equal(kept, value),
                                        second=m.module.weight.grad.clone())


def _replicas_section(out, rank):
    from course_lib.parallel.fsdp import FSDP
    from course_lib.parallel.zero import ShardedOptimizer

    # replicas that differ: a clear ValueError on every rank, from every wrapper
    def refused(build):
        try:
            build()
            return "accepted"
        except ValueError as exc:
            return str(exc)

    out["shapes"] = refused(lambda: DDP(nn.Linear(3, 3 if rank == 2 else 2)))
    out["counts"] = refused(lambda: DDP(nn.Sequential(*[nn.Linear(2, 2) for _ in range(2 if rank == 1 else 1)])))
    out["zero shapes"] = refused(lambda: ShardedOptimizer(nn.Linear(3, 3 if rank == 2 else 2).parameters(),
                                                          torch.optim.SGD, lr=0.1))
    out["fsdp shapes"] = refused(lambda: FSDP(nn.Sequential(nn.Linear(3, 3 if rank == 2 else 2))))
    out["dtypes"] = refused(lambda: DDP(nn.Linear(2, 2).to(torch.float64 if rank == 1 else torch.float32)))
    out["same after refusals"] = type(DDP(nn.Linear(2, 2))).__name__  # the group still works


def convention_checks():
    """One 3-rank launch: buffers, torch's keyword arguments, gradient copies, mismatched replicas."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    sections = {"buffers": _buffers_section, "keywords": _keywords_section, "bucket view": _bucket_view_section,
                "replicas": _replicas_section}
    return run_sections(sections, out, rank)   # a failing section fails its own test


@pytest.fixture(scope="module")
def conventions():
    return launch(convention_checks, 3, timeout=120)


def test_buffers_broadcast_as_torch_ddp(conventions):
    """BatchNorm's running statistics: ours equal torch's DDP on every rank after every step
    (rank 0's buffers are sent before each forward); after the next forward, identical everywhere."""
    assert_no_error(conventions, "buffers")
    for result in conventions:
        for step, (ours, theirs, _) in enumerate(result["steps"], 1):   # SGD at lr 0.1, fp32
            tolerance.assert_matches({n: ours[n] for n in theirs}, theirs, optimizer="sgd", steps=step, lr=0.1)
        tolerance.assert_matches(*result["params"], optimizer="sgd", steps=3, lr=0.1)
        # one flat message for all of BatchNorm's buffers (float and int64), then none under no_grad
        assert result["eval calls"] == ["broadcast buffers"]
        assert result["mlp forward calls"] == 0
    for name, ours in conventions[0]["eval"][0].items():
        for result in conventions[1:]:
            assert torch.equal(result["eval"][0][name], ours), name
            assert torch.equal(result["eval"][1][name], conventions[0]["eval"][1][name]), name
    # broadcast_buffers=False: each replica keeps its own statistics
    assert not torch.equal(conventions[0]["eval"][2]["1.running_mean"], conventions[1]["eval"][2]["1.running_mean"])


def test_torch_keyword_arguments(conventions):
    assert_no_error(conventions, "keywords")
    for result in conventions:
        assert result["process_group"] == 3
        assert result["process_group and group"].startswith("ValueError") and "process_group" in result[
            "process_group and group"]
        assert result["torch flags"] == "DDP"
        assert result["device_ids on cpu"].startswith("ValueError") and "device_ids" in result["device_ids on cpu"]
        assert "device_ids=[0]" in result["device_ids positional"]
        assert result["flag not bool"].startswith("TypeError") and "find_unused_parameters" in result["flag not bool"]


def test_gradient_as_bucket_view(conventions):
    """True: p.grad is a view of the bucket, the next step overwrites a kept reference;
    False: a copy (torch's default), the same values."""
    assert_no_error(conventions, "bucket view")
    for result in conventions:
        view, copy_ = result["bucket view", True], result["bucket view", False]
        assert view["kept_changed"] and not copy_["kept_changed"]
        assert torch.equal(view["first"], copy_["first"]) and torch.equal(view["second"], copy_["second"])


@pytest.mark.parametrize("case,expected", [
    ("shapes", "rank 2's 'weight' has shape (3, 3), rank 0's 'weight' has shape (2, 3)"),
    ("counts", "rank 1 has 4 parameters and buffers, rank 0 has 2 (the first one only rank 1 has: '1.weight')"),
    ("zero shapes", "rank 2's tensor 0 has shape (3, 3), rank 0's tensor 0 has shape (2, 3)"),
    ("fsdp shapes", "rank 2's '0.weight' has shape (3, 3), rank 0's '0.weight' has shape (2, 3)"),
    ("dtypes", "rank 1's 'weight' is float64, rank 0's 'weight' is float32"),
])
def test_replicas_that_differ_are_refused(conventions, case, expected):
    """A ValueError on EVERY rank at construction (before: the first step aborted or hung)."""
    assert_no_error(conventions, "replicas")
    for result in conventions:
        assert "the replicas differ across ranks" in result[case] and expected in result[case], result[case]
    assert all(result["same after refusals"] == "DDP" for result in conventions)
