"""``CUDA_LAUNCH_BLOCKING=1`` on the virtual clock (``"launch_blocking"``, a runtime item of
course_lib.virtual.software, stated for BLOOM in lab.dry_runs.SOFTWARE): every launch returns
when its kernel ends, NCCL's too. On toys whose kernels are counted the step grows by exactly
what the issue interval and the kernels' own times explain; one 8-rank launch (dp 2 x tp 2 x
pp 2 in DeepSpeed's rank order, all of BLOOM's software) is the dry run to the bit and trains in
float64 as one device, its values those of the same run without launch blocking."""

import pytest
import torch

from course_lib import tolerance, trace
from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run
from course_lib.virtual.compute import op_time
from course_lib.virtual.software import RUNTIME, check_fusions, install_launch_blocking, install_runtime

SPEC, HW = gpt_spec("GPT test", 4, 64, 4, V=256, s=32), "a100-80gb"
DEEPSPEED = ("pp", "dp", "tp")


def _toy(blocking: bool, shape, n: int):
    """n kernels (a + a, or a @ a for a square matrix) on one rank's clock, on the meta device:
    (the clock, one kernel's device seconds: compute.op_time, the stream's own price)."""
    cluster = VirtualCluster(HW)
    clock = cluster.start(0, 1, trace.Recorder(0))
    install_launch_blocking(clock, ("launch_blocking",) if blocking else ())
    a = torch.empty(shape, device="meta")
    with clock:
        for _ in range(n):
            out = a @ a if len(shape) == 2 else a + a
    func = torch.ops.aten.mm.default if len(shape) == 2 else torch.ops.aten.add.Tensor
    return clock, op_time(cluster, func, (a, a), {}, out)


def test_each_kernel_costs_its_issue_and_its_time_and_nothing_overlaps():
    """50 tiny adds (2 us each, the host's 12.32 us issue paces them) and 50 GEMMs 4096^2 (557 us,
    the device paces them): blocked, the stream's end is the sum over kernels of issue + time,
    op by op. Against the plain run, the difference is what the plain run hid: 49 kernels' own
    time where the host paced it, 49 issues where the device did."""
    issue = VirtualCluster(HW).launch_overhead
    n = 50
    for shape, hidden in (((8,), "kernel"), ((4096, 4096), "issue")):
        plain, seconds = _toy(False, shape, n)
        blocked, again = _toy(True, shape, n)
        assert seconds == again and blocked.kernels == plain.kernels == n
        assert (seconds < issue) == (hidden == "kernel")
        t = 0.0
        for _ in range(n):                # each launch returns at its kernel's end
            t = (t + issue) + seconds
        assert blocked.t == t and blocked.host == blocked.t
        per = seconds if hidden == "kernel" else issue
        tolerance.assert_matches([blocked.t - plain.t], [(n - 1) * per], dtype=torch.float64, terms=4 * n,
                                 scale=blocked.t, what=f"{shape}: what the plain run hid")


def _comm_rank(k):
    """Twice, from a host read (the host caught up with the stream): k GEMMs 4096^2 (on the meta
    device), then a blocking all-reduce, an async one waited for, a message 0 -> 1, each followed
    by one GEMM; first with launches returning at once, then blocking. (seconds of each run, issue)"""
    from course_lib.collectives.comm import Comm
    comm, clock = Comm(None, dim="dp"), trace.clock()
    a, z, msg = torch.empty(4096, 4096, device="meta"), torch.ones(2 ** 22), torch.ones(2 ** 22)
    out = []
    for blocking in (False, True):
        install_launch_blocking(clock, ("launch_blocking",) if blocking else ())
        float(torch.ones(2).sum())                # the host waits for the stream here
        t0 = clock.t
        for _ in range(k):
            a @ a
        comm.all_reduce(z)
        a @ a
        comm.all_reduce(z, async_op=True).wait()
        a @ a
        comm.send(msg, 1) if comm.rank == 0 else comm.recv(msg, 0)
        a @ a
        out.append(clock.t - t0)
    return out, clock.cluster.launch_overhead


def test_the_host_waits_for_each_collective_and_message():
    """Device-bound GEMMs around three communication calls (8 MiB each, longer than an issue
    interval), on 2 ranks: the plain run's host runs ahead, so only the first GEMM's issue
    shows; blocked, every GEMM's does: k + 3 issues in all, one of them after each of the three
    calls (their end is where the host issues the next kernel): the difference is (k + 2) issue
    intervals on both ranks (one less for each call whose end the host did not wait for)."""
    k = 6
    for (plain, blocked), issue in launch(_comm_rank, 2, k, clock=VirtualCluster(HW)):
        tolerance.assert_matches([blocked - plain], [(k + 2) * issue], dtype=torch.float64, terms=64,
                                 scale=blocked, what="the issues the blocked run exposes")


def test_the_item_is_checked_and_off_by_default():
    assert "launch_blocking" in RUNTIME and check_fusions("launch_blocking") == ("launch_blocking",)
    clock = VirtualCluster(HW).start(0, 1, trace.Recorder(0))
    assert clock.launch_blocking is False
    install_launch_blocking(clock, ("blocking_sends", "launch_blocking"))
    assert clock.launch_blocking is True
    install_launch_blocking(clock, ())
    assert clock.launch_blocking is False
    install_launch_blocking(None, ("launch_blocking",))          # the wall clock: nothing to set
    with pytest.raises(ValueError, match="unknown fusion 'launch-blocking'"):
        install_launch_blocking(clock, ("launch-blocking",))


