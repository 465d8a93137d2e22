"""Tensor and sequence parallelism (course_lib/parallel/tensor_parallel.py, tp_plan.py,
vocab_parallel.py): the tiny GPT, sliced over t ranks, trains exactly like one device
(5 AdamW steps: losses, gradients, parameters; t = 2, 3, 4; with and without SP; GQA with
K/V heads split or copied; an uneven vocabulary; tied embeddings); dropout draws the same
mask where the activations are replicated and independent ones where they are sharded;
bytes per layer = the formula; activation bytes per rank = Korthikanti's formula; torch's
DTensor tensor parallelism gives the same numbers; bad input is a ValueError on every rank;
on a dp x tp mesh, GradSync (reading the SP marks) makes it data-parallel too."""
import functools

import pytest
import torch
import torch.nn.functional as F

from course_lib import launch, tolerance
from course_lib.models import Dropout, GPTConfig, TinyGPT
from course_lib.parallel.tensor_parallel import TensorParallelDropout
from course_lib.parallel.tp_plan import assemble
from course_lib.reference import gpt_batches, train_gpt

STEPS, BATCH, LR = 5, 4, 1e-2
BASE = dict(vocab_size=256, seq_len=12, n_layers=2, hidden=48, n_heads=12, ffn_hidden=96)  # 12 heads, 96: / 2, 3, 4
CONFIGS = {  # t -> the models tried there (256 rows of vocabulary: uneven over 3 ranks)
    2: [GPTConfig(**BASE, n_kv_heads=4), GPTConfig(**BASE, tie_embeddings=True)],   # K/V heads split
    3: [GPTConfig(**BASE, n_kv_heads=1)],                                           # one K/V head, 3 copies
    4: [GPTConfig(**BASE, n_kv_heads=2)],                                           # 2 K/V heads, 2 copies each
}
GPT2 = GPTConfig(**{**BASE, "n_heads": 4}, block="gpt2", dropout=0.2)


def _f64_loss(logits, targets, n_tokens=None):  # the reference's loss, kept in float64
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / n_tokens


def tp_train(cfg, sp, record=False):
    """On each rank: the single-device model, parallelized, trained STEPS AdamW steps in float64."""
    import torch.distributed as dist

    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.tp_plan import local_shards, parallelize, sync_tensor_parallel_grads

    torch.manual_seed(dist.get_rank())                 # nothing may depend on the global RNG
    model = TinyGPT(cfg, seed=0).double()
    parallelize(model, Mesh(tp=dist.get_world_size()), sequence_parallel=sp, seed=7)
    drops = {n: m for n, m in model.named_modules() if isinstance(m, TensorParallelDropout)}
    for m in drops.values():
        m.record = [] if record else None
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, grads = [], None
    for x, y in gpt_batches(cfg, batch=BATCH, steps=STEPS):
        _, loss = model(x, y, n_tokens=y.numel())
        loss.backward()
        sync_tensor_parallel_grads(model)
        grads = grads or local_shards(model, grads=True)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    masks = {n: (m.region, m.record) for n, m in drops.items()} if record else None
    return losses, grads, local_shards(model), masks


def one_device(cfg, masks=None):
    model = TinyGPT(cfg, seed=0).double()
    model.loss = _f64_loss
    if masks is not None:  # replay the masks the ranks drew, assembled into whole ones
        for name, mod in list(model.named_modules()):
            if isinstance(mod, Dropout):
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr,
                        TensorParallelDropout(mod.p, masks=list(masks[name])))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    first = []

    def update(params):  # AdamW, after keeping the first step's gradients
        if not first:
            first.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()

    _, losses = train_gpt(model, gpt_batches(cfg, batch=BATCH, steps=STEPS), update)
    return losses, first[0], {n: p.detach() for n, p in model.named_parameters()}


