"""Packed documents under context parallelism (course_lib/parallel/cp_layouts.py, the doc_ids of
course_lib/attention.py, gpt.py and context_parallel.py) against one device.

One device: a token's output does not depend on another document's tokens (bit for bit: a
hidden key's probability is exactly 0). Layouts: every layout is a partition with equal
tokens per rank; the "documents" layout gives every rank exactly the same visible (query,
key) pairs where the sequence-wide zigzag does not. Ring attention (zigzag, contiguous,
documents) and Ulysses honour the document mask: outputs and q, k, v gradients equal one
device's masked attention (fp32, one step's reordering bound, course_lib.tolerance) on 3
ranks; a tiny GPT trained 4 AdamW steps in float64 through ``parallelize_nd`` with packed
documents (PP2 x CP2 documents-balanced ring; DP2 x CP2 Ulysses) ends with the single-device
weights. Bad input is refused with the rule's name.
"""
import pytest
import torch

from course_lib import launch, reference, tolerance
from course_lib.attention import causal_attention, document_mask
from course_lib.models import GPTConfig, TinyGPT
from course_lib.parallel import context_parallel as cp
from course_lib.parallel import cp_layouts

CFG = GPTConfig(vocab_size=64, seq_len=24, n_layers=2, hidden=32, n_heads=4, n_kv_heads=2)
DOCS = torch.tensor([0] * 4 + [1] * 12 + [2] * 8)          # 24 tokens; every length a multiple of 4
STEPS, BATCH, LR = 4, 4, 1e-2


def test_attention_never_crosses_documents():
    model = TinyGPT(CFG, seed=0)
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    other = idx.clone()
    other[:, :4] = (other[:, :4] + 1) % 64                   # change document 0 only
    packed, changed = model(idx, doc_ids=DOCS)[0], model(other, doc_ids=DOCS)[0]
    assert torch.equal(packed[:, 4:], changed[:, 4:])        # exactly: hidden keys weigh 0
    assert not torch.equal(packed[:, :4], changed[:, :4])
    per_row = model(idx, doc_ids=torch.stack([DOCS, torch.zeros(24, dtype=torch.long)]))[0]
    assert torch.equal(per_row[0], packed[0])                # a packing per row: row 1 is one document
    assert torch.equal(per_row[1], model(idx[1:])[0][0])
    alone = model(idx[:, 4:16])[0]                           # rotary is relative: same as alone
    tolerance.assert_matches(alone, packed[:, 4:16], what="document 1 alone")


def test_layouts_split_tokens_evenly_and_documents_balance_work():
    docs = torch.tensor([0] * 8 + [1] * 40 + [2] * 16)       # a long document in the middle
    for n in (2, 4):
        for layout in cp_layouts.LAYOUTS:
            pos = [cp_layouts.shard_positions(64, n, r, layout, doc_ids=docs) for r in range(n)]
            assert sorted(torch.cat(pos).tolist()) == list(range(64)), layout
            assert {len(p) for p in pos} == {64 // n}, layout
        work = {lay: cp_layouts.work_per_rank(64, n, lay, docs) for lay in cp_layouts.LAYOUTS}
        assert len(set(work["documents"])) == 1              # every rank the same pairs
        assert cp_layouts.imbalance(work["zigzag"]) > 1.05   # the sequence-wide zigzag is not
        assert sum(work["zigzag"]) == sum(work["documents"]) == cp_layouts.visible_pairs(torch.arange(64), docs)
    one = cp_layouts.work_per_rank(64, 4, "zigzag")          # one document: the zigzag balances
    assert len(set(one)) == 1


def _attention_cases():
    return [("ring", "zigzag"), ("ring", "contiguous"), ("ring", "documents"), ("ulysses", "documents")]


def _qkv(seq=24, a=6, kv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, seq, 8, generator=g) for h in (a, kv, kv, a)]  # q, k, v, dy


def _attention_on_ranks(cases, docs):
    import torch.distributed as dist

    from course_lib.parallel.mesh import Mesh

    comm = Mesh(cp=dist.get_world_size()).comm("cp")
    out = []
    for method, layout in cases:
        q, k, v, dy = _qkv()
        pos = cp.shard_positions(24, comm.size, comm.rank, layout, doc_ids=docs)
        local = [t.index_select(2, pos).requires_grad_() for t in (q, k, v)]
        if method == "ring":
            y = cp.ring_attention(*local, pos, comm, 24, layout, docs)
        else:
            y = cp.ulysses_attention(*local, pos, comm, doc_ids=docs)
        (y * dy.index_select(2, pos)).sum().backward()
        out.append((y.detach(), [t.grad for t in local], pos))
    return out


