"""N-D composition (course_lib/parallel/compose.py) against one device.

Each layout trains the tiny GPT 5 AdamW steps from the same weights on the same global
batches as course_lib.reference.train_gpt; every step's loss, the first step's gradients
(DDP layouts; FSDP keeps only gradient shards) and every final parameter (assembled from
the ranks' shards: stages, TP slices, experts, FSDP shards) must match the single-device
run, in float64 within course_lib.tolerance's bounds (in fp32 a correct run may differ by
~lr per step in parameters whose gradient is near zero). The gradients are compared
because AdamW alone would pass a gradient summed twice: it divides every update by the
gradient's own scale. Layouts cover 2D (DP x TP, FSDP x TP), 3D and 4D, odd sizes
(dp=3, tp=3, pp=3), uneven layer splits, a frozen and a tied parameter, every pipeline
schedule, Ulysses, and the MoE variant with EP inside DP. The 16-rank 4D run is chapter 9's
(its notebook is checked by nbval); here the 4D layout runs with dp=1.
"""
import dataclasses

import pytest
import torch

from course_lib import launch, reference, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.lab.nd_runs import LR, single_device
from course_lib.parallel.compose import assemble_nd, check_layout

CFG = GPTConfig(vocab_size=96, seq_len=16, n_layers=4, hidden=32, n_heads=4, n_kv_heads=2)
TIED = dataclasses.replace(CFG, tie_embeddings=True, n_layers=5)          # 5 layers: uneven stages
ODD = GPTConfig(vocab_size=96, seq_len=12, n_layers=3, hidden=48, n_heads=6, n_kv_heads=3, ffn_hidden=96)
MOE = GPTConfig(vocab_size=96, seq_len=16, n_layers=2, hidden=32, n_heads=4, n_experts=4, top_k=2)
STEPS = 5


def _freeze(model, frozen):
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return model


def _run(layout, kw, cfg, batch, frozen):
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    net = parallelize_nd(_freeze(TinyGPT(cfg, seed=0).double(), frozen), Mesh(**layout), **kw)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    losses, grads = [], None
    for x, y in reference.gpt_batches(cfg, batch=batch, steps=STEPS):
        losses.append(net.step(x, y))
        if grads is None and kw.get("data") != "fsdp":
            grads = net.shards(grads=True)  # the first step's, summed over the layout's dims
        opt.step()
        opt.zero_grad()
    if kw.get("data") == "fsdp":            # gradients stay sharded: a full-gradient view is refused by name
        with pytest.raises(ValueError, match="keep each rank's shard only"):
            net.shards(grads=True)
    return losses, net.shards(), grads


