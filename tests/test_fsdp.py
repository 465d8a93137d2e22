"""FSDP / ZeRO-3 (course_lib/parallel/fsdp.py) against single-device training on the full batch.

One launch per world size (1, 2, 3, 4) runs every check; the 4-rank launch also runs
TP + FSDP on Mesh(dp=2, tp=2). Comparisons go through course_lib.tolerance: the AdamW runs
(MLPs, TP + FSDP) in float64, the GPT with SGD + momentum in fp32 (a linear optimizer keeps
rounding at rounding level), mixed precision within the bound of its 16-bit roundings.
"""
import contextlib
import copy
import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import launch, tolerance
from course_lib.models import MLP, GPTConfig, TinyGPT
from course_lib.parallel.comm_ops import copy_to_parallel, reduce_from_parallel, split_to_parallel
from course_lib.parallel.fsdp import FSDP
from course_lib.parallel.fsdp_params import dim0_rows
from single_device import exact
from course_lib.planner.formulas import collective_bytes_per_rank

SIZES = (16, 32, 16, 32)
AWKWARD = dict(frozen=(1,), shared=True, unused=True)
BATCH, STEPS = 24, 5
CLIP_NORMS = (2.0, 1.0, math.inf)
GPT = GPTConfig(vocab_size=64, seq_len=16, n_layers=3, hidden=32, n_heads=4, n_kv_heads=2,
                tie_embeddings=True)


def mlp_data(seed=0, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)
    X, Y = torch.randn(BATCH, sizes[0], generator=g), torch.randn(BATCH, sizes[-1], generator=g)
    return [(X[p], Y[p]) for p in (torch.randperm(BATCH, generator=g) for _ in range(STEPS))]


def gpt_data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, GPT.vocab_size, (BATCH, GPT.seq_len + 1), generator=g) for _ in range(STEPS)]


def loss_of(model, batch, kind):
    if kind == "gpt":
        return model(batch[:, :-1], batch[:, 1:])[1]
    x, y = batch
    return F.mse_loss(model(x).to(y.dtype), y)         # 16-bit outputs: the loss in the targets' dtype


