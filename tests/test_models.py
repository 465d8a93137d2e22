"""course_lib.models (and course_lib.gpt, course_lib.attention, which it re-exports): shapes, deterministic init, the
awkward MLP cases, a tiny overfit, and the parts every parallel dimension cuts the GPT into."""
import pytest
import torch

from course_lib import models, tolerance
from course_lib.models import MLP, GPTConfig, SmallCNN, TinyGPT, n_params


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_tinygpt_shapes_and_loss():
    model = TinyGPT(seed=0)
    idx = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 17, 256)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.2  # small init: ~uniform
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 4


def test_seeded_init_does_not_depend_on_the_global_rng():
    torch.manual_seed(123)
    a = TinyGPT(seed=7)
    torch.manual_seed(999)
    b = TinyGPT(seed=7)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    c = TinyGPT(seed=8)
    assert not torch.equal(a.blocks[0].attn.wq.weight, c.blocks[0].attn.wq.weight)


def test_layers_are_not_identical_copies():
    # the seed-material bug: reseeding per layer made every layer (and shard) the same
    model = TinyGPT(seed=0)
    assert not torch.equal(model.blocks[0].attn.wq.weight, model.blocks[1].attn.wq.weight)
    w = model.blocks[0].mlp.w1.weight
    assert not torch.equal(w[: w.shape[0] // 2], w[w.shape[0] // 2:])


@pytest.mark.parametrize("cfg", [
    GPTConfig(n_kv_heads=2),
    GPTConfig(n_kv_heads=1, tie_embeddings=True),
    GPTConfig(block="gpt2", dropout=0.1),
])
def test_variants_run_backward(cfg):
    model = TinyGPT(cfg, seed=0)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    _, loss = model(idx, idx)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    if cfg.tie_embeddings:
        assert model.lm_head.weight is model.tok_emb.weight


def test_grouped_query_attention_equals_attention_with_repeated_kv():
    cfg = GPTConfig(n_layers=1, n_kv_heads=2)
    model = TinyGPT(cfg, seed=0).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 10, cfg.hidden, generator=torch.Generator().manual_seed(0))
    b, s, h = x.shape
    a, kv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    from course_lib.models import apply_rotary
    q = apply_rotary(attn.wq(x).view(b, s, a, d).transpose(1, 2), attn.cos[:s], attn.sin[:s])
    k = apply_rotary(attn.wk(x).view(b, s, kv, d).transpose(1, 2), attn.cos[:s], attn.sin[:s])
    v = attn.wv(x).view(b, s, kv, d).transpose(1, 2)
    k, v = k.repeat_interleave(a // kv, dim=1), v.repeat_interleave(a // kv, dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = attn.wo(ref.transpose(1, 2).reshape(b, s, h))
    tolerance.assert_matches(attn(x), ref)


def test_causal():
    model = TinyGPT(seed=0)
    idx = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    tolerance.assert_matches(model(idx)[0][:, :8], model(changed)[0][:, :8])


def test_bad_config_raises():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(hidden=64, n_heads=5)
    with pytest.raises(ValueError, match="n_kv_heads"):
        GPTConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="seq_len"):
        TinyGPT(GPTConfig(seq_len=8))(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        GPTConfig(dropout=1.0)
    for bad in ("0.1", True, None):
        with pytest.raises(TypeError, match="dropout must be a number"):
            GPTConfig(dropout=bad)


def test_mlp_awkward_cases():
    m = MLP((16, 32, 16, 32), frozen=(1,), shared=True, unused=True, seed=0)
    assert m.layers[2].weight is m.layers[0].weight
    names = dict(m.named_parameters())
    assert "layers.2.weight" not in names  # deduplicated
    m(torch.randn(4, 16)).sum().backward()
    assert m.unused.grad is None
    assert m.layers[1].weight.grad is None and not m.layers[1].weight.requires_grad
    assert m.layers[0].weight.grad is not None
    with pytest.raises(ValueError, match="shared"):
        MLP((16, 32, 8), shared=True)
    assert torch.equal(MLP(seed=3).layers[0].weight, MLP(seed=3).layers[0].weight)


def test_small_cnn_shapes():
    model = SmallCNN(seed=0)
    assert model(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    assert model(torch.zeros(5, 8, 8)).shape == (5, 10)
    assert n_params(model) > 0


def test_tinygpt_overfits_one_batch():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layers=2, seq_len=32), seed=0)
    idx = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        _, loss = model(x, y)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_saved_activations_counts_unique_storages_and_leaves_output_alone():
    from course_lib.models import saved_activations
    from course_lib.planner.formulas import activation_bytes_per_layer, llama_activation_bytes_per_layer

    s, b = 32, 2
    cfg = GPTConfig(block="gpt2", dropout=0.1, n_layers=1, seq_len=s)
    block = TinyGPT(cfg, seed=0).to(torch.bfloat16).train().blocks[0]
    x = torch.randn(b, s, cfg.hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out, rows = saved_activations(block, x.requires_grad_() * 1.0)
    assert isinstance(out, torch.Tensor) and out.shape == (b, s, cfg.hidden)
    big = sum(r.nbytes for r in rows if r.shape[-1] != 1)
    assert big == activation_bytes_per_layer(s, b, cfg.hidden, cfg.n_heads)  # Korthikanti, byte for byte
    assert sum(r.nbytes for r in rows if r.shape[-1] == 1) == 4 * 2 * b * s  # LayerNorm mean, rstd
    assert any(r.refs == 3 for r in rows)  # the normed input of W_q, W_k, W_v: one storage

    llama = TinyGPT(GPTConfig(n_layers=1, seq_len=s, n_kv_heads=2), seed=0).to(torch.bfloat16).train()
    h, a, kv, f = 64, 4, 2, llama.config.ffn_hidden
    _, rows = saved_activations(llama.blocks[0], x * 1.0)
    assert sum(r.nbytes for r in rows) == llama_activation_bytes_per_layer(s, b, h, a, kv, f)  # rstd included
    assert sum(r.nbytes for r in rows if r.shape[-1] == 1) == 2 * 2 * b * s  # the two RMSNorms' rstd


# ----------------------------------------------------------------------------- the parts every dimension cuts

VARIANTS = {
    "llama": GPTConfig(n_layers=2, seq_len=16),
    "gqa": GPTConfig(n_layers=2, seq_len=16, n_kv_heads=2, tie_embeddings=True),
    "mqa": GPTConfig(n_layers=2, seq_len=16, n_kv_heads=1),
    "gpt2": GPTConfig(n_layers=2, seq_len=16, block="gpt2", dropout=0.1),
}


def tokens(b, s, vocab=256, seed=0):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", VARIANTS)
def test_parts_composed_equal_forward_bit_for_bit(name):
    model = TinyGPT(VARIANTS[name], seed=0)  # train mode: the GPT-2 variant drops out
    idx, tgt = tokens(3, 16), tokens(3, 16, seed=1)
    torch.manual_seed(5)
    logits, loss = model(idx, tgt)
    torch.manual_seed(5)
    x = model.embed(idx)
    for block in model.blocks:
        x = block(x)
    parts_logits = model.head(x)
    assert torch.equal(parts_logits, logits)
    assert torch.equal(model.loss(parts_logits, tgt), loss)
    torch.manual_seed(5)  # explicit default positions and the local count: the same numbers
    again, loss_again = model(idx, tgt, positions=torch.arange(16), n_tokens=None)
    assert torch.equal(again, logits) and torch.equal(loss_again, loss)


@pytest.mark.parametrize("name", VARIANTS)
def test_second_half_with_prefix_keys_equals_rows_of_the_full_run(name):
    """Context parallelism: queries of positions [s/2, s) against the keys/values of [0, s)."""
    cfg = VARIANTS[name]
    attn = TinyGPT(cfg, seed=0).eval().blocks[0].attn
    b, s, d = 2, 16, cfg.head_dim
    x = torch.randn(b, s, cfg.hidden, generator=torch.Generator().manual_seed(0))
    full = attn(x)                                              # (b, s, h)
    for q_pos in (torch.arange(s // 2, s),                      # the second half
                  torch.cat([torch.arange(0, s // 4), torch.arange(3 * s // 4, s)])):  # load-balanced
        k_pos = torch.arange(s)
        q = attn.wq(x[:, q_pos]).view(b, len(q_pos), -1, d).transpose(1, 2)
        k = attn.wk(x).view(b, s, -1, d).transpose(1, 2)
        v = attn.wv(x).view(b, s, -1, d).transpose(1, 2)
        if attn.rotary:
            q = models.apply_rotary(q, *models.rotary_rows(attn.cos, attn.sin, q_pos, len(q_pos)))
            k = models.apply_rotary(k, *models.rotary_rows(attn.cos, attn.sin, k_pos, s))
        y = models.causal_attention(q, k, v, q_pos, k_pos)      # (b, a, s_q, d)
        part = attn.wo(y.transpose(1, 2).reshape(b, len(q_pos), -1))
        tolerance.assert_matches(part, full[:, q_pos])


def test_rotary_attention_depends_on_relative_positions_only():
    block = TinyGPT(VARIANTS["gqa"], seed=0).blocks[0]
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    tolerance.assert_matches(block(x, torch.arange(5, 13)), block(x))
    assert torch.equal(block(x, torch.arange(8)), block(x))     # explicit 0..s-1 is the default


def test_gpt2_embed_takes_the_position_rows():
    model = TinyGPT(VARIANTS["gpt2"], seed=0).eval()
    idx, pos = tokens(2, 8), torch.arange(8, 16)
    assert torch.equal(model.embed(idx, pos), model.tok_emb(idx) + model.pos_emb.weight[8:16])


def tp_slice(attn, rank, tp):
    """A copy of ``attn`` holding tensor-parallel rank ``rank``'s heads: W_q, W_k, W_v rows and
    W_o columns. KV heads fewer than tp are replicated (rank r uses KV head r * kv // tp)."""
    import copy

    d, a, kv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    q_rows = slice(rank * a // tp * d, (rank + 1) * a // tp * d)
    kv_head = rank * kv // tp
    kv_rows = slice(kv_head * d, (kv_head + max(1, kv // tp)) * d)
    part = copy.deepcopy(attn)
    with torch.no_grad():
        for name, rows in (("wq", q_rows), ("wk", kv_rows), ("wv", kv_rows)):
            old = getattr(attn, name)
            new = torch.nn.Linear(old.in_features, rows.stop - rows.start, bias=old.bias is not None)
            new.weight.copy_(old.weight[rows])
            if old.bias is not None:
                new.bias.copy_(old.bias[rows])
            setattr(part, name, new)
        wo = torch.nn.Linear(a // tp * d, attn.wo.out_features, bias=attn.wo.bias is not None)
        wo.weight.copy_(attn.wo.weight[:, q_rows])
        if wo.bias is not None:  # a row-parallel layer adds its bias once, after the sum
            wo.bias.copy_(attn.wo.bias if rank == 0 else torch.zeros_like(attn.wo.bias))
        part.wo = wo
    return part


@pytest.mark.parametrize("name,tp", [("llama", 2), ("llama", 4), ("gqa", 2), ("gqa", 4), ("mqa", 2), ("gpt2", 4)])
def test_head_slices_sum_to_the_full_attention(name, tp):
    attn = TinyGPT(VARIANTS[name], seed=0).eval().blocks[0].attn
    x = torch.randn(2, 12, attn.wq.in_features, generator=torch.Generator().manual_seed(0))
    parts = [tp_slice(attn, r, tp) for r in range(tp)]
    assert parts[0].n_heads == attn.n_heads // tp and parts[0].n_kv_heads == max(1, attn.n_kv_heads // tp)
    tolerance.assert_matches(sum(p(x) for p in parts), attn(x))


def test_loss_over_shards_with_the_global_count_adds_up_to_the_mean():
    model = TinyGPT(VARIANTS["llama"], seed=0)
    idx, tgt = tokens(4, 16), tokens(4, 16, seed=1)
    tgt[1, 3:7] = -100  # ignored, as torch's cross_entropy does
    logits, mean = model(idx, tgt)
    n = int((tgt != -100).sum())
    for cut in ((lambda t: t.chunk(2, 0)),                  # data parallel: rows
                (lambda t: t.chunk(4, 1)),                  # context parallel: sequence chunks
                (lambda t: [t[:, :5], t[:, 5:]])):         # uneven shards
        total = sum(model.loss(lg, tg, n_tokens=n) for lg, tg in zip(cut(logits), cut(tgt)))
        tolerance.assert_matches(total, mean)
    tolerance.assert_matches(model.loss(logits, tgt, n_tokens=torch.tensor(n)), mean)
    assert torch.equal(model.loss(logits, tgt), torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten()))


def test_bad_inputs_raise_value_errors_naming_the_constraint():
    model = TinyGPT(VARIANTS["llama"], seed=0)
    idx = tokens(2, 8)
    with pytest.raises(ValueError, match=r"shape \(s,\) = \(8,\)"):
        model(idx, positions=torch.arange(7))
    with pytest.raises(ValueError, match="int64"):
        model(idx, positions=torch.arange(8.0))
    with pytest.raises(ValueError, match=r"\[0, seq_len=16\)"):
        model(idx, positions=torch.arange(10, 18))
    with pytest.raises(ValueError, match="n_tokens"):
        model(idx, idx, n_tokens=0)
    with pytest.raises(ValueError, match="n_tokens"):
        model(idx, idx, n_tokens=torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="targets"):
        model(idx, idx[:, :-1])
    q, k = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        models.attention_scores(q, k)
    with pytest.raises(ValueError, match="needs a key at or before"):
        models.causal_attention(k, k, k, torch.arange(4), torch.arange(2, 6))
