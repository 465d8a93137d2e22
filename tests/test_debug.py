"""course_lib.debug: the flight recorder's ring, the merged diagnosis of real hangs and crashes
(small launch timeouts), the desync check, non-finite tracing and the gradient bisection."""
from __future__ import annotations

import inspect
import os
import textwrap

import pytest
import torch
import torch.nn as nn

from course_lib import launch
from course_lib.debug import diagnose
from course_lib.debug.bisect import first_divergence, grads_of
from course_lib.debug.desync import fingerprint, mismatch_message
from course_lib.debug.flight_recorder import FlightRecorder, Record, check_slots, parse
from course_lib.debug.nonfinite import NonFiniteError, NonFiniteTracer
from course_lib.debug.postmortem import describe_stack
from course_lib.launch import LaunchTimeout, RankError
from course_lib.parallel.mesh import MeshShape

HANG = 2.0   # seconds a planted hang gets before the launcher gives up on it


# ----------------------------------------------------------------------------- the ring, in-process

def test_ring_keeps_the_last_n_calls_with_per_group_numbers():
    fr = FlightRecorder(None, rank=3, slots=4)
    t = torch.zeros(8, 64)
    for k in range(5):
        fr.record("all_reduce", "dp", (0, 1, 2, 3), [t], extra="SUM", span="step [compute]", site="f (x.py:1)")
    e = fr.record("all_gather_into_tensor", "tp", (2, 3), [torch.zeros(4, dtype=torch.float64), torch.zeros(2)])
    e.waiting()
    s = fr.record("send", "pp", (1, 3), [t], peer=1, tag=0)
    s.complete()
    recs = fr.records()
    assert [r.index for r in recs] == [4, 5, 6, 7]                  # the oldest three overwritten
    assert [r.seq for r in recs] == [4, 5, 1, 1]                    # numbered per group / per message pair
    assert recs[1].name == "all_reduce #5 on dp [0, 1, 2, 3]" and recs[1].state == "issued"
    assert recs[2].shapes == ((4,), (2,)) and recs[2].dtypes == ("float64", "float32")
    assert recs[2].state == "waiting" and recs[3].state == "completed" and recs[3].name == "send #1 to rank 1"
    assert recs[1].span == "step [compute]" and recs[1].site == "f (x.py:1)" and recs[0].rank == 3
    e.complete()                                                    # a stale entry cannot touch a reused slot
    for _ in range(4):
        fr.record("barrier", "dp", (0, 1), [])
    e.waiting()
    assert {r.state for r in fr.records()} == {"issued"}
    assert parse(b"garbage", 0) == [] and parse(b"", 0) == []


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_ring_size_below_one_is_refused(bad):
    with pytest.raises(ValueError, match="flight_recorder"):
        check_slots(bad)
    with pytest.raises(ValueError, match="flight_recorder"):
        launch(lambda: None, 1, flight_recorder=bad)


def test_unknown_debug_mode_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="unknown debug mode 'nan'"):
        launch(lambda: None, 2, debug="nan")
    with pytest.raises(ValueError, match="unknown debug mode 'x'"):
        launch(lambda: None, 2, debug=("desync", "x"))


def _rec(rank, index, seq, op, dim, ranks, shapes=((8, 64),), state="waiting", peer=None):
    return Record(rank, index, seq, op, dim, tuple(ranks), shapes, ("float32",) * len(shapes), peer, 0,
                  "" if peer is not None else "SUM", "", "", state)