class Uneven(nn.Module):
    """A (5, 3) weight: on 2 ranks 3 + 2 rows, on 4 ranks 2 + 2 + 1 + 0; a (2, 5) one: 1 + 1 + 0 + 0."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([nn.Linear(3, 5), nn.Linear(5, 2)])

    def forward(self, x):
        return self.layers[1](torch.tanh(self.layers[0](x)))


def build(kind, seed):
    if kind == "uneven":
        return Uneven(seed)
    return TinyGPT(GPT, seed=seed) if kind == "gpt" else MLP(SIZES, seed=seed, **AWKWARD)


def data_of(kind):
    return {"gpt": gpt_data, "mlp": mlp_data, "uneven": functools.partial(mlp_data, sizes=(3, 2))}[kind]()


def make_opt(params, kind, dtype):
    """AdamW on the small MLPs. On the GPT's 10^5 weights, Adam's m / sqrt(v) turns the last-bit
    differences of a sum in another order into ~1e-5 wherever m nearly cancels between
    steps: a linear optimizer (SGD + momentum + weight decay) keeps them at rounding level."""
    if kind != "gpt" and dtype is None:
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.2, momentum=0.9 if dtype is None else 0.0, weight_decay=0.01)


def in_float64(kind, dtype):
    """The AdamW runs (MLPs in full precision): compared in float64 (course_lib.tolerance)."""
    return exact() if kind != "gpt" and dtype is None else contextlib.nullcontext()


def reference(kind, dtype=None, accumulate=1):
    return reference_run(kind, dtype, accumulate)[0]


@functools.lru_cache(maxsize=None)
def reference_run(kind, dtype=None, accumulate=1):
    """One device, full batch; with a dtype: forward/backward on a copy in that dtype,
    fp32 master weights and optimizer (what FSDP's mixed precision does). Returns the final
    state and the largest gradient element seen (the bounds' G)."""
    with in_float64(kind, dtype):
        return _reference_run(kind, dtype, accumulate)


def _reference_run(kind, dtype, accumulate):
    model = build(kind, 0)
    opt = make_opt(model.parameters(), kind, dtype)
    grad_scale = 0.0
    for batch in data_of(kind):
        work = copy.deepcopy(model).to(dtype) if dtype else model
        if dtype and kind != "gpt":
            batch = (batch[0].to(dtype), batch[1])
        for part in zip(*[b.chunk(accumulate) for b in batch]) if kind != "gpt" else batch.chunk(accumulate):
            (loss_of(work, part, kind) / accumulate).backward()
        if dtype:
            for p, q in zip(model.parameters(), work.parameters()):
                p.grad = None if q.grad is None else q.grad.float()
        grad_scale = max([grad_scale] + [float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
    return model.state_dict(), grad_scale


def assert_trained_like(got, kind, dtype, accumulate=1, what=""):
    """The bound of the run's optimizer (make_opt) and precision: AdamW in float64; SGD with
    momentum in fp32; mixed precision: SGD, every 16-bit rounding of a layer's output and
    gradient may land one ulp apart on the two sides (TERMS_16 along the chain)."""
    state, grad_scale = reference_run(kind, dtype, accumulate)
    if kind != "gpt" and dtype is None:
        return tolerance.assert_matches(got, state, optimizer="adamw", steps=STEPS, lr=1e-2, what=what)
    bound = dict(optimizer="sgd", steps=STEPS, lr=0.2, grad_scale=grad_scale, what=what)
    if dtype is None:
        return tolerance.assert_matches(got, state, momentum=0.9, **bound)
    return tolerance.assert_matches(got, state, dtype=dtype, terms=TERMS_16, **bound)


CONFIGS = [("mlp", None), ("gpt", None), ("gpt", torch.bfloat16), ("mlp", torch.float16), ("uneven", None)]
TERMS_16 = 16   # 16-bit roundings along the chain: (forward + backward) x (matmul, activation) x 4 layers


def local_rows(batch, kind, rank, world):
    if kind == "gpt":
        return batch.chunk(world)[rank]
    return batch[0].chunk(world)[rank], batch[1].chunk(world)[rank]


def train(kind, dtype, rank, world, accumulate=1, **fsdp_kw):
    from course_lib import memory

    model = build(kind, seed=rank)  # different on every rank: FSDP broadcasts rank 0's, then shards
    fsdp = FSDP(model, compute_dtype=dtype, **fsdp_kw)
    opt = make_opt(fsdp.parameters(), kind, dtype)
    for batch in data_of(kind):
        mine = local_rows(batch, kind, rank, world)
        parts = zip(*[b.chunk(accumulate) for b in mine]) if kind != "gpt" else mine.chunk(accumulate)
        for part in parts:
            (loss_of(fsdp, part, kind) / accumulate).backward()
        fsdp.finish_gradient_synchronization()
        if kind == "mlp":
            assert model.unused.grad is None
        held = memory.model_state_bytes(fsdp, opt)
        opt.step()
        opt.zero_grad()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return fsdp, opt, dict(state=fsdp.gather_full_params(), held=held, shapes=shapes,
                           units=[(u.numel, u.grad_numel, u.is_root, len(u.trainable)) for u in fsdp.units])


def measured_step(fsdp, opt, batch):
    """One GPT step with every collective measured: [(op, bytes sent)]."""
    fsdp.comm.reset()
    with fsdp.comm.measuring():
        loss_of(fsdp, batch, "gpt").backward()
        fsdp.finish_gradient_synchronization()
    opt.step()
    opt.zero_grad()
    return [(c.op, c.sent) for c in fsdp.comm.log]


def torch_shapes(kind):
    from torch.distributed.fsdp import fully_shard

    model = build(kind, 0)
    for block in (model.blocks if kind == "gpt" else model.layers):
        fully_shard(block)
    fully_shard(model)
    return {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}


def rank_checks():
    import torch.distributed as dist

    from course_lib import trace
    from course_lib.collectives.comm import Comm

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for kind, dtype in CONFIGS:
        trace.reset()
        with in_float64(kind, dtype):
            fsdp, opt, out[kind, dtype] = train(kind, dtype, rank, world)
        out[kind, dtype]["spans"] = trace.spans()
        if kind == "gpt" and dtype is None and world > 1:  # bytes: gloo's collectives, then our ring
            batch = local_rows(gpt_data()[0], kind, rank, world)
            out["bytes torch"] = measured_step(fsdp, opt, batch)
            ours = FSDP(build("gpt", 0), group=Comm(None, dim="dp", impl="course"))
            out["bytes course"] = measured_step(ours, make_opt(ours.parameters(), kind, None), batch)
    with exact():
        out["accumulate"] = train("mlp", None, rank, world, accumulate=2)[2]["state"]
    out["fully_shard"] = {kind: torch_shapes(kind) for kind in ("uneven", "gpt")}
    tiny = nn.Linear(1, 2)  # weight (2, 1): on 3 and 4 ranks the last shards have 0 rows
    with torch.no_grad():
        tiny.weight.copy_(torch.tensor([[1.0], [2.0]]) + rank), tiny.bias.fill_(rank)
    fsdp = FSDP(tiny)
    fsdp(torch.ones(3, 1)).sum().backward()  # d/dw = d/db = 3 on every rank
    fsdp.finish_gradient_synchronization()
    out["tiny"] = dict(shapes=[tuple(p.shape) for p in fsdp.parameters()],
                       grads=[None if p.grad is None else p.grad.clone() for p in fsdp.parameters()],
                       state=fsdp.gather_full_params())
    if world == 2:
        out["errors"] = bad_distributed_input()
    if world == 4:
        with exact():                      # AdamW, compared after 5 steps: float64
            out["tp"] = tp_fsdp()
    return out


# ----------------------------------------------------------------------------- TP + FSDP
IN, HID, OUT = 8, 12, 6


class TPMLP(nn.Module):
    """x (b, IN) -> column-parallel fc1 (HID / tp rows) -> relu -> row-parallel fc2 (HID / tp
    columns) -> all-reduce -> + bias -> this tp rank's rows (sequence parallel) * scale.
    ``tp=None``: the single-device model. ``scale`` sees only this rank's rows: its gradient
    is partial over tp, so it is reduced over ("dp", "tp")."""

    def __init__(self, seed, tp=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w1, b1 = torch.randn(HID, IN, generator=g) / IN ** 0.5, torch.randn(HID, generator=g) * 0.1
        w2, b2 = torch.randn(OUT, HID, generator=g) / HID ** 0.5, torch.randn(OUT, generator=g) * 0.1
        scale = 1 + 0.1 * torch.randn(OUT, generator=g)
        if tp is not None:
            w1, b1, w2 = w1.chunk(tp.size)[tp.rank], b1.chunk(tp.size)[tp.rank], w2.chunk(tp.size, dim=1)[tp.rank]
        self.tp = tp
        self.fc1, self.fc2 = nn.Linear(IN, w1.shape[0]), nn.Linear(w2.shape[1], OUT, bias=False)
        with torch.no_grad():
            for p, v in ((self.fc1.weight, w1), (self.fc1.bias, b1), (self.fc2.weight, w2)):
                p.copy_(v)
        self.bias, self.scale = nn.Parameter(b2), nn.Parameter(scale)  # after the all-reduce
        if tp is not None:  # what course_lib's TP layers tag their slices with (slice_parameter)
            self.fc1.weight.tp_shard, self.fc1.bias.tp_shard = (0, 0, 0, HID), (0, 0, 0, HID)
            self.fc2.weight.tp_shard = (1, 0, 0, HID)

    def forward(self, x):                                      # x (b, IN)
        if self.tp is not None:
            x = copy_to_parallel(x, self.tp)              # f: all-reduce backward
        h = F.relu(self.fc1(x))                                # (b, HID / tp)
        z = self.fc2(h)                                        # (b, OUT), partial over tp
        if self.tp is not None:
            z = reduce_from_parallel(z, self.tp)           # g: all-reduce forward
        z = z + self.bias
        if self.tp is not None:
            z = split_to_parallel(z, self.tp, dim=0)       # (b / tp, OUT): all-gather backward
        return z * self.scale


def tp_data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, IN, generator=g), torch.randn(8, OUT, generator=g)) for _ in range(STEPS)]


@functools.lru_cache(maxsize=None)
def tp_reference():
    with exact():
        return _tp_reference()


def _tp_reference():
    model = TPMLP(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for x, y in tp_data():
        F.mse_loss(model(x), y).backward()
        norms.append([torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf, t) for t in CLIP_NORMS])
        opt.step()
        opt.zero_grad()
    return model.state_dict(), norms


def tp_fsdp():
    from course_lib.parallel.mesh import Mesh, set_reduce_dims

    mesh = Mesh(dp=2, tp=2)
    dp, tp = mesh.comm("dp"), mesh.comm("tp")
    model = TPMLP(seed=dp.rank, tp=tp)  # dp rank 1 starts elsewhere: FSDP broadcasts dp rank 0's
    set_reduce_dims(model.scale, ("dp", "tp"))
    with torch.no_grad():
        model.scale.add_(tp.rank)  # replicated over dp and tp: FSDP broadcasts rank 0's over both
    fsdp = FSDP(model, mesh=mesh, units=[model.fc1, model.fc2], divisor=1)  # the loss is global
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for x, y in tp_data():
        x, y = x.chunk(dp.size)[dp.rank], y.chunk(dp.size)[dp.rank]   # (4, .) per dp rank
        y = y.chunk(tp.size)[tp.rank]                                  # (2, OUT): my rows
        loss = ((fsdp(x) - y) ** 2).sum() / (8 * OUT)  # / the global count: the sum over ranks is the loss
        loss.backward()
        fsdp.finish_gradient_synchronization()
        norms.append([fsdp.clip_grad_norm_(math.inf, t) for t in CLIP_NORMS])  # inf: scales by 1
        opt.step()
        opt.zero_grad()
    full = fsdp.gather_full_params()  # over dp; then over tp by hand
    for name, dim in (("fc1.weight", 0), ("fc1.bias", 0), ("fc2.weight", 1)):
        t = full[name].movedim(dim, 0).contiguous()
        parts = t.new_empty(tp.size * t.shape[0], *t.shape[1:])
        tp.all_gather_into_tensor(parts, t)
        full[name] = parts.movedim(0, dim)  # the tp slices side by side along dim
    return dict(state=full, shapes=shapes, norms=norms)


def bad_distributed_input():
    from course_lib.parallel.mesh import set_reduce_dims

    errors = []
    for make in (lambda: FSDP(nn.Linear(2, 2), dims=("dp", "tp")),
                 lambda: FSDP(_marked(nn.Linear(2, 2), ("dp", "tp"), set_reduce_dims)),
                 lambda: FSDP(_marked(nn.Linear(2, 2), ("tp",), set_reduce_dims)),
                 lambda: FSDP(nn.Linear(2, 2), divisor=0)):
        try:
            make()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def _marked(module, dims, set_reduce_dims):
    set_reduce_dims(module.weight, dims)
    return module


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def runs():
    return {n: launch(rank_checks, n, timeout=180) for n in (1, 2, 3, 4)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("kind,dtype", CONFIGS)
def test_matches_single_device(runs, world, kind, dtype):
    ref = reference(kind, dtype)
    for result in runs[world]:
        got = result[kind, dtype]["state"]
        assert list(got) == list(ref)  # original names, tied weight under both
        for name in ref:
            assert got[name].shape == ref[name].shape and got[name].dtype == ref[name].dtype
            if world == 1 and dtype is None:
                assert torch.equal(got[name], ref[name]), name
        assert_trained_like(got, kind, dtype)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_parameter_is_sharded_along_dim0_like_fully_shard(runs, world):
    for rank, result in enumerate(runs[world]):
        for kind in ("uneven", "gpt"):
            ours, full = result[kind, None]["shapes"], reference(kind)
            assert ours == result["fully_shard"][kind], kind  # torch's FSDP2 local shards
            for name, shape in ours.items():
                d0 = full[name].shape[0]
                assert shape == (dim0_rows(d0, world, rank)[1], *full[name].shape[1:]), name
        if world == 4:  # (5, 3) on 4 ranks: 2, 2, 1, 0 rows; (2, 5): 1, 1, 0, 0
            assert result["uneven", None]["shapes"]["layers.0.weight"] == ([2, 2, 1, 0][rank], 3)
            assert result["uneven", None]["shapes"]["layers.1.weight"] == ([1, 1, 0, 0][rank], 5)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gradient_accumulation(runs, world):
    for result in runs[world]:
        assert_trained_like(result["accumulate"], "mlp", None, accumulate=2)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_holds_its_shards(runs, world):
    for kind in ("mlp", "gpt"):
        full = dict(build(kind, 0).named_parameters())  # a tied weight once
        for rank, result in enumerate(runs[world]):
            res = result[kind, None]
            padded = sum(dim0_rows(p.shape[0], world, 0)[0] * p[0].numel() for p in full.values())
            itemsize = 4 if kind == "gpt" else 8     # the MLP trains in float64
            assert res["held"]["parameters"] == itemsize * padded  # every shard, padded to ceil(d0 / N) rows
            assert sum(u[0] for u in res["units"]) == padded


def step_formula(units, world):
    """Ring bytes per rank and step: all-gather every unit in forward, again in backward
    (not the root: it stays gathered in between), reduce-scatter the trainable gradients
    and one 'used' flag per trainable parameter."""
    ag = sum(collective_bytes_per_rank("all_gather", world * S * 4, world) * (1 if root else 2)
             for S, _, root, _ in units)
    rs = sum(collective_bytes_per_rank("reduce_scatter", world * (G + T) * 4, world) for _, G, _, T in units)
    return ag, rs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bytes_measured_per_step(runs, world):
    """Measured bytes (payload + the transport's few hundred header bytes per call): our ring
    sends the ring formula; gloo's all-gather too, its reduce-scatter about twice it (as much
    as an all-reduce)."""
    header = 1024  # bytes per call, at most
    for result in runs[world]:
        units = result["gpt", None]["units"]
        ag, rs = step_formula(units, world)
        for impl in ("course", "torch"):
            log = result[f"bytes {impl}"]
            sent = {op: sum(s for o, s in log if o == op) for op, _ in log}
            calls = {op: sum(o == op for o, _ in log) for op, _ in log}
            assert calls["all_gather_into_tensor"] == 2 * len(units) - 1  # one per unit and pass
            assert calls["reduce_scatter_tensor"] == len(units) and len(log) == 3 * len(units) - 1
            assert ag <= sent["all_gather_into_tensor"] <= ag + header * calls["all_gather_into_tensor"]
            if impl == "course":
                assert rs <= sent["reduce_scatter_tensor"] <= rs + header * len(units)
            else:
                assert sent["reduce_scatter_tensor"] == pytest.approx(2 * rs, rel=0.05)


def test_prefetch_overlaps_the_next_all_gather(runs):
    spans = [s for s in runs[2][0]["gpt", None]["spans"] if s.rank == 0]
    first = lambda name: min((s for s in spans if s.name == name), key=lambda s: s.start)
    for i in range(GPT.n_layers - 1):  # block i+1's all-gather starts before block i's forward ends
        assert first(f"all-gather blocks.{i + 1}").start < first(f"forward blocks.{i}").end
    assert any(s.name.startswith("reduce-scatter") for s in spans)
    assert any(s.name.startswith("backward blocks") for s in spans)
    assert {s.dim for s in spans if s.kind == "comm"} == {"dp"}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_more_ranks_than_rows(runs, world):
    for rank, result in enumerate(runs[world]):
        tiny = result["tiny"]
        assert list(tiny["state"]) == ["weight", "bias"]
        assert torch.equal(tiny["state"]["weight"], torch.tensor([[1.0], [2.0]]))  # rank 0's
        assert torch.equal(tiny["state"]["bias"], torch.zeros(2))
        rows = dim0_rows(2, world, rank)[1]
        assert tiny["shapes"] == [(rows, 1), (rows,)]
        for g, shape in zip(tiny["grads"], tiny["shapes"]):  # 0-row shards get 0-row gradients
            assert g is not None and tuple(g.shape) == shape and torch.all(g == 3)


def test_tp_then_fsdp_matches_one_device(runs):
    """Mesh(dp=2, tp=2): TP cuts fc1 by rows and fc2 by columns, FSDP cuts them again by rows."""
    ref = tp_reference()[0]
    for rank, result in enumerate(runs[4]):
        tp = rank % 2
        got = result["tp"]
        assert got["shapes"]["fc1.weight"] == (3, IN)          # 12 rows / tp 2 / dp 2
        assert got["shapes"]["fc2.weight"] == (3, HID // 2)    # 6 rows / dp 2, 6 of 12 columns
        assert got["shapes"]["scale"] == (3,)
        tolerance.assert_matches(got["state"], ref, optimizer="adamw", steps=STEPS, lr=1e-2,
                                 what=f"rank {rank} (tp {tp})")


def test_bad_input(runs):
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
    scalar = nn.Linear(2, 2)
    scalar.gain = nn.Parameter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="0-dimensional"):
        FSDP(scalar)
    several, no_tp, not_dp, divisor = runs[2][0]["errors"]
    assert "divisor must be a positive number" in divisor
    assert "needs mesh=" in several
    assert "pass mesh=Mesh" in no_tp          # reduced over tp, but only a dp group given
    assert "must be reduced over the dimensions it is sharded on" in not_dp


def test_clip_grad_norm_with_tp_is_the_single_device_norm(runs):
    """With TP under FSDP the norm sums over dp and tp: a TP slice counts on every TP rank, the
    replicated bias and the sequence-parallel scale once: every rank gets one device's norm."""
    ref_norms = tp_reference()[1]
    for rank, result in enumerate(runs[4]):
        for step, (got, want) in enumerate(zip(result["tp"]["norms"], ref_norms)):
            # one step's bound: in float64 the parameters' earlier difference (~1e-14) moves a
            # gradient norm far less than its own reordering does
            tolerance.assert_matches(list(got), list(want), what=f"rank {rank}, step {step}, norms {CLIP_NORMS}")


# ----------------------------------------------------------------------------- nesting, clipping, checkpoints
CLIP_SIZES, MAX_NORM = (5, 7, 5, 7), 0.05  # (7, 5): 4 + 3 rows on 2 ranks, 3 + 3 + 1 on 3


def clip_model(seed):
    """Uneven shards on 2 and 3 ranks, a frozen layer, a tied weight and an unused parameter."""
    return MLP(CLIP_SIZES, seed=seed, frozen=(1,), shared=True, unused=True)


def clip_data():
    g = torch.Generator().manual_seed(5)
    return torch.randn(12, CLIP_SIZES[0], generator=g), torch.randn(12, CLIP_SIZES[-1], generator=g)


def clip_reference(norm_type, seed=0):
    """One device, full batch: the norm torch.nn.utils.clip_grad_norm_ returns, the parameters
    after one SGD step (lr 1) on the clipped gradients."""
    model = clip_model(seed)
    x, y = clip_data()
    F.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return norm, model.state_dict()


def _error(fn, kind=ValueError):
    try:
        fn()
    except kind as e:
        return f"{type(e).__name__}: {e}"
    return None


def api_checks():
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    nested = []  # torch's habit: fully_shard(block), then fully_shard(model)
    for shape in ((3, 5), (3, 4)):  # (5, 3): uneven on 2 and 3 ranks; (4, 3): even on 2
        m = nn.Sequential(nn.Linear(*shape), nn.Linear(shape[1], 2))
        m[0] = FSDP(m[0])
        nested.append(_error(lambda: FSDP(m)))
    lin = nn.Linear(3, 4)
    wrapped = FSDP(lin)
    out["nested"] = nested + [_error(lambda: FSDP(wrapped)), _error(lambda: FSDP(lin)),
                              _error(lambda: FSDP(nn.Sequential(nn.Linear(4, 4), lin)))]

    x, y = clip_data()
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    out["clip"] = {}
    for norm_type in CLIP_NORMS:
        fsdp = FSDP(clip_model(seed=rank))
        F.mse_loss(fsdp(x), y).backward()
        pending = _error(lambda: fsdp.clip_grad_norm_(MAX_NORM, norm_type), RuntimeError)
        fsdp.finish_gradient_synchronization()
        per_rank = torch.nn.utils.clip_grad_norm_(fsdp.parameters(), math.inf, norm_type)  # shards only
        norm = fsdp.clip_grad_norm_(MAX_NORM, norm_type)
        torch.optim.SGD(fsdp.parameters(), lr=1.0).step()
        out["clip"][norm_type] = dict(pending=pending, norm=norm, per_rank=per_rank, state=fsdp.gather_full_params())
    out["clip bad"] = [_error(lambda: fsdp.clip_grad_norm_(-1.0)), _error(lambda: fsdp.clip_grad_norm_(1.0, 0))]
    F.mse_loss(fsdp(x), y).backward()
    fsdp.finish_gradient_synchronization()
    if rank == 0:  # one non-finite element on one rank: every rank sees the non-finite norm
        fsdp.module.layers[0].bias.grad[0] = math.nan
    out["nonfinite"] = [_error(lambda: fsdp.clip_grad_norm_(1.0, error_if_nonfinite=True), RuntimeError),
                        fsdp.clip_grad_norm_(1.0, "inf"), fsdp.clip_grad_norm_(1.0)]

    fsdp = FSDP(clip_model(seed=rank))  # rank 0's model (seed 0) on every rank
    out["sharded"] = {k: tuple(v.shape) for k, v in fsdp.state_dict().items()}
    out["full"] = fsdp.full_state_dict()
    out["rank0_only"] = fsdp.full_state_dict(rank0_only=True)
    single = clip_model(seed=7).state_dict()  # a single-device checkpoint
    bad = [{k: v for k, v in single.items() if k != "layers.1.bias"}, {**single, "extra": torch.zeros(1)},
           {**single, "layers.0.bias": torch.zeros(6)}, fsdp.state_dict()]
    out["load bad"] = [_error(lambda: fsdp.load_full_state_dict(sd)) for sd in bad]
    out["after bad"] = fsdp.full_state_dict()  # the failed loads changed nothing
    fsdp.load_full_state_dict(single)
    out["loaded"] = fsdp.full_state_dict()
    out["loaded shapes"] = {n: tuple(p.shape) for n, p in fsdp.module.named_parameters()}
    F.mse_loss(fsdp(x), y).backward()
    fsdp.finish_gradient_synchronization()
    fsdp.clip_grad_norm_(MAX_NORM)
    torch.optim.SGD(fsdp.parameters(), lr=1.0).step()
    out["loaded trained"] = fsdp.full_state_dict()
    return out


@pytest.fixture(scope="module")
def api_runs():
    return {n: launch(api_checks, n, timeout=120) for n in (2, 3)}


@pytest.mark.parametrize("world", [2, 3])
def test_nested_fsdp_is_refused(api_runs, world):
    for result in api_runs[world]:
        uneven, even, twice, inner_again, inside_again = result["nested"]
        for msg in (uneven, even):
            assert msg and "'0' is already an FSDP" in msg and "units=" in msg
        assert twice and "already an FSDP" in twice
        for msg in (inner_again, inside_again):
            assert msg and "already wrapped by an FSDP" in msg and "units=" in msg


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("norm_type", CLIP_NORMS)
def test_clip_grad_norm_matches_single_device(api_runs, world, norm_type):
    norm, state = clip_reference(norm_type)
    assert norm > MAX_NORM  # it clips
    per_rank = [result["clip"][norm_type]["per_rank"] for result in api_runs[world]]
    assert max(per_rank) <= norm * (1 + 1e-5) and min(per_rank) < norm * 0.99  # torch's clip on shards: per rank
    for rank, result in enumerate(api_runs[world]):
        got = result["clip"][norm_type]
        assert "pending" in got["pending"] and "finish_gradient_synchronization" in got["pending"]
        tolerance.assert_matches(got["norm"], norm, what="norm")
        # the clipped step (SGD, lr 1; every clipped gradient element <= MAX_NORM): frozen layer
        # unchanged, unused parameter untouched
        tolerance.assert_matches(got["state"], state, optimizer="sgd", steps=1, lr=1.0, grad_scale=MAX_NORM)


@pytest.mark.parametrize("world", [2, 3])
def test_clip_grad_norm_bad_input(api_runs, world):
    for result in api_runs[world]:
        negative, zero = result["clip bad"]
        assert "max_norm must be a number >= 0" in negative and "norm_type must be a number > 0" in zero
        error, inf_norm, norm = result["nonfinite"]  # a NaN on rank 0 only: every rank's norm is NaN
        assert error and "non-finite" in error and torch.isnan(inf_norm) and torch.isnan(norm)


@pytest.mark.parametrize("world", [2, 3])
def test_full_state_dict_round_trip(api_runs, world):
    initial, single = clip_model(0).state_dict(), clip_model(7).state_dict()
    _, trained = clip_reference(2.0, seed=7)
    for rank, result in enumerate(api_runs[world]):
        # state_dict(): this rank's rows under module.<name>, as documented
        assert result["sharded"] == {f"module.{k}": (dim0_rows(v.shape[0], world, rank)[1], *v.shape[1:])
                                     for k, v in initial.items()}
        for key in ("full", "after bad"):
            assert list(result[key]) == list(initial)
            assert all(torch.equal(result[key][k], initial[k]) for k in initial), key
        assert list(result["rank0_only"]) == (list(initial) if rank == 0 else [])
        assert all(torch.equal(result["loaded"][k], single[k]) for k in single)
        assert {k: v[0] for k, v in result["loaded shapes"].items()} == \
            {k: dim0_rows(v.shape[0], world, rank)[1] for k, v in clip_model(0).named_parameters()}
        tolerance.assert_matches({k: result["loaded trained"][k] for k in trained}, trained,
                                 optimizer="sgd", steps=1, lr=1.0, grad_scale=MAX_NORM)
        missing, unexpected, shape, sharded = result["load bad"]
        assert "missing keys ['layers.1.bias']" in missing
        assert "unexpected keys ['extra']" in unexpected
        assert "'layers.0.bias' has shape (6,)" in shape and "(7,)" in shape
        assert "FSDP.state_dict()'s sharded dict" in sharded
