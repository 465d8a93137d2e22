"""A given pipeline split (``Layout.stage_layers``, issue #36): virtual stages that hold only the
embedding or only the head, as Llama 3 405B's (Dubey et al. 2024, Sec. 3.3.2), equal to one
device over several AdamW steps in float64 (interleaved at pp 2 and 3, v 2 and 3, with TP + SP,
DP, FSDP and a tied embedding; ZB-V, whose rank 0 holds both ends), refused by name where a stage
would hold nothing, priced by the planner as the ranks cut it and by the dry run as a real
launch. Three launches (3 and 4 ranks; 4 on the virtual clock)."""
import dataclasses

import pytest
import torch

from course_lib import launch, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.lab.nd_runs import LR, single_device
from course_lib.layout import Layout, split_with_ends
from course_lib.parallel.compose import assemble_nd, check_layout
from course_lib.parallel.pipeline import partition_layers
from course_lib.planner import estimate
from course_lib.planner.layout import layers_per_stage
from course_lib.planner.presets import get_model

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layers=4, hidden=16, n_heads=2)
STEPS = 3
# name: (config, mesh dims, layout keywords, global batch); every split has an end with no layer
CASES = {
    3: {"pp3-v3-paper": (dataclasses.replace(CFG, n_layers=7), dict(pp=3),
                         dict(schedule="interleaved", v=3, microbatches=3, stage_layers=split_with_ends(7, 9)), 3),
        "pp3-v2-uneven": (dataclasses.replace(CFG, n_layers=5), dict(pp=3),
                          dict(schedule="interleaved", v=2, microbatches=3, stage_layers=(0, 1, 2, 1, 1, 0)), 6),
        "pp3-zb-v-ends": (dataclasses.replace(CFG, n_layers=6, tie_embeddings=True), dict(pp=3),   # rank 0: both ends
                          dict(schedule="zb-v", microbatches=3, stage_layers=(0, 2, 2, 1, 1, 0)), 3)},
    4: {"pp2-tp2-sp-v2-tied": (dataclasses.replace(CFG, tie_embeddings=True), dict(pp=2, tp=2),
                               dict(schedule="interleaved", v=2, microbatches=2, stage_layers=(0, 2, 2, 0)), 4),
        "pp2-dp2-v3-head-only": (dataclasses.replace(CFG, n_layers=5), dict(pp=2, dp=2),
                                 dict(schedule="interleaved", v=3, microbatches=2,
                                      stage_layers=(1, 1, 1, 1, 1, 0)), 4),
        "pp2-fsdp2-v2": (CFG, dict(pp=2, dp=2), dict(schedule="interleaved", v=2, microbatches=2, zero=3,
                                                     stage_layers=(0, 2, 2, 0)), 4)},
}


def _train(cases):
    """On every rank, each case STEPS AdamW steps (float64): its losses, the first step's
    gradients and its final parameters (this rank's shards), and the layers its stages hold."""
    from course_lib import reference
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    out = {}
    for name, (cfg, dims, kw, batch) in cases.items():
        net = parallelize_nd(TinyGPT(cfg, seed=0).double(), Mesh(**dims), Layout(**dims, global_batch=batch, **kw))
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
        losses, grads = [], None
        for x, y in reference.gpt_batches(cfg, batch=batch, steps=STEPS):
            losses.append(net.step(x, y))
            grads = grads or (net.shards(grads=True) if kw.get("zero") != 3 else {})   # FSDP: shards only
            opt.step()
            opt.zero_grad()
        out[name] = (losses, grads, net.shards(), {s: list(st.layers) for s, st in net.stages.items()})
    return out


@pytest.fixture(scope="module")
def runs():
    return {n: launch(_train, n, CASES[n], threads=1, timeout=240) for n in CASES}


def test_embedding_and_head_chunks_equal_one_device(runs):
    for n, cases in CASES.items():
        for name, (cfg, dims, kw, batch) in cases.items():
            shape = check_layout(cfg, Layout(**dims, global_batch=batch, **kw))
            ref = single_device(cfg, batch, STEPS, dtype=torch.float64)
            ranks = [r[name] for r in runs[n]]
            for losses, _, _, _ in ranks:
                tolerance.assert_matches(losses, ref.losses, optimizer="adamw", steps=STEPS, lr=LR,
                                         what=f"{name}: losses")
            if kw.get("zero") != 3:
                grads = assemble_nd([r[1] for r in ranks], shape)
                tolerance.assert_matches(grads, ref.grads, what=f"{name}: the first step's gradients")
            full = assemble_nd([r[2] for r in ranks], shape)
            assert set(full) == set(ref.state), name
            tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=STEPS, lr=LR, what=name)


