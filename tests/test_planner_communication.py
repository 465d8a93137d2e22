"""course_lib/planner/communication.py: what one data-parallel rank sends per step, against
the counting of each collective (a ring moves (N-1)/N of a tensor per rank) and against the
bytes chapter 4 measured on the kernel's counters (course_lib.lab.zero_measurements)."""
from __future__ import annotations

import pytest

from course_lib.lab.zero_measurements import MEASURED_PARAMS, MEASURED_ROOT_PARAMS, MEASURED_SENT
from course_lib.planner.communication import dp_bytes_per_step


def test_fsdp_root_unit_and_gloo_reduce_scatter_by_counting():
    n, root, N = 1000, 100, 4
    ring = lambda nbytes: nbytes * (N - 1) / N          # noqa: E731 - one ring collective's share
    assert dp_bytes_per_step(n, N, 0, 4, 4, root_params=root) == pytest.approx(2 * ring(4 * n))
    assert dp_bytes_per_step(n, N, 1, 4, 4, reduce_scatter="all_reduce") == pytest.approx(3 * ring(4 * n))
    # ZeRO-3: every unit gathered for forward and again for backward, the root unit once
    assert dp_bytes_per_step(n, N, 3, 4, 4, root_params=root) == pytest.approx(ring(4 * n) * 3 - ring(4 * root))
    assert dp_bytes_per_step(n, N, 3, 4, 4, microbatches=2) == 2 * dp_bytes_per_step(n, N, 3, 4, 4)
    assert dp_bytes_per_step(n, 1, 3, 4, 4, root_params=root) == 0
    with pytest.raises(ValueError, match="reduce_scatter must be"):
        dp_bytes_per_step(n, N, 1, reduce_scatter="tree")


@pytest.mark.parametrize("impl, stage, world", sorted(MEASURED_SENT))
def test_predicts_the_measured_bytes_within_one_percent(impl, stage, world):
    """Payload plus a few hundred bytes of transport headers per call: within 1%."""
    predicted = dp_bytes_per_step(MEASURED_PARAMS, world, stage, 4, 4, root_params=MEASURED_ROOT_PARAMS,
                                  reduce_scatter="all_reduce" if impl == "gloo" else "ring")
    assert predicted == pytest.approx(MEASURED_SENT[impl, stage, world], rel=0.01)
