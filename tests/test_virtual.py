"""course_lib/virtual: the virtual GPU clock prices a real run on a modelled cluster.

Expected times are computed here from the planner's Hardware and the cost model's formulas,
not from the clock's own code. Few launches, each checking several things."""
import json
import os
import sys

import pytest
import torch
import torch.nn as nn

from course_lib import costmodel, trace
from course_lib.collectives.comm import Comm
from course_lib.launch import LaunchTimeout, launch
from course_lib import schedules as S
from course_lib.parallel.pipeline import run_schedule
from course_lib.planner import HARDWARE, Layout, ModelSpec, simulate
from course_lib.planner.gemm import gemm_time
from course_lib.virtual import VirtualCluster

H100 = HARDWARE["h100-sxm"]
M, N, K = 768, 768, 768             # a compute-bound GEMM on an H100 (2 MNK / rate > bytes / HBM)
ELEMS = 1 << 16                      # the all-reduce's tensor
REL = 1e-9                           # sums of a few hundred float64 prices: exact up to rounding


NO_HOST = H100.with_(launch_overhead=0.0)   # kernels back to back: no issue interval between them


def gemm_seconds(m, n, k, hw=H100):
    """One bf16 GEMM on the virtual GPU: the planner's tile x wave model at the preset's fitted
    fraction of peak, or its bytes at the elementwise rate, or the kernel floor (the host's
    issue interval is the stream's, not the kernel's)."""
    eff = hw.efficiencies()
    return max(gemm_time(m, n, k, hw.with_(matmul_efficiency=eff["gemm"])),
               2 * (m * k + k * n + m * n) / (hw.hbm_bandwidth * eff["elementwise"]), hw.kernel_floor)


def _basics():
    comm = Comm(None, dim="dp")
    r = comm.rank
    torch.manual_seed(r)
    a, b, z, z2 = torch.randn(M, K), torch.randn(K, N), torch.ones(ELEMS) * r, torch.ones(ELEMS)
    before = trace.now()
    a.view(K, M).t()[:3].unsqueeze(0).expand(2, -1, -1)   # views launch no kernel
    free = trace.now() - before
    with trace.span("gemm", "compute"):
        c = a @ b
    if r == 0:
        comm.send(c, 1)                          # the chain rank 0 -> rank 1
    elif r == 1:
        c = torch.empty(M, N)
        comm.recv(c, 0)
    with trace.span("unequal work", "compute"):
        for _ in range(r):
            a @ b
    comm.all_reduce(z)                           # issued right at the end of "unequal work"
    h1 = comm.all_reduce(z2, async_op=True, name="first async")
    h2 = comm.all_reduce(z2.clone(), async_op=True, name="second async")   # waits for the stream
    with trace.span("overlapped", "compute"):
        a @ b
    after_compute = trace.now()
    priced = {s.name: s for s in trace.spans()}    # read before the waits: already priced
    assert priced["second async"].start >= priced["first async"].end > priced["first async"].start
    h1.wait()
    h2.wait()
    end = trace.now()
    return free, float(z[0]), after_compute, end, float(c[:2].sum())     # c: rank 1 received rank 0's