def _rank(cfg, layout, software, cfg64, layout64, steps):
    """The dry run's step (BLOOM's software), then a float64 training run twice on this clock:
    launches returning at once, then blocking (losses, shards, virtual seconds of each)."""
    from course_lib import reference
    from course_lib.gpt import TinyGPT
    from course_lib.lab.nd_runs import LR
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    mesh = Mesh.from_layout(layout)
    out = {"step": train_step(cfg, layout, mesh, fusions=software)}
    clock = trace.clock()
    out["blocking after the step"] = clock.launch_blocking
    batches = reference.gpt_batches(cfg64, batch=layout64.global_batch, steps=steps)
    for blocking in (False, True):
        net = parallelize_nd(TinyGPT(cfg64, seed=0).double(), mesh, layout64)
        install_runtime(net, software if blocking else tuple(f for f in software if f != "launch_blocking"))
        assert clock.launch_blocking == blocking
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
        out[blocking] = (reference.train_parallel(net, batches, opt), net.shards())
    return out


@pytest.fixture(scope="module")
def bloom_software_launch():
    from course_lib.gpt import GPTConfig
    from course_lib.lab.dry_runs import SOFTWARE
    from course_lib.virtual.dry_run import model_config
    software = SOFTWARE["BLOOM 2022"]
    layout = Layout(dp=2, tp=2, pp=2, micro_batch=1, global_batch=12, recompute="full", order=DEEPSPEED)
    cfg64 = GPTConfig(vocab_size=60, seq_len=12, n_layers=3, hidden=24, n_heads=6)   # uneven: 3 layers, 2 stages
    layout64 = Layout(dp=2, tp=2, pp=2, global_batch=6, microbatches=3, recompute="full", order=DEEPSPEED)
    real = launch(_rank, 8, model_config(SPEC, layout), layout, software, cfg64, layout64, 3,
                  clock=VirtualCluster(HW, gpus_per_node=4), timeout=300)
    return software, layout, cfg64, layout64, real


def test_bloom_software_dry_run_is_the_real_launch_and_blocking_is_never_shorter(bloom_software_launch):
    """BLOOM's software (its kernels, DeepSpeed's blocking sends, CUDA_LAUNCH_BLOCKING=1) at dp 2
    x tp 2 x pp 2, 6 micro-batches a replica, full recompute: the dry run (its later actions
    replayed) equals the real launch to the bit: step time, kernels. Without the item the same
    dry run runs the same kernels in a shorter step (at this host-bound shape the launch
    intervals are hidden less than the kernels are: the growth is at most the kernels' time)."""
    software, layout, _, _, real = bloom_software_launch
    assert "launch_blocking" in software
    steps = [out["step"] for out in real]
    assert all(out["blocking after the step"] for out in real)
    r = dry_run(SPEC, HW, layout, gpus_per_node=4, fusions=software, progress=None)
    assert r.replayed > 0
    assert r.step_time == max(s["t"] for s in steps), (r.step_time, [s["t"] for s in steps])
    assert r.kernels == steps[0]["kernels"] + steps[4]["kernels"]     # dp = tp = 0 of each stage: 0, 4
    plain = dry_run(SPEC, HW, layout, gpus_per_node=4, fusions=tuple(f for f in software if f != "launch_blocking"),
                    progress=None)
    assert plain.kernels == r.kernels
    assert r.step_time > plain.step_time
    busy = sum(s.end - s.start for s in r.spans if s.kind == "compute" and s.dim == "pp")
    assert r.step_time - plain.step_time <= busy


def test_launch_blocking_computes_what_the_plain_run_computes(bloom_software_launch):
    """3 AdamW steps in float64 at dp 2 x tp 2 x pp 2 (3 layers on 2 stages), BLOOM's runtime
    (blocking sends, DeepSpeed's send order): the run under launch_blocking gives the plain
    run's losses and shards bit for bit (the clock prices, it computes nothing), and both equal
    one device within course_lib.tolerance."""
    from course_lib.lab.nd_runs import LR, single_device
    from course_lib.parallel.compose import assemble_nd
    from course_lib.parallel.mesh import MeshShape
    _, _, cfg64, layout64, real = bloom_software_launch
    for out in real:
        (losses, shards), (losses_b, shards_b) = out[False], out[True]
        assert losses == losses_b
        assert shards.keys() == shards_b.keys() and all(torch.equal(shards[k][0], shards_b[k][0]) for k in shards)
    ref = single_device(cfg64, layout64.global_batch, 3, dtype=torch.float64)
    for out in real:
        tolerance.assert_matches(out[True][0], ref.losses, optimizer="adamw", steps=3, lr=LR, what="losses")
    full = assemble_nd([out[True][1] for out in real], MeshShape(**layout64.sizes, order=DEEPSPEED))
    tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=3, lr=LR, what="weights")
