"""FSDP / ZeRO-3 (course_lib/parallel/fsdp.py) against single-device training on the full batch."""
import copy
import math

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import launch
from course_lib.models import MLP, GPTConfig, TinyGPT
from course_lib.parallel.fsdp import FSDP

SIZES = (16, 32, 16, 32)
AWKWARD = dict(frozen=(1,), shared=True, unused=True)
BATCH, STEPS = 24, 5
GPT = GPTConfig(vocab_size=64, seq_len=16, n_layers=3, hidden=32, n_heads=4, n_kv_heads=2,
                tie_embeddings=True)


def mlp_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    X, Y = torch.randn(BATCH, SIZES[0], generator=g), torch.randn(BATCH, SIZES[-1], generator=g)
    return [(X[p], Y[p]) for p in (torch.randperm(BATCH, generator=g) for _ in range(STEPS))]


def gpt_data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, GPT.vocab_size, (BATCH, GPT.seq_len + 1), generator=g) for _ in range(STEPS)]


def loss_of(model, batch, kind):
    if kind == "gpt":
        return model(batch[:, :-1], batch[:, 1:])[1]
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def build(kind, seed):
    return TinyGPT(GPT, seed=seed) if kind == "gpt" else MLP(SIZES, seed=seed, **AWKWARD)


def make_opt(params, kind, dtype):
    """AdamW on the small MLP. On the GPT's 10^5 weights, Adam's m / sqrt(v) turns the last-bit
    differences of a sum in another order into ~1e-5 wherever m nearly cancels between
    steps: a linear optimizer (SGD + momentum + weight decay) keeps them at rounding level."""
    if kind == "mlp" and dtype is None:
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.2, momentum=0.9 if dtype is None else 0.0, weight_decay=0.01)


@functools.lru_cache(maxsize=None)
def reference(kind, dtype=None):
    """One device, full batch; with a dtype: forward/backward on a copy in that dtype,
    fp32 master weights and optimizer (what FSDP's mixed precision does)."""
    model = build(kind, 0)
    opt = make_opt(model.parameters(), kind, dtype)
    for batch in (gpt_data() if kind == "gpt" else mlp_data()):
        work = copy.deepcopy(model).to(dtype) if dtype else model
        if dtype and kind == "mlp":
            batch = (batch[0].to(dtype), batch[1])
        loss_of(work, batch, kind).backward()
        if dtype:
            for p, q in zip(model.parameters(), work.parameters()):
                p.grad = None if q.grad is None else q.grad.float()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


CONFIGS = [("mlp", None), ("gpt", None), ("gpt", torch.bfloat16), ("mlp", torch.float16)]


def rank_checks():
    import torch.distributed as dist

    from course_lib import memory, trace

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind, dtype in CONFIGS:
        model = build(kind, seed=rank)  # different on every rank: FSDP broadcasts rank 0's, then shards
        fsdp = FSDP(model, compute_dtype=dtype)
        opt = make_opt(fsdp.parameters(), kind, dtype)
        trace.reset()
        for batch in (gpt_data() if kind == "gpt" else mlp_data()):
            rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            local = batch[rows] if kind == "gpt" else (batch[0][rows], batch[1][rows])
            if kind == "gpt" and dtype is None:
                fsdp.comm.reset()
            loss_of(fsdp, local, kind).backward()
            fsdp.finish_gradient_synchronization()
            if kind == "mlp":
                assert model.unused.grad is None
            held = memory.model_state_bytes(fsdp, opt)
            opt.step()
            opt.zero_grad()
        sent = fsdp.comm.bytes_sent()  # the last step's
        out[kind, dtype] = dict(state=fsdp.gather_full_params(), held=held, sent=sent,
                                spans=trace.spans(), units=[(u.name, u.numel, u.is_root) for u in fsdp.units])
    model = MLP(SIZES, seed=rank, **AWKWARD)  # gradient accumulation: two micro-batches per step
    fsdp = FSDP(model)
    opt = make_opt(fsdp.parameters(), "mlp", None)
    for x, y in mlp_data():
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            (loss_of(fsdp, (xm, ym), "mlp") / 2).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    out["accumulate"] = fsdp.gather_full_params()
    tiny = nn.Linear(1, 2)  # 4 elements: on 3 ranks one slice is empty, on 4 each holds one
    with torch.no_grad():
        tiny.weight.copy_(torch.tensor([[1.0], [2.0]]) + rank), tiny.bias.fill_(rank)
    fsdp = FSDP(tiny)
    fsdp(torch.ones(3, 1)).sum().backward()  # d/dw = d/db = 3 on every rank
    fsdp.finish_gradient_synchronization()
    out["tiny"] = dict(shapes=[tuple(p.shape) for p in fsdp.parameters()],
                       grads=[None if p.grad is None else p.grad.clone() for p in fsdp.parameters()],
                       state=fsdp.gather_full_params())
    return out


