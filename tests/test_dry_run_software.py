"""What the published runs' software did, as the dry run runs it (``lab.dry_runs.SOFTWARE``) and
their layouts: the pipeline runner's blocking sends (``ScheduleRunner(blocking_sends=True)``,
DeepSpeed's PipelineEngine, BLOOM's software): the same training as one device, and on the
virtual clock a step never shorter than with sends waited at the end; the dry run prices it as
a real launch. Llama 3's chunks per rank: what the paper implies, what the course cuts."""
import pytest
import torch

import course_lib
from course_lib import reference, tolerance
from course_lib.layout import Layout
from course_lib.models import GPTConfig, TinyGPT
from course_lib.parallel.mesh import Mesh, MeshShape
from course_lib.parallel.pipeline import PipelineParallel
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run

SPEC, HW = gpt_spec("GPT test", 6, 64, 4, V=256, s=32), "a100-80gb"     # as tests/test_dry_run.py, 6 layers
STEPS = 3


def _cfg(tied):
    return GPTConfig(vocab_size=32, seq_len=8, n_layers=7, hidden=16, n_heads=2, tie_embeddings=tied)

CONFIGS = {2: [("1f1b", 4, 1, True), ("gpipe", 3, 1, False), ("zb-h1", 4, 1, True), ("interleaved", 4, 2, False)],
           3: [("1f1b", 6, 1, False), ("gpipe", 2, 1, True), ("interleaved", 3, 2, True)]}


def _blocking_equals_one_device(pp):
    """Each config trained STEPS AdamW steps in float64 with blocking sends: (config, params
    equal, losses equal, every send waited where posted: none left for the step's end)."""
    out = []
    for sched, m, v, tied in CONFIGS[pp]:
        cfg = _cfg(tied)
        batches = reference.gpt_batches(cfg, batch=12, steps=STEPS)
        ref = TinyGPT(cfg, seed=0).double()
        state, ref_losses = reference.train_gpt(ref, batches, torch.optim.AdamW(ref.parameters(), lr=1e-2,
                                                                                 weight_decay=0.1), micro=m)
        pipe = PipelineParallel(TinyGPT(cfg, seed=0).double(), Mesh(pp=pp), sched, microbatches=m, v=v)
        pipe.runner.blocking_sends = True
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
        losses = reference.train_parallel(pipe, batches, opt)
        got = {n: q.detach() for st in pipe.stages.values() for n, q in st.named_in_model().items()}
        bounds = dict(dtype=torch.float64, optimizer="adamw", steps=STEPS, lr=1e-2)
        out.append(((sched, m, v, tied), tolerance.compare(got, {n: state[n] for n in got}, **bounds),
                    tolerance.compare(losses, ref_losses, **bounds), pipe.runner.sends == []))
    return out


@pytest.mark.parametrize("pp", [2, 3])
def test_blocking_sends_equal_one_device(pp):
    for rank in course_lib.launch(_blocking_equals_one_device, pp, pp, timeout=180):
        for config, params, losses, none_left in rank:
            assert params and losses, f"{config}: blocking sends differ from one device: {params} {losses}"
            assert none_left, f"{config}: a send was left for the end of the step"


def _real_rank(cfg, layout, software):
    from course_lib.virtual.dry_run import train_step
    return train_step(cfg, layout, Mesh.from_layout(layout), fusions=software)


