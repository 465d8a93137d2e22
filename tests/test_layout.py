"""The one layout object (course_lib/layout.py): the planner's and the ranks'.

Its batch fields (any two give the third), the keywords that build it, the same object priced
by the planner and run by the ranks, and keywords and the object giving the same plan.
"""
import pytest
import torch

from course_lib import launch, reference
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.layout import Layout
from course_lib.parallel import check_layout
from course_lib.parallel.layout_rules import as_layout
from course_lib.planner import Layout as PlannerLayout
from course_lib.planner import estimate
from course_lib.planner.calibration import model_spec

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layers=2, hidden=16, n_heads=2, ffn_hidden=32)


def test_one_class():
    assert PlannerLayout is Layout


@pytest.mark.parametrize("fields,want", [   # (global_batch, micro_batch, microbatches)
    (dict(), (1, 1, 1)),
    (dict(dp=2), (2, 1, 1)),
    (dict(dp=2, global_batch=8), (8, 1, 4)),
    (dict(dp=2, global_batch=8, micro_batch=2), (8, 2, 2)),
    (dict(dp=2, global_batch=8, microbatches=2), (8, 2, 2)),
    (dict(dp=2, micro_batch=3, microbatches=2), (12, 3, 2)),
])
def test_any_two_batch_fields_give_the_third(fields, want):
    L = Layout(**fields)
    assert (L.global_batch, L.micro_batch, L.microbatches) == want


def test_with_derives_again_what_was_not_given():
    L = Layout(dp=2, global_batch=8)
    assert L.with_(dp=4).microbatches == 2 and L.with_(micro_batch=2).microbatches == 2
    assert L.with_(global_batch=16).microbatches == 8
    given = Layout(dp=2, global_batch=8, microbatches=2)
    assert given.with_(global_batch=16).micro_batch == 4          # microbatches was given: it stays


def test_runtime_keywords_build_the_layout():
    L = as_layout(dims=dict(dp=2, tp=2), microbatches=2, data="fsdp", batch=8, cp_method="ulysses")
    assert (L.dp, L.tp, L.zero, L.data, L.microbatches, L.micro_batch, L.sp, L.overlap_dp, L.cp_method) == \
        (2, 2, 3, "fsdp", 2, 2, True, False, "ulysses")
    assert Layout(zero=3).data == "fsdp" and Layout().data == "ddp"
    with pytest.raises(ValueError, match="data must be one of"):
        as_layout(dims=dict(dp=2), data="zero")
    with pytest.raises(ValueError, match="differ from the mesh"):
        as_layout(Layout(dp=2), dims=dict(dp=1, tp=2))


def test_the_planner_and_the_ranks_take_the_same_object():
    """One Layout: estimate prices it, check_layout accepts it; what the ranks do not build is
    refused by check_layout with the reason; ZeRO-1/2 with master weights and Llama 3's
    all-gathered K/V both take."""
    L = Layout(dp=2, tp=2, sp=True, global_batch=8, microbatches=2, overlap_dp=False)
    assert check_layout(CFG, L).world_size == 4
    assert estimate(model_spec(CFG), "h100-sxm", L, runtime="course").step_time > 0
    assert check_layout(CFG, L.with_(dp=1, cp=2, cp_comm="all_gather")).world_size == 4   # the ranks run it
    for change in (dict(zero=1, precision="bf16"), dict(zero=2, precision="bf16-accumulate-fp32")):
        estimate(model_spec(CFG), "h100-sxm", L.with_(**change))       # the planner prices it
        assert check_layout(CFG, L.with_(**change)).world_size == 4     # the ranks run it (masters: the slices)
    with pytest.raises(ValueError, match="dp \\* micro_batch \\* microbatches"):   # both refuse an inconsistent batch
        estimate(model_spec(CFG), "h100-sxm", Layout(dp=2, global_batch=8, micro_batch=1, microbatches=2))
    with pytest.raises(ValueError, match="dp \\* micro_batch \\* microbatches"):
        check_layout(CFG, Layout(dp=2, global_batch=8, micro_batch=1, microbatches=2))


def _two_ways(layout, kw):
    """This rank's plan built from the Layout and from the keywords: shards and a step's loss."""
    from course_lib.parallel import Mesh, parallelize_nd
    out = []
    for args, keywords in (((layout,), {}), ((), kw)):
        net = parallelize_nd(TinyGPT(CFG, seed=0).double(), Mesh(**layout.sizes), *args, **keywords)
        x, y = reference.gpt_batches(CFG, batch=layout.global_batch, steps=1)[0]
        loss = net.step(x, y)
        out.append((net.layout, net.placements, loss, net.shards(grads=True)))
    return out


@pytest.mark.parametrize("layout,kw", [
    (Layout(dp=2, tp=2, sp=True, global_batch=4, microbatches=2, overlap_dp=False),
     dict(microbatches=2)),
    (Layout(pp=2, cp=2, schedule="gpipe", global_batch=4, microbatches=2, cp_layout="contiguous", overlap_dp=False),
     dict(microbatches=2, schedule="gpipe", cp_layout="contiguous", sequence_parallel=False)),
])
def test_keywords_and_the_object_give_the_same_plan(layout, kw):
    for (lay_a, where_a, loss_a, grads_a), (lay_b, where_b, loss_b, grads_b) in launch(_two_ways, 4, layout, kw,
                                                                                         threads=1):
        assert (lay_a.sizes, lay_a.sp and lay_a.tp > 1, lay_a.microbatches, lay_a.schedule, lay_a.cp_layout) == \
            (lay_b.sizes, lay_b.sp and lay_b.tp > 1, lay_b.microbatches, lay_b.schedule, lay_b.cp_layout)
        assert where_a == where_b and loss_a == loss_b
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            assert torch.equal(grads_a[name][0], grads_b[name][0]), name