def test_diagnosis_of_the_issues_examples_from_records():
    """The four findings the issue names, from hand-made records (no ranks)."""
    dp = [0, 1, 2, 3]
    recs = {r: [_rec(r, 17, 17, "all_gather_into_tensor", "dp", dp)] for r in (0, 1, 2)}
    recs[3] = [_rec(3, 16, 16, "all_gather_into_tensor", "dp", dp, state="completed"),
               _rec(3, 17, 17, "all_reduce", "tp", [2, 3])]
    text = diagnose(recs)
    assert text.replace("\n    ", " ") == (
        "ranks 0, 1, 2 wait in all_gather #17 on dp [0, 1, 2, 3]; rank 3 never reached #17: it is in "
        "all_reduce #17 on tp [2, 3]: different ops at the same position (call 17 of each rank)\n"
        "rank 3 waits in all_reduce #17 on tp [2, 3]; rank 2 never reached #17: it is in all_gather #17 on "
        "dp [0, 1, 2, 3]: different ops at the same position (call 17 of each rank)")
    recs = {r: [_rec(r, 9, 9, "all_reduce", "dp", dp)] for r in (0, 1, 3)}
    recs[2] = [_rec(2, 8, 8, "all_reduce", "dp", dp, state="completed")]
    assert "rank 2 never reached #9: it raised ValueError after all_reduce #8" in \
        diagnose(recs, {2: "raised ValueError"}).replace("\n    ", " ")
    recs = {0: [_rec(0, 1, 1, "send", "pp", [0, 1], peer=1)], 1: [_rec(1, 1, 1, "send", "pp", [0, 1], peer=0)]}
    text = diagnose(recs).replace("\n    ", " ")
    assert "rank 0 waits in send #1 to rank 1: send to rank 1 with no matching receive (both ranks send first)" \
        in text and "rank 1 waits in send #1 to rank 0" in text
    recs = {r: [_rec(r, 1, 1, "send", "dp", [0, 1, 2], peer=(r + 1) % 3)] for r in range(3)}   # a ring
    assert "send to rank 1 with no matching receive (ranks 0, 1, 2 all send first: a cycle)" in \
        diagnose(recs).replace("\n    ", " ")
    recs = {0: [_rec(0, 4, 4, "all_reduce", "dp", [0, 1], ((8, 64),))],
            1: [_rec(1, 4, 4, "all_reduce", "dp", [0, 1], ((8, 32),))]}
    assert diagnose(recs).startswith("shapes differ at all_reduce #4 on dp [0, 1]: (8, 64) on rank 0 vs (8, 32)")
    assert diagnose({0: [], 1: []}).startswith("no communication call was recorded")


class _FakeEvent:
    """A CUDA event's stand-in: fires when the test says the kernel has run."""
    def __init__(self):
        self.fired = False

    def query(self):
        return self.fired


def test_under_nccl_a_call_on_cuda_tensors_completes_by_its_cuda_event(monkeypatch):
    """NCCL returns when the kernel is enqueued: the record says enqueued until the event
    recorded behind it fires; a CPU tensor, or a recorder without CUDA events, completes on
    return. (The GPU itself: test_flight_recorder_on_a_gpu.)"""
    from types import SimpleNamespace

    from course_lib.debug import flight_recorder
    events = []
    monkeypatch.setattr(flight_recorder, "_cuda_event", lambda device: events.append(_FakeEvent()) or events[-1])
    monkeypatch.setattr(flight_recorder, "WATCH_S", 3600.0)   # the test polls, not the watchdog
    comm = SimpleNamespace(dim="dp", ranks=[0, 1], size=2)
    on_gpu = SimpleNamespace(shape=(4,), dtype=torch.float32, is_cuda=True,   # a CUDA tensor's face
                             device=SimpleNamespace(index=0))
    for cuda_events, tensor, first in ((True, on_gpu, "enqueued"), (False, on_gpu, "completed"),
                                       (True, torch.zeros(4), "completed")):
        fr = flight_recorder.install(FlightRecorder(None, rank=0, cuda_events=cuda_events))
        try:
            for _ in range(2):
                flight_recorder.completed(flight_recorder.collective(comm, "all_reduce", (tensor,), {}, False), None)
            assert [r.state for r in fr.records()] == [first] * 2
            if first == "enqueued":
                assert [r.name for r in recs_of(fr, "enqueued")] == ["all_reduce #1 on dp [0, 1]",
                                                                   "all_reduce #2 on dp [0, 1]"]
                events[0].fired = True                        # the first kernel ran, the second not
                assert fr.poll() == 1
                assert [r.state for r in fr.records()] == ["completed", "enqueued"]
                assert diagnose({0: fr.records(), 1: []}).startswith("rank 0 waits in all_reduce #2 on dp")
                events[1].fired = True
                assert fr.poll() == 0 and {r.state for r in fr.records()} == {"completed"}
        finally:
            flight_recorder.install(None)
            fr.close()


