"""The virtual clock's ready-time exchange: through shared memory it equals the backend's."""
import os
import time

import pytest

from course_lib.launch import launch
from course_lib.virtual import VirtualCluster
from course_lib.virtual import exchange as X


def _both_ways(rounds):
    import random

    import torch.distributed as dist

    from course_lib.collectives.comm import Comm
    rank = dist.get_rank()
    shared = X.shared()
    assert shared is not None, "the launch shares its directory with a clock's ranks"
    groups = [None, [0, 1], [2, 3], [0, 2], [1, 3], [0, 1, 2]]
    comms = []
    for ranks in groups:           # new_group is collective: every rank makes every group
        group = None if ranks is None else dist.new_group(ranks)
        if ranks is None or rank in ranks:
            comms.append(Comm(group, dim=str(ranks)))
    rng, out = random.Random(rank), []
    for _ in range(rounds):
        for comm in comms:
            ready, nbytes = rng.random() * 1e-3, float(rng.randrange(1 << 20))
            gloo = X.GlooExchange(comm, ready, nbytes).result()
            mine = shared.issue(comm, ready, nbytes).result()
            out.append((comm.dim, gloo, mine))
    return out


def test_shared_exchange_equals_the_backends_all_reduce():
    cluster = VirtualCluster("h100-sxm", gpus_per_node=8)
    res = launch(_both_ways, 4, 3 * X.RING, clock=cluster, quiet=True)   # (the rings wrap)
    for rank_out in res:
        assert rank_out
        for dim, gloo, mine in rank_out:
            assert mine == gloo, (dim, gloo, mine)     # bit for bit: a MAX of the same float64s


class _FakeComm:
    def __init__(self, ranks, rank):
        self.group, self.ranks, self.rank, self.size = None, list(ranks), rank, len(ranks)


def test_a_member_that_never_issues_times_out_naming_the_group_and_seq(tmp_path):
    ex = X.Exchanges(str(tmp_path), timeout=0.05)
    other = X.Exchanges(str(tmp_path), timeout=0.05)         # member 1, in this process
    first = ex.issue(_FakeComm([0, 1], 0), 1.0, 8)
    other.issue(_FakeComm([0, 1], 1), 2.0, 16)
    assert first.result() == (2.0, 16.0)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"collective #2 on group world \(ranks \[0, 1\]\): rank\(s\) \[1\]"):
        ex.issue(_FakeComm([0, 1], 0), 3.0, 8).result()   # member 1 never issues its second
    assert time.monotonic() - started < 5


def test_no_shared_directory_falls_back_to_the_backend(monkeypatch):
    monkeypatch.delenv(X.ENV, raising=False)
    assert X.shared() is None
    monkeypatch.setenv(X.ENV, os.path.join(os.sep, "no", "such", "dir"))
    assert X.shared() is None