@pytest.fixture(scope="module")
def runs():
    return {n: launch(rank_checks, n, timeout=180) for n in (1, 2, 3, 4)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("kind,dtype", CONFIGS)
def test_matches_single_device(runs, world, kind, dtype):
    ref = reference(kind, dtype)
    tol = 1e-6 if dtype is None else 1e-3
    for result in runs[world]:
        got = result[kind, dtype]["state"]
        assert list(got) == list(ref)  # original names, tied weight under both
        for name in ref:
            assert got[name].shape == ref[name].shape and got[name].dtype == ref[name].dtype
            if world == 1 and dtype is None:
                assert torch.equal(got[name], ref[name]), name
            else:
                torch.testing.assert_close(got[name], ref[name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gradient_accumulation(runs, world):
    model = MLP(SIZES, seed=0, **AWKWARD)
    opt = make_opt(model.parameters(), "mlp", None)
    for x, y in mlp_data():
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            (loss_of(model, (xm, ym), "mlp") / 2).backward()
        opt.step()
        opt.zero_grad()
    ref = model.state_dict()
    for result in runs[world]:
        for name in ref:
            torch.testing.assert_close(result["accumulate"][name], ref[name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_holds_a_shard(runs, world):
    for kind in ("mlp", "gpt"):
        res = runs[world][0][kind, None]
        shard_bytes = sum(math.ceil(numel / world) * 4 for _, numel, _ in res["units"])
        assert res["held"]["parameters"] == shard_bytes  # 1/N of every unit, padded
        total = sum(p.numel() for p in build(kind, 0).parameters()) * 4
        assert shard_bytes < total / world + 4 * len(res["units"])


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_sent_is_3P_minus_the_root(runs, world):
    """Per step: all-gather in forward, again in backward (not the root: it stays gathered
    between the two), reduce-scatter of the gradients; plus the int32 'used' flags."""
    res = runs[world][0]["gpt", None]
    n_params = len(list(TinyGPT(GPT).parameters()))
    padded = [math.ceil(numel / world) * world * 4 for _, numel, _ in res["units"]]
    root = sum(p for p, (_, _, is_root) in zip(padded, res["units"]) if is_root)
    expected = (world - 1) / world * (3 * sum(padded) - root) + 2 * (world - 1) / world * 4 * n_params
    assert res["sent"] == pytest.approx(expected)


def test_prefetch_overlaps_the_next_all_gather(runs):
    spans = [s for s in runs[2][0]["gpt", None]["spans"] if s.rank == 0]
    first = lambda name: min((s for s in spans if s.name == name), key=lambda s: s.start)
    for i in range(GPT.n_layers - 1):  # block i+1's all-gather starts before block i's forward ends
        assert first(f"all-gather blocks.{i + 1}").start < first(f"forward blocks.{i}").end
    assert any(s.name.startswith("reduce-scatter") for s in spans)
    assert any(s.name.startswith("backward blocks") for s in spans)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_more_ranks_than_elements(runs, world):
    for rank, result in enumerate(runs[world]):
        tiny = result["tiny"]
        assert list(tiny["state"]) == ["weight", "bias"]
        torch.testing.assert_close(tiny["state"]["weight"], torch.tensor([[1.0], [2.0]]))  # rank 0's
        torch.testing.assert_close(tiny["state"]["bias"], torch.zeros(2))
        sizes = [s[0] for s in tiny["shapes"]]
        assert sum(sizes) == max(0, min(math.ceil(4 / world), 4 - rank * math.ceil(4 / world)))
        for g, shape in zip(tiny["grads"], tiny["shapes"]):  # empty slices get empty gradients
            assert g is not None and tuple(g.shape) == shape and torch.all(g == 3)


def test_bad_input():
    with pytest.raises(ValueError, match="no parameters"):
        FSDP(nn.ReLU())
    with pytest.raises(ValueError, match="one dtype"):
        FSDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()))
    with pytest.raises(ValueError, match="submodule"):
        FSDP(nn.Linear(2, 2), units=[nn.Linear(2, 2)])
    with pytest.raises(TypeError, match="compute_dtype"):
        FSDP(nn.Linear(2, 2), compute_dtype=torch.int8)
    with pytest.raises(ValueError, match="one device"):
        FSDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta")))