def recs_of(fr, state):
    return [r for r in fr.records() if r.state == state]


def _recorder_mode():
    from course_lib.debug import flight_recorder
    return flight_recorder.recorder().cuda_events


def test_the_backend_selects_the_completion_by_cuda_event():
    assert list(launch(_recorder_mode, 2)) == [False, False]          # gloo: the CPU's return


def _nccl_all_reduce_after_a_long_kernel():
    import torch.distributed as dist

    from course_lib.collectives import Comm
    from course_lib.debug import flight_recorder
    comm = Comm(None, dim="dp")
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(20):
        a = a @ a / 8192 ** 0.5                                        # ~20 TFLOP queued on the GPU
    out = torch.empty_like(a)
    comm.all_gather_into_tensor(out, a)          # (one rank: NCCL still runs it, behind the matmuls)
    fr = flight_recorder.recorder()
    after_return = fr.records()[-1].state
    torch.cuda.synchronize()
    for _ in range(100):                                               # the watchdog polls
        if fr.records()[-1].state == "completed":
            break
        import time
        time.sleep(0.05)
    return fr.cuda_events, dist.get_backend(), after_return, fr.records()[-1].state


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_flight_recorder_on_a_gpu():
    cuda_events, backend, after_return, at_end = launch(_nccl_all_reduce_after_a_long_kernel, 1,
                                                        backend="nccl")[0]
    assert (cuda_events, backend) == (True, "nccl")
    assert after_return == "enqueued" and at_end == "completed"


# ----------------------------------------------------------------------------- real hangs and crashes

def wrong_group():
    """Rank 3 all-reduces over tp where its dp peers all-gather: a cross-group hang."""
    import torch.distributed as dist

    from course_lib.parallel.mesh import Mesh
    mesh = Mesh(dp=2, tp=2)
    for _ in range(2):
        mesh.comm("dp").all_reduce(torch.ones(4))
    if dist.get_rank() == 3:
        mesh.comm("tp").all_reduce(torch.ones(4))
    else:
        mesh.comm("dp").all_gather_into_tensor(torch.empty(8), torch.ones(4))


def both_send_first():
    from course_lib.collectives import Comm
    comm = Comm(None, dim="pp")
    t = torch.ones(4)
    comm.send(t, 1 - comm.rank)      # the fix: even ranks send first, odd ranks receive first
    comm.recv(t, 1 - comm.rank)


def test_hangs_end_with_a_merged_diagnosis():
    with pytest.raises(LaunchTimeout) as hang:
        launch(wrong_group, 4, timeout=HANG, quiet=True)
    d = hang.value.diagnosis.replace("\n    ", " ")
    assert d == ("rank 1 waits in all_gather #3 on dp [1, 3]; rank 3 never reached #3: it is in all_reduce #1 "
                 "on tp [2, 3]: different ops at the same position (call 3 of each rank)\n"
                 "rank 3 waits in all_reduce #1 on tp [2, 3]; rank 2 never reached #1: it returned from fn "
                 "after all_gather #3 on dp [0, 2]")
    assert hang.value.diagnosis in str(hang.value)
    with pytest.raises(LaunchTimeout) as hang:
        launch(both_send_first, 2, timeout=HANG, quiet=True)
    assert "send to rank 1 with no matching receive (both ranks send first)" in hang.value.diagnosis.replace(
        "\n    ", " ")


def raise_midway(off=False):
    from course_lib.collectives import Comm
    comm = Comm(None, dim="dp")
    for step in range(3):
        if comm.rank == 2 and step == 2:
            raise ValueError("a bad batch on rank 2")
        comm.all_reduce(torch.ones(4))


def shapes_differ():
    from course_lib.collectives import Comm
    comm = Comm(None, dim="dp")
    comm.all_reduce(torch.ones(8, 64 if comm.rank == 0 else 32))


