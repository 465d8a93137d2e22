"""check_layout (course_lib/parallel/layout_rules.py) accepts exactly what the ranks run.

The property, over random layouts (odd sizes, GQA, MoE, tied, every schedule and torch's
names, v, Ulysses, FSDP, batches): the ranks build the plan (``parallelize_nd``, whose steps
call their own dimension's rules) and run one step; check_layout accepts a layout exactly when
every rank runs it, and refuses it with the ValueError every rank raises. Keywords and the one
Layout object give the same verdict. Then a few layouts on real ranks: accepted ones train
equal to one device, the two that used to slip through the check are refused on every rank
with the check's message, before any step.
"""
import collections
import dataclasses
import random

import pytest
import torch

from course_lib import launch, reference, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.launch import RankError
from course_lib.layout import Layout
from course_lib.parallel import check_layout
from course_lib.parallel.layout_rules import as_layout
from course_lib.parallel.mesh import MeshShape
from course_lib.schedules import make_schedule


def _random_layout(rng, max_world=None):
    heads = rng.choice([2, 3, 4, 6, 8])
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    gpt2 = rng.random() < 0.2
    cfg = GPTConfig(vocab_size=rng.choice([3, 33, 33]), seq_len=rng.choice([6, 8, 12, 16]),
                    n_layers=rng.randint(1, 5), hidden=heads * rng.choice([2, 4]), n_heads=heads,
                    n_kv_heads=kv, ffn_hidden=rng.choice([12, 16, 18]), tie_embeddings=rng.random() < 0.4,
                    block="gpt2" if gpt2 else "llama", dropout=0.1 if gpt2 and rng.random() < 0.5 else 0.0,
                    n_experts=rng.choice([0, 0, 0, 0, 2, 3, 4]), top_k=1)
    while True:
        dims = {d: rng.choice([1, 1, 1, 2, 2, 3, 4]) for d in ("dp", "pp", "cp", "tp")}
        if max_world is None or MeshShape(**dims).world_size <= max_world:
            break
    dims["ep"] = rng.choice([e for e in (1, 2, 3) if dims["dp"] % e == 0])
    kw = dict(microbatches=rng.choice([1, 2, 2, 3, 4]), v=rng.choice([1, 1, 1, 2, 3]),
              schedule=rng.choice(["gpipe", "1f1b", "1f1b", "interleaved", "zb-h1", "Interleaved1F1B", "GPipe"]),
              sequence_parallel=rng.random() < 0.5, cp_method=rng.choice(["ring", "ulysses"]),
              cp_layout=rng.choice(["zigzag", "contiguous"]), data=rng.choice(["ddp", "fsdp"]))
    return cfg, dims, kw, rng.choice([None, None, 12, 6])


def _verdict(call):
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def test_keywords_and_the_layout_object_get_the_same_verdict():
    """check_layout(cfg, **keywords) and check_layout(cfg, Layout) are one check: the same
    verdict over 500 random layouts, and the Layout built from the keywords is the one the
    ranks' plan builds (as_layout)."""
    rng, seen = random.Random(0), collections.Counter()
    for _ in range(500):
        cfg, dims, kw, batch = _random_layout(rng)
        by_keywords = _verdict(lambda: check_layout(cfg, **dims, **kw, batch=batch))
        layout = Layout.of(**dims, **{**kw, "sequence_parallel": kw["sequence_parallel"]}, overlap_dp=False,
                           batch=batch)
        assert layout == as_layout(dims=dims, batch=batch, **kw)
        assert _verdict(lambda: check_layout(cfg, layout)) == by_keywords, (cfg, dims, kw, batch)
        seen[by_keywords is None] += 1
    assert min(seen.values()) >= 30, seen


def _ranks_run(cases):
    """On every rank: each case's plan built (parallelize_nd) and one step run; None, or the
    ValueError's message, or another exception's (a bug either way)."""
    from course_lib.parallel import Mesh, parallelize_nd
    out = []
    for cfg, dims, kw, batch in cases:
        try:
            net = parallelize_nd(TinyGPT(cfg, seed=0), Mesh(**dims), **kw)
            x, y = reference.gpt_batches(cfg, batch=batch or dims["dp"] * kw["microbatches"], steps=1)[0]
            net.step(x, y)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
        except Exception as e:  # noqa: BLE001 - not a refusal: reported as such
            out.append(f"{type(e).__name__} (not a ValueError): {e}")
    return out


def test_check_layout_accepts_exactly_what_the_ranks_run():
    """The ranks build the plan and step, for random layouts of 1 to 4 ranks (one launch per
    world size): accepted <=> every rank runs it; refused <=> every rank raises the same
    ValueError (each plan step calls its dimension's rules; no copy of the plan here)."""
    rng, by_world = random.Random(1), collections.defaultdict(list)
    while sum(map(len, by_world.values())) < 60:
        case = _random_layout(rng, max_world=4)
        world = MeshShape(**case[1]).world_size
        if len(by_world[world]) < 15:
            by_world[world].append(case)
    seen = collections.Counter()
    for world, cases in sorted(by_world.items()):
        per_rank = launch(_ranks_run, world, cases, threads=1, timeout=600)
        for i, (cfg, dims, kw, batch) in enumerate(cases):
            verdict = _verdict(lambda: check_layout(cfg, **dims, **kw, batch=batch))
            got = {r[i] for r in per_rank}
            assert got == {verdict}, f"check_layout: {verdict}; the ranks: {got}\n{cfg, dims, kw, batch}"
            seen[verdict is None] += 1
    assert min(seen.values()) >= 10, seen          # both sides exercised, not a vacuous pass


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
