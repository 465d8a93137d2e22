"""Activation recomputation (course_lib/recompute.py) in every dimension.

* the policies leave the arithmetic alone: one device, float64, gradients equal to no
  recomputation's (dropout masks drawn again identically); torch.utils.checkpoint alike;
* parallel layouts with recomputation (TP + SP, PP with micro-batches in flight, CP ring and
  Ulysses, FSDP, per-block) train as one device: float64, 3 AdamW steps, tolerance's bound;
* the bytes a rank keeps per block, measured on storages, equal the Llama block's formula
  (course_lib.planner.activations), and the recompute FLOPs counted by torch's FlopCounterMode
  equal ``layer_flops_per_token``;
* an unknown policy is a ValueError naming it, before any rank starts.
"""
import dataclasses

import pytest
import torch

from course_lib import launch, reference, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.lab.nd_runs import LR, single_device
from course_lib.parallel.compose import assemble_nd, check_layout
from course_lib.parallel.mesh import MeshShape
from course_lib.planner.activations import stage_activation_bytes
from course_lib.planner.calibration import model_spec
from course_lib.planner.formulas import in_flight_microbatches, layer_flops_per_token
from course_lib.recompute import POLICIES, every, layer_policies
from course_lib.lab.recompute_runs import (activation_bytes_of_layouts, kept_bytes, pipeline_peaks, recompute_flops,
                                       torch_checkpoint_side_by_side)

CFG = GPTConfig(vocab_size=96, seq_len=16, n_layers=4, hidden=32, n_heads=4, n_kv_heads=2)
SPEC = model_spec(CFG)
STEPS, B = 3, 2
PER_BLOCK = ["full", "selective", "none", "full"]


def _grads(cfg, x, y, seed=None):
    model = TinyGPT(cfg, seed=0).double()
    if seed is not None:
        torch.manual_seed(seed)
    _, loss = model(x, y)
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("cfg", [CFG, GPTConfig(vocab_size=96, seq_len=16, n_layers=2, hidden=32, n_heads=4,
                                                block="gpt2", dropout=0.1)], ids=["llama", "gpt2-dropout"])
def test_policies_leave_the_gradients_alone(cfg):
    x, y = reference.gpt_batches(cfg, batch=4, steps=1)[0]
    want = _grads(cfg, x, y, seed=1)
    for policy in ("selective", "full", every(2, cfg.n_layers), ["none"] * (cfg.n_layers - 1) + ["full"]):
        got = _grads(dataclasses.replace(cfg, recompute=policy), x, y, seed=1)   # the same dropout masks
        tolerance.assert_matches(got, want, dtype=torch.float64, what=f"recompute={policy}")


def test_ours_and_torch_checkpoint_keep_the_block_input_only():
    side = torch_checkpoint_side_by_side(CFG, B)
    sbh = B * CFG.seq_len * CFG.hidden * 4                         # fp32 (b, s, h)
    assert side["ours"]["kept"] == side["torch"]["kept"] == sbh
    assert side["none"]["kept"] == stage_activation_bytes(SPEC, CFG.seq_len, B, ["none"]) * 2   # fp32: 2x bf16
    for who in ("ours", "torch"):
        tolerance.assert_matches(side[who]["grads"], side["none"]["grads"], dtype=torch.float32, what=who)
    fwd, bwd = layer_flops_per_token(CFG, CFG.seq_len, "full")
    assert side["ours"]["backward_flops"] == bwd * B * CFG.seq_len           # the whole forward again
    # torch stops recomputing once every saved tensor is back: w2's forward is not needed
    w2 = 2 * B * CFG.seq_len * CFG.ffn_hidden * CFG.hidden
    assert side["torch"]["backward_flops"] == side["ours"]["backward_flops"] - w2


def test_recompute_flops_equal_the_formula():
    tokens = B * CFG.seq_len
    counted = recompute_flops(CFG, B)
    for policy, (fwd, bwd) in counted.items():
        f, b = layer_flops_per_token(CFG, CFG.seq_len, policy)
        assert (fwd, bwd) == (f * tokens, b * tokens), policy
    assert counted["selective"][1] - counted["none"][1] == 4 * B * CFG.seq_len ** 2 * CFG.hidden  # QK^T, PV