def test_gemm_chain_and_all_reduce_prices():
    """Two nodes of 2 GPUs: the chain 0 -> 1 stays on NVLink, the all-reduces cross the network."""
    cluster = VirtualCluster(NO_HOST, gpus_per_node=2, dtype=torch.bfloat16)
    res = launch(_basics, 4, clock=cluster)
    spans = {(s.rank, s.name): s for s in res.spans}
    assert [x[0] for x in res] == [0.0] * 4 and [x[1] for x in res] == [6.0] * 4   # exact results
    assert res[1][4] == res[0][4]
    gemm = gemm_seconds(M, N, K)
    assert 2 * M * N * K / (H100.peak_flops * H100.matmul_efficiency) > 2 * (M * K + K * N + M * N) / H100.hbm_bandwidth
    for r in range(4):
        assert spans[r, "gemm"].duration == pytest.approx(gemm, rel=0.01)
        assert spans[r, "unequal work"].duration == pytest.approx(r * gemm, rel=0.01)
    # chain: the receive ends one message after the send was issued (at the end of the GEMM).
    # NCCL's model of one message (src/graph/tuning.cc): baseLat + one hwLat step, Simple
    # above 16 KiB: 8.4 + 3.4 us over NVLink, then the bytes at the preset's bus bandwidth
    nvlink = H100.nvlink_bandwidth * H100.nvlink_efficiency
    recv = spans[1, "recv from 0"]
    assert recv.end == pytest.approx(spans[0, "gemm"].end + 11.8e-6 + 2 * M * N / nvlink, rel=REL)
    assert spans[1, "unequal work"].start == pytest.approx(recv.end, rel=REL)
    # all-reduce of 128 KiB over 2 nodes x 2 GPUs: one end on every member, the slowest issue +
    # NCCL's fastest choice, ring with LL128 here (ring: 6 steps, 4 of them across the network)
    net, n = H100.network_bandwidth * H100.network_efficiency, 2 * ELEMS
    ring = {"LL": 6.6e-6 + 2 * 1.08e-6 + 4 * 2.7e-6 + n / (min(39e9, net / 4) * 4 / 6),
            "LL128": 14e-6 + 2 * 1.9e-6 + 4 * 4.0e-6 + n / (net * 0.92 * 4 / 6),
            "Simple": (8.4e-6 + 2 * 3.4e-6 + 4 * 14e-6) * 1.9 + n / (net * 4 / 6)}
    tree = {"LL": 6.8e-6 + 2 * (1.08e-6 + 5e-6) + n / (net * 0.92 / 3.8 * 0.5),
            "LL128": 14e-6 + 2 * (1.25e-6 + 8.5e-6) + n / (net * 0.92 * 120 / 128 * 0.5),
            "Simple": 2 * (28e-6 + 28e-6) + n / (net * 0.92 * 0.5)}
    best = min([*ring.values(), *tree.values()])
    assert best == ring["LL128"]
    issue = max(spans[r, "unequal work"].end for r in range(4))
    ends = {spans[r, "all-reduce"].end for r in range(4)}
    assert len(ends) == 1 and ends.pop() == pytest.approx(issue + best, rel=REL)
    # two async all-reduces share the communication stream; compute runs beside them
    for r in range(4):
        first, second = spans[r, "first async"], spans[r, "second async"]
        assert second.start == pytest.approx(first.end, rel=REL)
        assert spans[r, "overlapped"].start < first.end                     # overlapped
        assert res[r][3] == pytest.approx(max(res[r][2], second.end), rel=REL)  # wait() joins


def _stages(comm, p, v, n_linear, h):
    """Equal stages, n_linear + 1 kernels forward, n_linear + 1 backward (B), n_linear in W:
    n_linear Linear layers and one elementwise kernel (the last stage's is its loss, y.sum():
    one kernel forward, one (ones_like) backward, like x * 0.5). Stage 0 computes no input
    gradient (its input is data): a kernel that runs only in backward stands in for it."""
    torch.manual_seed(comm.rank)
    stages = {}
    for s in range(comm.rank, p * v, p):
        layers = [nn.Linear(h, h, bias=False) for _ in range(n_linear)]
        for lin in layers:
            nn.init.orthogonal_(lin.weight)                 # keeps the scale: no denormals
            lin.weight.grad = torch.zeros_like(lin.weight)  # every micro-batch accumulates alike
        stages[s] = nn.Sequential(layers[0], *([BackwardKernel()] if s == 0 else []), *layers[1:],
                                  *([] if s == p * v - 1 else [Half()]))
    return stages


class Half(nn.Module):
    def forward(self, x):
        return x * 0.5


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)       # a view: no kernel

    @staticmethod
    def backward(ctx, g):
        return g * 1.0            # one elementwise kernel


class BackwardKernel(nn.Module):
    def forward(self, x):
        return _Identity.apply(x)


def _pipelines(p, m, configs, n_linear=8, h=32, b=8):
    comm = Comm(None, dim="pp")
    out = {}
    for name, v in configs:
        stages = _stages(comm, p, v, n_linear, h)
        inputs = [torch.randn(b, h) for _ in range(m)]
        comm.barrier()
        trace.reset()
        res = run_schedule(S.make_schedule(name, p, m, v), stages, comm, p=p, m=m, v=v, inputs=inputs,
                           targets=[None] * m, loss_fn=lambda y, t: y.sum(), act_shape=(b, h))
        out[name] = (trace.spans(), res.losses)
    return out


CONFIGS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]