def test_ring_and_ulysses_with_documents_equal_one_device():
    docs = torch.tensor([0] * 6 + [1] * 12 + [2] * 6)        # multiples of 2N = 6 on 3 ranks
    cases = _attention_cases()
    ranks = launch(_attention_on_ranks, 3, cases, docs)
    q, k, v, dy = _qkv()
    ts = [t.clone().requires_grad_() for t in (q, k, v)]
    whole = torch.arange(24)
    y = causal_attention(*ts, future=document_mask(whole, whole, docs))
    (y * dy).sum().backward()
    for i, (method, layout) in enumerate(cases):
        for r, res in enumerate(ranks):
            got_y, grads, pos = res[i]
            where = f"{method} {layout} rank {r}"
            tolerance.assert_matches(got_y, y.detach().index_select(2, pos), what=where)
            tolerance.assert_matches({n: g for n, g in zip("qkv", grads)},
                                     {n: t.grad.index_select(2, pos) for n, t in zip("qkv", ts)}, what=where)


def _train(runs, docs):
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    out = []
    for mesh_kw, kw in runs:
        net = parallelize_nd(TinyGPT(CFG, seed=0).double(), Mesh(**mesh_kw), **kw)
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
        losses, grads = [], None
        for x, y in reference.gpt_batches(CFG, batch=BATCH, steps=STEPS):
            losses.append(net.step(x, y, doc_ids=docs))
            grads = grads or net.shards(grads=True)
            opt.step()
            opt.zero_grad()
        out.append((losses, net.shards(), grads))
    return out


RUNS = [(dict(pp=2, cp=2), dict(microbatches=2, cp_balance="documents")),
        (dict(dp=2, cp=2), dict(cp_method="ulysses", cp_balance="zigzag"))]


def test_training_packed_documents_with_cp_equals_one_device():
    from course_lib.parallel.compose import assemble_nd, check_layout

    model = TinyGPT(CFG, seed=0).double()                    # float64: exactness is the claim
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    ref_losses, ref_grads = [], None
    for x, y in reference.gpt_batches(CFG, batch=BATCH, steps=STEPS):
        loss = model(x, y, doc_ids=DOCS)[1]
        loss.backward()
        ref_grads = ref_grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        ref_losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    ranks = launch(_train, 4, RUNS, DOCS, threads=1)
    for i, (mesh_kw, kw) in enumerate(RUNS):
        shape = check_layout(CFG, **mesh_kw, batch=BATCH, **kw)
        for losses, _, _ in (r[i] for r in ranks):
            tolerance.assert_matches(losses, ref_losses, optimizer="adamw", steps=STEPS, lr=LR, what="losses")
        grads = assemble_nd([r[i][2] for r in ranks], shape)
        tolerance.assert_matches(grads, ref_grads, what=f"{kw}: the first step's gradients")
        full = assemble_nd([r[i][1] for r in ranks], shape)
        tolerance.assert_matches(full, model.state_dict(), optimizer="adamw", steps=STEPS, lr=LR)


def test_bad_packings_are_refused():
    model = TinyGPT(CFG, seed=0)
    idx = torch.zeros(1, 24, dtype=torch.long)
    with pytest.raises(ValueError, match="one contiguous run"):
        model(idx, doc_ids=torch.tensor([0] * 8 + [1] * 8 + [0] * 8))
    with pytest.raises(ValueError, match="int64"):
        model(idx, doc_ids=DOCS.float())
    with pytest.raises(ValueError, match="one id per token"):
        model(idx, doc_ids=DOCS[:12])
    with pytest.raises(ValueError, match="multiple of 2\\*CP=4"):
        cp_layouts.shard_positions(24, 2, 0, "documents", doc_ids=torch.tensor([0] * 6 + [1] * 18))
    with pytest.raises(ValueError, match="shape \\(s,\\)"):
        cp_layouts.shard_positions(24, 2, 0, "documents", doc_ids=DOCS[None])
    with pytest.raises(ValueError, match="pass step"):
        cp.rule_doc_ids(None, 24, 24, "documents", 2)
    with pytest.raises(ValueError, match="one packing for every row"):
        cp.rule_doc_ids(DOCS[None].repeat(2, 1), 24, 24, "zigzag", 2)
