"""The planner's simulator and search know ZB-H1, ZB-V, DualPipeV and the folded expert mesh.

* planner.simulate runs the zero-bubble schedules' own action lists (ZB-H1's one chunk per
  rank, the V schedules' two in a V): on
  equal stages and free links, every rank's idle time is the one the schedule's unit clock
  (``schedules.simulate``, which the virtual clock's runs match: tests/test_pipeline_v.py)
  gives at the same F, B and W; the planner does not share that code (its own event loop).
* search(..., schedules=..., timing="simulate", w_fraction=...) picks a V schedule where the
  weight-gradient part W of a backward is large and there are micro-batches to fill, 1F1B
  where there is neither (W = 0, m = 1: ZB-V's extra messages make it slower), and
  interleaved 1F1B over ZB-V when W = 0 (the V alone halves the fill and drain, as v = 2 does).
* For MoE presets it searches EP, expert TP and the dispatch, ranking by the estimate.
"""
from __future__ import annotations

import pytest
import torch

from course_lib import schedules as S
from course_lib.planner import HARDWARE, Layout, ModelSpec, estimate, simulate
from course_lib.planner.costs import stage_costs
from course_lib.planner.search import search

IDEAL = HARDWARE["h100-sxm"].with_(nvlink_latency=0, network_latency=0, nvlink_bandwidth=1e30,
                                   network_bandwidth=1e30, elementwise_passes=0, sm_count=0)
EVEN = ModelSpec("even", 48, 1024, 16, 16, 4096, 2, 1024)   # a 2-token vocabulary: equal stages
ALL = ("1f1b", "interleaved", "zb-v", "dualpipe-v")


def _idle_per_rank(spans, ranks):
    pipe = [s for s in spans if s.kind != "idle" and not s.name.startswith(("dp ", "optimizer"))]
    end = max(s.end for s in pipe)
    return [end - sum(s.duration for s in pipe if s.rank == r and s.kind == "compute") for r in ranks]


@pytest.mark.parametrize("name", ["zb-h1", "zb-v", "dualpipe-v"])
@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 8), (4, 2), (4, 13)])
@pytest.mark.parametrize("w", [0.5, 0.2])
def test_simulated_v_bubble_is_the_unit_clocks(name, p, m, w):
    if name == "dualpipe-v" and m < 2 * p:
        return
    k = 1 if name == "zb-h1" else 2                  # chunks per rank: a V's two are half its stage each
    layout = Layout(pp=p, schedule=name, global_batch=m)
    sim = simulate(EVEN, IDEAL, layout, w_fraction=w)
    stages = stage_costs(EVEN, IDEAL, layout)
    sched = S.make_schedule(name, p, m)
    split = {(a.stage, a.mb) for row in sched for a in row if a.op == "W"}
    durations = {}
    for r, row in enumerate(sched):
        t_f, t_b = stages[r].fwd_time / k, stages[r].bwd_time / k
        for a in row:
            durations[str(a)] = {"F": t_f, "W": w * t_b}.get(a.op, t_b - w * t_b if (a.stage, a.mb) in split
                                                             else t_b)
    want = _idle_per_rank(S.simulate(sched, p, k, durations=durations), range(p))
    got = _idle_per_rank(sim, sim.ranks)
    t_f, t_b = stages[0].fwd_time / k, stages[0].bwd_time / k
    scale = k * m * (t_f + t_b)                                  # a rank's work per step
    assert got == pytest.approx(want, abs=1e-9 * scale), (got, want)


@pytest.mark.parametrize("name,m", [("zb-h1", 2), ("zb-v", 2), ("zb-h1", 8), ("zb-v", 8), ("dualpipe-v", 8)])
def test_the_estimate_runs_the_action_lists_as_the_simulation_does(name, m):
    """A schedule with W actions is not steady state where the V never fills (m = 2 < 2p - 1),
    and its stages are not equal (a V's rank 0 holds the embedding and the LM head): the
    estimate's pipeline phase is the action lists run on the stages' costs
    (``simulator.pipeline_phase``), the simulation's, to the rounding; Table 2's steady state
    (``formulas.pipeline_idle``) was 20% short at m = 2."""
    layout = Layout(pp=4, schedule=name, global_batch=m)
    sim = simulate(EVEN, IDEAL, layout)
    est = estimate(EVEN, IDEAL, layout)
    pipe = max(s.end for s in sim if s.name[:1] in "FBW")
    assert est.step_time - est.time["optimizer"] - est.time["dp"] == pytest.approx(pipe, rel=1e-9)
    assert est.step_time == pytest.approx(sim.step_time, rel=1e-5)


def _best(global_batch, w, schedules=ALL, n=8, tp=2, model="llama3-8b"):
    r = search(model, "h100-sxm", n, global_batch, micro_batches=(1,), recomputes=("none",),
               zero_stages=(0,), cp_sizes=(1,), tp_sizes=(tp,), pp_sizes=(4,), schedules=schedules,
               timing="simulate", w_fraction=w)
    return r.best, {(e.layout.schedule, e.layout.v): e.step_time for e in r.ranked}


def test_search_picks_a_v_schedule_where_it_pays():
    for gbs in (8, 32):                                    # m = 2p and 8p micro-batches, W half a backward
        best, steps = _best(gbs, 0.5)
        assert best.layout.schedule in S.V_SCHEDULES, steps
        assert steps["zb-v", 1] < steps["interleaved", 2] < steps["1f1b", 1]
        assert "simulated timeline" in best.notes[-1]


