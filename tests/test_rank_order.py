"""A rank order per layout (``Layout.order`` / ``Mesh(order=...)``): which global ranks, so which
nodes, hold each group. DeepSpeed's PipeModelDataParallelTopology (axes pipe, data, model) is
``("pp", "dp", "tp")``; the course's default is dp, pp, cp, tp (outermost first)."""
import itertools

import pytest
import torch

from course_lib import tolerance
from course_lib.launch import launch
from course_lib.layout import MESH_ORDER, Layout, rank_order
from course_lib.parallel.mesh import MeshShape
from course_lib.planner import estimate
from course_lib.planner.layout import group_span, intra_node, strides
from course_lib.planner.presets import HARDWARE, gpt_spec
from course_lib.planner.runtime import group_in_node
from course_lib.virtual import VirtualCluster, dry_run

DEEPSPEED = ("pp", "dp", "tp")
SPEC = gpt_spec("GPT test", 4, 64, 4, V=256, s=32)     # as tests/test_dry_run.py
HW = "a100-80gb"


def test_deepspeeds_topology_numbers_the_ranks():
    """ProcessTopology(axes=['pipe', 'data', 'model'], dims=[p, d, t]) is row-major: rank =
    (pipe * d + data) * t + model; its docstring's example (2, 2, 2): pipe lists [0, 4], [1, 5]..."""
    m = MeshShape(dp=3, pp=2, tp=2, order=DEEPSPEED)
    for rank in range(m.world_size):
        c = m.coords(rank)
        assert rank == (c["pp"] * 3 + c["dp"]) * 2 + c["tp"]
        assert m.rank_of(dp=c["dp"], pp=c["pp"], tp=c["tp"]) == rank
    assert MeshShape(dp=2, pp=2, tp=2, order=DEEPSPEED).rank_sets("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.rank_sets("dp")[:2] == [[0, 2, 4], [1, 3, 5]]
    assert m.rank_sets(("dp", "tp"))[0] == [0, 1, 2, 3, 4, 5]     # a stage: one block of ranks
    assert MeshShape(dp=3, pp=2, tp=2, order=None).order == MESH_ORDER
    assert "ranks in order pp > dp > tp" in m.describe()


def test_every_order_numbers_every_group_in_ascending_ranks():
    """For all 24 orders of an MoE mesh (ep folded over dp x cp): the coordinates are a bijection,
    every group's ranks are ascending (dist.new_group numbers a group's ranks so), a group varies
    only its own coordinates, and the expert mesh keeps its sizes."""
    sizes = dict(dp=2, pp=2, cp=2, tp=2, ep=4)
    for order in itertools.permutations(MESH_ORDER):
        m = MeshShape(**sizes, order=order)
        assert sorted(m.rank_of(**{d: m.coords(r)[d] for d in MESH_ORDER}) for r in range(16)) == list(range(16))
        for dims in ("dp", "pp", "cp", "tp", ("dp", "cp"), ("pp", "tp"), "ep", "edp", ("ep", "etp")):
            sets = m.rank_sets(dims)
            assert sorted(r for s in sets for r in s) == list(range(16)), (order, dims)
            for s in sets:
                assert s == sorted(s), (order, dims, s)
                named = {dims} if isinstance(dims, str) else set(dims)
                fixed = [d for d in MESH_ORDER if d not in named] if not named & {"ep", "edp", "etp"} else ["pp"]
                assert len({tuple(m.coords(r)[d] for d in fixed) for r in s}) == 1, (order, dims)
        assert m.size("ep") == 4 and m.size("edp") == 1
        first = m.rank_sets("pp")[0]
        assert first[1] - first[0] == strides(Layout(**{k: v for k, v in sizes.items()}, order=order))["pp"]


@pytest.mark.parametrize("order, error, message", [
    (("pp", "dp", "sp"), ValueError, "unknown mesh dimension"),
    (("pp", "dp", "pp", "tp"), ValueError, "twice"),
    (("pp", "tp"), ValueError, "leaves out dp=2"),
    ("pp,dp,tp", TypeError, "tuple of mesh dimensions")])
def test_bad_orders_are_refused_before_any_rank_starts(order, error, message):
    from course_lib.gpt import GPTConfig
    from course_lib.parallel.layout_rules import check_layout
    from course_lib.planner.layout import validate
    layout = Layout(dp=2, tp=2, pp=2, micro_batch=1, global_batch=4, order=order)
    with pytest.raises(error, match=message):
        MeshShape(dp=2, pp=2, tp=2, order=order)
    with pytest.raises(error, match=message):
        check_layout(GPTConfig(n_layers=2, hidden=32, n_heads=4, vocab_size=64, seq_len=16), layout)
    with pytest.raises(error, match=message):
        validate(SPEC, HARDWARE[HW], layout)
    with pytest.raises(error, match=message):
        dry_run(SPEC, HW, layout)
    assert rank_order(("pp", "dp", "tp"), {"cp": 1}) == ("pp", "dp", "tp", "cp")   # size 1: left out


def test_a_layout_and_a_mesh_of_other_orders_are_refused():
    from course_lib.parallel.layout_rules import rule_order
    layout = Layout(dp=2, tp=2, pp=2, order=DEEPSPEED)
    with pytest.raises(ValueError, match="Mesh.from_layout"):
        rule_order(layout, MESH_ORDER, given=True)
    assert rule_order(layout, ("pp", "dp", "cp", "tp"), given=True) is layout     # cp = 1: the same ranks
    assert rule_order(Layout(dp=2, tp=2, pp=2), DEEPSPEED, given=False).order == DEEPSPEED   # keywords


def test_two_nodes_pp_outermost_puts_every_pipeline_hop_across_nodes():
    """16 GPUs on two 8-GPU nodes, tp 2 x pp 2 x dp 4: the course's order keeps each pipeline
    inside a node (dp crosses); DeepSpeed's puts every pp hop across (and each dp group inside)."""
    hw = HARDWARE[HW]
    assert hw.gpus_per_node == 8
    base = Layout(dp=4, tp=2, pp=2, micro_batch=1, global_batch=16)
    for order, pp_inside in ((None, True), (DEEPSPEED, False)):
        layout = base.with_(order=order)
        m = MeshShape(**layout.sizes, order=order)
        hops = [(s[0] // 8, s[1] // 8) for s in m.rank_sets("pp")]
        assert all((a == b) == pp_inside for a, b in hops), (order, hops)
        assert intra_node(layout, hw, "pp") == group_in_node(layout, hw, ("pp",)) == pp_inside
        assert intra_node(layout, hw, "dp") == group_in_node(layout, hw, ("dp",)) == (not pp_inside)
        assert intra_node(layout, hw, "tp")
    assert (group_span(base, "pp"), group_span(base.with_(order=DEEPSPEED), "pp")) == (4, 16)
    assert (group_span(base, "dp"), group_span(base.with_(order=DEEPSPEED), "dp")) == (16, 8)
    ours, theirs = (estimate(SPEC, hw, base.with_(order=o)) for o in (None, DEEPSPEED))
    assert ours.step_time != theirs.step_time


def test_megatrons_order_changes_no_group_of_its_published_rows():
    """lab.dry_runs.ORDER states Megatron-LM's pp-outermost order for Korthikanti's and
    Narayanan's rows: every one is tp = 8 or pp = 1, so each group's nodes (how many ranks on
    each node it touches) are the same as in the course's order; BLOOM's pipeline hops all
    cross nodes, where the course's order kept 6 of 11 inside. The planner prices Korthikanti's
    and Narayanan's rows the same in either order; BLOOM's, each hop on its own link
    (planner.pipeline_hops), every hop on the network in DeepSpeed's order (as before the hops
    were priced one by one) and a shorter step in the course's."""
    from course_lib.planner.pipeline_hops import hop_in_node
    from course_lib.lab.dry_runs import ORDER, published_runs
    gpn = lambda hw: hw.gpus_per_node

    def shape(layout, order, dim, g):
        m = MeshShape(**layout.sizes, order=order)
        return sorted(tuple(sorted(sum(1 for r in s if r // g == n) for n in {r // g for r in s}))
                      for s in m.rank_sets(dim))
    for source, name, model, hw, layout, *_ in published_runs():
        assert layout.order == ORDER[source]
        if source in ("Korthikanti 2022 T5", "Narayanan 2021 T1", "BLOOM 2022"):
            a, b = estimate(model, hw, layout), estimate(model, hw, layout.with_(order=None))
            assert a.memory == b.memory, name
            assert (a.step_time == b.step_time) == (source != "BLOOM 2022"), name
            assert not any(hop_in_node(layout, hw, i, i + 1) for i in range(layout.pp - 1)), name
        if source in ("Korthikanti 2022 T5", "Narayanan 2021 T1"):
            for dim in ("dp", "pp", "tp"):
                assert shape(layout, layout.order, dim, gpn(hw)) == shape(layout, None, dim, gpn(hw)), (name, dim)
        if source == "BLOOM 2022":
            for order, crossing in ((None, 5), (layout.order, 11)):   # of the 11 hops per pipeline
                pipeline = MeshShape(**layout.sizes, order=order).rank_sets("pp")[0]
                assert sum(a // 8 != b // 8 for a, b in zip(pipeline, pipeline[1:])) == crossing
                ours = layout.with_(order=order)
                assert sum(not hop_in_node(ours, hw, i, i + 1) for i in range(layout.pp - 1)) == crossing
            assert b.step_time < a.step_time, name


def _rank(cfg_dry, layout, cfg64, layout64, steps):
    """One launch, three checks: the dry run's program on the virtual clock; the mesh's groups
    against torch's init_device_mesh in the same order; a float64 training run's losses and shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from course_lib import reference
    from course_lib.gpt import TinyGPT
    from course_lib.lab.nd_runs import LR
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    mesh = Mesh.from_layout(layout)
    out = {"step": train_step(cfg_dry, layout, mesh)}
    dm = init_device_mesh("cpu", tuple(mesh.sizes[d] for d in mesh.order), mesh_dim_names=mesh.order)
    out["groups"] = {d: (mesh.ranks(d), dist.get_process_group_ranks(dm.get_group(d)), mesh.get_local_rank(d),
                         dm.get_local_rank(d)) for d in ("dp", "pp", "tp")}
    out["coordinate"] = (mesh.get_coordinate(), list(dm.get_coordinate()))
    net = parallelize_nd(TinyGPT(cfg64, seed=0).double(), mesh, layout64)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    out["losses"] = reference.train_parallel(net, reference.gpt_batches(cfg64, batch=layout64.global_batch,
                                                                        steps=steps), opt)
    out["shards"] = net.shards()
    return out


def test_deepspeeds_order_trains_as_one_device_and_the_dry_run_is_the_real_launch():
    """dp 2 x tp 2 x pp 2 in DeepSpeed's order on two virtual 4-GPU nodes (every pipeline hop
    across them, the dp sums inside): one launch of 8 ranks. Its groups are torch's DeviceMesh's
    in that order; 3 AdamW steps in float64 equal one device (losses on every rank, assembled
    weights, within course_lib.tolerance); the dry run of the same layout is the real launch to
    the bit (step time, kernels, memory per stage), and each of its pipeline sends crosses nodes."""
    from course_lib.gpt import GPTConfig
    from course_lib.lab.nd_runs import LR, single_device
    from course_lib.parallel.compose import assemble_nd
    from course_lib.virtual.dry_run import model_config
    layout = Layout(dp=2, tp=2, pp=2, sp=True, micro_batch=1, global_batch=8, recompute="selective",
                    order=DEEPSPEED)
    cfg64 = GPTConfig(vocab_size=60, seq_len=12, n_layers=3, hidden=24, n_heads=6, n_kv_heads=2, block="llama")
    layout64 = Layout(dp=2, tp=2, pp=2, sp=True, global_batch=6, microbatches=3, recompute="selective",
                      order=DEEPSPEED)                                  # uneven: 3 layers on 2 stages
    steps = 3
    cluster = VirtualCluster(HW, gpus_per_node=4)
    real = launch(_rank, 8, model_config(SPEC, layout), layout, cfg64, layout64, steps, clock=cluster, timeout=300)

    shape = MeshShape(**layout.sizes, order=DEEPSPEED)
    for rank, out in enumerate(real):
        for d, (ours, torchs, local, torch_local) in out["groups"].items():
            assert ours == torchs == next(s for s in shape.rank_sets(d) if rank in s) and local == torch_local, d
        assert out["coordinate"][0] == out["coordinate"][1]
    ref = single_device(cfg64, layout64.global_batch, steps, dtype=torch.float64)
    for out in real:
        tolerance.assert_matches(out["losses"], ref.losses, optimizer="adamw", steps=steps, lr=LR, what="losses")
    full = assemble_nd([out["shards"] for out in real], shape)
    assert set(full) == set(ref.state)
    tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=steps, lr=LR, what="weights")

    r = dry_run(SPEC, HW, layout, gpus_per_node=4)
    steps_real = [out["step"] for out in real]
    stage_ranks = [shape.rank_of(pp=i) for i in range(2)]             # dp = tp = 0 of each stage: 0, 4
    assert stage_ranks == [0, 4]
    assert r.step_time == max(s["t"] for s in steps_real), (r.step_time, [s["t"] for s in steps_real])
    assert r.kernels == sum(steps_real[i]["kernels"] for i in stage_ranks)
    for stage, rank in enumerate(stage_ranks):
        assert r.memory_by_stage[stage]["states"] == steps_real[rank]["states"]
        assert r.memory_by_stage[stage]["activations"] == steps_real[rank]["activations"]
    ours = dry_run(SPEC, HW, layout.with_(order=None), gpus_per_node=4)    # the course's: hops inside
    sends = {}
    for name, run, across in (("deepspeed", r, True), ("course", ours, False)):
        spans = [s for s in run.spans if s.dim == "pp" and s.name.startswith("send to")]
        assert spans and all((s.rank // 4 != int(s.name.split()[-1]) // 4) == across for s in spans), name
        sends[name] = min(s.end - s.start for s in spans)
    assert sends["deepspeed"] > sends["course"]           # every hop priced on the network, not NVLink
    assert ours.step_time != r.step_time


def test_other_orders_on_an_odd_world_train_as_one_device():
    """6 ranks, one launch (course_lib.lab.random_layouts.check: 3 AdamW steps in float64, the
    losses on every rank and the assembled weights against one device): cp outermost over dp
    with experts folded over dp (ep 3, MoE); pp outermost over dp, FSDP, 5 layers on 2 stages.
    parallelize_nd takes the mesh's order (first case) or checks the one it is given (second)."""
    from course_lib.gpt import GPTConfig
    from course_lib.lab.random_layouts import check
    from course_lib.parallel.layout_rules import check_layout
    moe = dict(vocab_size=48, seq_len=12, n_layers=2, hidden=24, n_heads=4, n_kv_heads=2, block="gpt2",
               n_experts=6, top_k=2, ffn_hidden=24, capacity_factor=None)
    dense = dict(vocab_size=60, seq_len=12, n_layers=5, hidden=24, n_heads=6, n_kv_heads=3, block="llama")
    cases = [(6, "cp-dp moe", moe, dict(dp=3, cp=2, ep=3, order=("cp", "dp")), {}, 6),
             (6, "pp-dp 1f1b fsdp", dense, dict(dp=3, pp=2, order=("pp", "dp")),
              dict(microbatches=2, schedule="1f1b", data="fsdp", order=("pp", "dp")), 6)]
    for world, name, cfg, dims, kw, batch in cases:      # accepted before any rank starts
        assert check_layout(GPTConfig(**cfg), **{**dims, **kw}, batch=batch).world_size == world
    assert check(cases, timeout=300) == [("cp-dp moe", None), ("pp-dp 1f1b fsdp", None)]


def test_each_pipeline_hop_is_priced_on_its_own_link_as_the_dry_run_charges_it():
    """16 ranks on four virtual 4-GPU nodes, tp 2 x pp 4 x dp 2, interleaved (v = 2): in the
    course's order a pipeline spans 8 ranks, two nodes, so hops 0-1 and 2-3 stay on NVLink while
    1-2 and the wrap-around 3-0 cross; in DeepSpeed's each stage has a node of its own. For every
    hop the dry run sends on, the planner's link (pipeline_hops.hop_in_node) is the clock's
    (rank // 4) and its price (NCCL's, async_tp_hop) the send's virtual time; each stage's send
    time (StageCost.p2p: the mean over its hops) is the mean of the dry run's."""
    from course_lib.planner.async_tp import async_tp_hop
    from course_lib.planner.pipeline_hops import hop_in_node, neighbours, stage_send_time
    spec = gpt_spec("GPT test 8L", 8, 64, 4, V=256, s=32)
    hw = HARDWARE[HW].with_(gpus_per_node=4)
    base = Layout(dp=2, tp=2, pp=4, schedule="interleaved", v=2, micro_batch=1, global_batch=8)
    nbytes = 32 * 64 * 2                                   # (s, b, h) bf16, no SP
    for order, inside in ((None, 2), (DEEPSPEED, 0)):      # hops on NVLink of the 4 in the ring
        layout = base.with_(order=order)
        r = dry_run(spec, HW, layout, gpus_per_node=4)
        stage_of = {rank: MeshShape(**layout.sizes, order=order).coords(rank)["pp"] for rank in range(16)}
        sends = {}
        for s in r.spans:
            if s.dim == "pp" and s.name.startswith("send to"):
                sends.setdefault((stage_of[s.rank], stage_of[int(s.name.split()[-1])]), set()).add(
                    (s.rank // 4 == int(s.name.split()[-1]) // 4, round(s.end - s.start, 15)))
        assert set(sends) == {(i, n) for i in range(4) for n in neighbours(layout, i)}, order
        assert sum(hop_in_node(layout, hw, i, (i + 1) % 4) for i in range(4)) == inside, order
        for (i, n), seen in sends.items():
            (same_node, t), = seen                          # one link and one price per hop
            assert hop_in_node(layout, hw, i, n) == same_node, (order, i, n)
            assert t == pytest.approx(async_tp_hop(hw, nbytes, same_node), rel=1e-9), (order, i, n)
        est = estimate(spec, hw, layout, runtime="course")
        for st in est.stages:
            dry = [next(iter(sends[(st.stage, n)]))[1] for n in neighbours(layout, st.stage)]
            assert st.p2p == pytest.approx(sum(dry) / len(dry), rel=1e-9), (order, st.stage)
            assert st.p2p == stage_send_time(layout, hw, st.stage, nbytes, async_tp_hop)
        network = async_tp_hop(hw, nbytes, False)           # the old price: every hop on the network
        assert all(st.p2p < network for st in est.stages) == (order is None), order


def test_random_layouts_draw_orders_from_a_stream_of_their_own(monkeypatch):
    """lab.dry_runs.random_layouts (the planner-vs-dry-run layouts) and lab.random_layouts.draw
    (the random layouts trained against one device) draw a rank order too: None and others,
    pp outermost among them; with the order drawn from its own stream the layouts themselves are
    the ones a draw without orders gives (here: the order helper replaced by one that never
    draws), so a seed's layouts stay those recorded before."""
    from course_lib.lab import dry_runs, random_layouts
    from course_lib.virtual.dry_run import check_dry_run
    planned = dry_runs.random_layouts(24, seed=0)
    trained = random_layouts.draw(40, seed=3)
    orders = [layout.order for _, _, layout in planned]
    assert None in orders and any(o and o[0] == "pp" for o in orders) and len(set(orders)) >= 6
    kinds = [dims.get("order") for _, _, _, dims, _, _ in trained]
    assert None in kinds and len(set(kinds)) >= 6 and MESH_ORDER not in kinds
    for model, _, layout in planned[:6]:
        check_dry_run(model, layout)                     # an order is a layout the ranks accept
    monkeypatch.setattr(dry_runs, "_order", lambda rng: None)
    monkeypatch.setattr(random_layouts, "_order", lambda rng: None)
    assert [(m, hw, layout.with_(order=None)) for m, hw, layout in planned] == dry_runs.random_layouts(24, seed=0)
    strip = [(w, name, cfg, {k: v for k, v in dims.items() if k != "order"}, kw, b)
             for w, name, cfg, dims, kw, b in trained]
    assert strip == random_layouts.draw(40, seed=3)
