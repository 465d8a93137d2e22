"""course_lib/virtual/links + clock: links that fill, a stream per communicator, the
algorithm that runs is the one priced (issue #33's audit, each case as its own check).

Expected times are written here from NCCL's table (src/graph/tuning.cc) and the preset's
bandwidths, not read from the clock's code."""
import pytest
import torch

from course_lib import collectives, trace
from course_lib.collectives.comm import Comm
from course_lib.launch import launch
from course_lib.parallel.mesh import Mesh
from course_lib.planner import HARDWARE
from course_lib.virtual import VirtualCluster

H100 = HARDWARE["h100-sxm"]
NVLINK = H100.nvlink_bandwidth * H100.nvlink_efficiency          # B/s a GPU sends (or receives) over NVLink
NET = H100.network_bandwidth * H100.network_efficiency            # and through its NIC
SIMPLE_NVLINK, SIMPLE_NET = 8.4e-6 + 3.4e-6, 8.4e-6 + 14e-6       # one message above 16 KiB: baseLat + hwLat
MiB = 1 << 20
REL = 1e-9


def _arrivals(comm, messages):
    """Rank 0 posts ``messages`` [(dst, bytes)] at once; each receiver waits for its own.
    Returns {(dst, i): seconds from the common start to the receive's end} on receivers."""
    bufs = [torch.zeros(n // 2, dtype=torch.bfloat16) for _, n in messages]   # (filling them is compute)
    comm.barrier()
    t0 = trace.now()
    works, out = [], {}
    for i, ((dst, n), buf) in enumerate(zip(messages, bufs)):
        if comm.rank == 0:
            works.append(comm.isend(buf, dst, tag=i))
        elif comm.rank == dst:
            comm.irecv(buf, 0, tag=i).wait()
            out[dst, i] = trace.now() - t0
    Comm.wait(*works)
    return out


def _chunks_and_directions():
    comm = Comm(None)
    n = 16 * MiB
    res = {k: _arrivals(comm, [(1, n // k)] * k) for k in (1, 4, 16)}
    res["two one way"] = _arrivals(comm, [(1, n), (1, n)])
    # a send and a receive in opposite directions at once
    a, b = torch.zeros(n // 2, dtype=torch.bfloat16), torch.zeros(n // 2, dtype=torch.bfloat16)
    comm.barrier()
    t0 = trace.now()
    if comm.rank < 2:
        peer = 1 - comm.rank
        works = [comm.isend(a, peer), comm.irecv(b, peer)]
        Comm.wait(*works)
    res["both ways"] = trace.now() - t0
    return res


def test_a_link_fills_chunks_pay_latency_and_directions_are_independent():
    """2 nodes of 1 GPU: every message crosses the network (16 MiB: 439 / 125 / 46 us before)."""
    res = launch(_chunks_and_directions, 2, clock=VirtualCluster("h100-sxm", gpus_per_node=1))[1]
    n = 16 * MiB
    one = res[1][1, 0]
    assert one == pytest.approx(SIMPLE_NET + n / NET, rel=REL)
    last = [max(res[k].values()) for k in (1, 4, 16)]
    # k messages of n/k: one stream per pair, each message pays its latency, the bytes the link
    assert last == pytest.approx([k * SIMPLE_NET + n / NET for k in (1, 4, 16)], rel=REL)
    assert last[0] < last[1] < last[2]                 # chunking never beats the bandwidth
    two = res["two one way"]
    assert two[1, 1] == pytest.approx(2 * (SIMPLE_NET + n / NET), rel=REL)      # twice one message
    assert res["both ways"] == pytest.approx(SIMPLE_NET + n / NET, rel=REL)     # full duplex


def _fan_out():
    comm = Comm(None)
    return _arrivals(comm, [(1, 4 * MiB), (2, 4 * MiB)])


def test_two_peers_share_the_senders_lane():
    """One node: rank 0 sends 4 MiB to rank 1 and to rank 2 at once. Two pair streams, one
    NVLink send lane: the second message's bytes wait for the first's."""
    res = launch(_fan_out, 3, clock=VirtualCluster("h100-sxm", gpus_per_node=8))
    n = 4 * MiB
    assert res[1][1, 0] == pytest.approx(SIMPLE_NVLINK + n / NVLINK, rel=REL)
    assert res[2][2, 1] == pytest.approx(SIMPLE_NVLINK + 2 * n / NVLINK, rel=REL)


def _tp_beside_dp():
    mesh = Mesh(dp=2, tp=2)
    dp, tp = mesh.comm("dp"), mesh.comm("tp")
    bucket, act = torch.zeros(32 * MiB // 2), torch.zeros(MiB // 2)     # 32 MiB, 1 MiB at bf16
    bucket.add_(0), act.add_(0)
    dp.barrier()
    t0 = trace.now()
    h = dp.all_reduce(bucket, async_op=True, name="dp bucket")
    tp.all_reduce(act, name="tp all-reduce")
    h.wait()
    spans = {s.name: s for s in trace.spans()}
    return t0, spans["dp bucket"], spans["tp all-reduce"]


def test_tp_collective_does_not_queue_behind_a_dp_bucket():
    """dp x tp = 2 x 2. NCCL runs one stream per communicator: the TP all-reduce starts when it is
    issued, beside the in-flight DP bucket. With the DP group across nodes (2 GPUs a node) they
    share no lane; inside one node they share each GPU's NVLink lanes: the two kernels' channels
    interleave on the link, so the TP collective is slowed by its own bytes' time (two transfers
    splitting the bandwidth), not held until the bucket's 32 MiB are through (first come, first
    served, as the clock had it before 2026-11-29: tp.start = t0 + 93 us)."""
    across = launch(_tp_beside_dp, 4, clock=VirtualCluster("h100-sxm", gpus_per_node=2))
    for t0, dp, tp in across:
        assert tp.start == pytest.approx(t0, abs=1e-12)       # not after dp.end, as one stream had it
        assert tp.end < dp.end
    inside = launch(_tp_beside_dp, 4, clock=VirtualCluster("h100-sxm", gpus_per_node=4))
    for t0, dp, tp in inside:
        bucket_on_lane = 2 * (2 - 1) / 2 * 32 * MiB / NVLINK   # a ring all-reduce sends 2(N-1)/N n
        tp_on_lane = 2 * (2 - 1) / 2 * MiB / NVLINK
        assert tp.start == pytest.approx(t0 + min(bucket_on_lane, tp_on_lane), rel=1e-6)
        assert tp.end < dp.end                                 # its own stream, sharing the lane


def _algorithms():
    comm = Comm(None)
    out = {}
    for name in ("naive", "ring", "torch"):
        if name == "torch":
            impl = "torch"
        else:   # the course's naive all-reduce, and its ring with one message per chunk
            fn = collectives.ALGORITHMS["all_reduce"][name]
            impl = {"all_reduce": fn if name == "naive" else
                    (lambda t, op=None, group=None, **kw: fn(t, group=group, segment_bytes=None, **kw))}
        c = Comm(None, impl=impl)
        x = torch.ones(16 * MiB // 2)                          # 16 MiB at bf16
        comm.barrier()
        t0 = trace.now()
        c.all_reduce(x)
        comm.barrier()                                         # done when the last rank is
        out[name] = (trace.spans()[-2].end - t0, float(x[0]))
    b = torch.ones(4 * MiB // 2)
    comm.barrier()
    t0 = trace.now()
    comm.broadcast(b, src=0)
    out["broadcast"] = trace.now() - t0
    return out


def test_the_algorithm_that_runs_is_the_one_priced():
    """4 GPUs of one node, a 16 MiB all-reduce (one price for all three before): a naive root
    all-reduce and the course's ring are priced from their own messages, torch's as NCCL runs
    it. The better algorithm gets the better time. Broadcast: NCCL's ring/chain, n / B."""
    res = launch(_algorithms, 4, clock=VirtualCluster("h100-sxm", gpus_per_node=8))
    for r in res:
        assert {v[1] for k, v in r.items() if k != "broadcast"} == {4.0}    # same sums
    naive, ring, nccl = (max(r[k][0] for r in res) for k in ("naive", "ring", "torch"))
    assert nccl < ring < naive
    n = 16 * MiB
    # the naive root takes 3 buffers in through one lane, then sends 3 out through another
    assert naive > 6 * n / NVLINK
    # the ring: 6 steps of one n/4 message each, one after another
    assert ring > 6 * (SIMPLE_NVLINK + n / 4 / NVLINK)
    # NCCL's ring/Simple in one node: 8.4 + 6 x 3.4 us + 2 (N-1)/N n / B
    assert nccl == pytest.approx(8.4e-6 + 6 * 3.4e-6 + 1.5 * n / NVLINK, rel=REL)
    # broadcast as a pipelined chain: 8.4 + 4 x 3.4 us + n / B (a binomial tree: 2 (a + n b))
    assert res[0]["broadcast"] == pytest.approx(8.4e-6 + 4 * 3.4e-6 + 4 * MiB / NVLINK, rel=REL)


def _p2p_behind_collective():
    comm = Comm(None)
    bucket, buf = torch.zeros(16 * MiB // 2), torch.zeros(MiB // 2)
    comm.barrier()
    t0 = trace.now()
    h = comm.all_reduce(bucket, async_op=True, name="bucket")
    if comm.rank == 0:
        comm.send(buf, 1)
        out = None
    else:
        comm.recv(buf, 0)
        out = trace.now() - t0
    h.wait()
    return out


def test_point_to_point_meets_collectives_on_the_lanes():
    """A 1 MiB message issued while a 16 MiB all-reduce of the same two GPUs holds their NVLink
    lanes shares them: its bytes take twice their time (half the bandwidth), once, though it
    crosses two busy lanes (the sender's and the receiver's: it moves at the lower share). First
    come, first served (before 2026-11-29), it arrived after the all-reduce's 16 MiB."""
    res = launch(_p2p_behind_collective, 2, clock=VirtualCluster("h100-sxm", gpus_per_node=8))
    assert res[1] == pytest.approx(MiB / NVLINK + SIMPLE_NVLINK + MiB / NVLINK, rel=REL)


def _small_beside_big_beside_small():
    """Rank 0 sends 16 MiB, then 1 MiB, to rank 1 (one communicator: one pair stream)."""
    comm = Comm(None)
    big, small = torch.zeros(8 * MiB), torch.zeros(MiB // 2)
    comm.barrier()
    t0 = trace.now()
    if comm.rank == 0:
        works = [comm.isend(big, 1, tag=0), comm.isend(small, 1, tag=1)]
        Comm.wait(*works)
        return None
    a, b = comm.irecv(big, 0, tag=0), comm.irecv(small, 0, tag=1)
    a.wait()
    big_at = trace.now() - t0
    b.wait()
    return trace.now() - t0, big_at


def test_a_shared_lane_is_never_slower_than_first_come_first_served():
    """The same pair's messages run one after another (one stream per pair), so sharing never
    applies there: a 1 MiB message behind a 16 MiB one on the same pair arrives after it, as
    before. Sharing is between streams (communicators), never a way around a stream's order."""
    res = launch(_small_beside_big_beside_small, 2, clock=VirtualCluster("h100-sxm", gpus_per_node=8))
    small_at, big_at = res[1]
    assert big_at == pytest.approx(SIMPLE_NVLINK + 16 * MiB / NVLINK, rel=REL)
    assert small_at == pytest.approx(2 * SIMPLE_NVLINK + 17 * MiB / NVLINK, rel=REL)


def _reset_while_pending():
    comm = Comm(None, dim="dp")
    a = torch.randn(256, 256)
    with trace.span("before", "compute"):
        a @ a
    h = comm.all_reduce(torch.zeros(MiB), async_op=True, name="pending all-reduce")
    trace.reset()
    with trace.span("after reset", "compute"):
        a @ a
    h.wait()
    return [(s.name, s.start, s.end) for s in trace.spans()]


def test_trace_reset_while_a_collective_is_pending():
    """reset() between an async collective's issue and its pricing: the compute span recorded
    after the reset keeps its times, and the collective's span is recorded (it ends after the
    reset), not written over another span."""
    res = launch(_reset_while_pending, 2, clock=VirtualCluster("h100-sxm", gpus_per_node=8))
    for spans in res:
        names = [s[0] for s in spans]
        assert sorted(names) == ["after reset", "pending all-reduce"]
        after = next(s for s in spans if s[0] == "after reset")
        comm = next(s for s in spans if s[0] == "pending all-reduce")
        assert after[2] > after[1] and after[1] < comm[2]      # its own times, beside the collective
        assert comm[2] > comm[1]


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_the_planners_formula_against_the_clocks_model(op):
    """The planner's alpha-beta ring (planner.communication.collective_time: its default
    runtime's, which models the published systems) and the clock's NCCL model are written apart.
    Where the bytes dominate they agree within 5%: the formula's domain (64 MiB in a node, 1 GiB
    across nodes). Across nodes at 64 MiB the formula is above the clock: it charges every ring
    step the network's alpha, where NCCL's rings cross the network only between nodes. Where
    latency dominates they part the other way too (the formula has no protocol choice): at
    64 KiB on 8 GPUs of a node NCCL's LL is several times faster. The course runtime prices
    NCCL's choice itself (planner.communication.nccl_time, tests/test_planner_nccl.py)."""
    from course_lib.planner.communication import collective_time as planner_time
    from course_lib.virtual.links import collective_time as clock_time
    for N, n in ((8, 64 * MiB), (8, 1024 * MiB), (16, 1024 * MiB), (64, 1024 * MiB)):
        cluster = VirtualCluster("h100-sxm", gpus_per_node=8)
        planner = planner_time(op, n, N, *H100.link(N <= 8))
        clock = clock_time(cluster, op, n, range(N))
        assert abs(planner / clock - 1) < 0.05, (op, N, n, planner, clock)
    cluster = VirtualCluster("h100-sxm", gpus_per_node=8)
    for N in (16, 64):
        assert planner_time(op, 64 * MiB, N, *H100.link(False)) > clock_time(cluster, op, 64 * MiB, range(N))
    small = 64 << 10
    assert planner_time(op, small, 8, *H100.link(True)) > 2 * clock_time(cluster, op, small, range(8))


def _host_around_collectives():
    comm = Comm(None)
    clock = trace.clock()
    a = torch.ones(1024, 1024)
    out = {}
    for kind in ("async", "blocking"):
        x = torch.ones(4)
        a @ a                                   # 2 GFLOP: the device runs ahead of the host
        t, host = clock.t, clock.host
        work = comm.all_reduce(x, async_op=kind == "async")
        out[kind] = (t, host, clock.host)
        if work is not None:
            work.wait()
    return out


def test_a_blocking_collective_reads_its_exchange_on_the_host():
    """The members' ready times of a blocking collective are read by the host (as a value read,
    ``.item()``): the host waits for its stream there; an async one's are read when it is
    priced, off the host's chain (the clock's bookkeeping, muted)."""
    for out in launch(_host_around_collectives, 2, clock=VirtualCluster("h100-sxm", gpus_per_node=8)):
        t, host, after = out["async"]
        assert t > host and after == host
        t, host, after = out["blocking"]
        assert t > host and after == t


def test_a_lane_is_shared_as_processor_sharing_shares_it():
    """Lane.shared, the rule alone: each transfer still on the lane delays a newcomer by the lane
    time it has left or the newcomer's own, the less (an equal part of the bandwidth each), never
    by more than first come, first served would; its bytes are kept after theirs."""
    from course_lib.virtual.links import Lane
    lane = Lane()
    lane.reserve(0.0, 10.0)                                   # a large transfer in flight
    start, slot = lane.shared(2.0, 1.0)                       # a small one beside it
    assert (start, slot) == (3.0, 10.0)                       # twice its time, not 8 + 1
    lane.reserve(slot, 1.0)
    assert lane.shared(10.5, 4.0) == (11.0, 11.0)             # after the large: only the small's rest
    even = Lane()
    ends = []
    for _ in range(3):                                        # three equal ones at once
        start, slot = even.shared(0.0, 2.0)
        even.reserve(slot, 2.0)
        ends.append(start + 2.0)
    assert ends == [2.0, 4.0, 6.0]                            # the lane carries 6 s of bytes by 6 s
    idle = Lane()
    assert idle.shared(1.0, 5.0) == (1.0, 1.0)