def test_bubbles_match_formula_and_planner():
    """Free point-to-point and actions of fixed times (the formula's assumptions, as in
    test_pipeline's planner check): no issue interval, else a stage's host runs ahead while it
    waits and its next action's kernels run back to back, shorter (as on a GPU)."""
    p, m = 4, 8
    ideal = H100.with_(nvlink_latency=0.0, network_latency=0.0, nvlink_bandwidth=1e30, network_bandwidth=1e30,
                       elementwise_passes=0, launch_overhead=0.0)
    res = launch(_pipelines, p, p, m, CONFIGS, clock=VirtualCluster(ideal, gpus_per_node=8))
    # the planner's stages are equal too with its flat GEMM model (on tiles, the last stage's
    # 2-token head GEMM would cost a whole 128-wide tile: 0.7% more)
    even, flat = ModelSpec("even", 48, 1024, 16, 16, 4096, 2, 1024), ideal.with_(sm_count=0)
    for name, v in CONFIGS:
        spans = [s for r in res for s in r[name][0]]
        times = {op: [s.duration for s in spans if s.kind == "compute" and s.name[0] == op] for op in "FBW"}
        assert max(times["F"]) - min(times["F"]) < 1e-3 * min(times["F"]), name      # equal stages
        t_f = sum(times["F"]) / len(times["F"])
        t_w = sum(times["W"]) / len(times["W"]) if times["W"] else 0.0
        t_b = sum(times["B"]) / len(times["B"]) + t_w
        formula = S.formula_bubble(name, p, m, v, t_f=t_f, t_b=t_b, t_w=t_w)
        assert S.bubble(spans) == pytest.approx(formula, rel=0.01), name
        if name != "zb-h1":                                   # the planner simulates the other three
            planned = simulate(even, flat, Layout(pp=p, schedule=name, v=v, global_batch=m))
            for r in range(p):
                assert S.bubble(spans, rank=r) == pytest.approx(planned.bubble(r), rel=1e-3), (name, r)


def _one_f_one_b():
    return _pipelines(4, 8, [("1f1b", 1), ("zb-h1", 1)])


def _one_f_one_b_kernels():
    """(the CPU kernels this rank runs, its 1F1B spans)."""
    from torch.backends import cpu

    return cpu.get_cpu_capability(), _one_f_one_b()["1f1b"][0]


def test_pipeline_on_h100_links_is_the_schedule_simulation_and_deterministic(tmp_path, monkeypatch):
    """With the preset's NVLink, every action starts exactly when schedules.simulate says (its
    t_comm = one message's time in NCCL's model, the run's own action times); twice in a row, and on
    ranks with the default (non-vectorised) kernels, the spans are identical."""
    cluster = VirtualCluster("h100-sxm", gpus_per_node=8, dtype=torch.bfloat16)
    first = launch(_one_f_one_b, 4, clock=cluster)
    second = launch(_one_f_one_b, 4, clock=cluster)
    # one 512-byte message over NVLink in NCCL's model: LL (up to 16 KiB), baseLat 6.6 + hwLat
    # 0.6 us, the bytes at a quarter of the bus bandwidth (LL carries 4 data bytes in 8)
    alpha, bw = 7.2e-6, min(87.7e9, H100.nvlink_bandwidth * H100.nvlink_efficiency / 4)
    for name in ("1f1b", "zb-h1"):
        spans = [s for r in first for s in r[name][0]]
        assert spans == [s for r in second for s in r[name][0]], name
        compute = [s for s in spans if s.kind == "compute"]
        t0 = min(s.start for s in compute)
        sim = S.simulate(S.make_schedule(name, 4, 8), 4, t_comm=alpha + 8 * 32 * 2 / bw,
                         durations={s.name: s.duration for s in compute})
        want = {s.name: (s.start, s.end) for s in sim if s.kind == "compute"}
        for s in compute:
            assert (s.start - t0, s.end - t0) == pytest.approx(want[s.name], rel=REL, abs=1e-15), (name, s)
    # each rank reads ATEN_CPU_CAPABILITY from the launcher's environment at its first op (the
    # ranks are fresh forks; no subprocess and its forkserver importing torch again, ~4 s of CPU)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    portable = launch(_one_f_one_b_kernels, 4, clock=VirtualCluster("h100-sxm", 8, torch.bfloat16))
    assert [kernels for kernels, _ in portable] == ["DEFAULT"] * 4
    assert [spans for _, spans in portable] == [r["1f1b"][0] for r in first]
    # the Chrome trace of that run
    path = tmp_path / "step.json"
    trace.to_chrome_trace(first.spans, path)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(first.spans)
    for e, s in zip(sorted(slices, key=lambda e: (e["pid"], e["ts"], e["ts"] + e["dur"], e["name"])),
                    sorted(first.spans, key=lambda s: (s.rank, s.start, s.end, s.name))):
        assert (e["pid"], e["name"]) == (s.rank, s.name)
        assert e["ts"] == pytest.approx(s.start * 1e6) and e["dur"] == pytest.approx(s.duration * 1e6)
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    by_kind = {(e["pid"], "comm" if e["cat"] == "comm" else "compute"): lanes[e["pid"], e["tid"]] for e in slices}
    assert {v for (_, k), v in by_kind.items() if k == "compute"} == {"compute"}
    assert {v for (_, k), v in by_kind.items() if k == "comm"} == {"comm pp"}
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    messages = sum(1 for s in first.spans if s.flow.startswith("send:"))
    assert messages > 0 and set(starts) == set(ends) and len(starts) == messages
    assert all(ends[i]["ts"] >= starts[i]["ts"] and ends[i]["pid"] != starts[i]["pid"] for i in starts)


