"""course_lib/planner/formulas.py: each formula against a count, a paper or a derivation."""
import contextlib
import math

import pytest

from course_lib.planner import formulas as F


LLAMA3_8B = dict(n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, ffn=14336, vocab=128256)


def test_param_count_llama3_published_sizes():
    assert F.param_count(**LLAMA3_8B) == 8_030_261_248          # Meta's model card: 8.03B
    assert F.param_count(n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, ffn=28672,
                         vocab=128256) == 70_553_706_496       # 70.6B
    assert F.param_count(n_layers=126, hidden=16384, n_heads=128, n_kv_heads=8, ffn=53248,
                         vocab=128256) == 405_853_388_800      # 405.9B


def test_param_count_matches_torch_modules():
    """Build the layer out of torch modules and count what torch counts."""
    torch = pytest.importorskip("torch")
    nn = torch.nn
    for mlp, bias, norm, tied, kv in [("swiglu", False, "rmsnorm", False, 2), ("gelu", True, "layernorm", True, 4)]:
        L, h, a, f, V, pos = 3, 32, 4, 48, 101, 16
        hd = h // a

        def norm_mod():
            return nn.LayerNorm(h, bias=True) if norm == "layernorm" else nn.RMSNorm(h)
        layers = []
        for _ in range(L):
            layers += [norm_mod(), nn.Linear(h, h, bias=bias), nn.Linear(h, kv * hd, bias=bias),
                       nn.Linear(h, kv * hd, bias=bias), nn.Linear(h, h, bias=bias), norm_mod()]
            mats = 3 if mlp == "swiglu" else 2
            layers += [nn.Linear(h, f, bias=bias) for _ in range(mats - 1)] + [nn.Linear(f, h, bias=bias)]
        emb = nn.Embedding(V, h)
        head = nn.Linear(h, V, bias=False)
        if tied:
            head.weight = emb.weight
        model = nn.ModuleList(layers + [emb, nn.Embedding(pos, h), norm_mod(), head])
        counted = sum(p.numel() for p in model.parameters())
        assert F.param_count(n_layers=L, hidden=h, n_heads=a, n_kv_heads=kv, ffn=f, vocab=V, mlp=mlp,
                             bias=bias, norm=norm, tied=tied, learned_pos=pos) == counted


@pytest.mark.parametrize("variant", [{}, {"n_kv_heads": 2}, {"block": "gpt2"},
                                     {"block": "gpt2", "tie_embeddings": True}, {"tie_embeddings": True}])
def test_param_count_matches_course_tiny_gpt(variant):
    """Instantiate course_lib.models' tiny GPT and count its parameters."""
    models = pytest.importorskip("course_lib.models")
    cfg = models.GPTConfig(**variant)
    model = models.TinyGPT(cfg)
    counted = sum(p.numel() for p in model.parameters())  # a tied weight counts once
    assert F.param_count(cfg) == counted


def test_flops_per_token_is_narayanan_for_gpt3_shapes():
    L, h, s, V = 96, 12288, 2048, 51200
    cfg = dict(n_layers=L, hidden=h, n_heads=96, vocab=V, mlp="gelu")
    narayanan = 72 * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L)) / s
    assert math.isclose(F.flops_per_token(cfg, s), narayanan, rel_tol=1e-12)
    full = 96 * s * L * h * h * (1 + s / (6 * h) + V / (16 * h * L)) / s
    assert math.isclose(F.flops_per_token(cfg, s, "full"), full, rel_tol=1e-12)
    sel = F.flops_per_token(cfg, s, "selective")
    assert narayanan < sel < full
    # 6 N D over the matmul weights, plus attention's 12 L s h, is the same count
    parts = F.param_breakdown(cfg)
    n_mm = parts["attention"] + parts["mlp"] + parts["lm_head"]
    assert math.isclose(F.training_flops(n_mm, 1) + 12 * L * s * h, narayanan, rel_tol=1e-12)


