"""Llama 3's all-gather CP on the virtual clock: its attention kernel (course_lib/flash_prefix.py,
FlashAttention causal at the bottom right, one kernel per query chunk) computes the course's
attention; a dry run of an all-gather CP layout is a real launch of it to the bit, with
FlashAttention (Llama 3's software) and with the course's written-out attention; its
all-gather and reduce-scatter are on the clock; the kernel is priced at its trimmed FLOPs."""
import sys

import pytest
import torch

from course_lib import tolerance
from course_lib.attention import causal_attention
from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.planner.presets import HARDWARE, ModelSpec
from course_lib.virtual import VirtualCluster, dry_run

SPEC = ModelSpec("Llama test", 4, 64, 4, 2, 128, 256, 32)      # GQA (4 query heads, 2 K/V), rotary, SwiGLU
HW = "h100-sxm"


def test_flash_prefix_is_the_courses_attention_and_priced_at_its_trimmed_flops():
    from course_lib.planner.kernel_cost import op_cost
    from course_lib.flash_prefix import flash_attention_prefix
    torch.manual_seed(0)
    c = 3
    for length, kv in ((3, 4), (5, 2), (12, 1)):   # the chunk alone (chunk 0), after 2 or 9 past keys; GQA
        q, k, v = (torch.randn(2, h, n, 8, dtype=torch.float64, requires_grad=True)
                   for h, n in ((4, c), (kv, length), (kv, length)))
        want = causal_attention(q, k, v, torch.arange(length - c, length), torch.arange(length))
        got = flash_attention_prefix(q, k, v)
        g = torch.randn_like(want)
        tolerance.assert_matches([got, *torch.autograd.grad(got, (q, k, v), g)],
                                 [want, *torch.autograd.grad(want, (q, k, v), g)], dtype=torch.float64,
                                 what=f"{length} keys, {kv} K/V heads")
    with pytest.raises(ValueError, match="must be the last"):
        flash_attention_prefix(k.expand(2, 4, 12, 8), q, q)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flash_attention_prefix(torch.zeros(1, 3, 2, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))
    f = torch.ops.course.flash_attention_prefix.default
    q, k = (torch.empty(1, 16, n, 128, device="meta", dtype=torch.bfloat16) for n in (4096, 3 * 4096))
    flops, _, kind, _ = op_cost(f, (q, k, k), {}, f(q, k, k), 2)
    # QK^T and PV over 2 past chunks in full (2 x 2 b a c (2c) d) and the diagonal's half (2 b a c^2 d)
    assert (flops, kind) == (2 * 2 * 16 * 4096 * 2 * 4096 * 128 + 2 * 16 * 4096 * 4096 * 128, "attention")


def _real_rank(cfg, layout, software):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    return train_step(cfg, layout, Mesh.from_layout(layout), fusions=software)


@pytest.mark.parametrize("layout, software", [
    (Layout(cp=2, tp=2, sp=True, cp_comm="all_gather", micro_batch=1, global_batch=2), ("flash_attention",)),
    (Layout(cp=2, pp=2, cp_comm="all_gather", micro_batch=1, global_batch=4, recompute="selective"), ()),
], ids=["flash-cp2-tp2", "course-cp2-pp2"])
def test_all_gather_cp_dry_run_equals_a_real_launch(layout, software, monkeypatch):
    """Every cp rank run: the real launch's step to the bit. Under FlashAttention the dry run
    folds the cp ranks (``folds_cp``: cp = 0 alone): never longer than every rank run (a folded
    twin adds no wait), and shorter by less than cp rank 0's time in collectives with its twins
    (where it waits for them)."""
    from course_lib.virtual.dry_run import folds_cp, model_config
    hw = HW if software else HARDWARE[HW].with_(fused_attention=False)   # "course": the written-out core
    real = launch(_real_rank, layout.n_gpus, model_config(SPEC, layout), layout, software, clock=VirtualCluster(hw))
    folded = dry_run(SPEC, hw, layout, fusions=software, progress=None)
    assert folded.fusions == software
    assert folds_cp(layout, software) == (folded.ranks_run == layout.pp)
    monkeypatch.setattr(sys.modules["course_lib.virtual.dry_run"], "folds_cp", lambda *a: False)
    r = dry_run(SPEC, hw, layout, fusions=software, progress=None)
    assert r.step_time == max(x["t"] for x in real), (r.step_time, [x["t"] for x in real])
    assert r.ranks_run == layout.pp * layout.cp
    with_twins = sum(s.end - s.start for s in r.spans if s.rank == 0 and "cp" in s.dim)   # its waits inside
    assert r.step_time - with_twins <= folded.step_time <= r.step_time
    comm = [s for s in r.spans if s.dim == "cp"]
    n = SPEC.n_layers * layout.microbatches // layout.pp        # attention layers a running rank runs
    for name in ("K/V all-gather", "K/V all-gather (backward)", "dK/dV reduce-scatter"):
        assert len([s for s in comm if s.name == name]) == n * r.ranks_run, name
    assert not [s for s in comm if "hop" in s.name]             # not the ring


def test_the_llama3_128k_row_runs_all_gather_cp_folded():
    """The published 128k row (Llama 3 Table 4: TP8 CP16 PP16 DP8): the ranks accept its
    all-gather CP, and under Llama 3's stated software its cp ranks fold (16 ranks run, not 256;
    benchmarks/dry_run_validation.py runs it)."""
    from course_lib.lab.dry_runs import LLAMA3_CP_NOTE, SOFTWARE, published_runs
    from course_lib.virtual.dry_run import check_dry_run, folds_cp
    (row,) = [r for r in published_runs() if r[4].cp > 1]
    model, layout, note = row[2], row[4], row[7]
    assert (layout.cp, layout.cp_comm, layout.seq_len, note) == (16, "all_gather", 131072, LLAMA3_CP_NOTE)
    check_dry_run(model, layout.with_(zero=0))
    assert folds_cp(layout, SOFTWARE["Llama 3 T4"]) and not folds_cp(layout.with_(cp_comm="ring"), ("flash_attention",))
    assert not folds_cp(layout, ())                  # the written-out attention: every cp rank runs
