"""course_lib.models: shapes, deterministic init, the awkward MLP cases, a tiny overfit."""
import pytest
import torch

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
    torch.testing.assert_close(attn(x), ref, rtol=1e-5, atol=1e-6)


def test_causal():
    model = TinyGPT(seed=0)
    idx = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    torch.testing.assert_close(model(idx)[0][:, :8], model(changed)[0][:, :8])


def test_bad_config_raises():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(hidden=64, n_heads=5)
    with pytest.raises(ValueError, match="n_kv_heads"):
        GPTConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="seq_len"):
        TinyGPT(GPTConfig(seq_len=8))(torch.zeros(1, 9, dtype=torch.long))


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
