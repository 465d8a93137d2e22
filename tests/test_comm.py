"""Comm (course_lib/collectives/comm.py): one object per group, torch's or our collectives,
async handles, bytes measured leaving the rank, spans tagged with the mesh dimension."""
import pytest
import torch

from course_lib import launch, tolerance

N_ELEMS = 3 * 4 * 5 * 1024  # divisible by 1..5 ranks: one reduce-scatter shape for every world


def naive_all_reduce(tensor, op=None, group=None):
    """A learner's all-reduce with torch's signature: all-gather everything, sum locally."""
    import torch.distributed as dist
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    tensor.copy_(torch.stack(parts).sum(0))


def rank_checks():
    import torch.distributed as dist

    from course_lib import trace
    from course_lib.collectives.comm import Comm

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for impl in ("torch", "course", {"all_reduce": naive_all_reduce}):
        key = impl if isinstance(impl, str) else "custom"
        comm = Comm(dim="dp", impl=impl)
        x = torch.arange(N_ELEMS, dtype=torch.float32) * (rank + 1)
        ar = x.clone()
        comm.all_reduce(ar)
        rs = torch.empty(N_ELEMS // world)
        comm.reduce_scatter_tensor(rs, x)
        ag = torch.empty(N_ELEMS * world)
        comm.all_gather_into_tensor(ag, x)
        bc = x.clone()
        comm.broadcast(bc, src=world - 1)
        a = [torch.full((1000,), float(rank + k)) for k in range(3)]
        handles = [comm.all_reduce(t, async_op=True) for t in a]
        busy = torch.randn(64, 64) @ torch.randn(64, 64)  # compute while they are in flight
        for h in handles:
            h.wait()
        with comm.measuring():
            comm.all_reduce(x.clone(), name="measured all-reduce")
            comm.reduce_scatter_tensor(rs, x, name="measured reduce-scatter")
            comm.all_gather_into_tensor(ag, x, name="measured all-gather")
        measured = {c.op: (c.payload, c.sent) for c in comm.log[-3:]}
        out[key] = dict(ar=ar, rs=rs, ag=ag, bc=bc, asyncs=[t[0].item() for t in a], measured=measured,
                        unmeasured=comm.log[0].sent, busy=busy.shape)
    out["dims"] = sorted({s.dim for s in trace.spans() if s.kind == "comm"})
    out["names"] = [s.name for s in trace.spans() if s.name.startswith("measured")]
    odd = dist.new_group([0]) if world > 1 else None
    out["outside"] = Comm.of(odd) is None if world > 1 else None
    errors = []
    for bad in (lambda: Comm(impl="nccl2"), lambda: Comm(impl={"allreduce": naive_all_reduce}),
                lambda: Comm().broadcast(torch.zeros(1), src=world)):
        try:
            bad()
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    c = Comm()
    out["neighbours"] = (c.prev, c.next, c.ranks)
    return out


@pytest.fixture(scope="module")
def runs():
    return {n: launch(rank_checks, n, timeout=120) for n in (1, 2, 3, 4)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("impl", ["torch", "course", "custom"])
def test_results_are_torchs(runs, world, impl):
    x = torch.arange(N_ELEMS, dtype=torch.float32)
    total = x * sum(range(1, world + 1))
    for rank, out in enumerate(runs[world]):
        got = out[impl]
        tolerance.assert_matches(got["ar"], total)
        tolerance.assert_matches(got["rs"], total.chunk(world)[rank])
        tolerance.assert_matches(got["ag"], torch.cat([x * (r + 1) for r in range(world)]))
        tolerance.assert_matches(got["bc"], x * world)
        assert got["asyncs"] == [sum(r + k for r in range(world)) for k in range(3)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bytes_are_measured_not_computed(runs, world):
    """Our ring sends the ring formula (plus a few header bytes); gloo's reduce-scatter sends
    as much as its all-reduce, about twice the formula."""
    payload = N_ELEMS * 4
    ring = (world - 1) / world * payload
    for out in runs[world]:
        ours, gloo = out["course"]["measured"], out["torch"]["measured"]
        assert out["torch"]["unmeasured"] is None  # outside measuring(): not measured
        assert ours["all_reduce"][1] == pytest.approx(2 * ring, rel=0.01)
        assert ours["reduce_scatter_tensor"][1] == pytest.approx(ring, rel=0.01)
        assert ours["all_gather_into_tensor"][0] == payload * world
        assert ours["all_gather_into_tensor"][1] == pytest.approx(ring * world, rel=0.01)
        assert gloo["all_reduce"][1] >= 2 * ring
        assert gloo["reduce_scatter_tensor"][1] == pytest.approx(gloo["all_reduce"][1], rel=0.05)


def test_spans_carry_the_dimension(runs):
    assert runs[2][0]["dims"] == ["dp"]
    assert runs[2][0]["names"] == ["measured all-reduce", "measured reduce-scatter", "measured all-gather"] * 3


@pytest.mark.parametrize("world", [2, 3])
def test_group_ranks_and_bad_input(runs, world):
    for rank, out in enumerate(runs[world]):
        assert out["neighbours"] == ((rank - 1) % world, (rank + 1) % world, list(range(world)))
        assert out["outside"] == (rank != 0)
        impl_err, key_err, src_err = out["errors"]
        assert "impl must be one of" in impl_err
        assert "unknown collective" in key_err and "allreduce" in key_err
        assert f"src={world} must be a rank of this group" in src_err


def message_records():
    """A ring all-reduce and a user's own messages, as the flight recorder keeps them, and which
    of torch's calls a message goes through while they are wrapped."""
    import torch.distributed as dist

    from course_lib.collectives import measure, ring
    from course_lib.collectives.comm import Comm, TrafficCounter
    from course_lib.debug import flight_recorder
    from course_lib.grading.traffic import counted_calls

    rec = flight_recorder.recorder()
    start = rec.index
    x = torch.ones(4 * 3 * 1024)
    ring.all_reduce(x, segment_bytes=4096)                       # 4 segments a chunk
    in_ring = [r for r in rec.records() if r.index > start]
    comm, start = Comm(), rec.index
    a, b = torch.ones(5), torch.empty(5)
    comm.exchange(a, comm.next, b, comm.prev)                    # two messages from this line,
    w = comm.isend(a, comm.next, tag=7)                          # one from this one
    comm.irecv(b, comm.prev, tag=7).wait()                       # and one from this one
    w.wait()
    own = [r for r in rec.records() if r.index > start]
    to_next, from_prev = comm.poster("send", comm.next, 5), comm.poster("recv", comm.prev, 5)  # this line
    start, counter = rec.index, TrafficCounter()
    handles = [from_prev(b), to_next(a), to_next(torch.ones(0)), from_prev(b[:0])]   # the empty: not sent
    done = [h.wait() for h in handles]
    posted = [(r.op, r.seq, r.tag, r.shapes, r.dtypes, r.site, r.state) for r in rec.records() if r.index > start]
    start = rec.index   # the same posters, a shape they have seen in another dtype, then complex (the slow path)
    again = [from_prev(b.double()), to_next(a.double()),
             from_prev(torch.empty(5, dtype=torch.complex64)), to_next(torch.ones(5, dtype=torch.complex64))]
    [h.wait() for h in again]
    retyped = [(r.op, r.seq, r.shapes, r.dtypes, r.state) for r in rec.records() if r.index > start]
    counted = Comm(counter=counter)
    counted.exchange(a, comm.next, b, comm.prev)
    slow = counted.poster("recv", comm.prev, 6)(b[:3]), counted.poster("send", comm.next, 6)(a[:3])
    [h.wait() for h in slow]
    try:
        comm.poster("sendrecv", 0)
    except ValueError as e:
        bad_op = str(e)
    with counted_calls() as calls:                               # dist.isend wrapped: still called
        ring.all_reduce(torch.ones(12), validate=False)
    # a group's facts are looked up once per process group: each group keeps its own
    sub, groups = dist.new_group([0, 2]), []
    for _ in range(2):
        try:
            c = Comm(sub)
            groups.append((c.rank, c.size, list(c.ranks)))
            c.ranks.append(99)                                   # a Comm's own list, not the kept one
        except ValueError as e:
            groups.append(str(e))
        groups.append((Comm().rank, Comm().size, Comm().ranks))
    # the posts kept from call to call: each call's records carry its own call site (two lines)
    start, y = rec.index, torch.ones(6)
    ring.all_reduce(y)                                           # site A
    ring.all_reduce(y)                                           # site B, the next line
    two_calls = [(r.op, r.seq, r.tag, r.site, r.state) for r in rec.records() if r.index > start]
    # ... and they keep neither a tensor nor a destroyed group alive
    import gc
    import weakref
    whole = dist.new_group([0, 1, 2])
    t = torch.ones(6)
    refs = weakref.ref(t), weakref.ref(whole)
    ring.all_reduce(t, group=whole)
    dist.destroy_process_group(whole)
    del t, whole
    gc.collect()
    freed = [ref() is None for ref in refs]
    # time_ops(shuffle=True): each repetition in its own order, the same on every rank
    order = []
    times = measure.time_ops({k: (lambda k=k: order.append(k)) for k in "abc"}, reps=4, warmup=1, shuffle=True)
    return dict(total=x[0].item(), groups=groups, order=order, times={k: len(v) for k, v in times.items()}, in_ring=[(r.op, r.seq, r.tag, r.shapes, r.site, r.state) for r in in_ring],
                own=[(r.op, r.tag, r.site, r.state) for r in own], counted=sorted(c.op for c in calls.calls),
                posted=posted, retyped=retyped, two_calls=two_calls, freed=freed, done=done, bad_op=bad_op, nothing=handles[2] is handles[3],
                traffic=(counter.bytes_sent, counter.bytes_received, counter.messages_sent),
                rank=dist.get_rank())


def test_messages_are_recorded_with_their_call_site_and_still_reach_wrapped_sends():
    """Each message of a ring all-reduce has its record (the ring's caller as its call site,
    numbered per direction, peer and tag, completed when the call returns); a user's own
    messages carry their own lines; with dist.isend / irecv wrapped, every message goes through
    them (a grader counting calls, measure.simulated_link)."""
    outs = launch(message_records, 3, timeout=120)
    for out in outs:
        assert out["total"] == 3
        msgs = out["in_ring"]
        sites = {site for *_, site, _ in msgs}
        assert len(sites) == 1 and sites.pop().startswith("message_records (")
        assert {state for *_, state in msgs} == {"completed"}
        # 2 steps x 4 segments of each phase, each way; the all-gather on its own tag
        for op in ("send", "recv"):
            for tag in (0, 1):
                seqs = [seq for o, seq, t, *_ in msgs if o == op and t == tag]
                assert len(seqs) == 8 and seqs == list(range(seqs[0], seqs[0] + 8))
        assert {shape for *_, shape, _, _ in msgs} == {((1024,),)}
        lines = [int(site.split(":")[-1].rstrip(")")) for op, tag, site, state in out["own"]]
        assert lines[0] == lines[1] and lines[2:] == [lines[0] + 1, lines[0] + 2]
        assert [(op, tag) for op, tag, _, _ in out["own"]] == [("recv", 0), ("send", 0), ("send", 7), ("recv", 7)]
        assert {state for *_, state in out["own"]} == {"completed"}
        assert out["counted"] == ["irecv"] * 4 + ["isend"] * 4
        # Comm.poster: the same records as post_send / post_recv (the site: the line that asked for it)
        posted = out["posted"]
        assert [p[:5] for p in posted] == [("recv", 1, 5, ((5,),), ("float32",)), ("send", 1, 5, ((5,),), ("float32",))]
        assert {p[6] for p in posted} == {"completed"} and out["done"] == [True] * 4 and out["nothing"]
        sites = {p[5] for p in posted}
        assert len(sites) == 1 and sites.pop().startswith("message_records (")
        assert {int(p[5].split(":")[-1].rstrip(")")) for p in posted} == {lines[2] + 4}
        # two calls from two lines: 8 messages each (3 ranks, 6 elements: one segment a chunk), each
        # call's records with its own line, the sequence numbers running on from one call to the next
        two = out["two_calls"]
        assert len(two) == 16 and {state for *_, state in two} == {"completed"}
        line_a = int(two[0][3].split(":")[-1].rstrip(")"))
        for call, site_line in ((two[:8], line_a), (two[8:], line_a + 1)):
            assert {int(site.split(":")[-1].rstrip(")")) for *_, site, _ in call} == {site_line}
            assert all(site.startswith("message_records (") for *_, site, _ in call)
        for op in ("send", "recv"):
            for tag in (0, 1):
                seqs = [seq for o, seq, t, *_ in two if o == op and t == tag]
                assert len(seqs) == 4 and seqs == list(range(seqs[0], seqs[0] + 4))
        assert out["freed"] == [True, True]   # the tensor and the destroyed group: nothing kept them
        assert out["retyped"] == [("recv", 2, ((5,),), ("float64",), "completed"), ("send", 2, ((5,),), ("float64",), "completed"),
                                  ("recv", 3, ((5,),), ("complex64",), "completed"),
                                  ("send", 3, ((5,),), ("complex64",), "completed")]
        assert out["traffic"] == (20 + 12, 20 + 12, 2)       # a Comm's counter counts the poster's messages
        assert "op must be 'send' or 'recv'" in out["bad_op"]
        world = (out["rank"], 3, [0, 1, 2])
        sub = {0: (0, 2, [0, 2]), 2: (1, 2, [0, 2])}.get(out["rank"])
        if sub is None:
            assert out["groups"][0] == out["groups"][2] and "not a member of the group" in out["groups"][0]
        else:
            assert out["groups"][0] == out["groups"][2] == sub
        assert out["groups"][1] == out["groups"][3] == world
    orders = [out["order"] for out in outs]
    assert orders[0] == orders[1] == orders[2] and outs[0]["times"] == {"a": 4, "b": 4, "c": 4}
    reps = [orders[0][3 + 3 * i:6 + 3 * i] for i in range(4)]   # (after the warm-up calls, a, b, c)
    assert all(sorted(r) == ["a", "b", "c"] for r in reps) and any(r != ["a", "b", "c"] for r in reps)