def test_crashes_are_diagnosed_the_same_whatever_the_timing():
    for _ in range(2):   # the survivors are given time to block: the same words every run
        with pytest.raises(ValueError) as err:
            launch(raise_midway, 4, quiet=True)
        assert err.value.diagnosis.replace("\n    ", " ") == (
            "ranks 0, 1, 3 wait in all_reduce #3 on dp [0, 1, 2, 3]; rank 2 never reached #3: it raised "
            "ValueError after all_reduce #2 on dp [0, 1, 2, 3]")
    with pytest.raises(RankError) as err:   # gloo aborts one rank: the records still tell why
        launch(shapes_differ, 2, quiet=True)
    assert err.value.diagnosis.startswith("shapes differ at all_reduce #1 on dp [0, 1]: (8, 64) on rank 0 vs "
                                          "(8, 32) on")
    with pytest.raises(ValueError) as err:
        launch(raise_midway, 4, quiet=True, flight_recorder=None)
    assert err.value.diagnosis == "" and "diagnosis" not in str(err.value)


def test_describe_stack_picks_the_distributed_call():
    dump = textwrap.dedent("""\
        Thread 0x01 (most recent call first):
          File "/x/site-packages/torch/distributed/distributed_c10d.py", line 10 in recv
          File "/x/site-packages/torch/distributed/c10d_logger.py", line 5 in wrapper
          File "/home/me/ring.py", line 7 in my_ring
          File "/x/course_lib/launch.py", line 9 in _rank_main
        """)
    assert describe_stack(dump) == "waiting in torch.distributed.recv, called from my_ring (ring.py:7)"
    assert describe_stack("") == ""


# ----------------------------------------------------------------------------- desync check

def desync_run(bug):
    from course_lib.collectives import Comm
    comm = Comm(None, dim="dp")
    x = torch.ones(8, 64)
    comm.all_reduce(x)
    send = [1, 2] if comm.rank == 0 else [1, 1]      # an uneven all-to-all is legal: not a desync
    recv = [1, 1] if comm.rank == 0 else [2, 1]
    comm.all_to_all_single(torch.empty(sum(recv), 5), torch.ones(sum(send), 5), recv, send)
    if bug and comm.rank == 1:
        comm.all_reduce(x[:, :32].contiguous())      # the planted bug: rank 1 reduces half a tensor
    else:
        comm.all_reduce(x)
    return float(x.sum())


def test_desync_check_raises_on_every_rank_naming_each_call_site():
    assert launch(desync_run, 2, False, debug="desync", quiet=True) == [2048.0, 2048.0]
    with pytest.raises(ValueError) as err:
        launch(desync_run, 2, True, debug="desync", quiet=True)
    lines, start = inspect.getsourcelines(desync_run)
    bug = start + next(i for i, l in enumerate(lines) if "the planted bug" in l)
    good = start + next(i for i, l in enumerate(lines) if l.strip() == "comm.all_reduce(x)" and i > 8)
    msg = str(err.value)
    assert "group rank 0: all_reduce (8, 64) float32 SUM on dp [0, 1], called from desync_run" in msg
    here = os.path.basename(__file__)
    assert f"{here}:{good})" in msg and f"{here}:{bug})" in msg
    assert "group rank 1: all_reduce (8, 32)" in msg


def test_fingerprints_ignore_an_all_to_alls_split_sizes():
    a = fingerprint("all_to_all_single", [torch.ones(3, 5), torch.ones(4, 5)], "", "ep", [0, 1])
    b = fingerprint("all_to_all_single", [torch.ones(2, 5), torch.ones(1, 5)], "", "ep", [0, 1])
    c = fingerprint("all_to_all_single", [torch.ones(2, 6), torch.ones(1, 6)], "", "ep", [0, 1])
    assert a == b != c
    assert mismatch_message([(a, "f (x.py:1)"), (b, "f (x.py:1)")]) == ""
    assert "called from g (y.py:2)" in mismatch_message([(a, "f (x.py:1)"), (c, "g (y.py:2)")])


# ----------------------------------------------------------------------------- non-finite values

class Normalize(nn.Module):
    def forward(self, x):                       # (batch, features) / its row norms: 0 / 0 on a zero row
        return x / x.norm(dim=-1, keepdim=True)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Normalize(), nn.Linear(4, 1))


