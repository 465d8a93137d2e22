"""course_lib.collectives.measure (and lab/measure.py, its sweep): what gloo sends, the sweep behind the
alpha-beta fit, priorities."""
import os
import sys

import pytest

from course_lib import costmodel as cm
from course_lib.collectives import measure
from course_lib.lab.measure import sweep_builtin
from course_lib.launch import launch

MiB = 1 << 20
linux_io = pytest.mark.skipif(measure.writes_made() is None, reason="needs /proc/self/io (Linux)")


def gloo_writes_per_all_reduce(sizes, reps=3):
    import torch
    import torch.distributed as dist

    out = []
    for n in sizes:
        x = torch.ones(n // 4)
        dist.all_reduce(x)
        dist.barrier()
        before = measure.writes_made()
        for _ in range(reps):
            dist.all_reduce(x)
        after = measure.writes_made()
        dist.barrier()
        out.append((after - before) / reps)
    return out


@linux_io
@pytest.mark.parametrize("N", [2, 3, 5])
def test_gloo_all_reduce_sends_the_segmented_rings_messages(N):
    # gloo writes three times per message (the receiver's "ready", the header, the
    # payload); the count follows segmented_ring_all_reduce, not the textbook ring
    sizes = [4 << 10, 1 * MiB, 3 * MiB + 4 * N, 8 * MiB]
    for rank_writes in launch(gloo_writes_per_all_reduce, N, sizes, quiet=True):
        for n, writes in zip(sizes, rank_writes):
            messages = cm.coefficients(measure.BUILTIN_MODEL["all_reduce"], n, N)[0]
            assert writes == pytest.approx(3 * messages), (n, writes, messages)
            assert writes > 3 * cm.coefficients("ring_all_reduce", n, N)[0]


def test_sweep_builtin_measures_every_point_once():
    rows = sweep_builtin([4 << 10, 64 << 10], [2, 3], rounds=2, reps=2, warmup=1)
    assert sorted((int(m.n_bytes), m.world_size) for m in rows) == [(4096, 2), (4096, 3), (65536, 2), (65536, 3)]
    assert all(m.algorithm == "segmented_ring_all_reduce" and m.seconds > 0 for m in rows)
    with pytest.raises(ValueError, match="rounds"):
        sweep_builtin([4096], [2], rounds=0)
    with pytest.raises(ValueError, match="stat must be one of"):
        sweep_builtin([4096], [2], stat="mean")


def test_fastest_keeps_each_points_fastest_round():
    M = cm.Measurement
    rounds = [M("a", 4096, 2, 3.0), M("a", 4096, 4, 1.0), M("a", 4096, 2, 2.0), M("a", 4096, 4, 5.0),
              M("b", 4096, 2, 9.0), M("a", 4096, 2, 2.5)]
    assert measure.fastest(rounds) == [M("a", 4096, 2, 2.0), M("a", 4096, 4, 1.0), M("b", 4096, 2, 9.0)]


@pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux scheduling API")
def test_realtime_priority_is_granted_or_changes_nothing_and_is_undone():
    before = os.sched_getscheduler(0)
    with measure.realtime_priority(False) as granted:
        assert granted is False and os.sched_getscheduler(0) == before
    with measure.realtime_priority() as granted:
        assert os.sched_getscheduler(0) == (os.SCHED_FIFO if granted else before)
    assert os.sched_getscheduler(0) == before


def test_last_level_cache_is_a_size_or_unknown():
    size = measure.last_level_cache_bytes()
    assert size is None or (isinstance(size, int) and size >= 64 << 10)
    if sys.platform.startswith("linux") and os.path.isdir("/sys/devices/system/cpu/cpu0/cache"):
        assert size is not None


def test_paired_ratio_is_the_median_of_each_repetitions_ratio():
    # a burst of load in repetition 2 slows both contestants: its pair's ratio stays near the others
    ours, gloo = [1.2, 1.3, 6.0, 1.25], [1.0, 1.0, 5.0, 1.0]
    assert measure.paired_ratio(ours, gloo) == pytest.approx(1.225)
    assert measure.median(ours) / measure.median(gloo) == pytest.approx(1.275)
    with pytest.raises(ValueError, match="equally long"):
        measure.paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="non-empty"):
        measure.paired_ratio([], [])
