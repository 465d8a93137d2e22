"""course_lib.virtual.fused_qkv: Megatron-LM's one QKV GEMM computes the course's three
projections to the bit, and the dry run with it is a real launch."""
import torch

from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run

SPEC = gpt_spec("GPT test", 4, 64, 4, V=256, s=32)
HW = "a100-80gb"


def _grads(cfg, fusions, x):
    from course_lib.gpt import TinyGPT
    from course_lib.virtual.software import install
    model = TinyGPT(cfg, seed=0).double()
    assert install(model, fusions) == (cfg.n_layers if fusions else 0)
    loss = model(x, x)[1]
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


def test_fused_qkv_is_the_three_linears_to_the_bit():
    """In float64, whole TinyGPTs (GPT-2 blocks with biases, Llama blocks), grouped-query
    attention (kv 4, 2, 1 of 4 heads), every recompute policy: the same loss and gradients."""
    from course_lib.gpt import GPTConfig
    x = torch.randint(0, 64, (2, 16))
    for block in ("gpt2", "llama"):
        for policy, kv in (("none", 4), ("selective", 2), ("full", 1)):
            cfg = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=4, n_kv_heads=kv,
                            block=block, recompute=policy)
            want, got = _grads(cfg, (), x), _grads(cfg, ("fused_qkv",), x)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (block, policy, kv)


def _tp_rank(cases, x):
    """Each case's step on this rank of a tp cut, three Linears and fused: are this rank's loss
    and gradient slices the same, bit for bit?"""
    import torch.distributed as dist
    from course_lib.gpt import GPTConfig
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.tp_plan import parallelize, sync_tensor_parallel_grads
    same = []
    for block, kv, sp in cases:
        cfg = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=4, n_kv_heads=kv, block=block)
        runs = []
        for fusions in ((), ("fused_qkv",)):
            from course_lib.gpt import TinyGPT
            from course_lib.virtual.software import install
            model = TinyGPT(cfg, seed=0).double()
            install(model, fusions)
            parallelize(model, Mesh(tp=dist.get_world_size()), sequence_parallel=sp)
            loss = model(x, x)[1]
            loss.backward()
            sync_tensor_parallel_grads(model)
            runs.append([loss.detach()] + [p.grad for p in model.parameters()])
        same.append(all(torch.equal(a, b) for a, b in zip(*runs)))
    return same


def test_fused_qkv_under_tensor_parallelism_is_the_column_slices_to_the_bit():
    """tp 4: each rank's slices of W_q, W_k, W_v (a K/V head copied on two ranks with kv 2, on
    four with kv 1: its gradient summed over the copies), with and without sequence
    parallelism (x's s/t tokens kept, x re-gathered in backward): the same loss and gradients."""
    cases = (("gpt2", 4, False), ("llama", 2, True), ("llama", 1, False), ("gpt2", 4, True))
    x = torch.randint(0, 64, (2, 16))
    for rank, same in enumerate(launch(_tp_rank, 4, cases, x)):
        assert all(same), (rank, dict(zip(cases, same)))


def _real_rank(cfg, layout, fusions):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    return train_step(cfg, layout, Mesh.from_layout(layout), fusions=fusions)


def test_fused_qkv_prices_as_a_real_launch_and_as_one_gemm():
    """tp 2 x pp 2, sequence parallel (x's s/t tokens kept, re-gathered in backward), 1F1B
    over 4 micro-batches, Megatron-LM's software:
    the dry run is the real 4-rank launch (step time, kernels, memory); each block's forward
    runs two GEMMs fewer, its backward four fewer, two bias sums fewer and no adds of the dX
    parts; the step is faster."""
    from course_lib.virtual.dry_run import model_config
    layout = Layout(tp=2, pp=2, sp=True, micro_batch=1, global_batch=4, recompute="none")
    fused = ("scale_mask_softmax", "bias_dropout_add", "fused_qkv")
    real = launch(_real_rank, 4, model_config(SPEC, layout), layout, fused, clock=VirtualCluster(HW))
    r = dry_run(SPEC, HW, layout, fusions=fused)
    assert r.kernels == real[0]["kernels"] + real[2]["kernels"]
    assert r.step_time == max(run["t"] for run in real), (r.step_time, real)
    for stage in range(2):
        assert r.memory_by_stage[stage]["states"] == real[stage * 2]["states"]
        assert r.memory_by_stage[stage]["activations"] == real[stage * 2]["activations"]
    three = dry_run(SPEC, HW, layout, fusions=fused[:2])
    # per block: forward 3 GEMMs -> 1; backward 6 GEMMs, 3 bias sums and autograd's 2 adds of
    # the dX parts -> 2 GEMMs and 1 sum; 2 blocks per stage, 2 stages, 4 micro-batches
    assert three.kernels - r.kernels == (2 + 8) * 2 * 2 * layout.microbatches
    assert r.step_time < three.step_time


def test_fused_qkv_is_priced_as_the_combined_gemms():
    """The clock's price of the fused op is the GEMM-by-shape model of x [T, h] against one
    [(h + 2 kv)/t, h] operand; dX and dW likewise."""
    from course_lib.planner.kernel_cost import op_cost
    T, h, q, kv = 64, 32, 16, 8
    x, wq, wk, wv = (torch.empty(s, device="meta") for s in ((2, T // 2, h), (q, h), (kv, h), (kv, h)))
    fwd = torch.ops.course.fused_qkv.default
    out = fwd(x, wq, wk, wv, None, None, None)
    flops, _, cls, detail = op_cost(fwd, (x, wq, wk, wv, None, None, None), {}, out, 2)
    assert (cls, detail, flops) == ("gemm", (T, q + 2 * kv, h, 1), 2 * T * (q + 2 * kv) * h)
    dx = torch.ops.course.fused_qkv_input_grad.default
    args = (*out, wq, wk, wv)
    assert op_cost(dx, args, {}, dx(*args), 2)[3] == (T, h, q + 2 * kv, 1)
    dw = torch.ops.course.fused_qkv_weight_grad.default
    args = (x, *out)
    assert op_cost(dw, args, {}, dw(*args), 2)[3] == (q + 2 * kv, h, T, 1)


def test_fused_qkv_refuses_what_it_does_not_fuse():
    """Async TP's decomposed all-gather matmul computes the projections itself; a projection
    that is not an nn.Linear (or TP's column slice) is not fused; biases all or none."""
    import pytest
    from course_lib.virtual.fused_qkv import fused_qkv
    lin = lambda bias=True: torch.nn.Linear(8, 8, bias=bias)
    x = torch.randn(2, 3, 8)
    x.async_outputs = {}
    with pytest.raises(NotImplementedError, match="async TP"):
        fused_qkv(x, lin(), lin(), lin())
    with pytest.raises(NotImplementedError, match="Identity"):
        fused_qkv(torch.randn(2, 3, 8), lin(), torch.nn.Identity(), lin())
    with pytest.raises(ValueError, match="bias"):
        fused_qkv(torch.randn(2, 3, 8), lin(), lin(False), lin())
