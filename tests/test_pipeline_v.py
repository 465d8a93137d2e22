"""ZB-V and DualPipeV (issue #37 item 1): the action lists (torch's orders, validated once),
the V placement (rank r holds stages r and 2p - 1 - r), equal to one device over several AdamW
steps for p = 2 and 4 and several m (odd ones included), the same losses and parameters as
torch's ScheduleZBVZeroBubble / ScheduleDualPipeV on the same stages, and the bubble and
activation formulas next to the simulated timeline. Two launches (2 and 4 ranks)."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import course_lib
from course_lib import reference, tolerance
from course_lib import schedules as S
from course_lib.models import GPTConfig, TinyGPT
from course_lib.parallel.mesh import Mesh
from course_lib.parallel.pipeline import PipelineParallel, TorchPipeline, rank_stages

STEPS = 3
torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
HAS_TORCH_V = all(hasattr(torch_schedules, c) for c in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"))


def _cfg(tied, n_layers=8):
    return GPTConfig(vocab_size=32, seq_len=8, n_layers=n_layers, hidden=16, n_heads=2, tie_embeddings=tied)


def _equal(configs, torch_configs):
    """On every rank: each (schedule, m, tied, n_layers) trained STEPS AdamW steps (float64) next to
    one device; each (schedule, m) of ``torch_configs`` 2 SGD steps next to torch's schedule."""
    mesh = Mesh(pp=dist.get_world_size())
    out = {"equal": [], "torch": [], "placement": None}
    if dist.get_world_size() == 4:                 # parallelize_nd(..., schedule=<a V name>), dp=2 x pp=2
        out["nd"] = _nd_step("ZBVZeroBubble", 3)
    for sched, m, tied, n_layers in configs:
        cfg = _cfg(tied, n_layers)
        batches = reference.gpt_batches(cfg, batch=2 * m, steps=STEPS)
        ref = TinyGPT(cfg, seed=0).double()
        state, ref_losses = reference.train_gpt(ref, batches, torch.optim.AdamW(ref.parameters(), lr=1e-2), micro=m)
        pipe = PipelineParallel(TinyGPT(cfg, seed=0).double(), mesh, sched, microbatches=m)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        losses = reference.train_parallel(pipe, batches, opt)
        got = {n: q.detach() for st in pipe.stages.values() for n, q in st.named_in_model().items()}
        bounds = dict(dtype=torch.float64, optimizer="adamw", steps=STEPS, lr=1e-2)
        out["equal"].append((sched, m, tied, n_layers, tolerance.compare(got, {n: state[n] for n in got}, **bounds),
                             tolerance.compare(losses, ref_losses, **bounds)))
        out["placement"] = sorted(pipe.stages)
        out.setdefault("tied_one_parameter", []).append(
            tied and pipe.stages[0].part.tok_emb.weight is pipe.stages[2 * mesh.sizes["pp"] - 1].part.lm_head.weight
            if 0 in pipe.stages else None)
    for sched, m in torch_configs:
        cfg = _cfg(True)
        batches = reference.gpt_batches(cfg, batch=2 * m, steps=2)
        runs = []
        for cls in (PipelineParallel, TorchPipeline):
            pipe = cls(TinyGPT(cfg, seed=0).double(), mesh, sched, microbatches=m)
            opt, losses = torch.optim.SGD(pipe.parameters(), lr=0.5), []
            grads = None
            for x, y in batches:
                losses.append(pipe.step(x, y))
                grads = grads or {f"{s}.{n}": q.grad.clone() for s, st in pipe.stages.items()
                                  for n, q in st.named_parameters()}
                opt.step()
                opt.zero_grad()
            runs.append((losses, grads, {f"{s}.{n}": q.detach().clone() for s, st in pipe.stages.items()
                                         for n, q in st.named_parameters()},
                         pipe.actions() if cls is TorchPipeline else None))
        (ours, g_ours, p_ours, _), (theirs, g_theirs, p_theirs, torch_order) = runs
        g = max(float(t.abs().max()) for t in g_ours.values())
        bounds = dict(dtype=torch.float64, optimizer="sgd", steps=2, lr=0.5, grad_scale=g)
        checks = [tolerance.compare(p_ours, p_theirs, **bounds),
                  tolerance.compare(g_ours, g_theirs, dtype=torch.float64)]      # the first step's gradients
        if 0 in pipe.stages:                                   # the last stage sits on rank 0: the losses
            checks.append(tolerance.compare(ours, theirs, **bounds))
        same_order = torch_order == [list(row) for row in S.make_schedule(sched, mesh.sizes["pp"], m)]
        out["torch"].append((sched, m, checks, same_order))
    return out


