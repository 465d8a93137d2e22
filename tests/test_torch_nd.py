"""Torch's own 2-D composition (course_lib/parallel/torch_nd.py: init_device_mesh +
parallelize_module on mesh["tp"] + fully_shard / replicate on mesh["dp"]) next to ours
(compose.parallelize_nd on Mesh(dp=2, tp=2)): 5 AdamW steps of the same tiny GPT on 4 ranks
give the single-device losses and final parameters (float64, course_lib.tolerance's AdamW
bound), torch's first gradients
are the single-device ones (sums over dp, not averages); bad layouts are a
ValueError on every rank."""
import functools

import pytest
import torch

from course_lib import launch, tolerance
from course_lib.models import GPTConfig, TinyGPT
from course_lib.parallel.compose import assemble_nd
from course_lib.parallel.mesh import MeshShape
from course_lib.reference import gpt_batches, train_gpt

STEPS, BATCH, LR = 5, 8, 1e-3
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=4, n_kv_heads=2)
# (implementation, data, sequence parallel): torch's FSDP with and without SP, torch's
# replicate (DDP on FSDP2's machinery) with SP, ours FSDP with SP
VARIANTS = [("torch", "fsdp", False), ("torch", "fsdp", True), ("torch", "ddp", True), ("ours", "fsdp", True)]


def _train(cfg, batches, variants):
    """On each rank: every variant trained STEPS AdamW steps in float64 from the same model;
    (losses, final parameters: torch's whole (full_tensor), ours this rank's shards)."""
    from torch.distributed.tensor import DTensor

    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.torch_nd import torch_parallelize_2d, torch_step

    def full(t):  # a DTensor (its shards over dp and tp) -> the whole tensor
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {}
    for impl, data, sp in variants:
        model = TinyGPT(cfg, seed=0).double()
        if impl == "torch":
            net = torch_parallelize_2d(model, 2, 2, sequence_parallel=sp, fsdp=data == "fsdp")
            params, step = net.parameters(), functools.partial(torch_step, net)
        else:
            net = parallelize_nd(model, Mesh(dp=2, tp=2), data=data, sequence_parallel=sp)
            params, step = net.parameters(), net.step
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
        losses, grads = [], None
        for x, y in batches:
            losses.append(step(x, y))
            if grads is None and impl == "torch":   # AdamW hides a gradient's scale: check the sum itself
                grads = {n: full(p.grad) for n, p in net.named_parameters()}
            opt.step()
            opt.zero_grad()
        if impl == "torch":
            final = {n: full(p) for n, p in net.named_parameters()}
        else:
            final = net.shards()
        out[(impl, data, sp)] = (losses, final, grads)
    try:                                  # 2 x 3 on 4 ranks: the same ValueError on every rank, no hang
        torch_parallelize_2d(TinyGPT(cfg, seed=0), 2, 3)
        out["error"] = None
    except ValueError as exc:
        out["error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs():
    batches = gpt_batches(CFG, batch=BATCH, steps=STEPS)
    ref = TinyGPT(CFG, seed=0).double()
    state, losses = train_gpt(ref, batches, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1))
    first = TinyGPT(CFG, seed=0).double()          # the first step's single-device gradients
    x, y = batches[0]
    first(x, y, n_tokens=y.numel())[1].backward()
    grads = {n: p.grad for n, p in first.named_parameters()}
    return state, losses, grads, launch(_train, 4, CFG, batches, VARIANTS, threads=1, timeout=120, quiet=True)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_same_losses_and_parameters_as_one_device(runs, variant):
    state, ref_losses, _, results = runs
    losses, final, _ = results[0][variant]
    for rank in results:   # the loss is the whole step's, on every rank
        tolerance.assert_matches(rank[variant][0], losses, what="losses across ranks")
    tolerance.assert_matches(losses, ref_losses, optimizer="adamw", steps=STEPS, lr=LR, what="losses")
    if variant[0] == "ours":
        final = assemble_nd([r[variant][1] for r in results], MeshShape(dp=2, tp=2))
    assert set(final) == set(state)
    tolerance.assert_matches(final, state, optimizer="adamw", steps=STEPS, lr=LR)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v[0] == "torch"], ids=lambda v: "-".join(map(str, v)))
def test_torch_gradients_are_the_sums_not_the_averages(runs, variant):
    """fully_shard / replicate average over dp unless told otherwise (torch_nd.sum_gradients):
    the first step's gradients are the single-device ones, not half of them."""
    _, _, ref_grads, results = runs
    grads = results[0][variant][2]
    tolerance.assert_matches({n: grads[n] for n in ref_grads}, ref_grads, what="step 1's gradients")


def test_bad_layout_is_a_value_error_on_every_rank(runs):
    for rank in runs[3]:
        assert rank["error"] is not None and "world size is 4" in rank["error"]
