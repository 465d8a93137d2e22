"""What keeps a long dry run within its bounds (issue #36: the 1T row in 10 minutes on 2 cores),
checked by counting, not by timing: the schedule is built and validated once per dry run, not
once per stage; a lane's shortcut answers what its scan answers."""
import random
import re

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


def test_a_stage_mesh_finds_its_groups_as_the_mesh_does():
    """StageMesh.ranks looks only at the ranks that differ from its own where the group reaches
    (not at every group of the world): the same ranks in the same order as MeshShape.rank_sets,
    for every dimension and pair of dimensions, expert dims folded over dp, cp and tp included, in
    the default rank order and others, and the same error for a combination the mesh refuses."""
    import itertools

    from course_lib.parallel.mesh import DIMS, EXPERT_DIMS, MeshShape
    from course_lib.virtual.priced import StageMesh
    names = [(d,) for d in DIMS + EXPERT_DIMS] + list(itertools.permutations(DIMS + EXPERT_DIMS, 2))
    for sizes in (dict(dp=2, pp=3, cp=2, tp=2, ep=2, etp=2), dict(dp=3, pp=2, tp=4, ep=2, etp=2),
                  dict(dp=2, pp=3, cp=2, tp=2, ep=2, order=("pp", "dp", "cp", "tp")),    # DeepSpeed's
                  dict(dp=2, pp=2, cp=2, tp=2, ep=4, order=("tp", "pp", "cp", "dp"))):
        shape = MeshShape(**sizes)
        for dims in names:
            try:
                sets = shape.rank_sets(dims)
            except ValueError as e:
                with pytest.raises(ValueError, match=re.escape(str(e))):
                    StageMesh(0, **sizes).ranks(dims)
                continue
            for rank in range(shape.world_size):
                assert StageMesh(rank, **sizes).ranks(dims) == next(s for s in sets if rank in s)


@pytest.mark.parametrize("schedule, m", [("dualpipe-v", 8), ("dualpipe-v", 16), ("zb-v", 8)])
def test_replay_of_a_schedule_that_splits_some_backwards_is_the_real_run(schedule, m):
    """DualPipeV splits its first backwards (B apart from W) and runs the rest whole: the dry
    run used to replay a forward whose whole backward had no tape yet and stopped with a
    RuntimeError. Now it replays only what has a tape, and the step is the unreplayed one."""
    layout = Layout(pp=4, schedule=schedule, micro_batch=1, global_batch=m)
    replayed = dry_run(SPEC, "a100-80gb", layout, progress=None)
    real = dry_run(SPEC, "a100-80gb", layout, progress=None, replay=False)
    assert replayed.step_time == real.step_time and replayed.kernels == real.kernels
    assert replayed.memory_by_stage == real.memory_by_stage