def test_search_picks_1f1b_or_interleaving_where_zb_v_does_not_pay():
    # no W to move and one micro-batch: the V's extra messages make ZB-V slower than 1F1B
    for n, tp in ((8, 2), (32, 8)):                        # pp inside a node, and across nodes
        best, steps = _best(1, 0.0, ("1f1b", "zb-v"), n, tp)
        assert best.layout.schedule == "1f1b" and steps["1f1b", 1] < steps["zb-v", 1], steps
        best, steps = _best(1, 0.5, ("1f1b", "zb-v"), n, tp)      # W moved off the critical path: it pays
        assert best.layout.schedule == "zb-v", steps
    # no W, equal stages: ZB-V's gain is the V's halved fill and drain, which interleaving (v = 2)
    # has too
    for gbs in (4, 8, 32):
        best, steps = _best(gbs, 0.0, model=EVEN)
        assert (best.layout.schedule, best.layout.v) == ("interleaved", 2), steps
    # Llama 3 8B's LM head (128k words, 2.4 layers of work) on the busiest rank either way: the
    # last rank of interleaving waits for the fill, a V's rank 0 (both ends) never does, and from
    # m = 2p on the V pays without W
    for gbs in (8, 32):
        best, steps = _best(gbs, 0.0)
        assert best.layout.schedule in S.V_SCHEDULES and steps["zb-v", 1] < steps["interleaved", 2], steps


def test_search_folds_experts_and_chooses_the_dispatch():
    r = search("mixtral-8x7b", "h100-sxm", 16, 16, micro_batches=(1,), recomputes=("full",), zero_stages=(1,),
               cp_sizes=(1,), tp_sizes=(2,), pp_sizes=(2,), ep_sizes=(1, 2, 4), etp_sizes=(1, 2),
               dispatches=("all_to_all", "all_gather"), schedules=("1f1b", "zb-v"))
    seen = {(e.layout.ep, e.layout.etp, e.model.moe_dispatch) for e in r.ranked + r.too_big}
    assert {(4, 2, "all_to_all"), (4, 2, "all_gather"), (2, 1, "all_to_all")} <= seen
    # the ranking is the estimate's: the best is no slower than any layout estimated on its own
    best = r.best
    for e in r.ranked:
        again = estimate(e.model, "h100-sxm", e.layout)
        assert again.step_time == pytest.approx(e.step_time) and best.step_time <= again.step_time


@pytest.mark.parametrize("kw,message", [
    (dict(schedules=("zb-h2",)), "schedules must name some of"),
    (dict(timing="guess"), "timing must be one of"),
    (dict(w_fraction=1.5), "w_fraction"),
    (dict(etp_sizes=(0,)), "etp_sizes must be integers"),
    (dict(dispatches=("broadcast",)), "dispatches must be among"),
])
def test_search_refuses_bad_choices(kw, message):
    with pytest.raises(ValueError, match=message):
        search("llama3-8b", "h100-sxm", 8, 8, **kw)
    if "w_fraction" in kw:
        with pytest.raises(ValueError, match="w_fraction"):
            simulate(EVEN, IDEAL, Layout(pp=2, schedule="zb-v", global_batch=4), **kw)


# ---------------------------------------------------------- the virtual clock, the same timeline

def _v_pipelines(p, m, h=32, b=8):
    """ZB-V and DualPipeV on Linear chunks in V placement, one step each (their spans)."""
    import torch.nn as nn

    from course_lib import trace
    from course_lib.collectives.comm import Comm
    from course_lib.parallel.pipeline.runner import run_schedule
    comm, out = Comm(None, dim="pp"), {}
    for name in S.V_SCHEDULES:
        torch.manual_seed(comm.rank)
        stages = {s: nn.Sequential(*[nn.Linear(h, h, bias=False) for _ in range(3)])
                  for s in S.rank_stage_ids(comm.rank, p, 2, "v")}
        comm.barrier()
        trace.reset()
        run_schedule(S.make_schedule(name, p, m), stages, comm, p=p, m=m, v=2,
                     inputs=[torch.randn(b, h) for _ in range(m)], targets=[None] * m,
                     loss_fn=lambda y, t: y.sum(), act_shape=(b, h))
        out[name] = trace.spans()
    return out


def test_the_virtual_clocks_v_timeline_is_the_unit_clocks():
    """The virtual clock (free links, a host that issues at once) runs every action of ZB-V and
    DualPipeV when ``schedules.simulate`` does with the run's own action times and one message's
    time in NCCL's model: the same timeline the planner's simulator reproduces above."""
    from course_lib.lab.pipeline_runs import FREE_H100
    from course_lib.launch import launch
    from course_lib.virtual import VirtualCluster
    from course_lib.virtual.links import p2p_time
    p, m, h, b = 2, 4, 32, 8
    cluster = VirtualCluster(FREE_H100, gpus_per_node=8)
    res = launch(_v_pipelines, p, p, m, clock=cluster, threads=1)
    t_comm = sum(p2p_time(FREE_H100, b * h * cluster.dtype.itemsize, True))
    for name in S.V_SCHEDULES:
        compute = [s for r in res for s in r[name] if s.kind == "compute"]
        t0 = min(s.start for s in compute)
        sim = S.simulate(S.make_schedule(name, p, m), p, 2, t_comm=t_comm,
                         durations={s.name: s.duration for s in compute})
        want = {s.name: (s.start, s.end) for s in sim if s.kind == "compute"}
        assert len(compute) == len(want)
        scale = max(s.end for s in compute) - t0
        for s in compute:
            assert (s.start - t0, s.end - t0) == pytest.approx(want[s.name], abs=1e-9 * scale), (name, s)
