"""course_lib.virtual.dry_run: the course's program on the meta device, folded, priced exactly
as a real launch on the virtual clock prices it."""
import pytest

from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.planner.presets import HARDWARE, gpt_spec
from course_lib.virtual import VirtualCluster, dry_run
from memory_parity import assert_same_memory

SPEC = gpt_spec("GPT test", 4, 64, 4, V=256, s=32)     # GeLU, LayerNorm, biases, tied, learned positions
HW = "a100-80gb"


def _real_rank(cfg, layout, fusions=()):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    return train_step(cfg, layout, Mesh.from_layout(layout), fusions=fusions)


def _real(layout, fusions=()):
    from course_lib.virtual.dry_run import model_config
    res = launch(_real_rank, layout.n_gpus, model_config(SPEC, layout), layout, fusions, clock=VirtualCluster(HW))
    return res


def test_dry_run_equals_a_real_launch_and_folds_replicas():
    """dp 2 x tp 2 x pp 2, 1F1B over 6 micro-batches, sequence parallel, selective recompute:
    the dry run (2 ranks running, on meta, the later actions replayed) gives the real 8-rank
    run's step time to the bit."""
    layout = Layout(dp=2, tp=2, pp=2, sp=True, micro_batch=1, global_batch=12, recompute="selective")
    r = dry_run(SPEC, HW, layout)
    assert r.fusions == ("flash_attention",)               # the A100 preset states fused attention
    real = _real(layout, r.fusions)                        # the same program, on 8 real ranks
    real_step = max(r["t"] for r in real)
    assert r.ranks_run == 2 and r.replayed > 0
    assert r.kernels == real[0]["kernels"] + real[2]["kernels"]
    assert r.step_time == real_step, (r.step_time, real_step)     # the same prices in the same order
    # the stages' memory: the real run's states and activations, at the virtual dtype
    for stage in range(2):
        rank = stage * 2                                   # dp = tp = 0 of each stage
        assert_same_memory(r.memory_by_stage[stage], real[rank], rank)
    # folding: dp 1 vs dp 4 of the same per-replica work differ only by DP's collectives
    one = dry_run(SPEC, HW, layout.with_(dp=1, global_batch=6))
    four = dry_run(SPEC, HW, layout.with_(dp=4, global_batch=24))
    dp_spans = [s for s in four.spans if s.dim == "dp"]
    assert dp_spans and not [s for s in one.spans if s.dim == "dp"]
    compute = lambda run: sorted((s.rank, s.name, s.start, s.end) for s in run.spans if s.kind == "compute")
    assert compute(one) == compute(four)                 # every action, to the bit, before the DP sums
    assert four.step_time > one.step_time


def test_bad_layouts_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="tp"):
        dry_run(SPEC, HW, Layout(tp=3, micro_batch=1, global_batch=1))       # 4 heads over 3 ranks
    with pytest.raises(ValueError, match="layers|stages"):
        dry_run(SPEC, HW, Layout(pp=8, micro_batch=1, global_batch=8))       # 4 layers over 8 stages
    with pytest.raises(ValueError, match="unknown model"):
        dry_run("no-such-model", HW, Layout())
    with pytest.raises(ValueError, match="unknown hardware"):
        dry_run(SPEC, "no-such-gpu", Layout())


def test_a_model_too_big_reports_its_peak_and_does_not_fit():
    big = gpt_spec("GPT 15B, 8 layers", 8, 12288, 96, V=51200, s=256)   # 15e9 parameters on one GPU
    r = dry_run(big, HW, Layout(micro_batch=1, global_batch=1))
    assert not r.fits and r.peak_memory > r.hardware.hbm_bytes
    assert r.memory_by_stage[0]["states"] == 16 * big.n_params   # bf16 weights, grads; fp32 master, 2 moments


def test_the_validation_rows_and_random_layouts_are_the_planners():
    """lab.dry_runs runs every published row the planner's validation uses, with the same
    layouts (its runner is benchmarks/dry_run_validation.py, not a timed test), and Liu et al.
    2025's rows with experts, which the planner's validation does not carry."""
    from course_lib.lab.dry_runs import MOE_FOLDING, published_runs, random_layouts
    from course_lib.planner.validation import (MOE_FOLDING_2025, korthikanti_dp8, korthikanti_full_recompute,
                                               published_rows)
    from course_lib.virtual.dry_run import check_dry_run
    rows, planner = published_runs(), published_rows() + korthikanti_full_recompute() + korthikanti_dp8()
    dense = [r for r in rows if r[0] != MOE_FOLDING]
    assert len(dense) == len(planner)
    assert {r[0] for r in dense} == {r["source"] for r in planner}
    assert len(rows) - len(dense) == len(MOE_FOLDING_2025)
    drawn = random_layouts(6, seed=1)
    assert len(drawn) == 6
    for model, hw, layout in drawn:
        check_dry_run(model, layout)                      # every drawn layout passes the ranks' rules