CASES = {
    "dp2-tp2-sp": (CFG, dict(dp=2, tp=2), {}, 8, ()),
    "fsdp2-tp2": (CFG, dict(dp=2, tp=2), dict(data="fsdp", sequence_parallel=False), 8, ("blocks.1.mlp_norm.weight",)),
    "dp3-fsdp-gpipe-pp2": (CFG, dict(dp=3, pp=2), dict(data="fsdp", schedule="gpipe", microbatches=2), 12, ()),
    "tp3-odd": (ODD, dict(tp=3), dict(microbatches=2), 6, ()),
    "pp3-tp2-tied-uneven": (TIED, dict(pp=3, tp=2), dict(microbatches=4), 8, ()),
    "dp2-tp2-pp2-1f1b": (CFG, dict(dp=2, tp=2, pp=2), dict(microbatches=2), 8, ("tok_emb.weight",)),
    "pp2-dp2-interleaved-tied": (TIED, dict(dp=2, pp=2), dict(microbatches=2, schedule="interleaved", v=2), 8, ()),
    "pp1-tp2-interleaved-tied": (TIED, dict(tp=2), dict(microbatches=2, schedule="interleaved", v=2), 4, ()),
    "pp2-tp2-zb": (CFG, dict(tp=2, pp=2), dict(microbatches=4, schedule="zb-h1"), 8, ()),
    "tp2-pp2-cp2": (CFG, dict(tp=2, pp=2, cp=2), dict(microbatches=2), 4, ()),
    "dp2-cp2-ulysses": (dataclasses.replace(CFG, n_kv_heads=4), dict(dp=2, cp=2),
                        dict(cp_method="ulysses", cp_layout="contiguous"), 8, ()),
    "moe-dp2-ep2-pp2": (MOE, dict(dp=2, ep=2, pp=2), dict(microbatches=2), 8, ()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_nd_training_equals_one_device(case):
    cfg, layout, kw, batch, frozen = CASES[case]
    shape = check_layout(cfg, **layout, batch=batch, **kw)
    groups = shape.sizes["dp"] * kw.get("microbatches", 1)
    ref = single_device(cfg, batch, STEPS, groups=groups, frozen=frozen, dtype=torch.float64)  # AdamW at LR
    ranks = launch(_run, shape.world_size, layout, kw, cfg, batch, frozen, threads=1)
    for losses, _, _ in ranks:                           # every rank returns the global loss
        tolerance.assert_matches(losses, ref.losses, optimizer="adamw", steps=STEPS, lr=LR, what="losses")
    if kw.get("data") != "fsdp":   # AdamW hides a gradient scaled by a constant: the gradients first
        grads = assemble_nd([g for _, _, g in ranks], shape)
        tolerance.assert_matches(grads, ref.grads, what="the first step's gradients")
    full = assemble_nd([shards for _, shards, _ in ranks], shape)
    assert set(full) == set(ref.state)
    tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=STEPS, lr=LR)
    for name in frozen:
        assert torch.equal(full[name], TinyGPT(cfg, seed=0).double().state_dict()[name]), f"frozen {name} moved"


def _reduce_dims_of_a_4d_run():
    """The dims each gradient is summed over, as the composition marks them (rank 0)."""
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh, get_reduce_dims

    net = parallelize_nd(TinyGPT(CFG, seed=0), Mesh(dp=2, cp=2, tp=2))
    return {name: get_reduce_dims(p) for name, p in net.stages[0].part.named_parameters()}


def test_gradient_sums_follow_the_layout():
    dims = launch(_reduce_dims_of_a_4d_run, 8, threads=1)[0]
    assert dims["blocks.0.attn.wq.weight"] == ("dp", "cp")            # sharded by TP: complete per tp rank
    assert dims["blocks.0.attn_norm.weight"] == ("dp", "cp", "tp")    # SP: each tp rank saw s/tp tokens
    assert dims["tok_emb.weight"] == ("dp", "cp")


def _run_fsdp_without_the_plans_marks(layout, kw, cfg, batch):
    """_run with compose's tensor marks dropped (its ``set_reduce_dims`` a no-op): FSDP must take
    each parameter's dims from the plan (``apply_data_parallel``'s ``reduce``), not from the tensor."""
    from unittest import mock

    with mock.patch("course_lib.parallel.compose.set_reduce_dims"):
        from course_lib.parallel.compose import parallelize_nd
        from course_lib.parallel.mesh import Mesh
        norm = parallelize_nd(TinyGPT(cfg, seed=0), Mesh(**layout), **kw).placements["blocks.0.attn_norm.weight"]
        return _run(layout, kw, cfg, batch, ()), norm


def test_fsdp_takes_each_gradients_dims_from_the_plan():
    """An SP norm weight's gradient is summed over ("dp", "cp", "tp"); its only tensor mark is
    tp_plan's ("dp", "tp"), which FSDP over ("dp", "cp") would refuse: the plan's record wins."""
    layout, kw, batch = dict(dp=2, tp=2), dict(data="fsdp"), 8
    shape = check_layout(CFG, **layout, batch=batch, **kw)
    ref = single_device(CFG, batch, STEPS, groups=2, dtype=torch.float64)
    ranks = launch(_run_fsdp_without_the_plans_marks, shape.world_size, layout, kw, CFG, batch, threads=1)
    for (losses, _, _), norm in ranks:
        tolerance.assert_matches(losses, ref.losses, optimizer="adamw", steps=STEPS, lr=LR, what="losses")
        assert norm.reduce == ("dp", "cp", "tp") and norm.shard == ("dp", "cp"), norm
    full = assemble_nd([shards for (_, shards, _), _ in ranks], shape)
    tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=STEPS, lr=LR)


@pytest.mark.parametrize("cfg,kw,message", [
    (CFG, dict(dp=2, tp=2, world_size=8), "must equal it"),
    (CFG, dict(tp=3), "divisible"),
    (CFG, dict(pp=5), "more pipeline stages"),
    (CFG, dict(cp=3), r"divisible by 2\*CP=6"),
    (CFG, dict(dp=2, batch=6, microbatches=2), "microbatches=2"),
    (CFG, dict(dp=4, batch=6), "divisible by dp=4"),
    (MOE, dict(dp=2, ep=2, tp=2, sequence_parallel=False), "sequence_parallel=True"),
    (CFG, dict(dp=2, ep=2), "has none"),
    (dataclasses.replace(MOE, n_experts=3), dict(dp=2, ep=2), "divisible by ep=2"),
    (CFG, dict(tp=2, cp=2, sequence_parallel=True, cp_layout="contiguous"), None),
    (CFG, dict(pp=2, data="fsdp", schedule="zb-h1", microbatches=2), "zb-h1"),
    (CFG, dict(dp=2, data="zero"), "data must be"),
])
def test_bad_layouts_are_refused_before_any_rank_starts(cfg, kw, message):
    if message is None:     # a valid layout: no error
        check_layout(cfg, **kw)
        return
    with pytest.raises(ValueError, match=message):
        check_layout(cfg, **kw)
