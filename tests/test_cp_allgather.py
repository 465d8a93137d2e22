"""Llama 3's all-gather context parallelism (course_lib/parallel/cp_allgather.py): selected by
``cp_comm="all_gather"`` on a layout; a GQA Llama-style TinyGPT trained AdamW steps in float64
through ``parallelize_nd`` equals one device at cp 2 and cp 3, with tp 2 (+ SP), pp 2 and FSDP,
zigzag, contiguous and packed documents; its messages are one all-gather per attention
forward, and an all-gather and a reduce-scatter per backward on the cp group (Transformer
Engine's); bad layouts are refused before any rank starts."""
import pytest
import torch

from course_lib import launch, reference, tolerance
from course_lib.layout import Layout
from course_lib.models import GPTConfig, TinyGPT
from course_lib.parallel import cp_allgather
from course_lib.parallel.compose import assemble_nd, check_layout

CFG = GPTConfig(vocab_size=64, seq_len=24, n_layers=2, hidden=32, n_heads=4, n_kv_heads=2)   # GQA, rotary
DOCS = torch.tensor([0] * 12 + [1] * 12)            # two packed documents, each a multiple of 2*cp (cp 2, 3)
STEPS, BATCH, LR = 3, 4, 1e-2

# (mesh, layout keywords, packed documents?): every run uses every rank of its launch
RUNS = {4: [(dict(cp=2, tp=2), dict(cp_comm="all_gather", sequence_parallel=True), False),
            (dict(cp=2, pp=2), dict(cp_comm="all_gather", microbatches=2, cp_balance="contiguous",
                                    recompute="selective"), False),
            (dict(dp=2, cp=2), dict(cp_comm="all_gather", data="fsdp", recompute="selective"), False)],
        6: [(dict(cp=3, tp=2), dict(cp_comm="all_gather"), False),
            (dict(cp=3, pp=2), dict(cp_comm="all_gather", microbatches=2, cp_balance="documents"), True)]}


def _train(runs, docs):
    from course_lib import trace
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    out = []
    for mesh_kw, kw, packed in runs:
        net = parallelize_nd(TinyGPT(CFG, seed=0).double(), Mesh(**mesh_kw), **kw)
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
        losses, grads = [], None
        trace.reset()
        for x, y in reference.gpt_batches(CFG, batch=BATCH, steps=STEPS):
            losses.append(net.step(x, y, doc_ids=docs if packed else None))
            grads = grads or (net.shards(grads=True) if kw.get("data") != "fsdp" else {})   # FSDP: shards only
            opt.step()
            opt.zero_grad()
        names = [s.name for s in trace.spans() if s.dim == "cp"]
        out.append((losses, net.shards(), grads, names))
    return out


def _one_device(packed):
    model = TinyGPT(CFG, seed=0).double()                    # float64: exactness is the claim
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, grads = [], None
    for x, y in reference.gpt_batches(CFG, batch=BATCH, steps=STEPS):
        loss = model(x, y, doc_ids=DOCS if packed else None)[1]
        loss.backward()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, grads, model.state_dict()


@pytest.mark.parametrize("world", [4, 6])
def test_all_gather_cp_trains_as_one_device(world):
    ranks = launch(_train, world, RUNS[world], DOCS, threads=1, timeout=240)
    ref = {packed: _one_device(packed) for packed in (False, True)}
    for i, (mesh_kw, kw, packed) in enumerate(RUNS[world]):
        ref_losses, ref_grads, ref_state = ref[packed]
        what = f"{mesh_kw} {kw}"
        shape = check_layout(CFG, **mesh_kw, batch=BATCH, **kw)
        for losses, _, _, names in (r[i] for r in ranks):
            tolerance.assert_matches(losses, ref_losses, optimizer="adamw", steps=STEPS, lr=LR, what=what)
            # Llama 3's messages: one all-gather per attention forward, the same again and one
            # reduce-scatter per backward (per layer, micro-batch and step), else only grad sync
            m = kw.get("microbatches", 1)
            assert names.count("K/V all-gather") == CFG.n_layers * m * STEPS // mesh_kw.get("pp", 1), (what, names)
            assert names.count("dK/dV reduce-scatter") == names.count("K/V all-gather"), (what, names)
            assert names.count("K/V all-gather (backward)") == names.count("K/V all-gather"), (what, names)
            assert not [n for n in names if "hop" in n or "ulysses" in n], (what, names)
        if ranks[0][i][2]:
            grads = assemble_nd([r[i][2] for r in ranks], shape)
            tolerance.assert_matches(grads, ref_grads, what=f"{what}: the first step's gradients")
        full = assemble_nd([r[i][1] for r in ranks], shape)
        tolerance.assert_matches(full, ref_state, optimizer="adamw", steps=STEPS, lr=LR, what=what)


def test_query_runs_are_the_zigzag_chunks():
    from course_lib.parallel.cp_layouts import shard_positions
    assert cp_allgather.query_runs(shard_positions(24, 3, 1)) == [(0, 4), (4, 8)]           # chunks 1 and 4
    assert cp_allgather.query_runs(shard_positions(24, 3, 1, "contiguous")) == [(0, 8)]
    assert cp_allgather.query_runs(shard_positions(24, 3, 2)) == [(0, 8)]   # chunks 2 and 3 touch...
    assert cp_allgather.query_runs(shard_positions(24, 3, 2), 4) == [(0, 4), (4, 8)]   # ...cut as the zigzag's


def test_bad_all_gather_layouts_are_refused_before_ranks_start():
    with pytest.raises(ValueError, match="divisible by 2\\*CP=6"):
        check_layout(CFG.with_(seq_len=21) if hasattr(CFG, "with_") else GPTConfig(
            vocab_size=64, seq_len=21, n_layers=2, hidden=32, n_heads=4, n_kv_heads=2),
            Layout(cp=3, cp_comm="all_gather", global_batch=4))
    with pytest.raises(ValueError, match="cp_method='ulysses' cannot run with it"):
        check_layout(CFG, Layout(cp=2, cp_comm="all_gather", cp_method="ulysses", global_batch=4))
    with pytest.raises(ValueError, match="cp_comm must be one of"):
        check_layout(CFG, Layout(cp=2, cp_comm="allgather", global_batch=4))
    with pytest.raises(ValueError, match="no attention dropout"):
        check_layout(GPTConfig(vocab_size=64, seq_len=24, n_layers=2, hidden=32, n_heads=4, dropout=0.1),
                     Layout(cp=2, cp_comm="all_gather", global_batch=4))