def test_fused_attention_cores_compute_the_courses_attention():
    """The sources' attention kernels (virtual.software) give the course's written-out attention,
    values and gradients, in float64 (one step: reordered sums only), grouped-query included;
    installed in a whole TinyGPT (GPT-2 and Llama blocks, selective recompute) they give the
    same loss and gradients."""
    import torch
    from course_lib import tolerance
    from course_lib.attention import causal_attention
    from course_lib.gpt import GPTConfig, TinyGPT
    from course_lib.virtual.software import flash_attention, install, scale_mask_softmax_attention
    torch.manual_seed(0)
    s = 12
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    for kv in (4, 2, 1):
        qkv = [torch.randn(2, h, s, 8, dtype=torch.float64, requires_grad=True) for h in (4, kv, kv)]
        want = causal_attention(*qkv, future=future)
        g = torch.randn_like(want)
        want_grads = torch.autograd.grad(want, qkv, g)
        for core in (lambda q, k, v: scale_mask_softmax_attention(q, k, v, future), flash_attention):
            got = core(*qkv)
            tolerance.assert_matches([got, *torch.autograd.grad(got, qkv, g)], [want, *want_grads],
                                     dtype=torch.float64, what=f"kv heads {kv}")
    for block, fusion in (("gpt2", "scale_mask_softmax"), ("llama", "flash_attention"),
                          ("llama", "scale_mask_softmax")):
        cfg = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=4, n_kv_heads=2,
                        block=block, recompute="selective")
        x = torch.randint(0, 64, (2, 16))
        results = []
        for fusions in ((), (fusion,)):
            model = TinyGPT(cfg, seed=0).double()
            assert install(model, fusions) == (2 if fusions else 0)
            loss = model(x, x)[1]
            loss.backward()
            results.append([loss.detach()] + [q.grad for q in model.parameters()])
        tolerance.assert_matches(results[1], results[0], dtype=torch.float64, what=f"{block}, {fusion}")


def test_fusions_price_as_a_real_launch_and_cut_the_attention_kernels():
    """tp 2 x pp 2, interleaved (v = 2, 8 micro-batches: forwards replayed before their backward's
    tape repeated) with Megatron-LM's fused scale-mask-softmax: the dry run's step time is the
    real 4-rank launch's (the kernel runs on the CPU there, on meta here: one price); it takes
    fewer kernels and less time than the written-out attention, and FlashAttention fewer still."""
    layout = Layout(tp=2, pp=2, sp=True, schedule="interleaved", v=2, micro_batch=1, global_batch=8,
                    recompute="selective")
    fused = "scale_mask_softmax"
    real = _real(layout, (fused,))
    real_step = max(r["t"] for r in real)
    r = dry_run(SPEC, HW, layout, fusions=fused)
    assert r.fusions == (fused,) and r.replayed > 0
    assert r.kernels == real[0]["kernels"] + real[2]["kernels"]
    assert r.step_time == real_step, (r.step_time, real_step)     # the same prices in the same order
    plain = dry_run(SPEC, HARDWARE[HW].with_(fused_attention=False), layout)    # the written-out core
    flash = dry_run(SPEC, HW, layout, fusions=["flash_attention"])
    assert flash.kernels < r.kernels < plain.kernels
    assert flash.step_time < r.step_time < plain.step_time
    stated = dry_run(SPEC, HW, layout)        # the preset states fused attention: FlashAttention runs
    assert stated.fusions == ("flash_attention",)
    assert (stated.kernels, stated.step_time) == (flash.kernels, flash.step_time)
    with pytest.raises(ValueError, match="unknown fusion"):
        dry_run(SPEC, HW, layout, fusions="fused_everything")
    with pytest.raises(ValueError, match="give one"):
        dry_run(SPEC, HW, layout, fusions=("flash_attention", "scale_mask_softmax"))


