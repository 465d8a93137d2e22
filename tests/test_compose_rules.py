"""check_layout (course_lib/parallel/layout_rules.py) accepts exactly what the ranks run.

The property, over 500 random layouts (odd sizes, GQA, MoE, tied, every schedule and torch's
names, v, Ulysses, FSDP, batches): every layout check_layout accepts passes every check the
ranks' own code makes (the same functions, called per rank coordinate as each rank calls them,
without starting ranks); every layout a rank's code refuses, check_layout refuses first; and
what check_layout refuses that no rank check catches is one of the documented "not supported
here" rules (layouts the ranks would run, but not equal to one device). Then a few layouts on
real ranks: accepted ones train equal to one device, the two that used to slip through the
check are refused on every rank with the check's message, before any step.
"""
import dataclasses
import random
import types

import pytest
import torch

from course_lib import launch, reference, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.launch import RankError
from course_lib.parallel import check_layout
from course_lib.parallel.context_parallel import context_parallel, shard_positions
from course_lib.parallel.expert_parallel import ExpertParallelMoE
from course_lib.parallel.layout_rules import rule_batch, ulysses_heads
from course_lib.parallel.mesh import MeshShape
from course_lib.parallel.pipeline import GPTStage
from course_lib.parallel.tensor_parallel import head_rows
from course_lib.parallel.tp_plan import PLAN, _check as tp_check
from course_lib.schedules import make_schedule

# refused by policy: the ranks would run these, but not as one device does
POLICY = ("not tensor-parallel here", "keep cp=1 with experts", "no attention dropout", "has none",
          "does not run under FSDP", "untie it or use data='ddp'")


def _random_layout(rng):
    heads = rng.choice([2, 3, 4, 6, 8])
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    gpt2 = rng.random() < 0.2
    cfg = GPTConfig(vocab_size=rng.choice([3, 33, 33]), seq_len=rng.choice([6, 8, 12, 16]),
                    n_layers=rng.randint(1, 5), hidden=heads * rng.choice([2, 4]), n_heads=heads,
                    n_kv_heads=kv, ffn_hidden=rng.choice([12, 16, 18]), tie_embeddings=rng.random() < 0.4,
                    block="gpt2" if gpt2 else "llama", dropout=0.1 if gpt2 and rng.random() < 0.5 else 0.0,
                    n_experts=rng.choice([0, 0, 0, 0, 2, 3, 4]), top_k=1)
    dims = {d: rng.choice([1, 1, 1, 2, 2, 3, 4]) for d in ("dp", "pp", "cp", "tp")}
    dims["ep"] = rng.choice([e for e in (1, 2, 3) if dims["dp"] % e == 0])
    kw = dict(microbatches=rng.choice([1, 2, 2, 3, 4]), v=rng.choice([1, 1, 1, 2, 3]),
              schedule=rng.choice(["gpipe", "1f1b", "1f1b", "interleaved", "zb-h1", "Interleaved1F1B", "GPipe"]),
              sequence_parallel=rng.random() < 0.5, cp_method=rng.choice(["ring", "ulysses"]),
              cp_layout=rng.choice(["zigzag", "contiguous"]), data=rng.choice(["ddp", "fsdp"]))
    return cfg, dims, kw, rng.choice([None, None, 12, 6])


