"""The planner's course runtime on what ZeRO-3 and gradient accumulation add to a step
(course_lib/planner/fsdp_ops.py, runtime.accumulation), against the program: autograd's
accumulation traced on the meta device, and the dry run, which runs the course's FSDP."""
import math

import torch

from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.layout import Layout
from course_lib.planner import HARDWARE, estimate
from course_lib.planner.kernels import KernelCounter
from course_lib.planner.presets import ModelSpec
from course_lib.planner.fsdp_ops import fsdp_exposed
from course_lib.planner.runtime import accumulation
from course_lib.virtual import dry_run

H100 = HARDWARE["h100-sxm"]
LLAMA = ModelSpec("Llama-style 4L h2048 GQA", 4, 2048, 16, 4, 5632, 32000, 1024)


def test_accumulation_is_a_traced_second_backward():
    """The second backward of a step launches one add_ per parameter more than the first, and
    moves 3 x 2 bytes per element more: the planner's accumulation, kernel for kernel."""
    cfg = GPTConfig(vocab_size=512, seq_len=64, n_layers=2, hidden=128, n_heads=4, n_kv_heads=2)
    with torch.device("meta"):
        net = TinyGPT(cfg, seed=0)
        x = torch.zeros(2, 64, dtype=torch.long)
    passes = []
    for _ in range(2):
        loss = net(x, x, n_tokens=x.numel())[1]
        with KernelCounter(H100, 2) as c:
            loss.backward()
        passes.append(c.total)
    params = list(net.parameters())
    acc = accumulation(H100, sum(q.numel() for q in params), len(params))
    extra = passes[1] - passes[0]
    assert (extra.count, extra.bytes) == (acc.count, acc.bytes)
    assert math.isclose(extra.time, acc.time, rel_tol=1e-9)


def test_fsdp_collectives_hide_behind_the_blocks_they_prefetch_beside():
    # forward: root and first block waited for, the rest exposed beyond a block's compute
    f, b = fsdp_exposed([3.0, 3.0, 3.0, 1.0], [2.0, 2.0, 2.0, 0.5], c_f=2.5, c_b=4.0, n_layers=3, root=True)
    assert f == 1.0 + 3.0 + 2 * 0.5
    # backward: last block's gather, the root's and first block's reduce-scatters, then per
    # block the gather and reduce-scatter beyond its backward
    assert b == 3.0 + 0.5 + 2.0 + 2 * 1.0


def test_zero3_and_accumulation_agree_with_the_dry_run():
    """ZeRO-3 over one rank and over two (its copies, its gathers prefetched) and DDP with
    gradient accumulation: the planner's course runtime within 5% of the dry run's step (the
    dry run with torch's foreach AdamW, which the planner counts)."""
    for layout in (Layout(zero=3, micro_batch=1, microbatches=2),
                   Layout(dp=2, zero=3, micro_batch=1, microbatches=2),
                   Layout(pp=2, micro_batch=1, microbatches=4)):
        est = estimate(LLAMA, H100, layout, runtime="course")
        r = dry_run(LLAMA, H100, layout, progress=None, optimizer="foreach")
        assert abs(est.step_time / r.step_time - 1) <= 0.05, (layout.describe(), est.step_time, r.step_time)