def _deadlock():
    comm = Comm(None)
    buf = torch.empty(4)
    comm.recv(buf, comm.next)        # everyone receives, nobody sends


def test_bad_input_and_deadlock():
    with pytest.raises(ValueError, match="unknown hardware 'h999'"):
        VirtualCluster("h999")
    with pytest.raises(ValueError, match="dtype torch.float64 has no FLOP rate"):
        VirtualCluster("h100-sxm", dtype=torch.float64)
    with pytest.raises(ValueError, match="gpus_per_node=3 does not divide the world size 4"):
        launch(_deadlock, 4, clock=VirtualCluster("h100-sxm", gpus_per_node=3))
    with pytest.raises(LaunchTimeout, match=r"did not finish within the timeout") as info:
        launch(_deadlock, 2, clock=VirtualCluster("h100-sxm"), timeout=2)   # as test_launch's hang
    # each rank is named stuck in its receive (the stack's frame, or the flight recorder's diagnosis)
    assert set(info.value.stuck) == {0, 1}
    assert all("recv" in what or f"rank {r} waits in recv" in str(info.value) for r, what in info.value.stuck.items())


def test_clock_exit_raises_what_settling_raises():
    """Pricing the collectives a program never waited for can fail (a broken group): the error
    reaches the caller, and the dispatch mode is left all the same."""
    from course_lib import trace
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    clock = VirtualCluster("h100-sxm", gpus_per_node=8).start(0, 1, trace.Recorder())

    def broken():
        raise RuntimeError("the group is gone")
    clock.settle = broken
    with pytest.raises(RuntimeError, match="the group is gone"):
        with clock:
            torch.ones(2) + 1
    assert _get_current_dispatch_mode() is None


def test_muted_ops_leave_the_dispatch_mode_and_cost_nothing():
    """A communication call's own ops (``clock.muted()``) are not compute: they are not priced,
    and they skip the compute stream's dispatch mode (it is off torch's mode stack inside, back
    on after, an error included, nested or not); outside, every op is seen and priced."""
    from course_lib import trace
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    clock = VirtualCluster("h100-sxm", gpus_per_node=8).start(0, 1, trace.Recorder())
    x = torch.ones(64, 64)
    with clock:
        x @ x
        t, kernels = clock.t, clock.kernels
        assert kernels == 1 and t == pytest.approx(H100.launch_overhead + gemm_seconds(64, 64, 64))
        with clock.muted():
            assert _get_current_dispatch_mode() is None
            with clock.muted():
                x @ x
            assert _get_current_dispatch_mode() is None
            x + x
        assert _get_current_dispatch_mode() is clock._mode
        with pytest.raises(ValueError), clock.muted():
            raise ValueError
        assert _get_current_dispatch_mode() is clock._mode and clock.muted_depth == 0
        assert (clock.t, clock.kernels) == (t, kernels)
        x + x
        assert clock.kernels == kernels + 1 and clock.t > t
    assert _get_current_dispatch_mode() is None


def test_device_check_prices_its_workloads_and_the_h100_record_without_a_gpu(capsys):
    """scripts/device_check.py runs here too (CI has no GPU): the workloads are priced on the
    meta device. The GEMM is one issue interval of the host, then the tile x wave model at the
    preset's fitted fraction of peak; the tiny kernels are 1000 issue intervals (the host paces
    them) and the last kernel's floor."""
    from course_lib.virtual import gpu_check
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    try:
        import device_check
    finally:
        sys.path.pop(0)
    if torch.cuda.is_available():
        pytest.skip("a GPU: the script measures, run it by hand")
    rows = {label: virtual for label, virtual, measured in device_check.main(["--repeats", "1"])}
    hw = HARDWARE["h100-sxm"]
    assert rows["GEMM 8192^3"] == pytest.approx(hw.launch_overhead + gemm_seconds(8192, 8192, 8192), rel=1e-9)
    assert rows["1000 tiny kernels"] == pytest.approx(1000 * hw.launch_overhead + hw.kernel_floor, rel=1e-9)
    assert set(gpu_check.unseen_workloads("meta")) <= set(rows)
    out = capsys.readouterr().out
    assert "no GPU: virtual times only" in out and "virtual / measured" in out
    # chapter 0 prints gpu_check.H100 (measured on an H100) next to virtual times computed on
    # the spot: the record's own virtual figures must be today's prices (to its 6 digits).
    # If the clock's model changes, re-price the record (its measured figures stay).
    recorded = {r["label"]: r["virtual"] for r in gpu_check.H100["rows"]}
    assert gpu_check.H100["preset"] == "h100-sxm" and set(recorded) <= set(rows)
    for label, virtual in recorded.items():
        assert rows[label] == pytest.approx(virtual, rel=1e-5), label
