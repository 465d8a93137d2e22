"""Dynamic loss scaling (course_lib/precision/loss_scale.py) against torch.amp.GradScaler.

1. The update rule against torch's own kernel (``torch._amp_update_scale_``), flag by flag.
2. The same fp16 run (CPU autocast: matmuls in float16) with GradScaler and with ours: the
   same scale before every step, the same skipped steps, bit-identical parameters.
3. One launch of 3 ranks: DDP with an overflow on rank 1 only skips the step on every rank
   (one 4-byte all-reduce per step), and a sharded gradient whose inf lives on one rank's
   shard: local verdicts differ, the reduced one is the same everywhere.
"""
import random

import pytest
import torch

from course_lib import launch
from course_lib.precision.loss_scale import (DynamicLossScaler, check_loss_scaler, overflow_on_any_rank,
                                             update_scale)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices (tests/conftest.py)


def test_update_rule_equals_torch_kernel():
    rng = random.Random(0)
    for growth_interval, growth, backoff in ((1, 2.0, 0.5), (3, 2.0, 0.5), (4, 1.5, 0.25), (2000, 2.0, 0.5)):
        scale, tracker = 2.0 ** 16, 0
        t_scale, t_tracker = torch.tensor(2.0 ** 16), torch.tensor(0, dtype=torch.int32)
        for _ in range(60):
            flag = rng.random() < 0.3
            torch._amp_update_scale_(t_scale, t_tracker, torch.tensor(float(flag)), growth, backoff, growth_interval)
            scale, tracker = update_scale(scale, tracker, flag, growth_factor=growth, backoff_factor=backoff,
                                          growth_interval=growth_interval)
            assert (scale, tracker) == (float(t_scale), int(t_tracker))


def test_rule_by_hand():
    # overflow: halve AND reset; two good steps (interval 2): double; growth past fp32 max refused
    assert update_scale(8.0, 1, True, growth_interval=2) == (4.0, 0)
    assert update_scale(8.0, 0, False, growth_interval=2) == (8.0, 1)
    assert update_scale(8.0, 1, False, growth_interval=2) == (16.0, 0)
    big = float(torch.finfo(torch.float32).max)
    assert update_scale(big, 0, False, growth_interval=1) == (big, 0)


def fp16_run(scaler, steps=14):
    """A tiny TinyGPT in fp16 autocast; the scale before each step and whether it stepped."""
    from course_lib.data import batches, byte_tokens, synthetic_text
    from course_lib.gpt import GPTConfig, TinyGPT

    model = TinyGPT(GPTConfig(n_layers=1, hidden=32, n_heads=2, seq_len=16), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stepped = []
    opt.register_step_post_hook(lambda *_: stepped.append(True))
    scales, skipped = [], []
    for i, (x, y) in enumerate(batches(byte_tokens(synthetic_text(4000)), 4, 16, seed=0, n_batches=steps)):
        with torch.autocast("cpu", dtype=torch.float16):
            _, loss = model(x, y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scales.append(scaler.get_scale())
        before = len(stepped)
        scaler.step(opt)
        skipped.append(len(stepped) == before)
        scaler.update()
    return scales, skipped, [p.detach().clone() for p in model.parameters()]


def test_same_run_as_torch_grad_scaler():
    kw = dict(init_scale=2.0 ** 24, growth_interval=3)
    ours = fp16_run(DynamicLossScaler(**kw))
    torchs = fp16_run(torch.amp.GradScaler("cpu", **kw))
    assert ours[0] == torchs[0]                       # the scale before every step
    assert ours[1] == torchs[1]                       # the skipped steps
    assert any(ours[1]) and not all(ours[1])          # the run both skips and steps
    assert max(ours[0][1:]) < 2.0 ** 24               # it backed off from the start
    assert all(torch.equal(a, b) for a, b in zip(ours[2], torchs[2]))   # the same ops: bit-identical


def test_defaults_are_torch_defaults():
    ref, ours = torch.amp.GradScaler("cpu"), DynamicLossScaler()
    assert (ours.get_scale(), ours.growth_factor, ours.backoff_factor, ours.growth_interval) == \
        (ref.get_scale(), ref.get_growth_factor(), ref.get_backoff_factor(), ref.get_growth_interval())


def _ranks(overflow_rank, overflow_step, steps):
    import torch.distributed as dist

    from course_lib.parallel.data_parallel import DDP
    from course_lib.parallel.mesh import Mesh
    from course_lib.precision.loss_scale import MESH_DIMS, DynamicLossScaler, overflow_on_any_rank

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = Mesh(dp=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)), mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = mesh.comm(MESH_DIMS)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=2, comm=comm)
    gen = torch.Generator().manual_seed(rank)
    out = {"scales": [], "stepped": [], "flag_calls": []}
    for step in range(steps):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
        if rank == overflow_rank and step == overflow_step:
            x[0, 0] = 1e6                     # beyond fp16's 65504: inf in this rank's activations
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x).float() - y) ** 2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        model.finish_gradient_synchronization()
        comm.reset()
        out["scales"].append(scaler.get_scale())
        out["stepped"].append(scaler.step(opt))
        scaler.update()
        out["flag_calls"].append([(c.op, c.name, c.payload) for c in comm.log])
    out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # a sharded gradient (ZeRO-2 / FSDP after the reduce-scatter): the inf is in rank 1's shard only
    shard = torch.ones(5)
    if rank == 1:
        shard[3] = float("inf")
    out["local"] = overflow_on_any_rank([shard], None)
    out["reduced"] = overflow_on_any_rank([shard], comm)
    return out