def _ranks_refuse(cfg, dims, kw, batch):
    """The first ValueError the ranks' own code raises for this layout (None: they run it),
    calling each check as parallelize_nd's steps do on every rank coordinate."""
    ns = types.SimpleNamespace
    try:
        shape = MeshShape(**dims)                                               # Mesh
        make_schedule(kw["schedule"], dims["pp"], kw["microbatches"], kw["v"])  # PipelineRuntime
        model = TinyGPT(cfg, seed=0)
        n = dims["pp"] * kw["v"]
        stages = [GPTStage(model, 0, n)]                   # split_stages (the layer split of all n)
        t, c = dims["tp"], dims["cp"]
        sp = kw["sequence_parallel"] and t > 1
        for r in range(t if t > 1 else 0):                                      # apply_tp: tp_plan's check
            tp_check(model, PLAN, ns(size=t, rank=r), sp)
        if c > 1:                                                               # apply_cp
            context_parallel(TinyGPT(cfg, seed=0), ns(size=c), kw["cp_method"], kw["cp_layout"])
            for r in range(c):
                shard_positions(cfg.seq_len, c, r, kw["cp_layout"])
            for r in range(t) if kw["cp_method"] == "ulysses" else ():           # each rank's local heads
                (q0, q1), (k0, k1), _ = head_rows(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, t, r)
                ulysses_heads((q1 - q0) // cfg.head_dim, (k1 - k0) // cfg.head_dim, c)
        if sp and (cfg.seq_len // c) % t:                                       # SP's scatter along s
            raise ValueError("sequence parallelism: tokens do not split over tp")
        for block in stages[0].part.blocks if dims["ep"] > 1 else ():          # apply_ep
            if hasattr(block.mlp, "moe"):
                try:
                    ExpertParallelMoE(block.mlp.moe, ns(size=lambda d: dims["ep"]))
                except AttributeError:       # past its check, at mesh.comm: the fake mesh has none
                    pass
        if batch is not None:
            rule_batch(batch, shape.sizes["dp"], kw["microbatches"])           # NDParallel.local_batch
    except ValueError as e:
        return str(e)
    return None


def test_check_layout_accepts_exactly_what_the_ranks_run():
    rng, seen = random.Random(0), {"accepted": 0, "both refuse": 0, "policy": 0}
    for _ in range(500):
        cfg, dims, kw, batch = _random_layout(rng)
        try:
            check_layout(cfg, **dims, **kw, batch=batch)
            verdict = None
        except ValueError as e:
            verdict = str(e)
        ranks = _ranks_refuse(cfg, dims, kw, batch)
        case = (cfg, dims, kw, batch)
        if verdict is None:
            assert ranks is None, f"check_layout accepts, a rank refuses: {ranks}\n{case}"
            seen["accepted"] += 1
        elif ranks is not None:
            seen["both refuse"] += 1
        else:
            assert any(p in verdict for p in POLICY), f"refused, but the ranks run it: {verdict}\n{case}"
            seen["policy"] += 1
    assert min(seen.values()) >= 30, seen          # every branch exercised, not a vacuous pass


# ---------------------------------------------------------------- a few layouts on real ranks
SMALL = GPTConfig(vocab_size=33, seq_len=12, n_layers=3, hidden=24, n_heads=6, n_kv_heads=3, ffn_hidden=18)
MISSED = [  # accepted by check_layout before: the ranks then failed inside step(), or trained apart
    (dataclasses.replace(SMALL, n_kv_heads=3), dict(cp=2), dict(cp_method="ulysses", cp_layout="contiguous")),
    (dataclasses.replace(SMALL, tie_embeddings=True), dict(dp=2), dict(schedule="interleaved", v=2, data="fsdp",
                                                                          microbatches=2)),
    (SMALL, dict(pp=2), dict(schedule="1f1b", v=2, microbatches=2)),
]
RUNS = [(SMALL, dict(dp=1, tp=3), dict(microbatches=2)),
        (dataclasses.replace(SMALL, tie_embeddings=True, n_kv_heads=6), dict(pp=2, cp=2),
         dict(schedule="zb-h1", microbatches=3, cp_method="ulysses"))]


def _train(cfg, dims, kw, batch, dtype=torch.float32, steps=2):
    from course_lib.parallel import Mesh, parallelize_nd
    net = parallelize_nd(TinyGPT(cfg, seed=0).to(dtype), Mesh(**dims), **kw)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    losses = []
    for x, y in reference.gpt_batches(cfg, batch=batch, steps=steps):
        losses.append(net.step(x, y))
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("cfg,dims,kw", MISSED)
def test_formerly_missed_layouts_refused_by_the_check_and_on_every_rank(cfg, dims, kw):
    with pytest.raises(ValueError) as before:
        check_layout(cfg, **dims, **kw)
    with pytest.raises(RankError) as on_ranks:
        launch(_train, MeshShape(**dims).world_size, cfg, dims, kw, 6, quiet=True, timeout=60)
    assert on_ranks.value.exc_type == "ValueError" and str(before.value) in str(on_ranks.value)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("cfg,dims,kw", RUNS)
def test_accepted_layouts_train_as_one_device_in_fp64_and_bf16(cfg, dims, kw, dtype):
    """Pipelines hand on activations in the model's dtype: fp64 equal to one device's fp64 over
    two SGD steps, bf16 to one device's bf16 within bf16's bound."""
    batch = 6
    check_layout(cfg, **dims, **kw, batch=batch)
    ref = TinyGPT(cfg, seed=0).to(dtype)
    _, want = reference.train_gpt(ref, reference.gpt_batches(cfg, batch=batch, steps=2),
                                  torch.optim.SGD(ref.parameters(), lr=0.5), micro=kw["microbatches"])
    for got in launch(_train, MeshShape(**dims).world_size, cfg, dims, kw, batch, dtype, threads=1):
        tolerance.assert_matches(got[:1], want[:1], dtype=dtype, what="first step's loss")
        tolerance.assert_matches(got, want, dtype=dtype, optimizer="sgd", steps=1, lr=0.5, grad_scale=1.0,
                                 what="losses")


def _named_grads(cfg):
    from course_lib.parallel import Mesh, parallelize_nd
    net = parallelize_nd(TinyGPT(cfg, seed=0).double(), Mesh(dp=2, pp=2), microbatches=2)
    x, y = reference.gpt_batches(cfg, batch=4, steps=1)[0]
    net.step(x, y)
    return {name: q.grad for name, q in net.named_parameters().items()}


def test_gradients_by_single_device_name():
    """NDParallel.named_parameters(): this rank's parameters under the single-device names, their
    .grad the summed gradient (fp64: equal to one device's first step within tolerance's bound)."""
    cfg = dataclasses.replace(SMALL, tie_embeddings=True, n_layers=2)
    model = TinyGPT(cfg, seed=0).double()
    x, y = reference.gpt_batches(cfg, batch=4, steps=1)[0]
    model(x, y, n_tokens=y.numel())[1].backward()
    want = {name: q.grad for name, q in model.named_parameters()}
    want["lm_head.weight"] = want["tok_emb.weight"]          # tied: the last stage's copy, summed
    per_rank = launch(_named_grads, 4, cfg, threads=1)
    assert set().union(*per_rank) == set(want)
    for got in per_rank:
        tolerance.assert_matches(got, {n: want[n] for n in got}, dtype=torch.float64, what="gradients")


def _validations_on_the_nd_path(cfg, schedule):
    from unittest import mock

    from course_lib import schedules
    from course_lib.parallel import Mesh, parallelize_nd
    with mock.patch.object(schedules, "simulate", wraps=schedules.simulate) as simulate:
        net = parallelize_nd(TinyGPT(cfg, seed=0), Mesh(pp=2), microbatches=2, schedule=schedule)
        net.step(*reference.gpt_batches(cfg, batch=2, steps=1)[0])
    return simulate.call_count, net.schedule == schedule


def test_an_action_list_is_validated_once_on_every_rank():
    """parallelize_nd checks a list schedule once (one simulation of its ranks): check_layout and
    the runner take what it validated as is."""
    sched = make_schedule("1f1b", 2, 2)
    assert launch(_validations_on_the_nd_path, 2, SMALL, sched, threads=1) == [(1, True)] * 2