def test_blocking_sends_price_as_a_real_launch_and_never_shorten_the_step():
    """pp 3 x tp 2, 1F1B over 6 micro-batches: the dry run with DeepSpeed's blocking sends gives
    the real 6-rank launch's step to the bit (at this host-bound shape the waits hide: the same
    step as without them). At a compute-bound shape (h 2048, s 2048: 8 MiB per message) on three
    schedules the blocking step is longer than the one whose sends are waited at its end."""
    from course_lib.virtual.dry_run import model_config
    layout = Layout(tp=2, pp=3, micro_batch=1, global_batch=6)
    software = ("scale_mask_softmax", "blocking_sends")
    real = course_lib.launch(_real_rank, layout.n_gpus, model_config(SPEC, layout), layout, software,
                             clock=VirtualCluster(HW))
    r = dry_run(SPEC, HW, layout, fusions=software)
    assert r.kernels == sum(real[rank]["kernels"] for rank in (0, 2, 4))
    assert r.step_time == max(x["t"] for x in real), (r.step_time, max(x["t"] for x in real))
    assert len([s for s in r.spans if s.name.startswith("wait send ")]) == 2 * 2 * 6   # 2 boundaries, F and B
    assert r.step_time >= dry_run(SPEC, HW, layout, fusions="scale_mask_softmax").step_time
    wide = gpt_spec("GPT wide", 6, 2048, 16, V=256, s=2048)
    for lay in (Layout(pp=3, global_batch=6), Layout(pp=3, schedule="gpipe", global_batch=6),
                Layout(pp=2, schedule="interleaved", v=2, global_batch=4)):
        plain = dry_run(wide, HW, lay, fusions="scale_mask_softmax", progress=None)
        blocking = dry_run(wide, HW, lay, fusions=software, progress=None)
        assert blocking.step_time > plain.step_time, (lay.describe(), blocking.step_time, plain.step_time)
        assert not [s for s in plain.spans if s.name.startswith("wait send ")]
    with pytest.raises(ValueError, match="blocking_sends must be True or False"):
        from course_lib.parallel.pipeline.runner import ScheduleRunner
        ScheduleRunner("1f1b", {}, _OneRankComm(), p=1, m=1, blocking_sends="yes")


class _OneRankComm:
    rank, size = 0, 1


def test_llama3_chunks_as_the_paper_states_them():
    """Llama 3's V (Sec. 3.3.2): 126 layers + embedding + output = 128 one-layer slots on 16
    ranks, 8 chunks a rank, the first holding only the embedding and the last only the output:
    the layout's split (Layout.stage_layers), which the dry run accepts; 7 layers on the first
    and the last rank, 8 on the others."""
    from course_lib.parallel.pipeline.rules import partition_layers
    from course_lib.planner.presets import get_model
    from course_lib.planner.validation import LLAMA3_TABLE4, LLAMA3_V_PAPER, llama3_layout
    from course_lib.virtual.dry_run import check_dry_run
    model = get_model("llama3-405b")
    gpus, tp, cp, pp, dp, s, _ = LLAMA3_TABLE4[0]
    layout = llama3_layout(tp, cp, pp, dp, s)
    assert (model.n_layers + 2) == pp * LLAMA3_V_PAPER and layout.v == LLAMA3_V_PAPER
    assert layout.stage_layers == (0,) + (1,) * model.n_layers + (0,)
    check_dry_run(model, layout.with_(zero=0))
    with pytest.raises(ValueError, match="more pipeline stages"):           # without the split: refused
        check_dry_run(model, layout.with_(zero=0, stage_layers=()))
    chunks = partition_layers(model.n_layers, pp * layout.v, layout.stage_layers)
    per_rank = [sum(len(chunks[j * pp + r]) for j in range(layout.v)) for r in range(pp)]
    assert per_rank == [7] + [8] * 14 + [7]


# PyTorch's DDP under the last backward (software "overlapped_dp": Megatron-LM's --DDP-impl torch
# on Narayanan et al. 2021's PP = 1 rows). One launch per world size: 3 ranks (dp 3, 3 micro-batches)
# and 4 (dp 2 x tp 2, 2 micro-batches; dp 4, one micro-batch).
OVERLAP_LAYOUTS = {3: {"dp3-m3": dict(dp=3, microbatches=3)},
                   4: {"dp2-tp2-m2": dict(dp=2, tp=2, microbatches=2), "dp4-m1": dict(dp=4, microbatches=1)}}


