"""Random layouts against one device: the check an outside reviewer runs on the course.

    python -m course_lib.lab.random_layouts --seed 3 --cases 30

draws ``cases`` layouts with a fixed seed: world sizes 2 to 8 (odd ones included), every
dimension (dp, tp, pp, cp, and for an MoE model ep x etp folded over the stage), every
schedule (GPipe, 1F1B, interleaved v = 2 or 3, ZB-H1, ZB-V, DualPipeV), DDP / FSDP / HSDP /
ZeRO++'s hpZ, sequence parallelism and async TP, ring or Ulysses CP with either split,
recompute policies, rank orders (``Mesh(order=...)``, two thirds of the layouts), both expert fold
orders (DP first, TP first as Megatron-Core folds: ``fold_order``, half the MoE layouts), odd layer
counts, GQA, tied embeddings, token dropping, both MoE dispatches and both expert MLPs (GeLU,
SwiGLU). Layouts that :func:`check_layout` refuses
are drawn again (the refusal is the right answer for them); every accepted one trains 3 AdamW
steps in float64 on ranks (one launch per world size) and must equal the single-device run within
:mod:`course_lib.tolerance`'s bounds: the losses on every rank and the assembled weights.

Found by it so far: zero-bubble's split backward left expert TP's w2 without a gradient;
HSDP with folded experts failed inside the ranks instead of in ``check_layout``.
"""
from __future__ import annotations

import argparse
import random
import time
import traceback

import torch

from course_lib import reference, tolerance
from course_lib.gpt import GPTConfig
from course_lib.lab.nd_runs import LR, single_device
from course_lib.launch import launch
from course_lib.layout import FOLDS, MESH_ORDER
from course_lib.parallel.compose import assemble_nd, check_layout
from course_lib.parallel.mesh import MeshShape

STEPS = 3
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v")


def _split(rng, world) -> dict:
    """dp x tp x pp x cp = world, each a random divisor of what is left (dp takes the rest)."""
    dims, rest = {}, world
    for d in rng.sample(["dp", "tp", "pp", "cp"], 4):
        k = rng.choice([k for k in range(1, rest + 1) if rest % k == 0])
        dims[d], rest = k, rest // k
    dims["dp"] *= rest
    return dims


def _model(rng) -> dict:
    heads = rng.choice([2, 3, 4, 6])
    hidden = heads * rng.choice([4, 8])
    return dict(vocab_size=rng.choice([48, 60, 64, 66]), seq_len=rng.choice([12, 16, 24]),
                n_layers=rng.choice([2, 3, 4, 5, 6]), hidden=hidden, n_heads=heads,
                n_kv_heads=rng.choice([k for k in (1, 2, 3, heads) if heads % k == 0]),
                block=rng.choice(["gpt2", "llama"]), tie_embeddings=rng.random() < 0.3)


def _experts(rng, cfg, dims, mlp_rng) -> None:
    """An MoE model: experts, routing, dispatch, and an expert mesh (ep x etp) that tiles the stage;
    the experts' MLP from ``mlp_rng`` (a stream of its own: the layouts drawn before it came stay)."""
    cfg.update(n_experts=rng.choice([2, 4, 6, 8]), ffn_hidden=cfg["hidden"], n_shared_experts=rng.choice([0, 0, 1]),
               capacity_factor=rng.choice([None, 0.75, 1.0, 1.5]), moe_dispatch=rng.choice(["all_to_all", "all_gather"]))
    cfg["top_k"] = min(rng.choice([1, 2, 3]), cfg["n_experts"])
    cfg["expert_mlp"] = mlp_rng.choice(["gelu", "swiglu"])      # GPT-2's experts or Mixtral's
    stage = dims["dp"] * dims["cp"] * dims["tp"]
    dims["ep"], dims["etp"] = rng.choice([(e, t) for e in range(1, stage + 1) for t in range(1, stage + 1)
                                          if stage % (e * t) == 0 and cfg["n_experts"] % e == 0])


def _options(rng, dims) -> dict:
    kw = {"microbatches": rng.choice([1, 2, 3, 4]) if dims["pp"] > 1 else rng.choice([1, 1, 2])}
    if dims["pp"] > 1:
        kw["schedule"] = rng.choice(SCHEDULES)
        if kw["schedule"] == "interleaved":
            kw["v"] = rng.choice([2, 3])
        if kw["schedule"] == "dualpipe-v":      # needs m >= 2p
            kw["microbatches"] = 2 * dims["pp"] + rng.choice([0, 1])
    if dims["tp"] > 1 and rng.random() < 0.5:
        kw["sequence_parallel"] = True
        kw["async_tp"] = rng.random() < 0.5
    if dims["cp"] > 1:
        kw["cp_method"], kw["cp_balance"] = rng.choice(["ring", "ulysses"]), rng.choice(["zigzag", "contiguous"])
    if kw.get("schedule") in ("zb-h1", "zb-v", "dualpipe-v"):
        return kw               # split weight gradients: DDP, no recompute (check_layout's rule)
    data = rng.choice(["ddp", "ddp", "fsdp", "hsdp"])
    if data == "hsdp":
        kw.update(data="hsdp", shard_size=rng.choice([s for s in range(1, dims["dp"] + 1) if dims["dp"] % s == 0]))
    elif data == "fsdp":
        kw["data"] = "fsdp"
        if rng.random() < 0.5:
            kw["zeropp"] = ("hpz",)      # (qwZ and qgZ quantize: equal only within their own bound)
    kw["recompute"] = rng.choice(["none", "none", "full", "selective"])
    return kw