def test_tracer_names_the_first_op_module_and_step():
    net, mask = _net(), torch.ones(3, 3, dtype=torch.bool).triu(1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as err, NonFiniteTracer():
        for step in range(3):
            scores = torch.randn(3, 3).masked_fill(mask, float("-inf")).softmax(-1)   # -inf on purpose: fine
            x = torch.randn(5, 4) + scores.sum()
            if step == 2:
                with torch.no_grad():
                    net[0].weight[1:].zero_()
                    net[0].bias.zero_()      # row 0 of x still gives a nonzero row; x[1] = 0 gives 0 / 0
                x[1] = 0
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()
    e = err.value
    assert (e.step, e.module, e.op, e.phase, e.kind) == (2, "1 (Normalize)", "aten.div.Tensor", "forward", "NaN")
    assert isinstance(e, FloatingPointError)
    x = torch.zeros(3, requires_grad=True)
    with pytest.raises(NonFiniteError, match="backward of SqrtBackward0: aten.div.Tensor made Inf"), \
            NonFiniteTracer():
        x.sqrt().sum().backward()


def nan_on_rank_one():
    from course_lib.collectives import Comm
    comm = Comm(None, dim="dp")
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(3):
        x = torch.ones(2, 4)
        if step == 1 and comm.rank == 1:
            net[0].weight.data.zero_()
            net[0].bias.data.zero_()           # this rank's layer output is all zeros: 0 / 0
        net(x).sum().backward()
        for p in net.parameters():
            comm.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()


def test_launch_traces_the_rank_that_made_the_nan():
    with pytest.raises(FloatingPointError) as err:
        launch(nan_on_rank_one, 2, debug="nonfinite", quiet=True)
    assert "rank 1 raised FloatingPointError: rank 1, step 1, forward of 1 (Normalize): aten.div.Tensor made NaN " \
        "from finite inputs" in str(err.value)
    assert "rank 0 waits in all_reduce #5 on dp [0, 1]; rank 1 never reached #5" in \
        err.value.diagnosis.replace("\n    ", " ")


# ----------------------------------------------------------------------------- bisection

def grad_variants(X, Y):
    """The first step's gradients of an MLP on Mesh(dp=2, cp=2) (rows split over both, as CP splits
    a per-token MLP's tokens), with the right sum and four planted mistakes."""
    from course_lib.parallel.mesh import Mesh
    mesh = Mesh(dp=2, cp=2)
    c = mesh.coord
    x, y = X.chunk(4)[2 * c["dp"] + c["cp"]], Y.chunk(4)[2 * c["dp"] + c["cp"]]
    out = {}
    for bug in ("none", "missing cp", "cp twice", "mean", "local count"):
        net = _mlp()
        count = len(x) if bug == "local count" else len(X)
        ((net(x) - y) ** 2).sum().div(count).backward()
        for p in net.parameters():
            mesh.comm("dp" if bug == "missing cp" else ("dp", "cp")).all_reduce(p.grad)
            if bug == "cp twice":
                mesh.comm("cp").all_reduce(p.grad)
            if bug == "mean":
                p.grad /= 4
        out[bug] = [grads_of(net.named_parameters())]
    return out


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).double()


def test_bisection_names_the_dimension_whose_sum_is_wrong():
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    Y = torch.randn(16, 2, generator=gen, dtype=torch.float64)
    ref = _mlp()
    ((ref(X) - Y) ** 2).sum().div(len(X)).backward()
    ref_grads = [{n: p.grad for n, p in ref.named_parameters()}]
    res = launch(grad_variants, 4, X, Y, quiet=True)
    shape = MeshShape(dp=2, cp=2)
    found = {bug: first_divergence([r[bug] for r in res], ref_grads, shape) for bug in res[0]}
    assert found["none"] is None
    f = found["missing cp"]
    assert (f.step, f.name, f.ranks, f.cause, f.dims) == (0, "0.weight", [0, 1, 2, 3], "missing", ("cp",))
    assert "the reduction over cp is missing" in str(f)
    assert (found["cp twice"].cause, found["cp twice"].factor) == ("scaled", 2.0)
    assert "reduction over dp or cp ran twice" in str(found["cp twice"])
    assert (found["mean"].factor, found["local count"].factor) == (0.25, 4.0)
    assert "averaged over dp and cp" in str(found["mean"])
    with pytest.raises(ValueError, match="2 ranks but the mesh has 4"):
        first_divergence([[{}], [{}]], ref_grads, shape)