def assert_equal_to_one_device(results, reference):
    ref_losses, ref_grads, ref_params = reference
    for losses, *_ in results:
        assert losses == results[0][0]                            # the same loss on every rank
        tolerance.assert_matches(losses, ref_losses, optimizer="adamw", steps=STEPS, lr=LR, what="losses")
    after = {1: dict(what="step 1's gradients"), 2: dict(optimizer="adamw", steps=STEPS, lr=LR)}
    for k, ref in ((1, ref_grads), (2, ref_params)):
        full = assemble([r[k] for r in results])
        assert full.keys() == ref.keys()
        tolerance.assert_matches(full, ref, **after[k])
        for r in results:                                         # a whole tensor: the same everywhere
            whole = {name: value for name, (value, shard) in r[k].items() if shard is None}
            tolerance.assert_matches(whole, {name: ref[name] for name in whole}, **after[k])


def _all_configs():
    import torch.distributed as dist
    t = dist.get_world_size()
    return {(i, sp): tp_train(cfg, sp) for i, cfg in enumerate(CONFIGS[t]) for sp in (False, True)}


@pytest.fixture(scope="module")
def llama_runs():
    return {t: launch(_all_configs, t, timeout=240) for t in CONFIGS}


@functools.lru_cache(maxsize=None)
def reference(t, i):
    return one_device(CONFIGS[t][i])


