"""course_lib.virtual.deepspeed_order.install_partitioned_pipe: DeepSpeed's PipelineEngine sends a
stage's output and a backward's input gradient as a PartitionedTensor (1/t from each
tensor-parallel rank, all-gathered by the receiver) and gathers its own freed output again at the
start of the backward (``"deepspeed_partitioned_pipe"``, stated for BLOOM in lab.dry_runs). On
gloo the values equal the plain exchange's bit for bit; the dry run prices it as a real launch."""
import pytest
import torch

import course_lib
from course_lib.layout import Layout
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run
from course_lib.virtual.software import check_fusions
from test_megatron_p2p import train_tiny_gpt

ORDER = ("blocking_sends", "deepspeed_p2p_order")
PARTITIONED = ORDER + ("deepspeed_partitioned_pipe",)
# micro-batch 3 of 7 tokens, hidden 16: 336 elements a message, 168 a tp rank
LAYOUT, SEQ = Layout(tp=2, pp=2, micro_batch=3, global_batch=6), 7


def _both():
    """The same 2-step training run (test_megatron_p2p's) with whole and with partitioned messages."""
    return train_tiny_gpt(LAYOUT, SEQ, ORDER), train_tiny_gpt(LAYOUT, SEQ, PARTITIONED)


def test_partitioned_messages_train_bit_for_bit_as_whole_ones():
    """tp 2 x pp 2, 1F1B, 2 AdamW steps: losses, first-step gradients and weights equal the whole
    messages' to the bit; every received message is gathered, and the first stage (it sent its
    outputs in pieces) gathers its output again before each backward."""
    out = course_lib.launch(_both, 4, timeout=240)
    for rank, ((l0, g0, s0, spans0, _), (l1, g1, s1, spans1, _)) in enumerate(out):
        assert l0 == l1, rank
        assert all(torch.equal(g0[k], g1[k]) for k in g0) and all(torch.equal(s0[k], s1[k]) for k in s0), rank
        gathers, outputs = spans1.count("all-gather p2p"), spans1.count("all-gather output")
        assert "all-gather p2p" not in spans0 and "all-gather output" not in spans0
        first = rank // 2 == 0                       # pp stage of the rank (mesh dp, pp, cp, tp)
        assert gathers == 2 * 2, (rank, gathers)    # 2 steps x 2 micro-batches: grads (first) / acts (last)
        assert outputs == (2 * 2 if first else 0), (rank, outputs)


SPEC, HW = gpt_spec("GPT test", 6, 64, 4, V=256, s=32), "a100-80gb"


def _real_rank(cfg, layout, software):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    return train_step(cfg, layout, Mesh.from_layout(layout), fusions=software)


def test_dry_run_prices_the_partitioned_pipe_as_a_real_launch():
    """tp 2 x pp 2, 1F1B, 4 micro-batches, two GPUs a node (the pipeline hop on the network): the
    dry run equals the real 4-rank launch to the bit; each send carries half the bytes; the
    statement needs DeepSpeed's order."""
    from course_lib.virtual.dry_run import model_config
    layout = Layout(tp=2, pp=2, micro_batch=1, global_batch=4)
    real = course_lib.launch(_real_rank, layout.n_gpus, model_config(SPEC, layout), layout, PARTITIONED,
                             clock=VirtualCluster(HW, gpus_per_node=2), timeout=180)
    r = dry_run(SPEC, HW, layout, fusions=PARTITIONED, gpus_per_node=2, progress=None)
    assert r.kernels == real[0]["kernels"] + real[2]["kernels"]
    assert r.step_time == max(x["t"] for x in real), (r.step_time, max(x["t"] for x in real))
    whole = dry_run(SPEC, HW, layout, fusions=ORDER, gpus_per_node=2, progress=None)
    sends = lambda run: sorted(s.end - s.start for s in run.spans if s.name.startswith("send to"))
    assert sends(r) and all(a < b for a, b in zip(sends(r), sends(whole)))
    with pytest.raises(ValueError, match="give 'deepspeed_p2p_order' with it"):
        check_fusions(("deepspeed_partitioned_pipe",))