def test_bias_dropout_add_computes_the_courses_block_and_prices_as_a_real_launch():
    """Megatron-LM's fused bias + dropout + add (virtual.software) gives the course's block to
    the bit in float64 (the same adds in the same order; GPT-2 and Llama blocks, every recompute
    policy); tp 2 x pp 2 without SP (TP's all-reduces summing in place), with it: the dry run is
    the real 4-rank launch to the bit, and each block's forward runs one kernel less per output
    layer. The bias + GeLU needs no fusion: the column layer's bias is in its GEMM (addmm), so
    the course runs a GEMM and one GeLU kernel, as Megatron's fused path does."""
    import torch
    from course_lib.gpt import GeLUMLP, GPTConfig, TinyGPT
    from course_lib.planner.kernel_cost import kernel_kind
    from course_lib.virtual.software import install
    x = torch.randint(0, 64, (2, 16))
    for block in ("gpt2", "llama"):
        for policy in ("none", "selective", "full"):
            cfg = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=4, n_kv_heads=2,
                            block=block, recompute=policy)
            results = []
            for fusions in ((), ("bias_dropout_add",)):
                model = TinyGPT(cfg, seed=0).double()
                assert install(model, fusions) == (2 if fusions else 0)
                loss = model(x, x)[1]
                loss.backward()
                results.append([loss.detach()] + [p.grad for p in model.parameters()])
            assert all(torch.equal(a, b) for a, b in zip(*results)), (block, policy)
    layout = Layout(tp=2, pp=2, sp=False, micro_batch=1, global_batch=4, recompute="full")
    fused = ("scale_mask_softmax", "bias_dropout_add")
    real = _real(layout, fused)
    r = dry_run(SPEC, HW, layout, fusions=fused)
    assert r.kernels == real[0]["kernels"] + real[2]["kernels"]
    assert r.step_time == max(run["t"] for run in real), (r.step_time, real)
    for stage in range(2):
        assert r.memory_by_stage[stage]["activations"] == real[stage * 2]["activations"]
    unfused = dry_run(SPEC, HW, layout, fusions=fused[:1])
    # per output layer, one kernel less per forward run: 2 layers x 2 blocks per stage x 2 stages,
    # each forward run twice (full recompute), 4 micro-batches
    assert unfused.kernels - r.kernels == 2 * 2 * 2 * 2 * layout.microbatches
    assert r.step_time < unfused.step_time

    class Kernels(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if kernel_kind(func):
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))
    mlp, h = GeLUMLP(GPTConfig(hidden=32, n_heads=4, vocab_size=64, seq_len=16, n_layers=1)), torch.randn(2, 16, 32)
    counted = Kernels()
    counted.ops = []
    with counted:
        torch.nn.functional.gelu(mlp.fc(h))
    assert counted.ops == ["addmm", "gelu"]


def test_dropout_runs_its_masks_and_prices_as_a_real_launch():
    """The sources' dropout (lab.dry_runs.DROPOUT: Megatron-LM's 0.1, hidden and attention) run
    by the model's own Dropout modules: tp 2 x pp 2 with SP and selective recompute, Megatron's
    fused softmax and bias + dropout + add, p = 0.1: the dry run is the real 4-rank launch to
    the bit (step time, kernels, each stage's states and activations), and the dropout costs
    kernels, time and mask bytes over p = 0. Context parallelism refuses dropout before
    anything runs; the one source with a CP row (Llama 3) states none."""
    from course_lib.lab.dry_runs import DROPOUT, SOFTWARE
    layout = Layout(tp=2, pp=2, sp=True, micro_batch=1, global_batch=4, recompute="selective")
    fused = SOFTWARE["Narayanan 2021 T1"]
    real = launch(_real_rank, layout.n_gpus, _config(layout, 0.1), layout, fused, clock=VirtualCluster(HW))
    r = dry_run(SPEC, HW, layout, fusions=fused, dropout=0.1)
    assert r.config.dropout == 0.1
    assert r.kernels == real[0]["kernels"] + real[2]["kernels"]
    assert r.step_time == max(run["t"] for run in real), (r.step_time, real)
    for stage in range(2):
        assert_same_memory(r.memory_by_stage[stage], real[stage * 2], stage)
    none = dry_run(SPEC, HW, layout, fusions=fused)
    assert r.kernels > none.kernels and r.step_time > none.step_time
    assert all(d["activations"] > n["activations"] for d, n in zip(r.memory_by_stage, none.memory_by_stage))
    assert DROPOUT["Llama 3 T4"] == 0.0 and DROPOUT["Narayanan 2021 T1"] == 0.1
    with pytest.raises(ValueError, match="dropout"):
        dry_run(SPEC, HW, Layout(cp=2, micro_batch=1, global_batch=1), dropout=0.1)