def _order(rng):
    """The ranks' order: the course's (None) a third of the time, else the four dims in any order."""
    order = tuple(rng.sample(MESH_ORDER, len(MESH_ORDER)))
    return None if rng.random() < 1 / 3 or order == MESH_ORDER else order


def draw(n: int, seed: int, worlds=(2, 3, 4, 4, 5, 6, 6, 8)) -> list:
    """``n`` layouts check_layout accepts: (world, name, cfg dict, mesh dims, parallelize_nd keywords, batch)."""
    rng, out, tried = random.Random(seed), [], 0
    mlp_rng = random.Random(f"expert mlp {seed}")
    order_rng = random.Random(f"rank order {seed}")    # (its own stream too: the same layouts)
    fold_rng = random.Random(f"fold order {seed}")     # (and the experts' fold order)
    while len(out) < n:
        tried += 1
        world = rng.choice(worlds)
        dims, cfg = _split(rng, world), _model(rng)
        if rng.random() < 0.4:
            _experts(rng, cfg, dims, mlp_rng)
        kw = _options(rng, dims)
        batch = dims["dp"] * kw["microbatches"] * rng.choice([1, 2])
        dims = {k: v for k, v in dims.items() if v != 1}
        order = _order(order_rng)
        if order is not None:
            dims["order"] = order
        if dims.get("ep", 1) * dims.get("etp", 1) > 1:
            fold = fold_rng.choice(sorted(FOLDS))
            if fold != "dp_first":
                dims["fold_order"] = fold
        try:
            check_layout(GPTConfig(**cfg), **dims, batch=batch, **kw)
        except ValueError:
            continue
        out.append((world, f"seed{seed}-{tried}", cfg, dims, kw, batch))
    return out


def _train(cases):
    """Rank body: each case's losses and this rank's shards, or the error it raised."""
    from course_lib.gpt import TinyGPT
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    out = {}
    for name, (cfg, dims, kw, batch) in cases.items():
        try:
            cfg = GPTConfig(**cfg)
            net = parallelize_nd(TinyGPT(cfg, seed=0).double(), Mesh(**dims), **kw)
            opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
            losses = reference.train_parallel(net, reference.gpt_batches(cfg, batch=batch, steps=STEPS), opt)
            out[name] = (losses, net.shards())
        except Exception as e:  # noqa: BLE001  (reported per case; the other cases go on)
            out[name] = (None, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}")
    return out


def check(drawn, timeout: float = 600) -> list:
    """Run the drawn layouts (one launch per world size); [(name, None or what went wrong)]."""
    by_world = {}
    for world, name, cfg, dims, kw, batch in drawn:
        by_world.setdefault(world, {})[name] = (cfg, dims, kw, batch)
    results = []
    for world, cases in sorted(by_world.items()):
        ranks = launch(_train, world, cases, threads=1, timeout=timeout, quiet=True)
        for name, (cfg, dims, kw, batch) in cases.items():
            losses, shards = ranks[0][name]
            if losses is None:
                results.append((name, shards))
                continue
            cfg = GPTConfig(**cfg)
            ref = single_device(cfg, batch, STEPS, groups=dims.get("dp", 1) * kw.get("microbatches", 1),
                                dtype=torch.float64)
            try:
                for r in ranks:
                    tolerance.assert_matches(r[name][0], ref.losses, optimizer="adamw", steps=STEPS, lr=LR,
                                             what="losses")
                full = assemble_nd([r[name][1] for r in ranks], MeshShape(**dims))
                assert set(full) == set(ref.state), f"parameter names differ: {set(full) ^ set(ref.state)}"
                tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=STEPS, lr=LR, what="weights")
                results.append((name, None))
            except AssertionError as e:
                results.append((name, str(e)[:800]))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cases", type=int, default=20)
    args = p.parse_args(argv)
    drawn = draw(args.cases, args.seed)
    began = time.perf_counter()
    results = dict(check(drawn))
    for world, name, cfg, dims, kw, batch in drawn:
        wrong = results[name]
        print(f"{'ok  ' if wrong is None else 'FAIL'} {name} world {world} {dims} {kw} batch {batch}\n"
              f"     {cfg}" + ("" if wrong is None else f"\n     {wrong}"))
    bad = sum(w is not None for w in results.values())
    print(f"{len(drawn) - bad} of {len(drawn)} layouts equal one device ({time.perf_counter() - began:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
