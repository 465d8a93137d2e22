"""course_lib/parallel/pipeline/ (+ course_lib/schedules.py): every schedule equal
to one device (losses, gradients through the parameters, parameters) over 5 steps, p = 2, 3, 4,
m = 1..8 (m < p too), tied embeddings, DP around PP, and torch.distributed.pipelining.
Few launches, each running many configurations."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import course_lib
from course_lib import reference, tolerance
from course_lib.models import GPTConfig, TinyGPT
from course_lib import schedules as S
from course_lib.parallel.mesh import Mesh
from course_lib.collectives.comm import Comm
from course_lib.launch import RankError
from course_lib.parallel.pipeline import PipelineParallel, TorchPipeline, measured_costs, partition_layers, run_schedule

STEPS = 5


def _cfg(tied):
    return GPTConfig(vocab_size=32, seq_len=8, n_layers=8, hidden=16, n_heads=2, tie_embeddings=tied)


def _sgd_steps(pipe, batches, lr=0.5):
    """Train ``pipe`` one SGD step per batch; its losses (the whole batch's, every rank) and its
    largest gradient element (the G of course_lib.tolerance's SGD bound)."""
    opt = torch.optim.SGD(pipe.parameters(), lr=lr)
    losses, largest = [], 0.0
    for x, y in batches:
        losses.append(pipe.step(x, y))
        largest = max([largest] + [float(q.grad.abs().max()) for q in pipe.parameters() if q.grad is not None])
        opt.step()
        opt.zero_grad()
    return losses, largest


def _equal_to_one_device(dp, pp, configs, batch=24):
    """On every rank: train each (schedule, m, v, tied) for STEPS steps, compare with one device."""
    mesh = Mesh(dp=dp, pp=pp)
    out = []
    for sched, m, v, tied in configs:
        cfg = _cfg(tied)
        batches = reference.gpt_batches(cfg, batch=batch, steps=STEPS)
        ref = TinyGPT(cfg, seed=0).double()        # float64: exactness after AdamW steps is the claim
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        state, ref_losses = reference.train_gpt(ref, batches, ropt, micro=m * dp)
        pipe = PipelineParallel(TinyGPT(cfg, seed=0).double(), mesh, sched, microbatches=m, v=v)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
        losses = []
        for x, y in batches:
            losses.append(pipe.step(x, y))                          # the global batch: each replica its rows
            opt.step()
            opt.zero_grad()
        got = {name: q.detach() for st in pipe.stages.values() for name, q in st.named_in_model().items()}
        bounds = dict(dtype=torch.float64, optimizer="adamw", steps=STEPS, lr=1e-2)
        out.append((sched, m, v, tied, tolerance.compare(got, {n: state[n] for n in got}, **bounds),
                    tolerance.compare(losses, ref_losses, **bounds)))
    return out


def _suite(jobs):
    """Several checks in one launch (starting ranks costs more than a small run)."""
    out = {}
    for name, fn, args in jobs:
        out[name] = fn(*args)
    return out


def _check(rows):
    for sched, m, v, tied, params, losses in rows:
        assert params and losses, f"{sched} m={m} v={v} tied={tied}: differs from one device: {params} {losses}"


@pytest.fixture(scope="module")
def two_ranks():
    configs = [("gpipe", 1, 1, True), ("gpipe", 3, 1, False), ("1f1b", 2, 1, True), ("1f1b", 8, 1, False),
               ("zb-h1", 1, 1, False), ("zb-h1", 4, 1, True), ("zb-h1", 8, 1, True),
               ("interleaved", 4, 2, True), ("interleaved", 2, 4, False), ("interleaved", 3, 2, False),
               ("interleaved", 1, 3, True)]             # m = 3, 1: torch's one round of N = m
    torch_configs = [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2), ("interleaved", 3, 2), ("zb-h1", 4, 1)]
    jobs = [("equal", _equal_to_one_device, (1, 2, configs)), ("torch", _same_as_torch, (torch_configs,)),
            ("bad", _bad_ranks, ()), ("input grad", _input_grads, ()), ("names", _names_on_ranks, ()),
            ("scale grads", _scale_grads, ())]
    return course_lib.launch(_suite, 2, jobs, timeout=180)


def test_p2_every_schedule_and_m(two_ranks):
    for rank in two_ranks:
        _check(rank["equal"])


def test_p3_m_below_p():
    configs = [("gpipe", 2, 1, True), ("1f1b", 1, 1, True), ("zb-h1", 6, 1, False), ("interleaved", 3, 2, True),
               ("interleaved", 2, 2, False), ("interleaved", 4, 2, False)]    # m < p; m = 4: one round of 4
    for rank in course_lib.launch(_equal_to_one_device, 3, 1, 3, configs, timeout=180):
        _check(rank)


def test_p4_and_dp_around_pp():
    configs4 = [("gpipe", 6, 1, False), ("1f1b", 2, 1, True), ("zb-h1", 3, 1, True), ("interleaved", 4, 2, True)]
    configs22 = [("1f1b", 2, 1, True), ("zb-h1", 3, 1, True), ("interleaved", 2, 2, True)]
    jobs = [("p4", _equal_to_one_device, (1, 4, configs4)), ("dp2pp2", _equal_to_one_device, (2, 2, configs22))]
    for rank in course_lib.launch(_suite, 4, jobs, timeout=180):
        _check(rank["p4"])
        _check(rank["dp2pp2"])


def _same_as_torch(configs):
    mesh = Mesh(pp=dist.get_world_size())
    out = []
    for sched, m, v in configs:
        cfg = _cfg(sched == "1f1b")            # one tied: torch's schedules leave it to us, as ours
        batches = reference.gpt_batches(cfg, batch=8 if 8 % m == 0 else 4 * m, steps=3)
        runs = []
        for cls in (PipelineParallel, TorchPipeline):
            pipe = cls(TinyGPT(cfg, seed=0).double(), mesh, sched, microbatches=m, v=v)
            losses, largest = _sgd_steps(pipe, batches)
            runs.append((losses, largest, {f"{i}": q.detach().clone() for i, q in enumerate(
                q for st in pipe.stages.values() for q in st.parameters())}))
        (ours, g, params), (theirs, _, torch_params) = runs
        bounds = dict(dtype=torch.float64, optimizer="sgd", steps=3, lr=0.5, grad_scale=g)
        checks = [tolerance.compare(params, torch_params, **bounds)]
        if mesh.coord["pp"] == mesh.sizes["pp"] - 1:    # torch reports losses on the last stage
            checks.append(tolerance.compare(ours, theirs, **bounds))
        out.append((sched, m, v, checks))
    return out


def test_same_as_torch_pipelining(two_ranks):
    for rank in two_ranks:
        for sched, m, v, checks in rank["torch"]:
            assert all(checks), f"{sched}: ours and torch.distributed.pipelining differ: {checks}"


# ---------------------------------------------------------------- schedules as data (no ranks)

@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 2), (4, 8), (4, 16)])
def test_simulated_bubble_matches_formula(p, m):
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1)):
        sched = S.make_schedule(name, p, m, v)
        spans = S.simulate(sched, p, v)
        assert S.bubble(spans) == pytest.approx(S.formula_bubble(name, p, m, v), abs=1e-9), name