@pytest.mark.parametrize("t", [2, 3, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_llama_equals_one_device_over_adamw_steps(llama_runs, t, sp):
    for i, cfg in enumerate(CONFIGS[t]):
        assert_equal_to_one_device([r[(i, sp)] for r in llama_runs[t]], reference(t, i))


# ----------------------------------------------------------------------------- dropout


def _gpt2_both():
    return {sp: tp_train(GPT2, sp, record=True) for sp in (False, True)}


@pytest.fixture(scope="module")
def gpt2_runs():
    return {t: launch(_gpt2_both, t, timeout=240) for t in (2, 4)}


def assemble_masks(per_rank):
    """Whole masks from the ranks' masks: one copy of a replicated one; the heads' (dim 1 of
    (b, heads, s, s)) or the tokens' (dim 1 of (b, s, h)) pieces of a sharded one, in rank order."""
    out = {}
    for name, (region, first) in per_rank[0].items():
        calls = [r[name][1] for r in per_rank]
        if region == "replicated":
            for masks in calls:
                assert all(torch.equal(a, b) for a, b in zip(masks, first)), f"{name}: replicas drew different masks"
            out[name] = first
        else:
            assert not any(torch.equal(a, b) for a, b in zip(calls[0], calls[1])), f"{name}: shards drew one mask"
            out[name] = [torch.cat(pieces, dim=1) for pieces in zip(*calls)]
    return out


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_dropout_streams_per_region_and_equal_to_one_device_with_the_same_masks(gpt2_runs, t, sp):
    results = [r[sp] for r in gpt2_runs[t]]
    regions = {name: region for name, (region, _) in results[0][3].items()}
    for name, region in regions.items():  # attention probabilities: my heads; SP: my tokens
        expected = "sharded" if (sp or name.endswith("attn.attn_dropout")) else "replicated"
        assert region == expected, (name, region)
    masks = assemble_masks([r[3] for r in results])
    assert_equal_to_one_device(results, one_device(GPT2, masks))


# ----------------------------------------------------------------------------- measured: bytes, memory

S, B = 64, 4  # one layer, fp32 for the bytes (ring: the formula), bf16 for the saved activations
MEASURED = {"llama": GPTConfig(seq_len=S, n_kv_heads=2), "gpt2": GPTConfig(seq_len=S, block="gpt2", dropout=0.1)}


def _layer_bytes_and_memory():
    """Per mode: the collectives of one layer's forward + backward (op, payload, bytes sent
    through our ring), and the bytes one block keeps for backward on this rank."""
    import torch.distributed as dist

    from course_lib.models import saved_activations
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.tp_plan import parallelize

    mesh = Mesh(tp=dist.get_world_size(), impl="course")
    t, r, comm = mesh.sizes["tp"], mesh.coord["tp"], mesh.comm("tp")
    out = {}
    for kind, cfg in MEASURED.items():
        for sp, keep in ((False, False), (True, False), (True, True)):
            model = parallelize(TinyGPT(cfg, seed=0), mesh, sequence_parallel=sp, keep_gathered=keep)
            x = torch.randn(B, S, cfg.hidden, generator=torch.Generator().manual_seed(0))
            x = (x.chunk(t, 1)[r] if sp else x).requires_grad_()
            comm.reset()
            with comm.measuring():
                model.blocks[0](x).sum().backward()
            calls = [(c.op, c.payload, c.sent) for c in comm.log if not c.name.startswith("copies")]
            copies = [c.payload for c in comm.log if c.name.startswith("copies")]  # GQA: K/V weights' grads
            block = model.blocks[0].to(torch.bfloat16)
            _, rows = saved_activations(block, x.detach().to(torch.bfloat16).requires_grad_() * 1.0)
            if kind == "gpt2":  # LayerNorm's mean and rstd, (b, s, 1): not in Korthikanti's count
                rows = [row for row in rows if row.shape[-1] != 1]
            out[(kind, sp, keep)] = (calls, sum(row.nbytes for row in rows), copies)
    return out


@pytest.fixture(scope="module")
def measured():
    return {t: launch(_layer_bytes_and_memory, t, timeout=120) for t in (2, 4)}


@pytest.mark.parametrize("t", [2, 4])
def test_bytes_per_layer_equal_the_formula(measured, t):
    from course_lib.planner.formulas import collective_bytes_per_rank, tp_bytes_per_layer

    for kind, cfg in MEASURED.items():
        n = S * B * cfg.hidden * 4                                     # one fp32 activation (s, b, h)
        formula = tp_bytes_per_layer(S, B, cfg.hidden, t, dtype_bytes=4)
        for rank in measured[t]:
            tp, _, copies = rank[(kind, False, False)]
            assert [(op, p) for op, p, _ in tp] == [("all_reduce", n)] * 4   # g, g forward; f, f backward
            assert sum(s for *_, s in tp) == pytest.approx(formula, rel=0.03)
            kv_copies = t // cfg.n_kv_heads if t > cfg.n_kv_heads else 1  # W_k, W_v: one all-reduce each
            w_kv = cfg.hidden * cfg.head_dim * 4 * (cfg.n_kv_heads if kv_copies > 1 else 0)
            assert copies == [w_kv] * (2 if kv_copies > 1 else 0)
            keep, *_ = rank[(kind, True, True)]                         # SP: the same volume, as AG + RS
            assert sorted(op for op, *_ in keep) == ["all_gather_into_tensor"] * 4 + ["reduce_scatter_tensor"] * 4
            assert sum(s for *_, s in keep) == pytest.approx(tp_bytes_per_layer(S, B, cfg.hidden, t, sp=True,
                                                                                dtype_bytes=4), rel=0.03)
            shard, *_ = rank[(kind, True, False)]                       # + one all-gather again per region
            regather = 2 * collective_bytes_per_rank("all_gather", n, t)
            assert sum(s for *_, s in shard) == pytest.approx(formula + regather, rel=0.03)


@pytest.mark.parametrize("t", [2, 4])
def test_activation_bytes_per_rank_equal_korthikanti(measured, t):
    from course_lib.planner.formulas import activation_bytes_per_layer, llama_activation_bytes_per_layer

    ll, g2 = MEASURED["llama"], MEASURED["gpt2"]
    for sp in (False, True):
        llama = llama_activation_bytes_per_layer(S, B, ll.hidden, ll.n_heads, ll.n_kv_heads, ll.ffn_hidden, t=t, sp=sp)
        gpt2 = activation_bytes_per_layer(S, B, g2.hidden, g2.n_heads, t=t, sp=sp)  # s b h (10 + 24/t + 5as/(ht))
        for rank in measured[t]:
            assert rank[("llama", sp, False)][1] == llama
            assert rank[("gpt2", sp, False)][1] == gpt2
    for rank in measured[t]:  # keeping the gathered inputs: the two column inputs whole, 2 s b h each (bf16)
        extra = 2 * 2 * S * B * ll.hidden * (1 - 1 / t)
        assert rank[("llama", True, True)][1] == pytest.approx(rank[("llama", True, False)][1] + extra)


# ----------------------------------------------------------------------------- torch's own version


def _ours_and_dtensor():
    """Two AdamW steps of the same model, ours and DTensor's: losses and whole gradients."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.tp_plan import local_shards, parallelize, sync_tensor_parallel_grads, torch_parallelize

    t, cfg = dist.get_world_size(), CONFIGS[2][0]
    out = {}
    for sp in (False, True):
        ours = parallelize(TinyGPT(cfg, seed=0).double(), Mesh(tp=t), sequence_parallel=sp)
        theirs = torch_parallelize(TinyGPT(cfg, seed=0).double(), t, sp)
        theirs.loss = _f64_loss
        runs = {}
        for name, model in (("ours", ours), ("torch", theirs)):
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
            losses, grads = [], []
            for x, y in gpt_batches(cfg, batch=BATCH, steps=2):
                with loss_parallel():
                    _, loss = model(x, y, n_tokens=y.numel())
                    loss.backward()
                if name == "ours":
                    sync_tensor_parallel_grads(model)
                    grads.append(local_shards(model, grads=True))
                else:
                    grads.append({n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad, None)
                                  for n, p in model.named_parameters()})
                opt.step()
                opt.zero_grad()
                losses.append(float(loss.full_tensor() if isinstance(loss, DTensor) else loss))
            runs[name] = (losses, grads)
        out[sp] = runs
    return out


def test_same_results_as_torch_dtensor_tensor_parallel():
    results = launch(_ours_and_dtensor, 2, timeout=120)
    for sp in (False, True):
        ours_losses, theirs_losses = results[0][sp]["ours"][0], results[0][sp]["torch"][0]
        tolerance.assert_matches(ours_losses, theirs_losses, what=f"sp={sp} losses")
        for step in range(2):   # float64: step 2's parameters differ by ~1e-15, far below a gradient's bound
            ours = assemble([r[sp]["ours"][1][step] for r in results])
            theirs = {n: g for n, (g, _) in results[0][sp]["torch"][1][step].items()}
            tolerance.assert_matches({n: ours[n] for n in theirs}, theirs, what=f"sp={sp} step {step} gradients")


# ----------------------------------------------------------------------------- bad input


def _bad_inputs():
    """Each case on every rank: the error message (or None if it did not raise)."""
    import torch.distributed as dist

    from course_lib.collectives.comm import Comm
    from course_lib.parallel.mesh import Mesh, as_mesh
    from course_lib.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorParallelDropout
    from course_lib.parallel.tp_plan import parallelize

    t, rank = dist.get_world_size(), dist.get_rank()
    base, mesh = {**BASE, "n_layers": 1}, Mesh(tp=dist.get_world_size())

    def model(**kw):
        return TinyGPT(GPTConfig(**{**base, **kw}), seed=0)

    def sp_forward():
        m = parallelize(TinyGPT(GPTConfig(**base), seed=0), mesh, sequence_parallel=True)
        m(torch.zeros(1, t + 1, dtype=torch.long))

    def row_given_whole_input():
        RowParallelLinear(torch.nn.Linear(6, 4), Comm())(torch.zeros(2, 6))

    def twice():
        parallelize(parallelize(model(), mesh), mesh)

    def own_layer_per_rank():                      # torch.manual_seed(rank): a different layer each
        torch.manual_seed(rank)
        ColumnParallelLinear(torch.nn.Linear(6, 6), Comm())

    def own_shape_per_rank():                      # rank 2 builds a wider layer: named, not an abort
        torch.manual_seed(0)
        ColumnParallelLinear(torch.nn.Linear(6, 9 if rank == 2 else 6), Comm())

    def vocab_target_out_of_range():
        from course_lib.parallel.vocab_parallel import shard_range, vocab_parallel_cross_entropy
        a, b = shard_range(7, t, rank)
        vocab_parallel_cross_entropy(torch.zeros(2, b - a), torch.tensor([1, 7]), Comm(), a)

    def vocab_too_small():
        from course_lib.parallel.vocab_parallel import VocabParallelEmbedding
        VocabParallelEmbedding(torch.nn.Embedding(t - 1, 4), Comm())

    def vocab_group():
        from course_lib.parallel.vocab_parallel import VocabParallelEmbedding
        VocabParallelEmbedding(torch.nn.Embedding(6, 4), dist.group.WORLD)

    def same_layer():                              # the same layer everywhere for the cases below
        g = torch.Generator().manual_seed(0)
        layer = torch.nn.Linear(6, 6)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        return layer

    cases = {
        "heads": lambda: parallelize(model(hidden=32, n_heads=4), mesh),
        "kv heads": lambda: parallelize(model(n_kv_heads=2), mesh),
        "ffn": lambda: parallelize(model(ffn_hidden=100), mesh),
        "no tp dim": lambda: parallelize(model(), as_mesh(group=None, dim="dp")),
        "mesh size": lambda: parallelize(model(), Mesh(tp=t - 1)),
        "seed per rank": lambda: parallelize(TinyGPT(GPTConfig(**base), seed=rank), mesh),
        "sequence": sp_forward,
        "row input": row_given_whole_input,
        "twice": twice,
        "not a comm": lambda: ColumnParallelLinear(torch.nn.Linear(6, 6), None),
        "own layer": own_layer_per_rank,
        "own shape": own_shape_per_rank,
        "uneven gather": lambda: ColumnParallelLinear(same_layer(), Comm(), rows=(0, 5 if rank == 0 else 1),
                                                      gather_output=True),
        "copies": lambda: ColumnParallelLinear(same_layer(), Comm(), copies=2),
        "cols": lambda: RowParallelLinear(same_layer(), Comm(), cols=(4, 9)),
        "dropout p": lambda: TensorParallelDropout(1.5),
        "target": vocab_target_out_of_range,
        "vocab size": vocab_too_small,
        "vocab group": vocab_group,
    }
    out = {}
    for name, case in cases.items():
        try:
            case()
            out[name] = None
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def test_bad_input_is_a_clear_error_on_every_rank_not_a_hang():
    expected = {"heads": "n_heads=4 is not divisible by tp=3", "kv heads": "n_kv_heads=2",
                "ffn": "MLP width 100 is not divisible by tp=3", "no tp dim": "'tp' dimension",
                "mesh size": "world size", "seed per rank": "different models",
                "sequence": "does not split evenly", "row input": "input features",
                "twice": "already tensor-parallel", "not a comm": "TypeError",
                "own layer": "ranks [1, 2] differ from rank 0's Linear", "uneven gather": "equal slices",
                "own shape": "rank 2's 'weight' has shape (9, 6), rank 0's 'weight' has shape (6, 6)",
                "copies": "copies=2 must be a positive int dividing", "cols": "cols [4, 9)",
                "dropout p": "between 0 and 1", "target": "1 target(s) are not (they range from 1 to 7)",
                "vocab size": "2 rows cannot be split over 3 ranks", "vocab group": "TypeError: pass the"}
    for rank, out in enumerate(launch(_bad_inputs, 3, timeout=60)):
        for name, fragment in expected.items():
            assert out[name] is not None and fragment in out[name], (rank, name, out[name])


# ----------------------------------------------------------------------------- the layers alone


def _layers_alone():
    """Megatron's MLP from two nn.Linear (GeLU between), the gathered column output, the
    vocabulary-parallel loss (uneven vocabulary, ignored targets) with its gradient."""
    import torch.distributed as dist

    from course_lib.collectives.comm import Comm
    from course_lib.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from course_lib.parallel.vocab_parallel import shard_range, vocab_parallel_cross_entropy

    comm, g = Comm(dim="tp"), torch.Generator().manual_seed(0)
    torch.manual_seed(dist.get_rank())
    fc, proj = torch.nn.Linear(8, 12).double(), torch.nn.Linear(12, 8).double()
    with torch.no_grad():
        for p in (*fc.parameters(), *proj.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))                  # the same layers on every rank
    x = torch.randn(3, 5, 8, generator=g).double()
    col, row = ColumnParallelLinear(fc, comm), RowParallelLinear(proj, comm)
    xin = x.clone().requires_grad_()
    y = row(F.gelu(col(xin)))
    y.square().sum().backward()
    whole = ColumnParallelLinear(fc, comm, gather_output=True)(x)
    logits = torch.randn(3, 5, 10, generator=g)                         # V = 10 over 3 ranks: 4, 3, 3
    targets = torch.randint(0, 10, (3, 5), generator=g)
    targets[0, :2] = -100
    start, stop = shard_range(10, comm.size, comm.rank)
    mine = logits[..., start:stop].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, targets, comm, start)
    loss.backward()
    return y.detach(), xin.grad, col.weight.grad, row.weight.grad, whole, loss.detach(), mine.grad, (start, stop)


def test_megatron_mlp_and_vocab_parallel_loss_equal_one_device():
    results = launch(_layers_alone, 3, timeout=60)
    g = torch.Generator().manual_seed(0)
    fc, proj = torch.nn.Linear(8, 12).double(), torch.nn.Linear(12, 8).double()
    with torch.no_grad():
        for p in (*fc.parameters(), *proj.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(3, 5, 8, generator=g).double().requires_grad_()
    y = proj(F.gelu(fc(x)))
    y.square().sum().backward()
    logits = torch.randn(3, 5, 10, generator=g).requires_grad_()
    targets = torch.randint(0, 10, (3, 5), generator=g)
    targets[0, :2] = -100
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())   # mean over the 13 counted tokens
    loss.backward()
    for r, (yr, gx, gfc, gproj, whole, lr, glog, (a, b)) in enumerate(results):
        tolerance.assert_matches(yr, y.detach())                                   # g: the whole output
        tolerance.assert_matches(gx, x.grad)                                       # f: the whole gradient
        tolerance.assert_matches(gfc, fc.weight.grad[4 * r:4 * r + 4])             # my rows
        tolerance.assert_matches(gproj, proj.weight.grad[:, 4 * r:4 * r + 4])      # my columns
        tolerance.assert_matches(whole, fc(x).detach())                            # gathered: all of Y
        tolerance.assert_matches(lr, loss.detach())
        tolerance.assert_matches(glog, logits.grad[..., a:b])


def _torch_conventions():
    """A sequence-parallel row layer alone (its bias added to s/t tokens), summed by GradSync;
    the loss with every target ignored, with another ignore_index; dropout with p = 1."""
    import torch.distributed as dist

    from course_lib.collectives.comm import Comm
    from course_lib.parallel.grad_sync import GradSync
    from course_lib.parallel.mesh import Mesh, get_reduce_dims
    from course_lib.parallel.tensor_parallel import RowParallelLinear, TensorParallelDropout
    from course_lib.parallel.vocab_parallel import shard_range, vocab_parallel_cross_entropy

    t, r = dist.get_world_size(), dist.get_rank()
    comm, mesh, g = Comm(dim="tp"), Mesh(tp=t), torch.Generator().manual_seed(0)
    proj = torch.nn.Linear(4 * t, 5).double()
    with torch.no_grad():
        for p in proj.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(2, 2 * t, 4 * t, generator=g).double()            # (b, s, in): s splits over t
    row = RowParallelLinear(proj, comm, output="reduce_scatter")
    row(x[..., 4 * r:4 * r + 4]).square().sum().backward()              # my tokens' share of the loss
    marked = get_reduce_dims(row.bias, ())
    GradSync(row, mesh, divisor=1).finish()                             # sums what is marked over tp
    logits = torch.randn(6, 10, generator=g)
    a, b = shard_range(10, t, r)
    all_ignored = vocab_parallel_cross_entropy(logits[:, a:b], torch.full((6,), -100), comm, a)
    targets = torch.tensor([3, 0, 9, 3, 5, 0])
    mine = logits[:, a:b].clone().requires_grad_()
    other_ignore = vocab_parallel_cross_entropy(mine, targets, comm, a, ignore_index=0)
    other_ignore.backward()
    dropped = TensorParallelDropout(1.0, torch.Generator().manual_seed(0))(torch.ones(5))
    return marked, row.bias.grad, row.weight.grad, all_ignored, other_ignore.detach(), mine.grad, (a, b), dropped


def test_sequence_parallel_bias_loss_and_dropout_follow_torch():
    g = torch.Generator().manual_seed(0)
    t = 3
    proj = torch.nn.Linear(4 * t, 5).double()
    with torch.no_grad():
        for p in proj.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(2, 2 * t, 4 * t, generator=g).double()
    proj(x).square().sum().backward()
    logits = torch.randn(6, 10, generator=g).requires_grad_()
    targets = torch.tensor([3, 0, 9, 3, 5, 0])
    loss = F.cross_entropy(logits, targets, ignore_index=0)
    loss.backward()
    assert torch.isnan(F.cross_entropy(logits, torch.full((6,), -100)))          # torch's mean over no token
    for r, (marked, gb, gw, all_ignored, lr, glog, (a, b), dropped) in enumerate(launch(_torch_conventions, t)):
        assert marked == ("dp", "tp")
        tolerance.assert_matches(gb, proj.bias.grad)                   # the whole bias gradient, every rank
        tolerance.assert_matches(gw, proj.weight.grad[:, 4 * r:4 * r + 4])
        assert torch.isnan(all_ignored), all_ignored
        tolerance.assert_matches(lr, loss.detach())
        tolerance.assert_matches(glog, logits.grad[:, a:b])
        assert torch.equal(dropped, torch.zeros(5))


# ----------------------------------------------------------------------------- with data parallelism


def _dp_tp_train(cfg):
    """Mesh(dp=2, tp=2): each data-parallel replica a TP pair on half the batch; GradSync sums
    every gradient over its reduce dims (dp; the SP marks over dp and tp). Without and with SP."""
    from course_lib.parallel.grad_sync import GradSync
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.tp_plan import local_shards, parallelize

    mesh, out = Mesh(dp=2, tp=2), {}
    mine = slice(mesh.coord["dp"] * BATCH // 2, (mesh.coord["dp"] + 1) * BATCH // 2)
    for sp in (False, True):
        model = parallelize(TinyGPT(cfg, seed=0).double(), mesh, sequence_parallel=sp)
        sync = GradSync(model.parameters(), mesh, divisor=1)  # the loss is over the global token count
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        losses = []
        for x, y in gpt_batches(cfg, batch=BATCH, steps=STEPS):
            _, loss = model(x[mine], y[mine], n_tokens=y.numel())
            loss.backward()
            sync.start()
            sync.finish()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[sp] = (losses, local_shards(model))
    return out


@pytest.fixture(scope="module")
def dp_tp_runs():
    return launch(_dp_tp_train, 4, CONFIGS[2][0], timeout=120)


@pytest.mark.parametrize("sp", [False, True], ids=["dp2xtp2", "dp2xtp2+sp"])
def test_composes_with_data_parallel_grad_sync(dp_tp_runs, sp):
    results = [r[sp] for r in dp_tp_runs]
    ref_losses, _, ref_params = reference(2, 0)
    for dp in (0, 1):                                           # ranks (0, 1) and (2, 3): one replica each
        full = assemble([r[1] for r in results[2 * dp:2 * dp + 2]])
        tolerance.assert_matches({n: full[n] for n in ref_params}, ref_params, optimizer="adamw", steps=STEPS, lr=LR)
    total = [results[0][0][k] + results[2][0][k] for k in range(STEPS)]   # the replicas' shares of the loss
    tolerance.assert_matches(total, ref_losses, optimizer="adamw", steps=STEPS, lr=LR, what="losses")
