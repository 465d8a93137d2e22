"""SwiGLU experts (course_lib/moe.py ``Expert(mlp="swiglu")``, Mixtral's: w2(silu(w1 x) * w3 x),
no biases) on the folded expert mesh against one device: 3 AdamW steps in float64 on EP 2 with
TP 2 and 2 pipeline stages, EP x ETP folded over DP x TP (expert TP cuts w1 and w3 by rows, w2
by columns), CP 2 with EP 2 on the all-gather dispatch, and an odd world (dp 3 x ep 3);
losses and assembled weights within course_lib.tolerance's bound (the lab's random-layout
check, on chosen layouts). The planner's parameter and FLOP counts are the model's."""
import dataclasses

import pytest
import torch

from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.lab.random_layouts import check, draw
from course_lib.moe import Expert, MoE
from course_lib.parallel.compose import check_layout
from course_lib.parallel.expert_parallel import slice_expert
from course_lib.tolerance import assert_matches

CFG = dict(vocab_size=48, seq_len=12, n_layers=2, hidden=16, n_heads=2, n_kv_heads=1, ffn_hidden=24,
           n_experts=4, top_k=2, capacity_factor=1.0, expert_mlp="swiglu")
# (world, name, cfg, mesh dims, parallelize_nd keywords, batch), as random_layouts.draw gives them
CASES = [
    (4, "pp2-tp2-ep2", CFG, dict(pp=2, tp=2, ep=2), dict(microbatches=2, sequence_parallel=True), 2),
    (4, "dp2-tp2-ep2-etp2-drop", dict(CFG, capacity_factor=0.75), dict(dp=2, tp=2, ep=2, etp=2),
     dict(sequence_parallel=True), 4),
    (4, "cp2-ep2-gather-pp2", dict(CFG, moe_dispatch="all_gather", n_shared_experts=1), dict(cp=2, pp=2, ep=2),
     dict(microbatches=2), 2),
    (3, "dp3-ep3-odd", dict(CFG, n_experts=6, capacity_factor=None), dict(dp=3, ep=3), {}, 3),
]


def test_swiglu_experts_on_the_folded_mesh_equal_one_device():
    for world, name, cfg, dims, kw, batch in CASES:
        assert check_layout(GPTConfig(**cfg), **dims, batch=batch, **kw).world_size == world, name
    results = dict(check(CASES, timeout=300))
    assert results == {name: None for _, name, *_ in CASES}, results


def test_swiglu_expert_is_llamas_mlp_and_its_etp_slices_sum_to_it():
    torch.manual_seed(0)
    net = Expert(8, 12, "swiglu").double()
    assert [n for n, _ in net.named_parameters()] == ["w1.weight", "w3.weight", "w2.weight"]   # no biases
    x = torch.randn(5, 8, dtype=torch.float64)
    want = net.w2(torch.nn.functional.silu(net.w1(x)) * net.w3(x))
    assert torch.equal(net(x), want)
    parts = [slice_expert(net, 3, r) for r in range(3)]                 # 12 = 4 + 4 + 4 columns
    assert [p.w3.weight.shape for p in parts] == [torch.Size([4, 8])] * 3
    # three partial sums added in another order: the reordering bound of float64 (course_lib.tolerance)
    assert_matches(sum(p(x) for p in parts), want, what="etp slices", dtype=torch.float64)
    with pytest.raises(ValueError, match="one of"):
        Expert(8, 12, "relu")
    with pytest.raises(ValueError, match="expert_mlp"):
        GPTConfig(**dict(CFG, expert_mlp="geglu"))


def test_planner_counts_the_swiglu_experts_the_model_holds():
    from course_lib.planner import formulas
    for mlp, block in (("swiglu", "llama"), ("gelu", "gpt2")):
        cfg = GPTConfig(**dict(CFG, expert_mlp=mlp, block=block))
        model = TinyGPT(cfg, seed=0)
        assert sum(p.numel() for p in model.parameters()) == formulas.param_count(cfg), mlp
        one = sum(p.numel() for p in model.blocks[0].mlp.moe.experts[0].parameters())
        assert one == formulas.param_breakdown(cfg)["mlp_one_expert"], mlp
    gelu = MoE(16, 24, 4, mlp="gelu")           # unchanged: the GeLU expert's draw order and biases
    assert [n for n, _ in gelu.experts[0].named_parameters()] == ["w1.weight", "w1.bias", "w2.weight", "w2.bias"]


def test_random_layouts_draw_swiglu_experts():
    drawn = draw(60, seed=5)
    kinds = {cfg.get("expert_mlp") for _, _, cfg, *_ in drawn if "n_experts" in cfg}
    assert kinds == {"gelu", "swiglu"}