def _torch_interleaved(torch_schedules, p, m, v):
    """torch's ScheduleInterleaved1F1B order, computed as its constructor does (no ranks): its
    rounds, max(1, m // p), of m / rounds micro-batches; None where torch refuses m."""
    rounds = max(1, m // p)
    if m % rounds:
        return None
    fake = SimpleNamespace(pp_group_size=p, n_local_stages=v, microbatches_per_round=m // rounds,
                           _n_microbatches=m)
    op = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    return [[S.Action(op[a.computation_type.name], a.stage_index, a.microbatch_index)
             for a in torch_schedules.ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, r)
             if a is not None] for r in range(p)]


def test_interleaved_is_torchs_order_for_every_m():
    """Ours is torch's interleaved order wherever torch runs one (m < p and m not a multiple of p
    included: Llama 3's N = 5 of p = 4, m = 10), refused where torch refuses; with any group
    N >= p the bubble stays (p - 1)/(v m + p - 1), below p it is the formula's m < p case."""
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    ran = 0
    for p in range(1, 6):
        for v in (2, 3, 4):
            for m in range(1, 21):
                theirs = _torch_interleaved(torch_schedules, p, m, v)
                if theirs is None:
                    with pytest.raises(ValueError, match="rounds"):
                        S.interleaved_1f1b(p, m, v)
                    continue
                ours = S.interleaved_1f1b(p, m, v)
                assert ours == theirs, (p, m, v)
                ran += 1
                for n in (d for d in range(min(p, m), m + 1) if m % d == 0):
                    sched = S.validate(S.interleaved_1f1b(p, m, v, group=n), p, m, v)
                    spans = S.simulate(sched, p, v, t_f=1 / v, t_b=2 / v)
                    assert S.bubble(spans) == pytest.approx(S.bubble_fraction(p, m, "interleaved", v), abs=1e-9)
    assert ran == 213
    assert S.microbatch_group(4, 10) == 5 and S.microbatch_group(4, 8) == 4 and S.microbatch_group(4, 3) == 3