def _config(layout, dropout):
    from course_lib.virtual.dry_run import model_config
    return model_config(SPEC, layout, dropout=dropout)


def test_fused_bias_dropout_add_with_dropout_is_the_courses_dropout_with_its_masks():
    """bias_dropout_add at p > 0 (one kernel reading the mask the dropout draws from its own
    stream, as unfused) gives, in float64, what the course's unfused block gives: the same
    masks, loss and gradients to the bit, and the same with the masks replayed; full recompute
    redraws the same masks (equal to no recompute); the mask is a bool, 1 byte per element."""
    import torch
    from course_lib.gpt import GPTConfig, TinyGPT
    from course_lib.parallel.tensor_parallel import TensorParallelDropout
    from course_lib.virtual.software import bias_dropout_add, install
    x = torch.randint(0, 64, (2, 16))

    def run(policy, fused, masks=None):
        cfg = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=4, block="gpt2",
                        dropout=0.25, recompute=policy)
        model = TinyGPT(cfg, seed=0).double()
        drops = {}
        for name, mod in list(model.named_modules()):
            if type(mod).__name__ == "Dropout":
                parent, _, attr = name.rpartition(".")
                new = TensorParallelDropout(mod.p, torch.Generator().manual_seed(len(drops)),
                                            masks=None if masks is None else list(masks[name]))
                new.record = []
                setattr(model.get_submodule(parent) if parent else model, attr, new)
                drops[name] = new
        install(model, ("bias_dropout_add",) if fused else ())
        loss = model(x, x)[1]
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()], {n: d.record for n, d in drops.items()}

    fused, masks = run("none", True)
    assert all(len(m) == 1 and m[0].dtype == torch.bool for m in masks.values())
    assert 0 < sum(int(m[0].sum()) for m in masks.values()) < sum(m[0].numel() for m in masks.values())
    unfused, drawn = run("none", False)
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused))
    assert all(torch.equal(masks[n][0], drawn[n][0]) for n in masks)
    replayed, _ = run("none", True, masks)
    assert all(torch.equal(a, b) for a, b in zip(fused, replayed))
    recomputed, _ = run("full", True)
    assert all(torch.equal(a, b) for a, b in zip(fused, recomputed))
    # the kernel alone: residual + dropout(x + bias), its gradients through the kept mask
    drop = TensorParallelDropout(0.5, torch.Generator().manual_seed(3))
    drop.record = []
    h, res = torch.randn(4, 8, dtype=torch.float64, requires_grad=True), torch.randn(4, 8, dtype=torch.float64)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    out = bias_dropout_add(h, b, res, drop)
    keep = drop.record[0]
    assert torch.equal(out, res + (h + b) * keep * 2.0)
    out.backward(torch.ones_like(out))
    assert torch.equal(h.grad, keep * 2.0) and torch.equal(b.grad, (keep * 2.0).sum(0))


def test_the_hardwares_fused_attention_is_run_as_the_planner_prices_it():
    """A Hardware stating ``fused_attention`` (every preset: the planner's FlashAttention) runs
    the course's FlashAttention core, and ring CP its blocks as that kernel; a source's stated
    kernel wins, packed documents keep the written-out core (Ulysses runs the kernel on
    its gathered sequence put in order); attention dropout,
    which the course's CPU flash kernel does not run, is refused by name before any rank
    starts."""
    from course_lib.virtual.dry_run import hardware_attention
    a100 = HARDWARE[HW]
    plain = Layout(tp=2, micro_batch=1, global_batch=2)
    assert hardware_attention(a100, plain) == ("flash_attention",)
    assert hardware_attention(a100, plain.with_(cp=2)) == ("flash_attention",)            # ring: flash blocks
    assert hardware_attention(a100, plain.with_(cp=2, cp_method="ulysses")) == ("flash_attention",)
    assert hardware_attention(a100, plain.with_(cp=2, cp_method="ulysses", cp_layout="contiguous")) == \
        ("flash_attention",)
    assert hardware_attention(a100, plain.with_(documents=(16, 16))) == ()
    assert hardware_attention(a100, plain, ("scale_mask_softmax",)) == ()
    assert hardware_attention(a100.with_(fused_attention=False), plain) == ()
    with pytest.raises(ValueError, match="fused_attention"):
        dry_run(SPEC, HW, plain, dropout=0.1)
    stated = dry_run(SPEC, HW, plain, dropout=0.1, fusions=("scale_mask_softmax",))   # Megatron's, stated
    assert stated.fusions == ("scale_mask_softmax",)