def _train_overlapped(layouts, batch):
    from course_lib.lab.nd_runs import LR
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.grad_sync import OverlappedGradSync
    from course_lib.virtual.software import overlap_dp
    cfg = _cfg(True)
    out = {}
    for name, kw in layouts.items():
        sizes = {k: v for k, v in kw.items() if k in ("dp", "tp")}
        net = parallelize_nd(TinyGPT(cfg, seed=0).double(), Mesh(**sizes), microbatches=kw["microbatches"])
        overlap_dp(net)
        sync = net.grad_sync
        launched_in_backward = []
        finish = sync.finish

        def counted_finish():   # buckets the last backward's hooks launched before the runtime's finish
            launched_in_backward.append(sum(b.work is not None for b in sync.buckets))
            finish()
        net.gradient_sums = [counted_finish if f == finish else f for f in net.gradient_sums]
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
        losses = reference.train_parallel(net, reference.gpt_batches(cfg, batch=batch, steps=STEPS), opt)
        out[name] = (losses, net.shards(), isinstance(sync, OverlappedGradSync), launched_in_backward,
                     len(sync.buckets))
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_overlapped_dp_trains_as_one_device(world):
    """The gradient sums launched under the last micro-batch's backward (the earlier ones in
    no_sync) train as one device in float64 over STEPS AdamW steps, at an odd dp and with TP;
    every bucket is launched by the backward's hooks, none left for the runtime's finish."""
    from course_lib.lab.nd_runs import LR, single_device
    from course_lib.parallel.compose import assemble_nd
    from course_lib.parallel.mesh import MeshShape
    batch = 9 if world == 3 else 4
    ref = single_device(_cfg(True), batch, STEPS, dtype=torch.float64)
    ranks = course_lib.launch(_train_overlapped, world, OVERLAP_LAYOUTS[world], batch, threads=1, timeout=180)
    for name, kw in OVERLAP_LAYOUTS[world].items():
        for losses, _, overlapped, launched, n_buckets in (r[name] for r in ranks):
            assert overlapped
            assert launched == [n_buckets] * STEPS, (name, launched, n_buckets)
            tolerance.assert_matches(losses, ref.losses, optimizer="adamw", steps=STEPS, lr=LR, what=name)
        sizes = {k: v for k, v in kw.items() if k in ("dp", "tp")}
        full = assemble_nd([r[name][1] for r in ranks], MeshShape(**sizes))
        tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=STEPS, lr=LR, what=name)


def test_overlapped_dp_prices_as_a_real_launch_under_the_backward():
    """dp 2 x tp 2, two micro-batches: the dry run with DDP under the last backward is the real
    4-rank launch to the bit; on a model of many buckets its DP all-reduces start before the
    last backward ends (after it without the statement), and the step is shorter than the one
    that sums after the backward. A pipeline is refused (Megatron-LM runs torch's DDP without one)."""
    from course_lib.virtual.dry_run import model_config
    layout = Layout(dp=2, tp=2, micro_batch=1, global_batch=4)
    software = ("scale_mask_softmax", "overlapped_dp")
    real = course_lib.launch(_real_rank, layout.n_gpus, model_config(SPEC, layout), layout, software,
                             clock=VirtualCluster(HW))
    r = dry_run(SPEC, HW, layout, fusions=software, progress=None)
    assert r.kernels == real[0]["kernels"]
    assert r.step_time == max(x["t"] for x in real), (r.step_time, max(x["t"] for x in real))
    # wide enough for many 25 MiB buckets (the small model's gradients fill one, launched last);
    # dp across nodes (2 GPUs a node), as on the published rows: in one node the buckets would
    # share each GPU's NVLink lanes with the TP all-reduces, and delay them
    wide = gpt_spec("GPT wide", 4, 2048, 16, V=256, s=1024)
    r = dry_run(wide, HW, layout, fusions=software, progress=None, gpus_per_node=2)
    after = dry_run(wide, HW, layout, fusions="scale_mask_softmax", progress=None, gpus_per_node=2)
    for run, under in ((r, True), (after, False)):
        last_b = max(s.end for s in run.spans if s.kind == "compute" and s.name.startswith("B"))
        first_dp = min(s.start for s in run.spans if s.dim == "dp" and s.kind == "comm" and "loss" not in s.name)
        assert (first_dp < last_b) == under, (under, first_dp, last_b)
    assert r.step_time < after.step_time, (r.step_time, after.step_time)
    with pytest.raises(NotImplementedError, match="overlapped_dp: DDP under the last backward runs without a "
                                                  "pipeline"):
        dry_run(SPEC, HW, Layout(dp=2, pp=2, micro_batch=1, global_batch=4), fusions=software, progress=None)


