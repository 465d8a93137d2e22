"""course_lib.virtual.deepspeed_order: DeepSpeed's TrainSchedule send order (``"deepspeed_p2p_order"``,
stated for BLOOM in lab.dry_runs.SOFTWARE) on the course's pipeline runner: every rank's
messages and passes in the order of DeepSpeed's instructions, training as one device."""
import re

import pytest
import torch

from course_lib import tolerance, trace
from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.virtual.deepspeed_order import DeepSpeedP2POrder
from course_lib.virtual.software import install_runtime


def deepspeed_train_schedule(m: int, p: int, s: int) -> list:
    """DeepSpeed's TrainSchedule.steps() for stage ``s`` (deepspeed/runtime/pipe/schedule.py,
    before microsoft/DeepSpeed#2862), restated: its communication and compute instructions as
    the course's runner names their spans, micro-batch ids for buffers."""
    def step_to_micro_batch(step):
        if step % 2 == 0 and s % 2 == 0:
            return step // 2 - s // 2, True
        if step % 2 == 1 and s % 2 == 1:
            return (step - 1) // 2 - s // 2, True
        if step % 2 == 0:
            return step // 2 - p + (s + 1) // 2, False
        return (step - 1) // 2 - p + 1 + s // 2, False
    valid = lambda mb: 0 <= mb < m      # noqa: E731
    out, prev = [], -1
    for step in range(2 * (m + p - 1)):
        mb, forward = step_to_micro_batch(step)
        if forward:
            if valid(mb) and s > 0:
                out.append(f"recv act {mb}")
            if valid(prev) and s > 0:
                out.append(f"send grad {prev}")
        else:
            if valid(prev) and s < p - 1:
                out.append(f"send act {prev}")
            if valid(mb) and s < p - 1:
                out.append(f"recv grad {mb}")
        if valid(mb):
            out.append(("F" if forward else "B") + f"{mb}" + (f"@{s}" if s else ""))
        prev = mb
    return out


_EVENT = re.compile(r"^(?:[FB]\d+(?:@\d+)?|(?:recv|send) (?:act|grad) \d+)$")


def _deepspeed_rank(cfg, m, steps):
    """pp 3, 1F1B, DeepSpeed's runtime (blocking sends, its send order): losses and shards after
    ``steps`` AdamW steps in float64, and the runner's events of its first step in order."""
    from course_lib import reference
    from course_lib.gpt import TinyGPT
    from course_lib.lab.nd_runs import LR
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    layout = Layout(pp=3, global_batch=2 * m, microbatches=m)
    pipe = parallelize_nd(TinyGPT(cfg, seed=0).double(), Mesh.from_layout(layout), layout)
    install_runtime(pipe, ("blocking_sends", "deepspeed_p2p_order"))
    trace.reset()
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR, weight_decay=0.1)
    losses = reference.train_parallel(pipe, reference.gpt_batches(cfg, batch=2 * m, steps=steps), opt)
    events = [sp.name for sp in trace.spans() if _EVENT.match(sp.name)]
    return losses, pipe.shards(), events[:len(events) // steps], pipe.runner.sends


def test_deepspeed_send_order_is_deepspeeds_and_trains_as_one_device():
    """3 stages (7 layers: uneven), 5 micro-batches: every rank's sends, receives, forwards and
    backwards come in the order of DeepSpeed's TrainSchedule instructions (its input gradients
    held until the next activation arrives: not the course's order), 3 AdamW steps in float64
    equal one device, no send is left for the step's end; a schedule DeepSpeed does not run is
    refused."""
    from course_lib.gpt import GPTConfig
    from course_lib.lab.nd_runs import LR, single_device
    from course_lib.parallel.compose import assemble_nd
    from course_lib.parallel.mesh import MeshShape
    cfg, m, steps = GPTConfig(vocab_size=32, seq_len=8, n_layers=7, hidden=16, n_heads=2), 5, 3
    real = launch(_deepspeed_rank, 3, cfg, m, steps, timeout=180)
    for s, (_, _, events, left) in enumerate(real):
        assert events == deepspeed_train_schedule(m, 3, s), (s, events)
        assert left == []
    course = deepspeed_train_schedule(m, 3, 1)
    assert course.index("send grad 0") > course.index("recv act 2")      # held: the course sends it first
    ref = single_device(cfg, 2 * m, steps, dtype=torch.float64)
    for losses, *_ in real:
        tolerance.assert_matches(losses, ref.losses, optimizer="adamw", steps=steps, lr=LR, what="losses")
    full = assemble_nd([r[1] for r in real], MeshShape(pp=3))
    tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=steps, lr=LR, what="weights")
    from course_lib.parallel.pipeline.runner import ScheduleRunner
    from course_lib.schedules import make_schedule
    with pytest.raises(ValueError, match="TrainSchedule runs 1F1B"):
        DeepSpeedP2POrder(ScheduleRunner(make_schedule("gpipe", 1, 2, 1), {}, _OneRank(), p=1, m=2))


class _OneRank:
    rank, size = 0, 1