def test_single_device_bytes_equal_the_formula():
    blocks = list(TinyGPT(CFG, seed=0).to(torch.bfloat16).blocks)
    x = torch.randn(B, CFG.seq_len, CFG.hidden)
    for policy in (*POLICIES, every(2, CFG.n_layers)):
        for blk, p in zip(blocks, layer_policies(policy, CFG.n_layers)):
            blk.recompute, blk.attn.recompute = p, ("selective" if p == "selective" else "none")
        want = stage_activation_bytes(SPEC, CFG.seq_len, B, layer_policies(policy, CFG.n_layers))
        assert kept_bytes(blocks, x) == (want, want), policy


LAYOUTS = {  # 4 ranks each
    "tp2-pp2-full": (dict(tp=2, pp=2), dict(microbatches=2, recompute="full")),
    "cp2-tp2-selective": (dict(cp=2, tp=2), dict(recompute="selective")),
    "dp2-cp2-ulysses-selective": (dict(dp=2, cp=2), dict(recompute="selective", cp_method="ulysses",
                                                         cp_layout="contiguous")),
    "dp2-pp2-every-2": (dict(dp=2, pp=2), dict(microbatches=2, recompute=every(2, 4))),
    "fsdp2-tp2-per-block": (dict(dp=2, tp=2), dict(data="fsdp", recompute=PER_BLOCK)),
}


def _train(layouts, batch):
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    out = {}
    for name, (layout, kw) in layouts.items():
        net = parallelize_nd(TinyGPT(CFG, seed=0).double(), Mesh(**layout), **kw)
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
        losses = reference.train_parallel(net, reference.gpt_batches(CFG, batch=batch, steps=STEPS), opt)
        out[name] = (losses, net.shards())
    return out


def test_layouts_with_recomputation_train_as_one_device():
    batch = 4
    for layout, kw in LAYOUTS.values():
        check_layout(CFG, **layout, **kw, batch=batch)
    ref = single_device(CFG, batch, STEPS, dtype=torch.float64)       # no recomputation at all
    ranks = launch(_train, 4, LAYOUTS, batch, threads=1)
    for name, (layout, _) in LAYOUTS.items():
        for losses, _ in (r[name] for r in ranks):
            tolerance.assert_matches(losses, ref.losses, optimizer="adamw", steps=STEPS, lr=LR, what=name)
        full = assemble_nd([r[name][1] for r in ranks], MeshShape(**layout))
        tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=STEPS, lr=LR, what=name)


BYTES_LAYOUTS = {  # 2 ranks each: (mesh, keywords, t, sp, cp, attention keeps lse instead of scores)
    "tp2+sp": (dict(tp=2), dict(sequence_parallel=True)),
    "tp2": (dict(tp=2), dict(sequence_parallel=False)),
    "cp2-ulysses": (dict(cp=2), dict(cp_method="ulysses", cp_layout="contiguous")),
    "cp2-ring": (dict(cp=2), dict(cp_layout="contiguous")),
}


def test_bytes_per_rank_equal_korthikanti_style_formula():
    ranks = launch(activation_bytes_of_layouts, 2, dataclasses.asdict(CFG), BYTES_LAYOUTS, B, threads=1)
    s, h = CFG.seq_len, CFG.hidden
    for name, (layout, kw) in BYTES_LAYOUTS.items():
        t, cp = layout.get("tp", 1), layout.get("cp", 1)
        sp, ring = kw.get("sequence_parallel", True) and t > 1, cp > 1 and kw.get("cp_method", "ring") == "ring"
        for policy in ("none", "selective", "full", "every 2"):
            p = every(2, CFG.n_layers) if policy == "every 2" else policy
            want = stage_activation_bytes(SPEC, s, B, p, t=t, sp=sp, cp=cp, fused_attention=ring)
            kept = [n for n in layer_policies(p, CFG.n_layers) if n != "full"]
            if ring:   # the ring saves its (b, a, s/cp, d) output besides W_o's transposed copy
                want += len(kept) * 2 * B * s // cp * h
            held = want    # alive, not saved: the ring's q and k positions (int64) on its context
            if ring:
                held += len(kept) * 2 * 8 * s // cp
            if name == "cp2-ulysses" and policy == "selective":   # the recomputation holds the gathered positions
                held += len(kept) * 8 * s
            for rank in ranks:   # (storages alive after forward, storages autograd saved)
                assert rank[name][policy] == (held, want), (name, policy, rank[name][policy], want)