def test_sequence_first_unprices_the_layout_copies_only():
    """Megatron-LM's (s, b, h) activations ("sequence_first"): the sequence-parallel collectives'
    transposing copies go unpriced. At micro-batch 1 the course's (b, s, h) pieces are
    contiguous already: the same step to the bit, the same kernels. At micro-batch 2 each SP
    gather copies its input and output (2 kernels) and each reduce-scatter its input (1): per
    region (attention, MLP) forward a gather and a reduce-scatter (3), backward the column
    layer's re-gather, the gather's reduce-scatter and the reduce-scatter's gather (5): 16 a
    layer; the embedding's reduce-scatter and its backward (3) and the head's region (5): 8;
    the step is shorter. Without SP nothing moves."""
    def run(micro_batch, sp, software):
        lay = Layout(tp=2, sp=sp, micro_batch=micro_batch, global_batch=micro_batch)
        return dry_run(SPEC, HW, lay, progress=None, fusions=software)
    for sp in (True, False):
        one = [run(1, sp, sw) for sw in ((), ("sequence_first",))]
        assert (one[0].step_time, one[0].kernels) == (one[1].step_time, one[1].kernels)
    two = [run(2, True, sw) for sw in ((), ("sequence_first",))]
    assert two[0].kernels - two[1].kernels == 16 * SPEC.n_layers + 8
    assert two[1].step_time < two[0].step_time
    plain = [run(2, False, sw) for sw in ((), ("sequence_first",))]
    assert (plain[0].step_time, plain[0].kernels) == (plain[1].step_time, plain[1].kernels)


def _gemm_weights_per_step(spec, layout) -> int:
    """The GEMM weights whose fp32 sums each micro-batch after the first adds into, counted from
    the spec (not from the code under test): per layer W_q, W_k, W_v, W_o and the MLP's two; the
    last stage's copy of a tied LM head when the pipeline splits it from the embedding."""
    per_layer = 6
    head = 1 if (not spec.tied or layout.pp > 1) else 0
    return (layout.microbatches - 1) * (per_layer * spec.n_layers + head)


def test_gradient_accumulation_fusion_unprices_the_weight_sums_only():
    """Megatron-LM's wgrad GEMM accumulating into the fp32 main_grad ("gradient_accumulation_fusion",
    the Mixtral rows' Megatron-Core): the adds of each later micro-batch's gradient into a GEMM
    weight's fp32 sum go unpriced, nothing else: the kernels fewer by exactly that count (the
    embedding's, the norms' and the biases' adds stay), the step shorter, the memory the same.
    Through ZeRO-1's sums and through the master weights' alike; the dry run is the real launch
    to the bit. Under a precision that sums in 16 bits it is refused by name, before anything
    runs (Megatron-LM turns it off there)."""
    from course_lib.virtual.dry_run import model_config
    fused = ("gradient_accumulation_fusion",)
    for zero in (0, 1):
        lay = Layout(pp=2, dp=2, zero=zero, micro_batch=1, global_batch=8, precision="bf16-accumulate-fp32")
        plain, gaf = (dry_run(SPEC, HW, lay, progress=None, fusions=f) for f in ((), fused))
        assert plain.kernels - gaf.kernels == _gemm_weights_per_step(SPEC, lay) == 111, zero
        assert gaf.step_time < plain.step_time and gaf.peak_memory == plain.peak_memory
        # (under a precision each tensor is priced at its own dtype: the dry run's cluster)
        real = course_lib.launch(_real_rank, lay.n_gpus, model_config(SPEC, lay), lay, fused,
                                 clock=VirtualCluster(HW, dtype=None))
        stage_ranks = [MeshShape(**lay.sizes).rank_of(pp=i) for i in range(2)]
        assert gaf.kernels == sum(real[k]["kernels"] for k in stage_ranks)
        assert gaf.step_time == max(x["t"] for x in real)
    with pytest.raises(ValueError, match="gradient_accumulation_fusion.*bf16-accumulate-fp32"):
        dry_run(SPEC, HW, Layout(pp=2, micro_batch=1, global_batch=4), progress=None, fusions=fused)
