"""course_lib/planner/simulator.py: the simulated step against the formulas and estimate()."""
import pytest

from course_lib.planner import HARDWARE, Layout, ModelSpec, estimate, simulate
from course_lib.planner import formulas as F
from course_lib.planner.simulator import schedule_order
from course_lib.trace import Span

# equal stages and free communication: the textbook pipeline
IDEAL = HARDWARE["h100-sxm"].with_(nvlink_latency=0, network_latency=0, nvlink_bandwidth=1e30,
                                   network_bandwidth=1e30, elementwise_passes=0, sm_count=0)
EVEN = ModelSpec("even", 48, 1024, 16, 16, 4096, 2, 1024)   # a 2-token vocabulary: no LM-head imbalance


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (3, 9), (8, 8), (4, 10), (4, 3)])   # 10: N = 5; 3 < p
def test_bubble_matches_formula(schedule, v, p, m):
    sim = simulate(EVEN, IDEAL, Layout(pp=p, schedule=schedule, v=v, global_batch=m))
    expected = F.bubble_fraction(p, m, schedule, v)
    for rank in sim.ranks:
        assert sim.bubble(rank) == pytest.approx(expected, abs=2e-3)


def test_schedules_run_every_op_once():
    for sched, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for stage in range(4):
            order = schedule_order(4, 8, sched, v, stage)
            assert sorted(order) == sorted((ph, mb, ch) for ph in "FB" for mb in range(8) for ch in range(v))
    # 1F1B keeps at most p - stage micro-batches in flight
    order = schedule_order(4, 8, "1f1b", 1, 0)
    in_flight = peak = 0
    for phase, _, _ in order:
        in_flight += 1 if phase == "F" else -1
        peak = max(peak, in_flight)
    assert peak == 4 == F.in_flight_microbatches(4, 8, "1f1b")


@pytest.mark.parametrize("model,layout", [
    ("llama3-8b", Layout(dp=8, global_batch=16, recompute="selective")),
    ("llama3-8b", Layout(dp=4, zero=1, global_batch=8, recompute="selective", overlap_dp=False)),
    ("llama3-8b", Layout(dp=4, zero=3, global_batch=8, micro_batch=2, recompute="full")),
    ("llama3-70b", Layout(dp=2, tp=8, pp=4, sp=True, global_batch=32, recompute="selective")),
    ("llama3-70b", Layout(dp=2, tp=2, pp=4, cp=2, sp=True, zero=1, schedule="interleaved", v=2,
                          global_batch=16, recompute="selective")),
    ("mixtral-8x7b", Layout(dp=4, tp=2, pp=2, ep=4, sp=True, global_batch=16, recompute="selective")),
    # torch's rounds: m = 6 on PP 4 (one round of N = 6), m = 2 < PP (micro-batches come round late)
    ("llama3-70b", Layout(dp=2, tp=8, pp=4, sp=True, schedule="interleaved", v=2, global_batch=12,
                          recompute="selective")),
    ("llama3-70b", Layout(dp=2, tp=8, pp=4, sp=True, schedule="interleaved", v=4, global_batch=4,
                          recompute="selective")),
])
def test_simulated_step_matches_estimate(model, layout):
    sim = simulate(model, "h100-sxm", layout)
    est = estimate(model, "h100-sxm", layout)
    assert sim.step_time == pytest.approx(est.step_time, rel=0.01)
    assert all(isinstance(s, Span) and s.kind in ("compute", "comm", "idle") for s in sim)
    assert len(sim.ranks) == layout.n_gpus


def test_dp_ring_steps_are_concurrent_chunks():
    """A ring all-reduce is 2(N-1) steps of n/N on every rank at once, not N-1 full hops."""
    hw = HARDWARE["h100-sxm"]
    layout = Layout(dp=16, global_batch=16, overlap_dp=False)
    sim = simulate("llama3-8b", hw, layout)
    ring = [s for s in sim if s.name.startswith("dp all_reduce")]
    assert len(ring) == 16 * 2 * 15
    n = sum(st.params for st in estimate("llama3-8b", hw, layout).stages) * 2
    alpha, bw = hw.link(False)
    alpha *= 32 + 2                         # a message per layer, the embedding and the head
    total = F.collective_time("all_reduce", n, 16, alpha, bw)
    for rank in range(16):
        mine = [s for s in ring if s.rank == rank]
        assert sum(s.duration for s in mine) == pytest.approx(total, rel=1e-9)
        assert mine[0].duration == pytest.approx(alpha + n / 16 / bw)
    starts = {s.start for s in ring if s.name.endswith(" 1/30")}
    assert len(starts) == 1                                                  # all ranks at once


def test_large_layouts_simulate_one_gpu_per_stage():
    layout = Layout(dp=64, tp=8, pp=8, sp=True, zero=1, global_batch=512, recompute="selective")
    sim = simulate("llama3-70b", "h100-sxm", layout)
    assert len(sim.ranks) == 8
    assert sim.step_time == pytest.approx(estimate("llama3-70b", "h100-sxm", layout).step_time, rel=0.01)