@pytest.fixture(scope="module")
def runs():
    # m < 2p - 1 (the V never fills), odd m, uneven layers (5, 9 over 2p stages), tied and not
    two = [("zb-v", 1, True, 8), ("zb-v", 3, False, 5), ("dualpipe-v", 5, True, 6)]
    four = [("zb-v", 3, True, 8), ("dualpipe-v", 9, False, 9)]
    torch2 = [("zb-v", 3), ("dualpipe-v", 4)] if HAS_TORCH_V else []
    torch4 = [("zb-v", 5), ("dualpipe-v", 8)] if HAS_TORCH_V else []
    return (course_lib.launch(_equal, 2, two, torch2, timeout=240),
            course_lib.launch(_equal, 4, four, torch4, timeout=240))


def test_parallelize_nd_takes_the_v_names(runs):
    for rank in runs[1]:
        pp, stages, same = rank["nd"]
        assert stages == [pp, 3 - pp] and same, (pp, stages, same)


def test_equal_to_one_device_p2_p4(runs):
    for p, ranks in zip((2, 4), runs):
        for r, rank in enumerate(ranks):
            assert rank["placement"] == [r, 2 * p - 1 - r], rank["placement"]      # the V
            for sched, m, tied, n_layers, params, losses in rank["equal"]:
                assert params and losses, f"p={p} {sched} m={m} tied={tied} L={n_layers}: {params} {losses}"
            if r == 0:       # first and last stage on rank 0: a tied embedding stays one parameter
                tied = [c[2] for c in rank["equal"]]
                assert rank["tied_one_parameter"] == tied


@pytest.mark.skipif(not HAS_TORCH_V, reason="this torch has no ScheduleZBVZeroBubble / ScheduleDualPipeV")
def test_same_as_torch(runs):
    for ranks in runs:
        for rank in ranks:
            for sched, m, checks, same_order in rank["torch"]:
                assert same_order, f"{sched} m={m}: torch's pipeline_order differs from ours"
                assert all(checks), f"{sched} m={m}: ours and torch's differ: {checks}"


# ---------------------------------------------------------------- the schedules as data (no ranks)

def _torch_order(cls, p, m):
    """torch's per-rank order, computed as its constructor does (no ranks needed): its I is our B,
    DualPipeV's overlapped F&B pair its forward then its backward (torch's runtime runs them so)."""
    op = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    fake = SimpleNamespace(pp_group_size=p, num_stages=2 * p, _n_microbatches=m)
    return [[S.Action(op[b.computation_type.name], b.stage_index, b.microbatch_index)
             for a in cls._calculate_single_rank_operations(fake, r) if a is not None
             for b in (a.sub_actions or (a,))] for r in range(p)]


@pytest.mark.skipif(not HAS_TORCH_V, reason="this torch has no ScheduleZBVZeroBubble / ScheduleDualPipeV")
def test_action_lists_are_torchs_and_valid():
    for p in (1, 2, 3, 4, 5):
        for m in range(1, 13):
            zbv = S.make_schedule("zb-v", p, m)
            assert zbv == _torch_order(torch_schedules.ScheduleZBVZeroBubble, p, m), (p, m)
            assert S.validate(zbv, p, m, 2).placement == ("v" if p > 1 else "loop")
            if m >= 2 * p:
                dpv = S.make_schedule("DualPipeV", p, m)
                assert dpv == _torch_order(torch_schedules.ScheduleDualPipeV, p, m), (p, m)
                S.validate(dpv, p, m, 2)


