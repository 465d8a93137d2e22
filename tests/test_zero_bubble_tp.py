"""Zero bubble under tensor parallelism: the TP layers' weight gradients are W's, not B's.

ZB-H1, ZB-V and DualPipeV split each backward: B the input gradients, W the weight GEMMs. The
tensor-parallel layers are not ``nn.Linear`` (the runner's own split), so each leaves its dW in
the forward's record (``parallel.weight_grads``); under sequence parallelism W gathers the kept
s/t shard again, and a K/V weight summed over copies gets its all-reduce in W. Checked here:
every layout equals one device (float64, 4 AdamW steps; tied embeddings, K/V copies, odd tp,
no SP, dp beside), every TP weight of every stage had its dW in W and none in B, and on the
virtual clock W holds the share of the backward the planner's own trace gives it (it held
nothing before) and ZB-H1's step is shorter than 1F1B's.
"""
import dataclasses
from unittest import mock

import pytest
import torch

from course_lib import launch, reference, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.lab.nd_runs import LR, single_device
from course_lib.parallel.compose import assemble_nd, check_layout

CFG = GPTConfig(vocab_size=96, seq_len=16, n_layers=4, hidden=32, n_heads=4, n_kv_heads=2)
TIED = dataclasses.replace(CFG, tie_embeddings=True)
ODD = GPTConfig(vocab_size=96, seq_len=12, n_layers=3, hidden=48, n_heads=6, n_kv_heads=3, ffn_hidden=96)
STEPS = 4

CASES = {   # cfg, mesh, parallelize_nd's keywords, global batch
    "tp2-sp-pp2-zbv-tied": (TIED, dict(tp=2, pp=2), dict(schedule="zb-v", microbatches=3), 6),
    "tp4-kv-copies-pp2-zbh1": (CFG, dict(tp=4, pp=2), dict(schedule="zb-h1", microbatches=3), 6),
    "dp2-tp2-nosp-pp2-dualpipev": (CFG, dict(dp=2, tp=2, pp=2),
                                   dict(schedule="dualpipe-v", microbatches=4, sequence_parallel=False), 8),
    "tp3-odd-pp2-zbh1": (ODD, dict(tp=3, pp=2), dict(schedule="zb-h1", microbatches=2), 4),
}


def _run(layout, kw, cfg, batch):
    from course_lib.parallel import weight_grads
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.pipeline import runner
    from course_lib.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    net = parallelize_nd(TinyGPT(cfg, seed=0).double(), Mesh(**layout), **kw)
    tp_weights = {id(mod.weight) for st in net.stages.values() for mod in st.modules()
                  if isinstance(mod, (ColumnParallelLinear, RowParallelLinear))}
    in_w, in_b = set(), set()              # the TP weights W computed; deferred ones B asked for

    def run_later(later):
        in_w.update(id(w) for w, *_ in later if w.grad_fn is None)
        in_w.update(id(leaf) for w, *_ in later if w.grad_fn is not None        # a sum over copies
                    for leaf in _leaves(w))
        weight_grads.run_later(later)

    def backward_input(y, dy, x, record):
        dx, for_w = real_backward_input(y, dy, x, record)
        deferred = {id(q) for q in record.get("deferred", ())}     # (a tied embedding's own use: B's)
        in_b.update(id(q) for q in record["others"] if id(q) in deferred)
        return dx, for_w
    real_backward_input = runner.backward_input
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    losses, grads = [], None
    with mock.patch.object(runner, "run_later", run_later), \
            mock.patch.object(runner, "backward_input", backward_input):
        for x, y in reference.gpt_batches(cfg, batch=batch, steps=STEPS):
            losses.append(net.step(x, y))
            grads = grads or net.shards(grads=True)
            opt.step()
            opt.zero_grad()
    return losses, net.shards(), grads, tp_weights - in_w, in_b