def sgd_steps(X, Y, step_before_sync):
    """Three SGD steps of data parallelism on 2 ranks; the bug: optimizer.step() before the sync."""
    from course_lib.collectives import Comm
    comm = Comm(None, dim="dp")
    net, grads, params = _mlp(), [], []
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = X.chunk(2)[comm.rank], Y.chunk(2)[comm.rank]
    for _ in range(3):
        params.append({n: p.detach().clone() for n, p in net.named_parameters()})
        ((net(x) - y) ** 2).sum().div(len(X)).backward()
        if step_before_sync:
            opt.step()
        for p in net.parameters():
            comm.all_reduce(p.grad)
        if not step_before_sync:
            opt.step()
        grads.append(grads_of(net.named_parameters()))
        opt.zero_grad()
    return grads, params


def test_bisection_blames_the_update_when_gradients_matched():
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    Y = torch.randn(16, 2, generator=gen, dtype=torch.float64)
    ref, ref_grads, ref_params = _mlp(), [], []
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        ref_params.append({n: p.detach().clone() for n, p in ref.named_parameters()})
        ((ref(X) - Y) ** 2).sum().div(len(X)).backward()
        ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        opt.step()
        opt.zero_grad()
    for bug in (True, False):
        res = launch(sgd_steps, 2, X, Y, bug, quiet=True)
        found = first_divergence([r[0] for r in res], ref_grads, MeshShape(dp=2), params=[r[1] for r in res],
                                 ref_params=ref_params, optimizer="sgd", lr=0.1)
        if bug:
            assert (found.step, found.name, found.ranks, found.cause) == (1, "0.weight", [0, 1], "update")
            assert "gradient of step 0 matched one device" in str(found)
        else:
            assert found is None


def tp_step(X, Y, same_seed):
    """A column / row tensor-parallel MLP on 2 ranks with a dropout in its replicated output."""
    from course_lib.collectives import Comm
    from course_lib.parallel.comm_ops import copy_to_parallel, reduce_from_parallel
    comm = Comm(None, dim="tp")
    r, full, cols = comm.rank, _mlp(), slice(8 * comm.rank, 8 * comm.rank + 8)
    w1 = full[0].weight[cols].detach().clone().requires_grad_()      # (8, 8)
    w2 = full[2].weight[:, cols].detach().clone().requires_grad_()   # (2, 8)
    b1, b2 = full[0].bias[cols].detach().clone(), full[2].bias.detach()
    y = reduce_from_parallel(torch.tanh(copy_to_parallel(X, comm) @ w1.T + b1) @ w2.T, comm) + b2
    mask = (torch.rand(y.shape, generator=torch.Generator().manual_seed(7 + (0 if same_seed else r))) > 0.5) * 2.0
    ((y * mask - Y) ** 2).sum().div(len(X)).backward()
    return [{"0.weight": (w1.grad, (0, 8 * r, 8 * r + 8, 16)), "2.weight": (w2.grad, (1, 8 * r, 8 * r + 8, 16))}]


def test_bisection_finds_a_forward_that_differs_on_one_rank():
    gen = torch.Generator().manual_seed(2)
    X = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    Y = torch.randn(16, 2, generator=gen, dtype=torch.float64)
    ref = _mlp()
    mask = (torch.rand(16, 2, generator=torch.Generator().manual_seed(7)) > 0.5) * 2.0
    ((ref(X) * mask - Y) ** 2).sum().div(len(X)).backward()
    ref_grads = [{n: ref.get_parameter(n).grad for n in ("0.weight", "2.weight")}]
    found = [first_divergence(list(launch(tp_step, 2, X, Y, same, quiet=True)), ref_grads, MeshShape(tp=2))
             for same in (False, True)]
    assert (found[0].name, found[0].ranks, found[0].cause) == ("0.weight", [1], "other")
    assert "another forward" in str(found[0]) and found[1] is None
