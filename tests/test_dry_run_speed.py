"""What keeps a long dry run within its bounds (issue #36: the 1T row in 10 minutes on 2 cores),
checked by counting, not by timing: the schedule is built and validated once per dry run, not
once per stage; a lane's shortcut answers what its scan answers."""
import random

import pytest

import course_lib.schedules as schedules
from course_lib.layout import Layout
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import dry_run
from course_lib.virtual.links import Lane

SPEC = gpt_spec("GPT test", 8, 64, 4, V=256, s=32)


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2)])
def test_the_schedule_is_validated_once_not_once_per_stage(monkeypatch, schedule, v):
    """pp 4: every stage used to check all four ranks' action lists itself (p x p x m x v
    actions in all: the largest cost of the 1T row, 64 stages x 131,072 actions)."""
    simulated = []
    real = schedules.simulate

    def counting(sched, p, *a, **kw):
        simulated.append(p)
        return real(sched, p, *a, **kw)
    monkeypatch.setattr(schedules, "simulate", counting)
    r = dry_run(SPEC, "a100-80gb", Layout(pp=4, schedule=schedule, v=v, micro_batch=1, global_batch=8),
                progress=None)
    assert r.ranks_run == 4 and r.replayed > 0
    assert simulated == [4]          # one deadlock check of the lists the four stages run


def _scan(busy, ready, duration):
    """Lane.earliest as it was written first: every interval, in start order."""
    t = ready
    for s, e in busy:
        if e <= t:
            continue
        if s >= t + duration:
            break
        t = e
    return t


def test_a_lane_answers_what_its_scan_answers():
    """The shortcut (every interval ended by ``ready``) never changes an answer: reservations
    out of order, overlapping, released, and more than the lane keeps."""
    rng = random.Random(0)
    lane = Lane()
    for i in range(3 * Lane.KEEP):
        start, duration = rng.uniform(0, i), rng.choice([0.0, rng.uniform(0, 3)])
        lane.reserve(start, duration)
        if rng.random() < 0.2:
            lane.release(start, duration)
        for _ in range(4):
            ready, want = rng.uniform(0, i + 5), rng.uniform(0, 2)
            assert lane.earliest(ready, want) == _scan(lane.busy, ready, want)