def test_zero_bubble_formula_exact_for_every_m():
    """ZB-H1's formula is its own timeline's bubble for m < p too (no steady state: the last
    micro-batch walks back through every stage before rank 0's last W), on the clock it is built on."""
    for p in range(2, 5):
        for m in range(1, 9):
            for scale in (1.0, 0.5):
                spans = S.simulate(S.zero_bubble_h1(p, m), p, t_f=scale, t_b=2 * scale, t_w=scale)
                assert S.bubble(spans) == pytest.approx(
                    S.formula_bubble("zb-h1", p, m, t_f=scale, t_b=2 * scale, t_w=scale), abs=1e-12), (p, m)
    assert S.formula_bubble("zb-h1", 4, 1) == pytest.approx(6 / 9)    # F, B through 4 stages, then W


def test_schedule_names_and_chunks():
    """torch's names (any case) are the same schedules; an unknown name or v > 1 outside the
    interleaved schedule is a ValueError naming what is allowed."""
    for alias, name, v in (("GPipe", "gpipe", 1), ("1F1B", "1f1b", 1), ("Interleaved1F1B", "interleaved", 2),
                           ("scheduleinterleaved1f1b", "interleaved", 2), ("ZB-H1", "zb-h1", 1)):
        assert S.make_schedule(alias, 2, 4, v) == S.make_schedule(name, 2, 4, v), alias
    with pytest.raises(ValueError, match=r"schedule must be one of .*'gpipe'.*got 'pipedream'"):
        S.make_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match="got 'InterleavedZeroBubble'"):   # not the same schedule as zb-h1
        S.make_schedule("InterleavedZeroBubble", 2, 4)
    for name in ("gpipe", "1f1b", "zb-h1"):
        with pytest.raises(ValueError, match="v=2 chunks per rank needs the interleaved schedule"):
            S.make_schedule(name, 2, 4, 2)


def test_simulated_bubble_matches_planner():
    """The two simulators run the same schedule: given the planner's own action times (its stages
    are nearly equal: the last one also holds the head), ours finds the planner's bubble."""
    from course_lib.planner import HARDWARE, Layout, ModelSpec, simulate
    ideal = HARDWARE["h100-sxm"].with_(nvlink_latency=0, network_latency=0, nvlink_bandwidth=1e30,
                                       network_bandwidth=1e30, elementwise_passes=0)
    even = ModelSpec("even", 48, 1024, 16, 16, 4096, 2, 1024)
    p = 4
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        sim = simulate(even, ideal, Layout(pp=p, schedule=name, v=v, global_batch=8))
        durations = {}
        for s in sim:
            if s.kind == "compute" and s.name[0] in "FB":
                mb, _, ch = s.name[1:].partition(".")
                stage = int(ch or 0) * p + s.rank
                durations[f"{s.name[0]}{mb}" + (f"@{stage}" if stage else "")] = s.duration
        ours = S.simulate(S.make_schedule(name, p, 8, v), p, v, durations=durations)
        assert S.bubble(ours, rank=0) == pytest.approx(sim.bubble(0), abs=1e-6), name
        assert S.bubble(S.simulate(S.make_schedule(name, p, 8, v), p, v)) == pytest.approx(
            S.formula_bubble(name, p, 8, v), abs=1e-9)