def _one_device_with_torch(world, overflow_rank, overflow_step, steps):
    """The same data on one device (the ranks' batches concatenated) under torch's GradScaler."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    scales, stepped = [], []
    for step in range(steps):
        xs, ys = zip(*[(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for g in gens])
        x, y = torch.cat(xs), torch.cat(ys)
        if step == overflow_step:
            x[4 * overflow_rank, 0] = 1e6
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x).float() - y) ** 2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scales.append(scaler.get_scale())
        scaler.unscale_(opt)
        stepped.append(all(torch.isfinite(p.grad).all() for p in model.parameters()))
        scaler.step(opt)
        scaler.update()
    return scales, stepped


def test_overflow_on_one_rank_skips_every_rank():
    results = launch(_ranks, 3, 1, 2, 5, timeout=90)
    first = results[0]
    # the same scales and skipped steps as torch's GradScaler on one device with the whole batch
    assert (first["scales"], first["stepped"]) == _one_device_with_torch(3, 1, 2, 5)
    assert first["stepped"] == [True, True, False, True, True]
    assert first["scales"] == [2.0 ** 10, 2.0 ** 10, 2.0 ** 11, 2.0 ** 10, 2.0 ** 10]
    for r in results:
        assert r["stepped"] == first["stepped"] and r["scales"] == first["scales"]
        assert torch.equal(r["params"], first["params"])            # the replicas stayed equal
        assert all(calls == [("all_reduce", "all-reduce found_inf", 4)] for calls in r["flag_calls"])
    assert [r["local"] for r in results] == [False, True, False]   # each rank sees its shard
    assert [r["reduced"] for r in results] == [True, True, True]   # one verdict for the mesh


def test_bad_input():
    with pytest.raises(ValueError, match="needs a loss scaler"):
        check_loss_scaler("fp16", None, "parallelize_nd")
    with pytest.raises(ValueError, match="needs a loss scaler"):
        check_loss_scaler(torch.float16, None)
    check_loss_scaler(torch.bfloat16, None)
    check_loss_scaler("fp16", DynamicLossScaler())
    for kw, words in ((dict(growth_factor=1.0), "growth_factor"), (dict(backoff_factor=1.0), "backoff_factor"),
                      (dict(growth_interval=0), "growth_interval"), (dict(init_scale=float("inf")), "init_scale")):
        with pytest.raises(ValueError, match=words):
            DynamicLossScaler(**kw)
    scaler = DynamicLossScaler()
    with pytest.raises(RuntimeError, match="step"):
        scaler.update()
    assert overflow_on_any_rank([torch.tensor([1.0, float("nan")])]) is True
