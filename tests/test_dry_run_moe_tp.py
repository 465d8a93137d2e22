"""The dry run (course_lib.virtual.dry_run) of mixture-of-experts models under tensor and
context parallelism: a routing group spans the cp x tp ranks, whose token places are
all-gathered; the dry run folds the tp members (and runs every cp rank), so it gives each
folded member's places itself (virtual/moe_folding.py). Checked to the last bit against a real
launch(..., clock=...) of the same layout with the same (balanced) routing: step time, kernel
count and memory of every running rank. SwiGLU experts (Mixtral's) and GeLU experts."""
import pytest
import torch

from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.parallel.mesh import MeshShape
from course_lib.planner.presets import ModelSpec, gpt_spec
from course_lib.virtual import VirtualCluster, dry_run
from course_lib.virtual.dry_run import model_config, running_ranks
from course_lib.virtual.moe_folding import token_places
from memory_parity import assert_same_memory

HW = "a100-80gb"
LLAMA_MOE = ModelSpec("Llama test MoE", 2, 64, 4, 2, 96, 256, 32, n_experts=4, top_k=2)     # SwiGLU experts
GPT_MOE = gpt_spec("GPT test", 2, 64, 4, V=256, s=32).with_(name="GPT test MoE", n_experts=4, top_k=2)


def _real_rank(cfg, layout):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    from course_lib.virtual.priced import BalancedRouting
    with BalancedRouting():            # the routing the dry run assumes, on the real run
        return train_step(cfg, layout, Mesh.from_layout(layout))


@pytest.mark.parametrize("spec,layout", [
    (LLAMA_MOE, Layout(tp=2, sp=True, pp=2, ep=2, micro_batch=1, global_batch=2, recompute="selective")),
    (GPT_MOE.with_(moe_dispatch="all_gather"), Layout(cp=2, tp=2, sp=True, ep=2, etp=2, micro_batch=1,
                                                      global_batch=1)),
], ids=["swiglu-tp2-pp2-ep2", "gelu-cp2-tp2-ep2-etp2-allgather"])
def test_moe_dry_run_under_tp_and_cp_equals_a_real_launch(spec, layout):
    real = launch(_real_rank, layout.n_gpus, model_config(spec, layout), layout, clock=VirtualCluster(HW))
    r = dry_run(spec, HW, layout, progress=None)
    running = running_ranks(MeshShape(**layout.sizes, etp=layout.etp))
    assert r.ranks_run == len(running) == layout.pp * layout.cp
    assert r.step_time == max(x["t"] for x in real), (r.step_time, max(x["t"] for x in real))
    assert r.kernels == sum(real[rank]["kernels"] for rank in running)
    for i, rank in enumerate(running):
        assert_same_memory(r.memory_by_stage[i], real[rank], rank)
    assert r.config.expert_mlp == spec.mlp
    names = {s.name for s in r.spans if s.kind == "comm"}
    assert {"dispatch", "combine", "routing: token places"} <= names


def test_folded_members_token_places_are_the_ones_their_plan_sets():
    """token_places (what the dry run gives a folded member) = NDParallel.token_index on that
    member's own plan, for every rank of a cp 2 x tp 2 layout (zigzag positions, SP chunks)."""
    from course_lib.gpt import TinyGPT
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.virtual.priced import StageMesh
    layout = Layout(cp=2, tp=2, sp=True, ep=4, micro_batch=2, global_batch=2)
    cfg = model_config(GPT_MOE, layout)
    with torch.device("meta"):
        model = TinyGPT(cfg, seed=0)
    shape, seen = MeshShape(**layout.sizes), set()
    for rank in range(shape.world_size):
        net = parallelize_nd(model, StageMesh(rank, **layout.sizes), layout)
        x = torch.zeros(2, cfg.seq_len, dtype=torch.int64, device="meta")
        xl, _, pos = net.local_batch(x, x)
        want = net.token_index(xl, pos)
        assert torch.equal(token_places(cfg, layout, shape.coords(rank)), want), rank
        seen.add(tuple(want.tolist()))
    assert len(seen) == 4 and sorted(i for s in seen for i in s) == list(range(2 * cfg.seq_len))


def test_moe_layouts_the_dry_run_cannot_fold_are_refused_before_anything_runs():
    # 6 experts, top-1: a tp rank's 16 tokens go 3, 3, 3, 3, 2, 2 to the experts, its twin's 3, 3, 2, 2, 3, 3
    with pytest.raises(NotImplementedError, match=r"unequal tokens .* \(0, 1\): \[3, 3, 2, 2, 3, 3\]"):
        dry_run(GPT_MOE.with_(n_experts=6, top_k=1), HW, Layout(tp=2, sp=True, ep=2, micro_batch=1, global_batch=1))
    with pytest.raises(ValueError, match="sequence_parallel"):      # the ranks' own rule (check_layout)
        dry_run(GPT_MOE, HW, Layout(tp=2, ep=2, micro_batch=1, global_batch=1))


def test_mixtral_is_run_with_swiglu_experts_under_tp_and_ep():
    """The outside check's row: dry_run("mixtral-8x7b", "h100-sxm", Layout(tp=2, ep=8, pp=4, ...))
    passes every rule before anything runs, with Mixtral's SwiGLU experts and its parameters
    (46.7B: the course's model counts what the preset counts); 8x22B (141B) likewise."""
    from course_lib.planner import formulas
    from course_lib.planner.presets import get_model
    from course_lib.virtual.dry_run import check_dry_run
    layout = Layout(tp=2, pp=4, dp=8, ep=8, sp=True, micro_batch=1, global_batch=64, recompute="selective")
    for name, n in (("mixtral-8x7b", 46_702_792_704), ("mixtral-8x22b", 140_620_634_112)):
        spec = get_model(name)
        cfg = check_dry_run(spec, layout)
        assert (cfg.expert_mlp, cfg.n_experts, cfg.top_k, cfg.block) == ("swiglu", 8, 2, "llama")
        assert formulas.param_count(cfg) == spec.n_params == n