def test_simulated_costs_between_actions():
    """GPipe, p=2, m=1: F, message, F, overhead, B, message, B: the step is 6 + 2 t_comm + t_overhead;
    and measured_costs reads both costs back from a simulated trace of 1F1B and interleaved."""
    spans = S.simulate(S.gpipe(2, 1), 2, t_comm=0.25, t_overhead=0.125)
    compute = [s for s in spans if s.kind == "compute"]
    assert max(s.end for s in compute) - min(s.start for s in compute) == pytest.approx(6.5 + 0.125)
    for name, v in (("1f1b", 1), ("interleaved", 2)):
        sched = S.make_schedule(name, 2, 8, v)
        c = measured_costs(S.simulate(sched, 2, v, t_comm=0.25, t_overhead=0.125), sched, 2, v)
        assert (c["t_comm"], c["t_overhead"]) == pytest.approx((0.25, 0.125)), name
        assert S.bubble(S.simulate(sched, 2, v, durations=c["durations"])) == pytest.approx(
            S.formula_bubble(name, 2, 8, v), abs=1e-9)


def test_activation_peaks():
    p, m = 4, 8
    assert [S.in_flight(r) for r in S.gpipe(p, m)] == [m] * p
    assert [S.in_flight(r) for r in S.one_f_one_b(p, m)] == [4, 3, 2, 1]
    assert [S.in_flight(r) for r in S.zero_bubble_h1(p, m)] == [p] * p   # 1F1B's first-stage peak


def test_validator_names_the_first_bad_action():
    good = S.one_f_one_b(2, 2)
    assert S.validate(good, 2, 2) == good
    cases = [
        ([[("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)],
          [("F", 1, 1), ("B", 1, 1), ("F", 1, 0), ("B", 1, 0)]], "deadlock: rank 0, action 1 B0"),
        ([[("B", 0, 0), ("F", 0, 0)], [("F", 1, 0), ("B", 1, 0)]], "rank 0, action 0 B0: B of stage 0"),
        ([[("F", 0, 0), ("B", 0, 0)], [("F", 1, 0)]], "rank 1: B of stage 1, micro-batch 0 is missing"),
        ([[("F", 1, 0)], []], "stage 1 lives on rank 1"),
        ([[("X", 0, 0)], []], "op 'X'"),
        ([[("F", 0, 0), ("F", 0, 0)], []], "runs twice"),
        ([[("F", 0, 0), ("B", 0, 0)]], "expected 2 lists"),
        ([[("F", 0, 5)], []], "micro-batch 5 is outside"),
    ]
    for sched, message in cases:
        m = 2 if message.startswith(("deadlock", "micro-batch 5")) else 1
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            S.validate(sched, 2, m)


def test_a_validated_schedule_is_checked_once(monkeypatch):
    """What validate returns, validated again for the same (p, m, v) and unchanged, is returned as
    is (no second simulation); changed, or for another (p, m, v), it is checked again."""
    calls = []
    simulate = S.simulate
    monkeypatch.setattr(S, "simulate", lambda *a, **k: calls.append(a) or simulate(*a, **k))
    checked = S.validate(S.one_f_one_b(2, 2), 2, 2)
    assert len(calls) == 1 and checked == S.one_f_one_b(2, 2)
    assert S.validate(checked, 2, 2) is checked and S.simulate(checked, 2) and len(calls) == 2   # no new check
    with pytest.raises(ValueError, match="micro-batch 1 is outside"):
        S.validate(checked, 2, 1)
    checked[0][0], checked[0][1] = checked[0][1], checked[0][0]           # F1 before F0: still valid
    assert S.validate(checked, 2, 2) is not checked and len(calls) == 3
    checked[1].reverse()                                                  # B before F
    with pytest.raises(ValueError, match="comes before its F"):
        S.validate(checked, 2, 2)


def _mlp(seed, layers=2, h=8):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[mod for _ in range(layers) for mod in (torch.nn.Linear(h, h), torch.nn.ReLU())])


def _input_grads(m=4):
    """Each schedule on 2 ranks with inputs that want a gradient: stage 0 fills their .grad
    (split backward too) and the parameters' gradients, as one device's backward does."""
    me = dist.get_rank()
    out = {}
    for name in ("gpipe", "1f1b", "zb-h1"):
        xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(m)]
        stage = _mlp(me)
        run_schedule(S.make_schedule(name, 2, m), {me: stage}, Comm(None), p=2, m=m, inputs=xs, targets=xs,
                     loss_fn=lambda o, t: (o - t.detach()).pow(2).sum(), act_shape=(3, 8))
        out[name] = ([x.grad for x in xs] if me == 0 else None, [q.grad for q in stage.parameters()])
    return out