def test_the_stages_hold_the_given_split(runs):
    for n, cases in CASES.items():
        for name, (cfg, dims, kw, _) in cases.items():
            cut = partition_layers(cfg.n_layers, len(kw["stage_layers"]), kw["stage_layers"])
            held = {s: layers for r in runs[n] for s, layers in r[name][3].items()}
            assert held == {s: list(cut[s]) for s in range(len(cut))}, name
            assert [len(held[s]) for s in sorted(held)] == list(kw["stage_layers"]), name
    assert runs[3][0]["pp3-v3-paper"][3][0] == []      # rank 0's first chunk: the embedding alone
    assert runs[3][2]["pp3-v3-paper"][3][8] == []      # rank 2's last chunk: the head alone


def test_llama3_split_is_the_papers():
    # 126 layers + the embedding + the head = 128 slots: 16 ranks x 8 chunks of one each (v = 8);
    # v = 1: "we reduce one Transformer layer each from the first and the last stages"
    assert split_with_ends(126, 128) == (0,) + (1,) * 126 + (0,)
    assert split_with_ends(126, 16) == (7,) + (8,) * 14 + (7,)
    assert split_with_ends(6, 4) == (1, 2, 2, 1)
    with pytest.raises(ValueError, match="more pipeline stages"):
        split_with_ends(3, 6)
    with pytest.raises(ValueError, match="fewer slots"):
        split_with_ends(1, 4, embedding=2)


@pytest.mark.parametrize("split, error, match", [
    ((0, 2, 0, 2), ValueError, "virtual stage 2 empty of everything"),
    ((1, 1, 1), ValueError, "gives 3 stages, the pipeline has pp \\* chunks = 4"),
    ((0, 2, 2, 1), ValueError, "summing to the model's 4 layers"),
    ((2, -1, 2, 1), ValueError, "counts >= 0"),
    ((1.0, 1, 1, 1), TypeError, "tuple of layer counts"),
])
def test_bad_splits_are_refused_by_name(split, error, match):
    layout = Layout(pp=2, schedule="interleaved", v=2, microbatches=2, stage_layers=split)
    with pytest.raises(error, match=match):
        check_layout(CFG, layout)                        # before any rank starts
    spec = dataclasses.replace(get_model("llama3-8b"), n_layers=4)
    with pytest.raises(error, match=match):              # the planner applies the same rule
        estimate(spec, "h100-sxm", layout)


def test_without_a_split_every_stage_needs_a_layer():
    with pytest.raises(ValueError, match="every stage needs a layer"):
        check_layout(CFG, Layout(pp=2, schedule="interleaved", v=3, microbatches=2))
    check_layout(CFG, Layout(pp=2, schedule="interleaved", v=3, microbatches=2, stage_layers=(0, 1, 1, 1, 1, 0)))


def test_the_planner_prices_the_ranks_split():
    layout = Layout(dp=64, tp=8, pp=16, zero=2, sp=True, schedule="interleaved", v=8, global_batch=2048,
                    stage_layers=split_with_ends(126, 128))
    est = estimate("llama3-405b", "h100-sxm", layout)
    cut = partition_layers(126, 128, layout.stage_layers)
    held = [sum(len(cut[s]) for s in range(r, 128, 16)) for r in range(16)]
    assert [st.layers for st in est.stages] == held == [7] + [8] * 14 + [7]
    v = Layout(pp=2, schedule="zb-v", microbatches=4, stage_layers=(0, 2, 1, 1))     # V: rank 0 holds 0 and 3
    assert layers_per_stage(dataclasses.replace(get_model("llama3-8b"), n_layers=4), v) == [1, 3]


def _real_rank(cfg, layout):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    return train_step(cfg, layout, Mesh.from_layout(layout))


def test_the_dry_run_prices_the_split_as_a_real_launch():
    """tp 2 (+ SP) x pp 2, interleaved v = 2, the embedding and the head alone in their chunks:
    the dry run (meta device, one rank per stage) gives the real 4-rank run's step time and
    kernels to the bit; without the split (two layers on the embedding's and the head's chunks)
    the step differs."""
    from course_lib.planner.presets import gpt_spec
    from course_lib.virtual import VirtualCluster, dry_run
    from course_lib.virtual.dry_run import model_config

    spec = gpt_spec("GPT test", 4, 64, 4, V=256, s=32)
    layout = Layout(tp=2, pp=2, sp=True, schedule="interleaved", v=2, microbatches=2, global_batch=2,
                    stage_layers=(0, 2, 2, 0))
    real = launch(_real_rank, 4, model_config(spec, layout), layout, clock=VirtualCluster("a100-80gb"))
    r = dry_run(spec, "a100-80gb", layout, progress=None)
    assert r.step_time == max(x["t"] for x in real)
    assert r.kernels == real[0]["kernels"] + real[2]["kernels"]
    assert dry_run(spec, "a100-80gb", layout.with_(stage_layers=()), progress=None).step_time != r.step_time
