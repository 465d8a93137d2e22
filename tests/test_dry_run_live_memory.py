"""The dry run's peak over the step (course_lib.virtual.live_memory): every tensor the program
holds between the moments it counts, checked against torch's own tracker.

torch.distributed._tools.mem_tracker.MemTracker follows every storage a step allocates, on
its own code. On a one-rank real launch of the course's step (a cluster at each tensor's own
dtype, so the bytes are the tensors' own) the course's peak is MemTracker's, up to what one
of the two does not follow by design: the module buffers and the optimizer's step counts
(MemTracker counts them, the course does not), the token batch (made before the step), and
the fp32 masters of a mixed precision, which MemTracker does not see (no module holds them)."""
import pytest
import torch

from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run
from course_lib.virtual.dry_run import model_config

SPEC = gpt_spec("GPT test", 4, 64, 4, V=256, s=32)
HW = "a100-80gb"


def _tracked_step(cfg, layout):
    """The course's step (``train_step``, torch's AdamW) with torch's MemTracker watching it."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    seen = {}

    def watch(net, opt):
        tracker = MemTracker()
        tracker.track_external(*net.modules.values(), opt)
        seen.update(net=net, opt=opt, tracker=tracker)
        return tracker

    out = train_step(cfg, layout, Mesh.from_layout(layout), optimizer="foreach", watch=watch)
    net, opt = seen["net"], seen["opt"]
    theirs = sum(d["Total"] for d in seen["tracker"].get_tracker_snapshot("peak").values())
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)
    buffers = nbytes({id(b): b for m in net.modules.values() for b in m.buffers()}.values())
    steps = nbytes(st["step"] for st in opt.state.values())
    masters = nbytes(net.master.parameters()) if net.master else 0
    batch = 2 * layout.global_batch * cfg.seq_len * 8          # the token batch, twice (inputs, targets)
    sync = net.grad_sync                                       # DDP's buckets: made before the step
    buckets = nbytes(b.buffer for b in sync.buckets) if sync is not None else 0
    temporary = nbytes(q for g in opt.param_groups for q in g["params"])   # foreach AdamW's, at its end
    return {"ours": out["peak"], "theirs": theirs, "masters": masters, "buckets": buckets,
            "untracked": buffers + steps + batch, "temporary": temporary}


@pytest.mark.parametrize("precision,dp", [("full", 1), ("bf16", 1), ("full", 2)])
def test_the_peak_is_torchs_mem_tracker(precision, dp):
    """At dp 2 the buckets DDP made with the model hold every gradient beside the .grad autograd
    made, until the sums; after them each .grad is a view of its bucket, and the optimizer's
    temporary (the size of the parameters) comes on top: MemTracker sees it, not the buckets."""
    layout = Layout(dp=dp, micro_batch=2, global_batch=2 * dp, precision=precision)   # one micro-batch: MemTracker follows each module once
    for got in launch(_tracked_step, dp, model_config(SPEC, layout), layout, clock=VirtualCluster(HW, dtype=None)):
        assert abs(got["ours"] - (got["theirs"] + got["masters"] + got["buckets"])) <= got["untracked"], got
        assert got["untracked"] < 0.01 * got["ours"]
        assert (got["buckets"] > 0) is (dp > 1) and got["temporary"] > 10 * got["untracked"]


def test_the_loss_holds_its_logits_gradient_between_the_moments():
    """A vocabulary large against the model: between the moments the loss's backward holds the
    logits' gradient (b s V, at the cluster's 2 bytes), which no moment counts."""
    spec = gpt_spec("GPT wide vocabulary", 2, 64, 4, V=8192, s=64)
    r = dry_run(spec, HW, Layout(micro_batch=2, global_batch=2), progress=None)
    mem, = r.memory_by_stage
    assert mem["peak"] - mem["moments"] >= 2 * 64 * 8192 * 2
    assert r.peak_memory == mem["peak"] and r.moment_memory == mem["moments"]
