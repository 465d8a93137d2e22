"""course_lib/lab/virtual_runs: one N-D step on the virtual clock, and the planner's same layout."""
import pytest
import torch

from course_lib import costmodel
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.planner import HARDWARE
from course_lib.virtual import VirtualCluster
from course_lib.parallel.layout_rules import as_layout
from course_lib.lab.virtual_runs import planner_estimate, virtual_step

CFG = GPTConfig(n_layers=1, hidden=32, n_heads=2, seq_len=16, vocab_size=64)
H100 = HARDWARE["h100-sxm"]


def test_dp_step_is_deterministic_and_priced_by_its_parts():
    node = VirtualCluster("h100-sxm", gpus_per_node=8, dtype=torch.bfloat16)
    a = virtual_step(CFG, dict(dp=2), {}, 4, node)
    b = virtual_step(CFG, dict(dp=2), {}, 4, node)
    assert a.step_time == b.step_time and a.kernels == b.kernels and a.comm == b.comm
    assert a.kernels[0] == a.kernels[1] > 0                    # both ranks run the same program
    # the step holds every kernel (at least its floor on the device) and the gradient
    # all-reduce(s) on NVLink, no more than their sum plus each kernel's issue by the host
    # (the kernels' own roofline time is under 1 us each at this size)
    alpha, bw = node.link(range(2))
    params = sum(p.numel() for p in TinyGPT(CFG).parameters())
    one_all_reduce = costmodel.ring_all_reduce(2 * params, 2, alpha, 1 / bw)   # bf16 gradients, one bucket
    assert a.comm["dp"] >= one_all_reduce * (1 - 1e-9)
    assert a.calls["dp"] >= 1 and a.comm["dp"] >= a.calls["dp"] * 2 * alpha * (1 - 1e-9)   # 2(N-1) steps each
    assert a.step_time >= a.kernels[0] * H100.kernel_floor + a.comm["dp"] * (1 - 1e-9)
    assert a.step_time <= a.kernels[0] * (H100.launch_overhead + H100.kernel_floor + 1e-6) + a.comm["dp"]


def test_the_planner_prices_the_layout_the_ranks_run():
    lay = as_layout(dims=dict(pp=2, dp=2), microbatches=2, batch=8)      # parallelize_nd's keywords
    assert (lay.dp, lay.pp, lay.tp, lay.micro_batch, lay.global_batch, lay.microbatches, lay.overlap_dp) == \
        (2, 2, 1, 2, 8, 2, False)
    assert as_layout(dims=dict(tp=2), batch=4).sp                  # parallelize_nd's default: SP with TP
    assert not as_layout(dims=dict(tp=2), sequence_parallel=False, batch=4).sp
    assert as_layout(dims=dict(dp=2), data="fsdp").zero == 3
    est = planner_estimate(CFG, dict(dp=2), {}, 4, H100)
    assert est.step_time > 0 and est.time.get("dp", 0) > 0


def test_bad_layout_is_refused_before_any_rank_starts():
    node = VirtualCluster("h100-sxm", gpus_per_node=8)
    with pytest.raises(ValueError, match="n_heads|heads"):
        virtual_step(CFG, dict(tp=3), {}, 3, node)
    with pytest.raises(ValueError, match="gpus_per_node"):
        virtual_step(CFG, dict(dp=4), {}, 4, VirtualCluster("h100-sxm", gpus_per_node=3))


def test_the_course_runtime_planner_counts_the_programs_collectives():
    """planner.estimate(runtime="course") against the program itself on the virtual clock (one
    launch): the same collectives per mesh dimension, and the step within 10% with and without
    the launch term (launch off: every term is a collective's latency or a kernel's roofline)."""
    for hw in (H100, H100.with_(launch_overhead=0.0)):
        node = VirtualCluster(hw, gpus_per_node=8, dtype=torch.bfloat16)
        run = virtual_step(CFG, dict(dp=2, tp=2), {}, 4, node)
        est = planner_estimate(CFG, dict(dp=2, tp=2), {}, 4, hw)
        counted = {d: n for d, n in run.calls.items() if d != "pp"}    # "pp": the runtime's empty wait
        assert est.stages[0].calls == counted
        assert abs(est.step_time / run.step_time - 1) < 0.10, (est.step_time, run.step_time)