def test_input_gradient_every_schedule(two_ranks):
    whole = torch.nn.Sequential(*_mlp(0), *_mlp(1))
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(4)]
    sum((whole(x) - x.detach()).pow(2).sum() for x in xs).backward()
    grads = [q.grad for q in whole.parameters()]
    for name in ("gpipe", "1f1b", "zb-h1"):
        x_grads, g0 = two_ranks[0]["input grad"][name]
        g1 = two_ranks[1]["input grad"][name][1]
        assert x_grads[0] is not None, f"{name}: stage 0's input has no gradient"
        for x, g in zip(xs, x_grads):
            tolerance.assert_matches(g, x.grad, what=f"{name}: input gradient differs from one device")
        for q, g in zip(grads, g0 + g1):
            tolerance.assert_matches(g, q, what=f"{name}: parameter gradient differs from one device")


def test_bad_input():
    with pytest.raises(ValueError, match="more pipeline stages"):
        partition_layers(3, 4)
    with pytest.raises(ValueError, match="rounds of equal size"):
        S.interleaved_1f1b(4, 9, 2)          # 2 rounds (torch's rule) of 4.5
    with pytest.raises(ValueError, match="must divide m"):
        S.interleaved_1f1b(4, 8, 2, group=3)
    with pytest.raises(ValueError, match="below min\\(p, m\\)"):
        S.interleaved_1f1b(4, 8, 2, group=2)
    with pytest.raises(ValueError, match="m \\(micro-batches\\)"):
        S.one_f_one_b(2, 0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        S.make_schedule("pipedream", 2, 2)
    assert [list(r) for r in partition_layers(10, 4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def _bad_ranks():
    out = []
    for make in (lambda: Mesh(pp=3),                                       # 2 ranks, mesh of 3
                 lambda: PipelineParallel(TinyGPT(_cfg(False)), Mesh(pp=2), "interleaved", 5, v=2),
                 lambda: PipelineParallel(TinyGPT(_cfg(False)), Mesh(pp=2), "1f1b", 4, v=1).step(
                     torch.zeros(6, 8, dtype=torch.long), torch.zeros(6, 8, dtype=torch.long)),
                 lambda: PipelineParallel(TinyGPT(_cfg(False)), Mesh(pp=2), S.one_f_one_b(3, 2), 2),
                 lambda: run_schedule(S.one_f_one_b(3, 2), {}, Comm(None), p=3, m=2)):
        try:
            make()
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


def test_bad_input_on_ranks(two_ranks):
    msgs = two_ranks[0]["bad"]
    assert "world has 2 ranks" in msgs[0]
    assert "rounds of equal size" in msgs[1]        # m = 5 on p = 2: torch's 2 rounds of 2.5
    assert "must cut into microbatches=4" in msgs[2]
    assert "expected 2 lists" in msgs[3]
    assert "pipeline group of p ranks; this one has 2" in msgs[4]


def _names_on_ranks():
    """The pipelines' constructors: torch's names accepted, the rest a ValueError on every rank."""
    cfg, mesh = _cfg(False), Mesh(pp=2)
    ours = PipelineParallel(TinyGPT(cfg), mesh, "1F1B", 4)
    theirs = TorchPipeline(TinyGPT(cfg), mesh, "Interleaved1F1B", 4, v=2)
    out = {"ours 1F1B": ours.schedule == S.one_f_one_b(2, 4),
           "torch Interleaved1F1B": (type(theirs.schedule).__name__, len(theirs.stages))}
    for label, make in (("torch pipedream", lambda: TorchPipeline(TinyGPT(cfg), mesh, "pipedream", 4)),
                        ("ours 1f1b v=2", lambda: PipelineParallel(TinyGPT(cfg), mesh, "1f1b", 4, v=2)),
                        ("torch zb-h1 v=2", lambda: TorchPipeline(TinyGPT(cfg), mesh, "zb-h1", 4, v=2)),
                        ("torch batch 10, m=4", lambda: TorchPipeline(TinyGPT(cfg), mesh, "1f1b", 4).step(
                            torch.zeros(10, 8, dtype=torch.long), torch.zeros(10, 8, dtype=torch.long)))):
        try:
            make()
            out[label] = "no error"
        except ValueError as e:
            out[label] = str(e)
    return out


def test_names_and_bad_input_on_every_rank(two_ranks):
    for rank in two_ranks:
        got = rank["names"]
        assert got["ours 1F1B"] and got["torch Interleaved1F1B"] == ("ScheduleInterleaved1F1B", 2)
        assert "schedule must be one of" in got["torch pipedream"] and "'1f1b'" in got["torch pipedream"]
        assert "needs the interleaved schedule" in got["ours 1f1b v=2"]
        assert "needs the interleaved schedule" in got["torch zb-h1 v=2"]
        assert "must cut into microbatches=4" in got["torch batch 10, m=4"]


def _scale_grads(m=4):
    """A mean loss_fn with scale_grads=True: our gradients against torch's ScheduleGPipe /
    Schedule1F1B (scale_grads=True, their default) on the same stages and data."""
    from torch.distributed import pipelining
    me = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    out = {}
    for name in ("gpipe", "1f1b", "zb-h1"):
        stage = _mlp(me)
        res = run_schedule(S.make_schedule(name, 2, m), {me: stage}, Comm(None), p=2, m=m, inputs=list(x.chunk(m)),
                           targets=list(y.chunk(m)), loss_fn=F.mse_loss, act_shape=(8 // m, 8), scale_grads=True)
        ours = [q.grad for q in stage.parameters()]
        theirs = None
        if name != "zb-h1":
            stage2 = _mlp(me)
            cls = pipelining.ScheduleGPipe if name == "gpipe" else pipelining.Schedule1F1B
            sched = cls(pipelining.PipelineStage(stage2, me, 2, torch.device("cpu")), m, loss_fn=F.mse_loss,
                        scale_grads=True)
            sched.step(*((x,) if me == 0 else ()), target=y if me == 1 else None)
            theirs = [q.grad for q in stage2.parameters()]
        out[name] = (ours, theirs, res.losses)
    return out


def test_scale_grads_like_torch_and_one_device(two_ranks):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    whole = torch.nn.Sequential(*_mlp(0), *_mlp(1))
    F.mse_loss(whole(x), y).backward()                    # one device: the mean over the whole batch
    one_device = [q.grad for q in whole.parameters()]
    for name in ("gpipe", "1f1b", "zb-h1"):
        ours = two_ranks[0]["scale grads"][name][0] + two_ranks[1]["scale grads"][name][0]
        for a, b in zip(ours, one_device):
            tolerance.assert_matches(a, b, what=f"{name}: scale_grads=True differs from one device")
        if name != "zb-h1":
            theirs = two_ranks[0]["scale grads"][name][1] + two_ranks[1]["scale grads"][name][1]
            for a, b in zip(ours, theirs):
                tolerance.assert_matches(a, b, what=f"{name}: scale_grads=True differs from torch's")
        losses = two_ranks[1]["scale grads"][name][2]     # loss_fn's values, unscaled (as torch's)
        tolerance.assert_matches([sum(losses.values()) / 4], [F.mse_loss(whole(x), y).item()], what="loss")


def _one_rank_interleaved():
    """pp = 1, interleaved with v = 2: both stages on this rank (hand-over in memory, one tied matrix)."""
    out = []
    for tied in (False, True):
        cfg = _cfg(tied)
        batches = reference.gpt_batches(cfg, batch=4, steps=3)
        ref = TinyGPT(cfg, seed=0).double()        # float64: exactness after the steps is the claim
        state, ref_losses = reference.train_gpt(ref, batches, torch.optim.SGD(ref.parameters(), lr=0.5), micro=1)
        for cls in (PipelineParallel, TorchPipeline):
            pipe = cls(TinyGPT(cfg, seed=0).double(), Mesh(pp=1), "interleaved", microbatches=2, v=2)
            losses, largest = _sgd_steps(pipe, batches)
            got = {name: q.detach() for st in pipe.stages.values() for name, q in st.named_in_model().items()}
            bounds = dict(dtype=torch.float64, optimizer="sgd", steps=3, lr=0.5, grad_scale=largest)
            checks = [tolerance.compare(got, {n: state[n] for n in got}, **bounds),
                      tolerance.compare(losses, ref_losses, **bounds)]
            one = pipe.stages[0].part.tok_emb.weight is pipe.stages[1].part.lm_head.weight
            messages = pipe.last_result.messages if cls is PipelineParallel else 0
            out.append((cls.__name__, tied, checks, one, messages))
    return out


def test_one_rank_interleaved_equals_one_device():
    for cls, tied, checks, one, messages in course_lib.launch(_one_rank_interleaved, 1, timeout=120)[0]:
        assert all(checks), f"{cls} pp=1 v=2 tied={tied}: differs from one device: {checks}"
        assert one == tied, f"{cls} pp=1 v=2 tied={tied}: tok_emb and lm_head are one parameter: {one}"
        assert messages == 0, f"{cls}: a stage on the same rank sent {messages} messages to itself"


def _wrong_act_shape(act_shape, act_dtype):
    me = dist.get_rank()
    xs = [torch.randn(3, 8) for _ in range(2)]
    run_schedule(S.one_f_one_b(2, 2), {me: _mlp(me)}, Comm(None), p=2, m=2, inputs=xs, targets=xs,
                 loss_fn=F.mse_loss, act_shape=act_shape, act_dtype=act_dtype)


@pytest.mark.parametrize("act_shape,act_dtype", [((3, 6), torch.float32), ((3, 10), torch.float32),
                                                 ((3, 8), torch.float64)])
def test_wrong_act_shape_raises_before_sending(act_shape, act_dtype):
    """The true activation is (3, 8) float32. Before: too small killed the receiver (SIGABRT),
    too big hung it. Now the sender raises before any message; launch stops the receiver."""
    with pytest.raises(RankError) as info:
        course_lib.launch(_wrong_act_shape, 2, act_shape, act_dtype, quiet=True, timeout=20)
    assert info.value.rank == 0 and info.value.exc_type == "ValueError", str(info.value)
    msg = str(info.value)
    assert "(3, 8) torch.float32" in msg and f"act_shape={act_shape}" in msg, msg


def test_reduce_points_are_torchs_reduce_grad():
    """Where ZeRO-2's grad_reduce="chunk" sends a stage's sums (``reduce_points``: its last
    backward) is where torch's pipelining schedules REDUCE_GRAD (``_add_reduce_grad``, on torch's
    own interleaved order); "round" ends are every N-th backward of a stage in that order."""
    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(ts, "_add_reduce_grad"):
        pytest.skip("this torch has no _add_reduce_grad")
    checked = 0
    for p in (2, 3, 4):
        for v in (2, 3):
            for m in (p, p + 1, 2 * p, 3 * p):
                for r, theirs_row in enumerate(_torch_interleaved(ts, p, m, v)):
                    fake = SimpleNamespace(pp_group_size=p, n_local_stages=v, _n_microbatches=m,
                                           microbatches_per_round=S.microbatch_group(p, m))
                    acts = ts._add_reduce_grad(ts.ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, r), m)
                    theirs, prev = [], None
                    for a in (a for a in acts if a is not None):
                        if a.computation_type.name == "REDUCE_GRAD":
                            theirs.append((prev.stage_index, prev.microbatch_index))
                        else:
                            prev = a
                    points = S.reduce_points(S.interleaved_1f1b(p, m, v)[r])
                    assert [(a.stage, a.mb) for a, (_, last) in points.items() if last] == theirs, (p, m, v, r)
                    ends = [k for k, (a, (end, _)) in enumerate(points.items()) if end]
                    n = S.microbatch_group(p, m)
                    assert ends == [k for k in range(len(points)) if (k + 1) % n == 0], (p, m, v, r)
                    checked += 1
    assert checked == 72