def _leaves(t):
    """The leaf tensors autograd reaches from ``t``."""
    out, todo = [], [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None:
            continue
        if hasattr(fn, "variable"):
            out.append(fn.variable)
        todo += [nxt for nxt, _ in fn.next_functions]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_zero_bubble_under_tp_equals_one_device_with_dw_in_w(case):
    cfg, layout, kw, batch = CASES[case]
    shape = check_layout(cfg, **layout, batch=batch, **kw)
    groups = shape.sizes["dp"] * kw["microbatches"]
    ref = single_device(cfg, batch, STEPS, groups=groups, dtype=torch.float64)
    ranks = launch(_run, shape.world_size, layout, kw, cfg, batch, threads=1)
    for losses, _, _, not_in_w, in_b in ranks:
        tolerance.assert_matches(losses, ref.losses, optimizer="adamw", steps=STEPS, lr=LR, what="losses")
        assert not not_in_w, f"{len(not_in_w)} tensor-parallel weights got no dW in W"
        assert not in_b, f"{len(in_b)} tensor-parallel weights were asked of autograd in B"
    grads = assemble_nd([g for _, _, g, _, _ in ranks], shape)
    tolerance.assert_matches(grads, ref.grads, what="the first step's gradients")
    full = assemble_nd([shards for _, shards, _, _, _ in ranks], shape)
    tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=STEPS, lr=LR)


def test_w_holds_the_tp_weight_gemms_on_the_clock():
    """A 16-layer GPT at tp 2 x pp 4 + SP on virtual H100s: W is the share of B + W that the
    planner's own trace gives it (its weight GEMMs and, under SP, the re-gathers of the column
    layers' inputs; planner.kernels._w_pass, written apart from weight_grads): 17.0% on the
    clock, 15.8% traced (it was 0 when TP layers ran their whole backward in B); and ZB-H1
    beats 1F1B."""
    from course_lib.planner import Layout, ModelSpec, estimate
    from course_lib.virtual import dry_run

    gpt = ModelSpec("GPT 16L h2048", 16, 2048, 16, 16, 8192, 32000, 1024)
    layouts = {s: Layout(dp=1, tp=2, pp=4, sp=True, schedule=s, microbatches=8, global_batch=8)
               for s in ("1f1b", "zb-h1")}
    runs = {s: dry_run(gpt, "h100-sxm", lay, progress=None) for s, lay in layouts.items()}
    spans = [sp for sp in runs["zb-h1"].spans if sp.kind == "compute" and sp.name[0] in "BW"]
    w = sum(sp.end - sp.start for sp in spans if sp.name[0] == "W")
    b = sum(sp.end - sp.start for sp in spans if sp.name[0] == "B")
    stages = estimate(gpt, "h100-sxm", layouts["zb-h1"], runtime="course").stages
    traced = sum(st.w_time for st in stages) / sum(st.bwd_time - st.w_fused for st in stages)
    assert w / (b + w) == pytest.approx(traced, rel=0.10), (w / (b + w), traced)
    assert runs["zb-h1"].step_time < 0.95 * runs["1f1b"].step_time, {s: r.step_time for s, r in runs.items()}


def _fp32_sums(layout, kw):
    """The fp32 gradient sums (the masters' .grad) after one step under bf16-accumulate-fp32."""
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    net = parallelize_nd(TinyGPT(CFG, seed=0), Mesh(**layout), **kw, precision="bf16-accumulate-fp32")
    x, y = reference.gpt_batches(CFG, batch=8, steps=1)[0]
    net.step(x, y)
    return {f"{s}.{n}": net.master.of[id(q)].grad for s, st in net.stages.items() for n, q in st.named_parameters()}


@pytest.mark.parametrize("tp", [1, 2])
def test_w_adds_each_micro_batch_into_the_fp32_sums(tp):
    """W writes .grad outside autograd; mixed precision's fp32 sums take each backward's gradient
    in a post-accumulate-grad hook (MainGrads), so W runs the hooks as autograd would: the sums
    of ZB-H1 are 1F1B's to the bit (they were bf16 sums of W's weights: up to 3e-5 apart at 8
    micro-batches), the tensor-parallel layers' included."""
    runs = {s: launch(_fp32_sums, 2 * tp, dict(pp=2, tp=tp), dict(schedule=s, microbatches=8), threads=1)
            for s in ("1f1b", "zb-h1")}
    for ours, theirs in zip(runs["zb-h1"], runs["1f1b"]):
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert ours[name] is not None and torch.equal(ours[name], theirs[name]), name