def test_runtime_is_validated():
    from course_lib.planner import Layout, estimate
    with pytest.raises(ValueError, match="runtime"):
        estimate("llama3-8b", "h100-sxm", Layout(tp=8, global_batch=8), runtime="deepspeed")


PIPE_CFG = GPTConfig(n_layers=4, hidden=128, n_heads=4, seq_len=64)


@pytest.mark.parametrize("dims,kw,batch", [
    (dict(pp=2, dp=2), dict(microbatches=2), 8),
    (dict(pp=4), dict(microbatches=8), 8),
    (dict(pp=2), dict(microbatches=4, schedule="interleaved", v=2), 8),
], ids=["pp2-dp2-m2", "pp4-m8", "pp2-interleaved"])
def test_the_course_runtime_planner_prices_a_host_bound_pipeline(dims, kw, batch):
    """A pipeline of a tiny model is host-bound: each op's kernels take less than their issue.
    On the clock a stage waiting for its input has its host issue the op meanwhile, so the fill
    and drain pass at the devices' pace; the planner's runtime="course" models it (each stage's
    host excess, ``StageCost.host``) and lands within 10% of the real program on the clock (it
    was 21-36% over when it charged the fill and drain at the host's pace)."""
    node = VirtualCluster("h100-sxm", gpus_per_node=8, dtype=torch.bfloat16)
    run = virtual_step(PIPE_CFG, dims, kw, batch, node)
    est = planner_estimate(PIPE_CFG, dims, kw, batch, H100)
    assert all(st.host[0] > 0 and st.host[1] > 0 for st in est.stages)      # host-bound: it matters here
    assert abs(est.step_time / run.step_time - 1) < 0.10, (est.step_time, run.step_time)


def test_pipeline_time_with_and_without_the_hosts_excess():
    """With no host excess (the published systems' runtime, and the course's where the host
    waits for the stream inside a pass) the pipeline is 1F1B's sum(op) + (m v - 1) max(op). With
    one, through each stage k: the later of its host issuing all m v ops from the start and its
    device running them from its first input's arrival (the first stage's first forward at the
    host's pace, the stages between at their devices'), then the last micro-batch's round trip
    beyond k and backward before k at the devices' pace."""
    from types import SimpleNamespace
    from course_lib.planner import Layout
    from course_lib.planner.estimate import pipeline_time
    layout = Layout(pp=3, micro_batch=1, microbatches=4)

    def stage(k, f, b, host=(0.0, 0.0)):
        return SimpleNamespace(stage=k, fwd_time=f, bwd_time=b, p2p=0.0, host=host)
    plain = [stage(0, 1.0, 2.0), stage(1, 1.0, 3.0), stage(2, 2.0, 2.0)]
    assert pipeline_time(plain, layout)[0] == 3.0 + 4.0 + 4.0 + (4 - 1) * 4.0
    issued = [stage(0, 1.0, 2.0, (0.5, 1.0)), stage(1, 1.0, 3.0, (0.5, 0.5)), stage(2, 2.0, 2.0, (0.0, 0.0))]
    # (fwd, bwd) on the device: (0.5, 1.0), (0.5, 2.5), (2.0, 2.0); ops 3, 4, 4
    through = [max(4 * 3.0, 4 * 1.5) + (0.5 + 2.5) + (2.0 + 2.0),          # k = 0
               max(4 * 4.0, 1.0 + 4 * 3.0) + 1.0 + (2.0 + 2.0),             # k = 1: 16 + 5
               max(4 * 4.0, 1.0 + 0.5 + 4 * 4.0) + 1.0 + 2.5]               # k = 2: 17.5 + 3.5
    assert pipeline_time(issued, layout)[0] == max(through) == 21.0
    # a host-bound pipeline: the busiest host's m v ops and the others' devices, no fill at its pace
    bound = [stage(k, 1.0, 2.0, (0.9, 1.8)) for k in range(3)]
    assert pipeline_time(bound, layout)[0] == pytest.approx(4 * 3.0 + 2 * 0.3)