def test_pipeline_peak_is_in_flight_microbatches_times_the_stage():
    m, p = 4, 4
    ranks = launch(pipeline_peaks, p, dataclasses.asdict(CFG), dict(pp=p), 2 * m, microbatches=m, threads=1)
    for rank in ranks:
        for policy, got in rank.items():
            if got["first"] or got["last"]:       # embedding ids / head and loss: not a block's
                continue
            want = stage_activation_bytes(SPEC, CFG.seq_len, 2, [policy] * len(got["layers"]))
            assert got["per_microbatch"] == want, policy
            assert got["peak"] == in_flight_microbatches(p, m, "1f1b", stage=got["stage"]) * want, policy


def test_stage_0_holds_L_layers_times_the_interleaving_factor():
    """Korthikanti et al. 2022, Sec. 4.2.3: 1F1B's first stage holds L layers of one micro-batch
    whatever p is; interleaving v chunks multiplies that by 1 + (p - 1) / (p v). The token ids
    the embedding keeps are views of the input batch, left out with count_ids=False."""
    m, one_mb = 4, stage_activation_bytes(SPEC, CFG.seq_len, 2, "none")
    for p, v, kw in ((4, 1, {}), (2, 1, {}), (2, 2, dict(schedule="interleaved", v=2))):
        got = launch(pipeline_peaks, p, dataclasses.asdict(CFG), dict(pp=p), 2 * m, ("none",),
                     microbatches=m, threads=1, count_ids=False, **kw)[0]["none"]
        assert got["stage"] == 0 and got["chunks"] == list(range(0, p * v, p)), got
        factor = 1 + (p - 1) / (p * v) if v > 1 else 1
        assert got["peak"] == factor * one_mb, (p, v, got["peak"], factor * one_mb)
        held = in_flight_microbatches(p, m, "interleaved" if v > 1 else "1f1b", v)
        assert got["peak"] == held * stage_activation_bytes(SPEC, CFG.seq_len, 2, ["none"] * len(got["layers"]))
    counted = launch(pipeline_peaks, 2, dataclasses.asdict(CFG), dict(pp=2), 2 * m, ("none",),
                     microbatches=m, threads=1)[0]["none"]
    assert counted["peak"] > one_mb        # the ids' storage, once per micro-batch in flight


@pytest.mark.parametrize("kw,message", [
    (dict(recompute="most"), "unknown recompute policy 'most'"),
    (dict(recompute=["full", "none"]), "a recompute policy per block: got 2 for 4"),
    (dict(recompute=["full", "none", "x", "none"]), "unknown recompute policy 'x'"),
    (dict(pp=2, microbatches=2, schedule="zb-h1", recompute="full"), "zb-h1"),
])
def test_unknown_policies_are_refused_before_any_rank_starts(kw, message):
    with pytest.raises(ValueError, match=message):
        check_layout(CFG, **kw)


def test_bad_policies_in_the_model_and_helpers():
    with pytest.raises(ValueError, match="unknown recompute policy 'sometimes'"):
        GPTConfig(recompute="sometimes")
    with pytest.raises(ValueError, match="k must be a positive int"):
        every(0, 4)
    with pytest.raises(ValueError, match="unknown recompute policy 'most'"):
        stage_activation_bytes(SPEC, 16, 2, ["most"])
    check_layout(CFG, recompute=every(2, 4), pp=2, microbatches=2)      # valid: no error


def test_chapter_figure_draws_measured_bars_and_planner_ticks():
    from course_lib.viz.memory_precision import memory_and_wire

    rows = [("TP2", "none", 10, 9, 9), ("TP2", "full", 2, 2, 2), ("CP2", "none", 12, 11, 10), ("CP2", "full", 2, 2, 2)]
    fig = memory_and_wire(rows, {("DP2", "dp"): {"full": 8, "bf16": 4}, ("DP2", "tp"): {"full": 6, "bf16": 3}})
    left, right = fig.axes
    assert [round(p.get_height() * 1024) for p in left.patches] == [9, 11, 2, 2]       # saved bytes, by policy
    assert len(left.collections) == 2                                                   # planner ticks per policy
    assert [round(p.get_height() * 1024) for p in right.patches] == [8, 6, 4, 3]
