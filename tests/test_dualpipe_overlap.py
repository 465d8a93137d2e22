"""DualPipe's F&B overlap on the virtual clock (issue #37, item 1 of what was left).

The pair's clock (course_lib.virtual.overlap) fills the gaps one action leaves with the
other's kernels; the runner overlaps DualPipeV's F&B pairs (runner.fb_pairs); on an MoE model
with ep = 2 over the network, the step gets shorter, its arithmetic stays bit for bit the same
(and equal to one device), and per pair the all-to-all time hidden is at most the formula's
min(a2a_F, compute_B) + min(a2a_B, compute_F). One launch (4 ranks) checks it all.
"""
from __future__ import annotations

import pytest
import torch

from course_lib import reference, schedules as S, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.lab.overlap_runs import dualpipe_overlap
from course_lib.parallel.pipeline.runner import fb_pairs
from course_lib.planner.presets import HARDWARE
from course_lib.virtual import VirtualCluster
from course_lib.virtual.overlap import KernelLane

MOE = GPTConfig(vocab_size=256, seq_len=32, n_layers=4, hidden=64, n_heads=4, ffn_hidden=128, n_experts=8,
                top_k=2, capacity_factor=None, tie_embeddings=False)


def test_kernel_lane_fills_the_gaps_in_order():
    lane = KernelLane()
    assert lane.place(0.0, 1.0) == 1.0 and lane.place(1.0, 1.0) == 2.0     # back to back: one interval
    assert lane.place(5.0, 1.0) == 6.0                                      # a gap [2, 5)
    assert (lane.starts, lane.ends) == ([0.0, 5.0], [2.0, 6.0])
    assert lane.place(0.0, 2.0) == 4.0          # the first gap that fits, merged with [0, 2)
    assert lane.place(0.0, 3.0) == 9.0          # [4, 5) too short: after the last
    assert lane.place(2.5, 0.5) == 4.5 and (lane.starts, lane.ends) == ([0.0, 5.0], [4.5, 9.0])
    assert lane.busy() == 8.5


def test_fb_pairs_are_dualpipes_main_phase():
    rows = S.dualpipe_v(2, 4)
    for row in rows:
        pairs = fb_pairs(row)
        assert pairs, "DualPipeV's main phase pairs a forward with another chunk's backward"
        for i in pairs:
            f, b = row[i], row[i + 1]
            assert (f.op, b.op) == ("F", "B") and f.stage != b.stage and f.mb != b.mb
    # ZB-V's backwards are split (a W each): nothing to pair; 1F1B has one stage per rank
    for row in S.zero_bubble_v(2, 4):
        assert not fb_pairs(row, {(a.stage, a.mb) for a in row if a.op == "W"})
    assert not any(fb_pairs(row) for row in S.one_f_one_b(3, 6))


def test_overlap_hides_the_all_to_all_and_keeps_the_arithmetic():
    # EP over the network (a GPU per node), a host that runs ahead (issue time 0): the regime
    # DualPipe targets, where the all-to-all is long and the host is not the bottleneck
    hw = HARDWARE["h100-sxm"].with_(launch_overhead=0.0)
    run = dualpipe_overlap(MOE, dict(pp=2, dp=2, ep=2), m=4, batch=8,
                           cluster=VirtualCluster(hw, gpus_per_node=1, dtype=torch.bfloat16))
    assert run.same, "overlapping changes when kernels run, never what they compute"
    x, y = reference.gpt_batches(MOE, batch=8, steps=1)[0]
    with torch.no_grad():
        want = TinyGPT(MOE, seed=0)(x, y, n_tokens=y.numel())[1]
    tolerance.assert_matches({"loss": torch.tensor(run.loss)}, {"loss": want.float()}, what="loss",
                             dtype=torch.float32)
    assert run.overlapped < run.plain
    assert run.pairs and run.hidden > 0
    for f, b, af, cf, ab, cb, hidden in run.pairs:
        assert af > 0 and ab > 0, (f, b)
        assert -1e-12 <= hidden <= min(af, cb) + min(ab, cf) + 1e-12, (f, b, hidden)
    assert run.hidden <= run.hidden_formula + 1e-12


def test_refusals():
    with pytest.raises(ValueError, match="needs an MoE model"):
        dualpipe_overlap(MOE, dict(pp=2, dp=2), m=4, batch=8, cluster=VirtualCluster("h100-sxm"))
    from course_lib.parallel.pipeline.runner import ScheduleRunner

    class _Comm:
        size, rank = 2, 0
    with pytest.raises(ValueError, match="overlap_fb must be True or False"):
        ScheduleRunner(S.dualpipe_v(2, 4), {}, _Comm(), p=2, m=4, overlap_fb=1)


def _pair_times(launch_overhead, wait=50e-6):
    """(sequential, overlapped) end of two actions on one rank's clock: the first computes,
    waits ``wait`` for an all-to-all (a join, as Comm's collective does), computes again; the
    second computes only."""
    from course_lib import trace
    hw = HARDWARE["h100-sxm"].with_(launch_overhead=launch_overhead)
    a, w = torch.randn(256, 256), torch.randn(256, 256)
    ends = []
    for overlap in (False, True):
        clock = VirtualCluster(hw, gpus_per_node=8).start(0, 1, trace.Recorder())
        with clock:
            def first():
                for _ in range(5):
                    a @ w
                clock.join(clock.t + wait)
                for _ in range(5):
                    a @ w

            def second():
                for _ in range(20):
                    a @ w
            if overlap:
                with clock.overlapped() as pair:
                    first()
                    pair.next()
                    second()
            else:
                first()
                second()
            ends.append(clock.t)
    return ends


def test_the_pairs_clock_hides_a_wait_unless_the_host_is_the_bottleneck():
    compute = _pair_times(0.0, wait=0.0)[0]          # 30 kernels back to back, nothing to wait for
    second = compute * 20 / 30                       # the second action's 20 kernels
    # waits of whole kernels (a gap is filled by whole kernels: 8, then 22 kernels' time),
    # shorter, then longer than the second's compute
    for wait in (8 * compute / 30, 22 * compute / 30):
        plain, overlapped = _pair_times(0.0, wait)   # the host runs ahead (issue time 0)
        assert plain == pytest.approx(compute + wait, rel=1e-12)
        # the formula exactly: the wait hides under the other's compute, min(wait, compute_B)
        assert overlapped == pytest.approx(plain - min(wait, second), rel=1e-12)
    # 1 ms per op: the host paces both actions, one after the other; the pair gains nothing
    plain, overlapped = _pair_times(1e-3, wait=0.0)
    assert overlapped == pytest.approx(plain, rel=1e-12) and plain >= 30e-3