def test_v_placement_and_names():
    assert [S.stage_rank(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [S.stage_rank(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert S.rank_stage_ids(1, 3, 2, "v") == [1, 4]
    for name, canon in (("ZB-V", "zb-v"), ("ZBVZeroBubble", "zb-v"), ("ScheduleDualPipeV", "dualpipe-v")):
        assert S.schedule_name(name) == canon and S.chunks(name) == 2 and S.placement_of(name) == "v"
    assert S.chunks("1f1b") == 1 and S.chunks("interleaved", 3) == 3
    with pytest.raises(ValueError, match="two chunks per rank in V order"):
        S.schedule_name("zb-v", 3)
    stages = rank_stages(TinyGPT(_cfg(True)), 0, 2, 2, "v")
    assert sorted(stages) == [0, 3] and stages[0].part.tok_emb.weight is stages[3].part.lm_head.weight


def test_refusals_name_the_constraint():
    with pytest.raises(ValueError, match=r"dualpipe-v needs at least 2p = 8 micro-batches.*m=7"):
        S.make_schedule("dualpipe-v", 4, 7)
    with pytest.raises(ValueError, match="m \\(micro-batches\\) must be an integer >= 1"):
        S.make_schedule("zb-v", 2, 0)
    # a V list run with v=1 (the validator reads the placement from the lists: v=2 only)
    with pytest.raises(ValueError, match="stage 3 is outside 0..1"):
        S.validate(S.make_schedule("zb-v", 2, 2), 2, 2, 1)
    bad = [list(row) for row in S.make_schedule("zb-v", 2, 2)]
    bad[0][0] = S.Action("F", 2, 0)                           # stage 2 is rank 1's (V) and rank 0's (loop)
    with pytest.raises(ValueError, match=r"rank 0, action \d+ F\d@3: stage 3 lives on rank 1 \(V order, v=2: 0\)"):
        S.validate(bad, 2, 2, 2)
    with pytest.raises(ValueError, match="more pipeline stages \\(8\\) than layers \\(4\\)"):
        PipelineParallel(TinyGPT(_cfg(True, 4)), SimpleNamespace(sizes={"pp": 4}, coord={"pp": 0}), "zb-v")
    from course_lib.parallel.compose import check_layout
    with pytest.raises(ValueError, match="zb-v computes weight gradients outside autograd"):
        check_layout(_cfg(True), pp=2, dp=2, schedule="zb-v", microbatches=2, data="fsdp", batch=8)
    check_layout(_cfg(True), pp=2, schedule="dualpipe-v", microbatches=4, batch=8)    # two chunks: 4 of 8 layers
    with pytest.raises(ValueError, match="dualpipe-v needs at least 2p = 4"):
        check_layout(_cfg(True), pp=2, schedule="dualpipe-v", microbatches=3, batch=6)


def _idle(name, p, m, t_f, t_b, t_w):
    spans = [s for s in S.simulate(S.make_schedule(name, p, m), p, 2, t_f=t_f, t_b=t_b, t_w=t_w)
             if s.kind == "compute"]
    step = max(s.end for s in spans) - min(s.start for s in spans)
    return [step - sum(s.end - s.start for s in spans if s.rank == r) for r in range(p)]


def test_bubble_and_memory_next_to_the_formulas():
    for p in (2, 3, 4):
        for m in (2 * p, 2 * p + 1, 3 * p + 1):
            for scale in (1.0, 0.25):      # F = B - W = W: ZB-V's formula exact (its "zero bubble" case)
                idle = _idle("zb-v", p, m, scale, 2 * scale, scale)
                assert idle == pytest.approx([S.formula_idle("zb-v", p, scale, 2 * scale, scale)] * p, abs=1e-12)
            for t_f, t_b, t_w in ((1, 2, 1), (1, 2, 0.5), (1, 3, 1.5), (2, 2, 1), (1, 4, 1)):
                # DeepSeek's DualPipe formula with F&B = F + B (no overlap): an upper bound on every rank
                idle = _idle("dualpipe-v", p, m, t_f, t_b, t_w)
                assert max(idle) <= S.formula_idle("dualpipe-v", p, t_f, t_b, t_w) + 1e-12, (p, m, idle)
            # 1F1B on stages of two chunks has (p - 1)(F + B) of a stage: ZB-V's is smaller
            assert S.formula_idle("zb-v", p) < S.formula_idle("1f1b", p, 2, 4, 2)
            assert max(S.in_flight(r) for r in S.make_schedule("dualpipe-v", p, m)) == \
                S.formula_peak_activations("dualpipe-v", p, m) == 2 * p + 1
        for m in range(1, 3 * p):
            assert max(S.in_flight(r) for r in S.make_schedule("zb-v", p, m)) == \
                S.formula_peak_activations("zb-v", p, m)
    # when ZB-V does not pay: one micro-batch and no W to move (1F1B's stage = two chunks)
    assert _step("zb-v", 4, 1, 1, 2, 0) == _step("1f1b", 4, 1, 2, 4, 0) == 24
    assert _step("zb-v", 4, 8, 1, 2, 1) < 0.8 * _step("1f1b", 4, 8, 2, 4, 2)   # F = B - W = W, m = 2p


def _step(name, p, m, t_f, t_b, t_w):
    spans = [s for s in S.simulate(S.make_schedule(name, p, m), p, S.chunks(name), t_f=t_f, t_b=t_b, t_w=t_w)
             if s.kind == "compute"]
    return max(s.end for s in spans) - min(s.start for s in spans)


# ---------------------------------------------------------------- the planner prices them

def test_planner_knows_the_v_schedules():
    from course_lib.planner import Layout, estimate
    from course_lib.planner import formulas as F
    for p in (2, 4):
        for m in (2 * p, 3 * p + 1):
            # memory: the planner's in-flight micro-batches (a stage's worth) are the lists' chunks / 2
            for name in ("zb-v", "dualpipe-v"):
                held = max(S.in_flight(r) for r in S.make_schedule(name, p, m)) / 2
                assert F.in_flight_microbatches(p, m, name, stage=p - 1) == held
            # the bubble fraction: formula_bubble at a chunk's F : B : W = 1 : 2 : 1
            assert F.bubble_fraction(p, m, "zb-v") == pytest.approx((p - 1) / (6 * m + p - 1))
            assert F.bubble_fraction(p, m, "dualpipe-v") == pytest.approx((p - 1) / (3 * m + p - 1))
            assert F.bubble_fraction(p, m, "zb-v") < F.bubble_fraction(p, m, "interleaved", 2) < \
                F.bubble_fraction(p, m, "1f1b")
            sim = _idle("zb-v", p, m, 1.0, 2.0, 1.0)             # the real list at F = B - W = W
            assert sim[0] == pytest.approx(F.pipeline_idle("zb-v", p, 2.0, 4.0))
        assert [F.p2p_sends("zb-v", p, st) for st in range(p)] == [2] + [4] * (p - 2) + [2]
    est = {s: estimate("llama3-8b", "h100-sxm", Layout(tp=8, pp=4, schedule=s, global_batch=16))
           for s in ("1f1b", "zb-v", "dualpipe-v")}
    assert est["zb-v"].time["bubble"] < est["dualpipe-v"].time["bubble"] < est["1f1b"].time["bubble"]
    assert est["zb-v"].memory["activations"] == pytest.approx(est["1f1b"].memory["activations"])
    assert est["dualpipe-v"].memory["activations"] == pytest.approx(est["1f1b"].memory["activations"] * 4.5 / 4)
    with pytest.raises(ValueError, match="dualpipe-v needs at least 2p = 8 micro-batches, got 6"):
        estimate("llama3-8b", "h100-sxm", Layout(tp=8, pp=4, schedule="dualpipe-v", global_batch=6))
    with pytest.raises(ValueError, match="schedule_order gives Megatron-LM's orders"):
        S.schedule_order(2, 4, "zb-v", 2, 0)



def _nd_step(schedule, m):
    """parallelize_nd with a V schedule's name (dp=2 around pp=2): (pp coordinate, its stages,
    its parameters after 2 SGD steps next to one device's)."""
    from course_lib.parallel.compose import parallelize_nd
    cfg = _cfg(True)
    batches = reference.gpt_batches(cfg, batch=4 * m, steps=2)
    ref = TinyGPT(cfg, seed=0).double()
    state, _ = reference.train_gpt(ref, batches, torch.optim.SGD(ref.parameters(), lr=0.5), micro=2 * m)
    mesh = Mesh(dp=2, pp=2)
    net = parallelize_nd(TinyGPT(cfg, seed=0).double(), mesh, schedule=schedule, microbatches=m)
    opt, largest = torch.optim.SGD(net.parameters(), lr=0.5), 0.0
    for x, y in batches:
        net.step(x, y)
        largest = max([largest] + [float(q.grad.abs().max()) for q in net.parameters() if q.grad is not None])
        opt.step()
        opt.zero_grad()
    got = {n: q.detach() for st in net.stages.values() for n, q in st.named_in_model().items()}
    return mesh.coord["pp"], sorted(net.stages), tolerance.compare(
        got, {n: state[n] for n in got}, dtype=torch.float64, optimizer="sgd", steps=2, lr=0.5, grad_scale=largest)
