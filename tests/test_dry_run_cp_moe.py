"""The dry run (course_lib.virtual.dry_run) with context parallelism and mixture-of-experts
models: the same virtual step time as a real launch of the same layout, to the last bit."""
import pytest
import torch

from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.parallel.mesh import MeshShape
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run
from memory_parity import assert_same_memory

SPEC = gpt_spec("GPT test", 4, 64, 4, V=256, s=32)     # GeLU, LayerNorm, biases, tied, learned positions
MOE = SPEC.with_(name="GPT test MoE", n_experts=4, top_k=2)
HW = "a100-80gb"


def _real_rank(cfg, layout, balanced):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    from course_lib.virtual.priced import BalancedRouting
    if not balanced:
        return train_step(cfg, layout, Mesh.from_layout(layout))
    with BalancedRouting():            # the routing the dry run assumes, on the real run
        return train_step(cfg, layout, Mesh.from_layout(layout))


def _check_equal(spec, layout):
    from course_lib.virtual.dry_run import model_config
    real = launch(_real_rank, layout.n_gpus, model_config(spec, layout), layout, spec.n_experts > 1,
                  clock=VirtualCluster(HW))
    real_step = max(r["t"] for r in real)
    r = dry_run(spec, HW, layout, progress=None)
    assert r.step_time == real_step, (layout.describe(), r.step_time, real_step)
    return r, real


@pytest.mark.parametrize("layout", [
    Layout(cp=2, tp=2, sp=True, micro_batch=1, global_batch=2),                  # ring, with TP + SP
    Layout(cp=2, pp=2, cp_method="ulysses", micro_batch=1, global_batch=4, recompute="selective"),
], ids=["ring-cp2-tp2", "ulysses-cp2-pp2"])
def test_context_parallel_dry_run_equals_a_real_launch(layout):
    """Every cp rank of a stage runs (its ring messages between them, for real); its tp / dp
    twins are folded. Step time bit-equal to the real launch's; memory per stage too."""
    r, real = _check_equal(SPEC, layout)
    assert r.ranks_run == layout.pp * layout.cp
    for stage in range(layout.pp):                 # the rank at dp = tp = 0, cp = 0 of each stage
        rank = stage * layout.cp * layout.tp
        assert_same_memory(r.memory_by_stage[stage * layout.cp], real[rank], rank)
    assert any(s.dim == "cp" for s in r.spans)


@pytest.mark.parametrize("layout,dispatch", [
    (Layout(dp=2, pp=2, ep=2, micro_batch=1, global_batch=4, recompute="selective"), "all_to_all"),
    (Layout(dp=4, ep=2, etp=2, micro_batch=1, global_batch=4), "all_gather"),
    (Layout(dp=4, ep=2, zero=2, micro_batch=1, global_batch=4), "all_to_all"),
    (Layout(dp=4, pp=2, ep=2, zero=1, micro_batch=1, global_batch=8), "all_to_all"),
    # Megatron-Core's fold (TP first, PP outermost): the ep pair is the tp pair, an expert's
    # copies and its ZeRO-1 group lie along dp, outside the fold
    (Layout(dp=2, tp=2, sp=True, ep=2, zero=1, micro_batch=1, global_batch=2, fold_order="tp_first",
            order=("pp", "dp", "cp", "tp")), "all_to_all"),
], ids=["a2a-dp2-pp2-ep2", "allgather-dp4-ep2-etp2", "a2a-dp4-ep2-zero2", "a2a-dp4-pp2-ep2-zero1",
        "a2a-dp2-tp2-ep2-tpfirst-zero1"])
def test_moe_dry_run_equals_a_real_launch_with_balanced_routing(layout, dispatch):
    """One running rank per stage: its ep (and etp) peers are folded, each sending what it
    sends. With the router's top-k balanced on the real run (BalancedRouting), the same step,
    and the same memory per stage (under ZeRO-2 the experts' slices over the 2 ranks holding
    each expert, "edp", reduce-scattered there)."""
    r, real = _check_equal(MOE.with_(moe_dispatch=dispatch), layout)
    assert r.ranks_run == layout.pp
    names = {s.name for s in r.spans if s.kind == "comm"}
    assert "dispatch" in names and "combine" in names
    shape = MeshShape(**layout.sizes, etp=layout.etp, order=layout.order, fold_order=layout.fold_order)
    for stage in range(layout.pp):             # the rank at dp = 0 of each stage
        rank = shape.rank_of(pp=stage)
        assert_same_memory(r.memory_by_stage[stage], real[rank], rank)
    if layout.zero:
        assert any(s.name.startswith("reduce-scatter b") and "edp" in s.dim.split("+") for s in r.spans), \
            {(s.name, s.dim) for s in r.spans if s.kind == "comm"}


def test_round_robin_routing_is_balanced_and_dispatch_sizes_static():
    from course_lib.meta import round_robin
    from course_lib.virtual.priced import BalancedRouting
    choice = round_robin(12, 4, 2)
    assert choice.shape == (12, 2) and (choice[:, 0] != choice[:, 1]).all()
    assert torch.bincount(choice.flatten(), minlength=4).tolist() == [6, 6, 6, 6]   # T k / E each
    logits = torch.randn(12, 4)
    with BalancedRouting():
        values, idx = logits.topk(2, dim=-1)
    assert torch.equal(idx, choice) and torch.equal(values, logits.gather(-1, choice))


def test_moe_layouts_the_ranks_refuse_are_refused_before_anything_runs():
    # (MoE under tp / cp and SwiGLU experts run: tests/test_dry_run_moe_tp.py)
    with pytest.raises(ValueError, match="ep"):                       # 4 experts over 3 ranks
        dry_run(MOE, HW, Layout(dp=3, ep=3, micro_batch=1, global_batch=3))