def test_activation_formulas_korthikanti():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert F.activation_bytes_per_layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert F.activation_bytes_per_layer(s, b, h, a, t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert F.activation_bytes_per_layer(s, b, h, a, t, sp=True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert F.activation_bytes_per_layer(s, b, h, a, t, sp=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    assert F.activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * sbh
    with pytest.raises(ValueError, match="recompute"):
        F.activation_bytes_per_layer(s, b, h, a, recompute="some")


@pytest.mark.parametrize("dp,expected", [
    (1, (120, 120, 120)), (4, (52.5, 41.3, 30)), (16, (35.6, 21.6, 7.5)), (64, (31.4, 16.6, 1.88)),
    (256, (30.4, 15.4, 0.47)), (1024, (30.1, 15.1, 0.12))])
def test_zero_table1(dp, expected):
    """ZeRO paper Table 1 (7.5B, K=12), within 1% or the table's printed rounding."""
    for stage, paper in zip((1, 2, 3), expected):
        ours = F.zero_memory_bytes(7.5e9, stage, dp)["total"] / 1e9
        assert abs(ours - paper) <= max(0.01 * paper, 0.005 + 1e-9), (dp, stage, ours, paper)
    assert F.zero_memory_bytes(7.5e9, 0, dp)["total"] == 120e9


def test_bubble_and_collectives():
    assert F.bubble_fraction(4, 16, "1f1b") == pytest.approx(3 / 19)
    assert F.bubble_fraction(4, 16, "gpipe") == F.bubble_fraction(4, 16, "1f1b")
    assert F.bubble_fraction(4, 16, "interleaved", v=2) == pytest.approx(3 / 35)
    assert F.bubble_fraction(1, 5) == 0
    assert F.collective_bytes_per_rank("all_gather", 100.0, 4) == 75.0      # (N-1)/N n, not (N-1) n
    assert F.collective_bytes_per_rank("all_reduce", 100.0, 4) == 150.0
    assert F.collective_time("all_reduce", 1e6, 4, alpha=1e-5, bandwidth=1e9) == pytest.approx(6e-5 + 1.5e-3)
    assert F.collective_time("all_reduce", 1e6, 1, alpha=1e-5, bandwidth=1e9) == 0.0
    with pytest.raises(ValueError, match="schedule"):
        F.bubble_fraction(4, 8, "zigzag")


def test_in_flight_microbatches_count_the_schedules_every_stage():
    """The planner's activations in flight per stage, against the course's own schedules
    (the action lists its pipeline runs): forwards run minus last backwards, at the peak."""
    from course_lib import schedules as S

    for p in (2, 3, 4, 8):
        for m in sorted({1, 2, p - 1, p, p + 1, 2 * p, 2 * p + 2, 3 * p} - {0}):
            for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("interleaved", 4)):
                if name == "interleaved" and m % max(1, m // p):
                    continue                # not torch's rounds (2p + 2 on p = 4: 10 in 2 rounds of 5 runs)
                counted = [S.in_flight(actions) / v for actions in S.make_schedule(name, p, m, v)]
                formula = [F.in_flight_microbatches(p, m, name, v, stage=i) for i in range(p)]
                assert counted == pytest.approx(formula), (name, p, m, v)
                if name == "interleaved":   # a group N chosen: N = m runs breadth-first
                    for n in (d for d in range(min(p, m), m + 1) if m % d == 0):
                        counted = [S.in_flight(a) / v for a in S.interleaved_1f1b(p, m, v, group=n)]
                        assert counted == pytest.approx(
                            [F.in_flight_microbatches(p, m, name, v, stage=i, group=n) for i in range(p)]), (p, m, v, n)


@pytest.mark.parametrize("s", [32, 64])
def test_activation_formula_matches_bytes_autograd_saves(s):
    """Korthikanti's count against the tiny GPT-2 block (fp32 values, 1-byte dropout masks)."""
    torch = pytest.importorskip("torch")
    models = pytest.importorskip("course_lib.models")
    torch.manual_seed(0)
    cfg = models.GPTConfig(block="gpt2", dropout=0.1, n_layers=1, hidden=64, n_heads=4, seq_len=s)
    block = models.TinyGPT(cfg).train().blocks[0]
    b = 2
    _, rows = models.saved_activations(block, torch.randn(b, s, 64, requires_grad=True))
    counted = sum(r.nbytes for r in rows)
    formula = F.activation_bytes_per_layer(s, b, 64, 4, value_bytes=4)
    # the difference: LayerNorm's mean and 1/std per token
    assert formula <= counted <= formula * 1.01


def _llama_block_rows(s, b, h, a, kv, dtype="bfloat16", ffn=None, checkpointed=False, fused=False):
    """(rows saved by one course_lib.models Llama-style block, its config, bytes per value)."""
    torch = pytest.importorskip("torch")
    models = pytest.importorskip("course_lib.models")
    cfg = models.GPTConfig(n_layers=1, seq_len=s, hidden=h, n_heads=a, n_kv_heads=kv, ffn_hidden=ffn)
    dt = getattr(torch, dtype)
    block = models.TinyGPT(cfg, seed=0).to(dt).train().blocks[0]
    if checkpointed:  # full recomputation: the block runs under activation checkpointing
        inner = block

        class Checkpointed(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.block = inner

            def forward(self, x):
                return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True)
        block = Checkpointed()
    x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(0)).to(dt).requires_grad_()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is as fast, and immune to oversubscribed cores
    from course_lib import fused as fused_kernels
    try:
        with fused_kernels.kernels() if fused else contextlib.nullcontext():
            _, rows = models.saved_activations(block, x * 1.0)
    finally:
        torch.set_num_threads(threads)
    return rows, cfg, x.element_size()


LLAMA_SHAPES = [  # s, b, h, a, kv, dtype, ffn: kv = a, kv = 1, grouped, fp32, an odd f / h
    (32, 2, 64, 4, 4, "bfloat16", None), (64, 2, 64, 4, 1, "bfloat16", None),
    (16, 3, 48, 6, 2, "bfloat16", None), (24, 2, 64, 4, 1, "float32", None),
    (64, 1, 64, 8, 8, "float32", None), (16, 2, 48, 4, 2, "bfloat16", 100)]


@pytest.mark.parametrize("s,b,h,a,kv,dtype,ffn", LLAMA_SHAPES)
def test_llama_activation_formula_matches_bytes_autograd_saves(s, b, h, a, kv, dtype, ffn):
    """Our Llama-style block, byte for byte: every storage autograd keeps (rstd included)."""
    rows, cfg, w = _llama_block_rows(s, b, h, a, kv, dtype, ffn)
    f = cfg.ffn_hidden
    counted = sum(r.nbytes for r in rows)
    formula = F.llama_activation_bytes_per_layer(s, b, h, a, kv, f, value_bytes=w)
    assert counted == formula
    if w == 2:
        assert formula == s * b * h * (16 + 4 * kv / a + 8 * f / h + 2 * a * s / h) + 4 * b * s
    # without the two (b, s, 1) rstd tensors
    assert sum(r.nbytes for r in rows if r.shape[-1] != 1) == \
        F.llama_activation_bytes_per_layer(s, b, h, a, kv, f, value_bytes=w, rstd=False)
    # selective recomputation drops the one storage saved inside the attention core
    # (its inputs Q, K, V stay): the softmax output, (b, a, s, s)
    core = [r for r in rows if r.made_by == "Softmax"]
    assert [r.shape for r in core] == [(b, a, s, s)]
    assert counted - core[0].nbytes == \
        F.llama_activation_bytes_per_layer(s, b, h, a, kv, f, recompute="selective", value_bytes=w)


@pytest.mark.parametrize("s,b,h,a,kv,dtype,ffn", LLAMA_SHAPES)
def test_llama_fused_kernels_formula_matches_bytes_autograd_saves(s, b, h, a, kv, dtype, ffn):
    """The same block with course_lib.fused's RMSNorm and SwiGLU: each norm keeps x and an
    fp32 rstd, SwiGLU its two inputs; the formula with fused_kernels=True, byte for byte."""
    rows, cfg, w = _llama_block_rows(s, b, h, a, kv, dtype, ffn, fused=True)
    f = cfg.ffn_hidden
    counted = sum(r.nbytes for r in rows)
    assert counted == F.llama_activation_bytes_per_layer(s, b, h, a, kv, f, value_bytes=w, fused_kernels=True)
    if w == 2:
        assert counted == s * b * h * (12 + 4 * kv / a + 6 * f / h + 2 * a * s / h) + 8 * b * s
    plain, _, _ = _llama_block_rows(s, b, h, a, kv, dtype, ffn)
    # one f-wide tensor (silu) and, per norm, one h-wide one (x * rstd) fewer
    assert sum(r.nbytes for r in plain) - counted == (s * b * f + 2 * s * b * h) * w + 2 * b * s * (w - 4)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_kernels_give_the_plain_ops_results_and_gradients(dtype):
    torch = pytest.importorskip("torch")
    from course_lib import fused, gpt

    cfg = gpt.GPTConfig(n_layers=2, seq_len=16, hidden=32, n_heads=4, n_kv_heads=2)
    model = gpt.TinyGPT(cfg, seed=0).to(getattr(torch, dtype))
    with torch.no_grad():                    # weights away from 1, so the norm's gradient is not trivial
        for m in model.modules():
            if isinstance(m, gpt.RMSNorm):
                m.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    idx = torch.randint(0, cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for use in (False, True):
        model.zero_grad()
        with fused.kernels() if use else contextlib.nullcontext():
            loss = model(idx, idx)[1]
            loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(results[1][0], results[0][0], **tol)
    for g_fused, g_plain in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(g_fused, g_plain, **tol)
    assert gpt.RMSNorm.forward is not fused.rms_norm      # kernels() put the plain forward back


@pytest.mark.parametrize("s,b,h,a,kv,dtype,ffn", LLAMA_SHAPES[:4])
def test_llama_full_recompute_matches_a_checkpointed_block(s, b, h, a, kv, dtype, ffn):
    rows, cfg, w = _llama_block_rows(s, b, h, a, kv, dtype, ffn, checkpointed=True)
    assert sum(r.nbytes for r in rows) == \
        F.llama_activation_bytes_per_layer(s, b, h, a, kv, cfg.ffn_hidden, recompute="full", value_bytes=w) \
        == s * b * h * w


@pytest.mark.parametrize("a,kv", [(4, 4), (8, 4), (8, 2)])
def test_llama_tensor_parallel_split_of_the_counted_tensors(a, kv):
    """TP keeps the norms' tensors and the column-parallel inputs whole and splits the
    rest (heads, f) t ways; SP splits everything. Checked on the counted rows for every
    t that divides kv (the TP variants are derived, there is no TP block to count)."""
    s, b, h = 32, 2, 64
    rows, cfg, w = _llama_block_rows(s, b, h, a, kv)
    replicated_by = {"attn_norm", "mlp_norm", "attn.wq,attn.wk,attn.wv", "mlp.w1,mlp.w3"}
    replicated = sum(r.nbytes for r in rows if r.saved_by in replicated_by)
    total = sum(r.nbytes for r in rows)
    assert replicated == (12 * s * b * h + 4 * b * s) * w // 2
    for t in (t for t in (1, 2, 4) if kv % t == 0):
        tp = F.llama_activation_bytes_per_layer(s, b, h, a, kv, cfg.ffn_hidden, t=t)
        assert tp == pytest.approx(replicated + (total - replicated) / t, rel=1e-12)
        sp = F.llama_activation_bytes_per_layer(s, b, h, a, kv, cfg.ffn_hidden, t=t, sp=True)
        assert sp == pytest.approx(total / t, rel=1e-12)


def test_llama_activation_formulas_at_llama3_shapes():
    s, b, h, a, kv, f = 8192, 1, 8192, 64, 8, 28672   # Llama 3 70B
    sbh = s * b * h
    none = sbh * (16 + 4 * kv / a + 8 * f / h + 2 * a * s / h) + 4 * b * s
    assert F.llama_activation_bytes_per_layer(s, b, h, a, kv, f) == pytest.approx(none, rel=1e-12)
    for t in (2, 8):   # t <= kv: K and V split like every other head
        tp = sbh * (12 + 4 / t + 4 * kv / (a * t) + 8 * f / (h * t) + 2 * a * s / (h * t)) + 4 * b * s
        assert F.llama_activation_bytes_per_layer(s, b, h, a, kv, f, t) == pytest.approx(tp, rel=1e-12)
        assert F.llama_activation_bytes_per_layer(s, b, h, a, kv, f, t, sp=True) == pytest.approx(none / t, rel=1e-12)
    # t = 16 > kv = 8: each rank keeps a copy of one K/V head, 4 s b h / a instead of 4 s b h kv / (a t)
    t = 16
    sp16 = (sbh * (16 + 8 * f / h + 2 * a * s / h) + 4 * b * s) / t + sbh * 4 / a
    assert F.llama_activation_bytes_per_layer(s, b, h, a, kv, f, t, sp=True) == pytest.approx(sp16, rel=1e-12)
    sel = F.llama_activation_bytes_per_layer(s, b, h, a, kv, f, 8, sp=True, recompute="selective")
    assert sel == pytest.approx((none - 2 * a * s * s * b) / 8, rel=1e-12)
    assert F.llama_activation_bytes_per_layer(s, b, h, a, kv, f, 8, sp=True, recompute="full") == 2 * sbh / 8
    assert F.llama_activation_bytes_per_layer(s, b, h, a, kv, f, cp=4) == pytest.approx(none / 4, rel=1e-12)
    with pytest.raises(ValueError, match="recompute"):
        F.llama_activation_bytes_per_layer(s, b, h, a, kv, f, recompute="some")
    with pytest.raises(ValueError, match="kv_heads"):
        F.llama_activation_bytes_per_layer(s, b, h, a, 3, f)


# ---- GEMM efficiency by shape (course_lib/planner/gemm.py) ------------------------------------

def test_gemm_time_tile_and_wave_quantisation():
    from course_lib.planner import HARDWARE
    from course_lib.planner.gemm import gemm_efficiency, gemm_time
    hw = HARDWARE["a100-80gb"].with_(gemm_tile_overhead=0.0)   # 108 SMs, 128 x 128 tiles
    rate = hw.peak_flops * hw.matmul_efficiency
    # a tile's fixed cost (the preset's K_0, fitted on XLA's H100 table) costs K_0 more steps of K
    k0 = HARDWARE["a100-80gb"].gemm_tile_overhead
    assert k0 > 0 and gemm_time(128 * 108, 128, 4096, hw.with_(gemm_tile_overhead=k0)) == pytest.approx(
        2 * 128 * 128 * (4096 + k0) / (rate / 108))
    tile = 2 * 128 * 128 * 4096 / (rate / 108)       # one tile of depth K = 4096 on one SM
    # 108 tiles: one full wave; 109 tiles: a second wave for one tile
    assert gemm_time(128 * 108, 128, 4096, hw) == pytest.approx(tile)
    assert gemm_time(128 * 109, 128, 4096, hw) == pytest.approx(2 * tile)
    assert gemm_efficiency(128 * 108, 128, 4096, hw) == pytest.approx(hw.matmul_efficiency)
    assert gemm_efficiency(128 * 109, 128, 4096, hw) == pytest.approx(hw.matmul_efficiency * 109 / 216)
    # a partial tile costs a whole one
    assert gemm_time(128 * 108 - 1, 128, 4096, hw) == pytest.approx(tile)
    # the roofline: a GEMM with a short K is bound by HBM (writing its M x N result), not the tiles
    M, N, K = 4096, 4096, 16
    assert gemm_time(M, N, K, hw) == pytest.approx(2 * (M * K + K * N + M * N) / hw.hbm_bandwidth)
    # the flat model (sm_count = 0): every GEMM at matmul_efficiency
    assert gemm_efficiency(100, 7, 3, hw.with_(sm_count=0)) == pytest.approx(hw.matmul_efficiency)
    # large, well-shaped GEMMs come close to the ceiling; small hidden sizes lose to quantisation
    assert gemm_efficiency(2048, 16384, 16384, hw) > 0.66
    assert gemm_efficiency(2048, 2304, 2304, hw) < 0.9 * hw.matmul_efficiency


def test_layer_gemms_flops_match_the_flop_formulas():
    from course_lib.planner import MODELS
    from course_lib.planner.gemm import gemms_flops, head_gemms, layer_gemms
    for key in ("llama3-8b", "gpt3-175b"):
        m = MODELS[key]
        s, b, t = 2048, 2, 4
        tokens = b * s
        for rc in F.RECOMPUTE:
            f, g = layer_gemms(m, s, b, t, recompute=rc, fused_attention=False)
            lf, lb = F.layer_flops_per_token(m, s, rc)
            assert gemms_flops(f) == pytest.approx(lf * tokens / t)
            assert gemms_flops(g) == pytest.approx(lb * tokens / t)
        # fused: the causal half of attention, and FlashAttention's backward recomputes QK^T
        f, g = layer_gemms(m, s, b, t, recompute="none", fused_attention=True)
        lf, lb = F.layer_flops_per_token(m, s, "none", causal=True)
        assert gemms_flops(f) == pytest.approx(lf * tokens / t)
        assert gemms_flops(g) == pytest.approx((lb + s * m.hidden) * tokens / t)   # + QK^T causal: 1 s h
        hf, hb = head_gemms(m, s, b, t)
        assert gemms_flops(hf) + gemms_flops(hb) == pytest.approx(sum(F.head_flops_per_token(m)) * tokens / t)


def test_causal_flops_halve_attention():
    m = dict(n_layers=2, hidden=64, n_heads=4, vocab=10)
    full, causal = F.flops_per_token(m, 512), F.flops_per_token(m, 512, causal=True)
    assert full - causal == 2 * 6 * 512 * 64       # half of 12 L s h


def test_layer_activation_bytes_choose_the_block_and_follow_fused_attention():
    from course_lib.planner import MODELS
    from course_lib.planner.activations import layer_activation_bytes, lse_bytes
    llama, gpt = MODELS["llama3-70b"], MODELS["megatron-175b"]
    s, b, t = 8192, 1, 8
    args = (llama.hidden, llama.n_heads, llama.n_kv_heads, llama.ffn, t, True)
    assert layer_activation_bytes(llama, s, b, t, True, "none", fused_attention=False) == \
        F.llama_activation_bytes_per_layer(s, b, *args, "none")
    assert layer_activation_bytes(llama, s, b, t, True, "none", fused_attention=True) == pytest.approx(
        F.llama_activation_bytes_per_layer(s, b, *args, "selective") + lse_bytes(s, b, llama.n_heads, t))
    assert layer_activation_bytes(gpt, 2048, b, t, True, "none", fused_attention=False) == \
        F.activation_bytes_per_layer(2048, b, gpt.hidden, gpt.n_heads, t, True, "none")
    assert layer_activation_bytes(gpt, 2048, b, t, True, "full") == F.activation_bytes_per_layer(
        2048, b, gpt.hidden, gpt.n_heads, t, True, "full")


def _ring_traffic(s, b, heads, kv_heads, d):
    """One ring-attention forward + backward on this rank: bytes it sent (forward, backward)."""
    import torch

    from course_lib.collectives.comm import Comm, TrafficCounter
    from course_lib.parallel.context_parallel import ring_attention, zigzag_positions
    counter = TrafficCounter()
    comm = Comm(None, counter, dim="cp")
    gen = torch.Generator().manual_seed(comm.rank)
    n = s // comm.size
    q = torch.randn(b, heads, n, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, n, d, generator=gen, requires_grad=True) for _ in range(2))
    y = ring_attention(q, k, v, zigzag_positions(s, comm.size, comm.rank), comm, s)
    fwd = counter.bytes_sent
    y.sum().backward()
    return fwd, counter.bytes_sent - fwd


def test_cp_bytes_per_layer_are_what_the_course_ring_sends():
    from course_lib import launch
    s, b, a, kv, d, N = 48, 2, 4, 2, 8, 3
    sent = launch(_ring_traffic, N, s, b, a, kv, d)
    KV = 2 * s * b * kv * d * 4                              # K and V of the whole sequence, fp32
    for fwd, bwd in sent:
        assert fwd == (N - 1) * KV // N and bwd == (2 * N - 1) * KV // N
        assert fwd + bwd == F.cp_bytes_per_layer(s, b, kv * d, N, dtype_bytes=4)
    assert F.cp_bytes_per_layer(s, b, kv * d, N, 4, "all_gather") == 3 * (N - 1) * KV / N
    with pytest.raises(ValueError, match="algorithm"):
        F.cp_bytes_per_layer(s, b, kv * d, N, algorithm="tree")


def test_zero_rounds_count_the_schedules_own_order():
    """grad_reduce's reductions per chunk and step, counted on the first rank's order: m / N
    rounds interleaved (m = 16 on p = 4: 4), one in 1F1B and ZB-H1, and where a V schedule
    alternates its two chunks a round per micro-batch or so; "chunk" reduces once; "step" and
    ZeRO-1/3 are not chunk by chunk."""
    from course_lib import schedules as S
    from course_lib.layout import Layout

    def rounds(**kw):
        return F.zero_rounds(Layout(dp=4, pp=4, zero=2, global_batch=64, grad_reduce="round", **kw))
    assert rounds(schedule="interleaved", v=2) == (4, 4, 2) and rounds(schedule="interleaved", v=4) == (4, 4, 4)
    assert rounds(schedule="1f1b") == (1, 1, 1) and rounds(schedule="zb-h1") == (1, 1, 1)
    ends = sum(end for end, _ in S.reduce_points(S.make_schedule("zb-v", 4, 16)[0]).values())
    assert rounds(schedule="zb-v") == (ends / 2, ends / 2, 2) and ends > 2 * 4
    assert F.zero_rounds(Layout(dp=4, pp=4, zero=2, schedule="interleaved", v=2, global_batch=64,
                                grad_reduce="chunk")) == (1, 4, 2)
    for kw in (dict(zero=2), dict(zero=1), dict(zero=3)):
        assert F.zero_rounds(Layout(dp=4, pp=4, global_batch=64, **kw)) is None
