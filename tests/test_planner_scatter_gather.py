"""The planner prices a pipeline message as Megatron-LM (scatter/gather, Narayanan et al. 2021
Sec. 4.1) and DeepSpeed's partitioned pipe send it without sequence parallelism: each of a
stage's t tensor-parallel ranks sends 1/t over the pipeline hop, the receiver all-gathers the
pieces over its TP group. Under SP the message is already each rank's own s/t: unchanged. The
course's runtime (its program sends whole tensors) is unchanged."""
import pytest

from course_lib.planner import formulas as F
from course_lib.planner.costs import stage_costs
from course_lib.planner.layout import Layout, intra_node
from course_lib.planner.pipeline_hops import stage_send_time
from course_lib.planner.presets import HARDWARE, gpt_spec

A100 = HARDWARE["a100-80gb"]
MODEL = gpt_spec("GPT 76.1B", 60, 10240, 80)


def _act(layout):
    return 2 * layout.micro_batch * MODEL.seq_len * MODEL.hidden     # bytes, 16-bit


def test_without_sp_each_rank_sends_its_piece_and_the_receiver_gathers():
    layout = Layout(dp=32, tp=8, pp=4, micro_batch=2, global_batch=1792, recompute="full")
    act = _act(layout)
    a_tp, bw_tp = A100.link(intra_node(layout, A100, "tp"))
    for st in stage_costs(MODEL, A100, layout):
        piece = stage_send_time(layout, A100, st.stage, act / 8)
        gather = F.collective_time("all_gather", act, 8, a_tp, bw_tp)
        assert st.p2p == piece + gather                   # the same two terms, exactly
        assert st.p2p < stage_send_time(layout, A100, st.stage, act)      # cheaper than whole, here
        sends = st.comm_bytes["pp"] / (act / 8)
        assert sends == pytest.approx(round(sends)) and sends > 0          # 1/t a message on the hop


def test_under_sp_and_in_the_course_runtime_the_message_is_whole():
    sp = Layout(dp=32, tp=8, pp=4, sp=True, micro_batch=2, global_batch=1792, recompute="selective")
    for st in stage_costs(MODEL, A100, sp):
        assert st.p2p == stage_send_time(sp, A100, st.stage, _act(sp) / 8)
    small = gpt_spec("GPT small", 4, 256, 4, V=1024, s=128)
    plain = Layout(tp=2, pp=2, micro_batch=2, global_batch=8)
    (first, *_), = [stage_costs(small, A100, plain, runtime="course")]
    assert first.comm_bytes["pp"] > 0
    whole = 2 * 2 * 128 * 256
    assert first.comm_bytes["pp"] == pytest.approx(first.comm_bytes["pp"] // whole * whole)   # whole messages
