"""The planner's ``runtime="course"`` after the schedule: GradSync's fills and all-reduces, the
loss's sum and AdamW (course_lib/planner/runtime.py ``dp_sync``, buckets.py ``bucket_copy``), against the
dry run's own tail (from the end of the last backward to the end of the step).

GradSync fills each bucket with ``view.copy_(p.grad)``; the clock prices ``copy_`` as the GPU runs
it: the source read and the destination written (not read), 2 x the gradient's bytes, one
streaming pass at the elementwise rate when both are contiguous (kernel_cost.STREAMING_COPIES).
The planner once priced it apart from the clock and the tail came out 7.4% short on this layout
(the sweep's dp and cp rows lost the same); it now calls the clock's own op_cost. Everything in the tail is priced by
the same kernel model, and the all-reduces by NCCL's tuning model on both sides, each its own
transcription (planner.communication.nccl_time; until 2026-11-30 the planner's alpha-beta ring:
2.925 against the clock's 2.934 ms for the 1.05 GB bucket over 2 H100s, 0.3%): so 1%."""
from course_lib.layout import Layout
from course_lib.planner import estimate
from course_lib.planner.presets import get_hardware, get_model
from course_lib.planner.buckets import bucket_copy
from course_lib.virtual import dry_run


def test_the_tail_after_the_schedule_is_the_dry_runs():
    spec = get_model("llama3-8b").with_(n_layers=2)
    layout = Layout(dp=2, micro_batch=1, microbatches=1, seq_len=2048)
    est = estimate(spec, "h100-sxm", layout, runtime="course")
    r = dry_run(spec, "h100-sxm", layout, progress=None, optimizer="foreach")
    ran = min(s.rank for s in r.spans)
    backward_ends = max(s.end for s in r.spans if s.rank == ran and s.dim == "pp" and s.name.startswith("B"))
    tail = est.time["optimizer"] + est.time["dp"]
    assert abs(tail / (r.step_time - backward_ends) - 1) <= 0.01, (tail, r.step_time - backward_ends)


def test_a_fill_moves_twice_the_gradient():
    hw = get_hardware("h100-sxm")
    k = bucket_copy(hw, 2**20)
    assert (k.count, k.flops, k.bytes) == (1, 0, 2 * 2 * 2**20)


def test_a_zero_bucket_fill_is_one_foreach_copy_priced_as_the_clock_prices_it():
    """ZeRO-1/2 pack a bucket with one ``torch._foreach_copy_`` over its gradients cut at the
    ends of the ranks' rows (parallel/zero_nd.py ``row_pieces``); the planner cuts them the same way
    (``row_pieces``, written apart: it imports nothing of parallel/) and prices the op as the
    clock does: 2 x the bytes (the destination written, not read), multi-tensor apply's launches."""
    import torch

    from course_lib.parallel.zero_nd import row_pieces as program_pieces
    from course_lib.planner.buckets import bucket_fill, row_pieces
    from course_lib.planner.kernel_cost import op_cost

    hw = get_hardware("h100-sxm")
    sizes = [3 * 2**20 + 5, 7, 2**22, 100_003, 1]
    for group in (1, 2, 3, 8, 1024):
        shard = -(-sum(sizes) // group)
        with torch.device("meta"):
            flat = torch.empty(group, shard + len(sizes))[:, :shard]
            ran, at = [], 0
            for n in sizes:
                ran += [dst.numel() for dst, _ in program_pieces(flat, at, torch.empty(n))]
                at += n
            pieces = row_pieces(sizes, group)
            assert pieces == ran, group
            cost = op_cost(torch.ops.aten._foreach_copy_.default, ([torch.empty(n) for n in pieces],
                                                                  [torch.empty(n) for n in pieces]), {}, None, 2)
        k = bucket_fill(hw, sizes, group)
        assert (k.count, k.flops, k.bytes) == (cost[3], cost[0], cost[1]) and k.bytes == 2 * 2 * sum(sizes)
        assert k.count == (1 if group < 1024 else 17)   # 64 tensors a launch (two lists)
