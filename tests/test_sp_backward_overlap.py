"""Megatron-LM 2022's sequence-parallel backward overlap ("sp_backward_overlap",
course_lib.virtual.software; tensor_parallel.column_backward): the same values to the bit as
the plain SP layer, the same collectives, and a step the clock prices faster; the dry run with
it is the real launch."""
import torch

from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run

SPEC = gpt_spec("GPT test", 2, 48, 6, V=96, s=24)
HW = "a100-80gb"


def _rank(cases, x):
    """Each case's loss and gradients on this rank, the SP layers plain and overlapped: equal to
    the bit? And the tp collectives each issued (op, name, bytes), sorted: the same?"""
    import torch.distributed as dist
    from course_lib.gpt import GPTConfig, TinyGPT
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.tp_plan import parallelize, sync_tensor_parallel_grads
    from course_lib.virtual.software import install, overlap_sp_backward
    out = []
    for block, fusions, policy in cases:
        cfg = GPTConfig(vocab_size=96, seq_len=24, n_layers=2, hidden=48, n_heads=6, ffn_hidden=192, block=block,
                        recompute=policy)
        runs, calls = [], []
        for overlap in (False, True):
            model = TinyGPT(cfg, seed=0).double()
            install(model, fusions)
            mesh = Mesh(tp=dist.get_world_size())
            parallelize(model, mesh, sequence_parallel=True)
            assert overlap_sp_backward(model, overlap) >= 2 * 4      # W_q, W_k, W_v, W_1 (W_3) a block
            comm = mesh.comm("tp")
            comm.log.clear()
            loss = model(x, x)[1]
            loss.backward()
            sync_tensor_parallel_grads(model)
            runs.append([loss.detach()] + [p.grad for p in model.parameters()])
            calls.append(sorted((c.op, c.name, c.payload) for c in comm.log))
        out.append((all(torch.equal(a, b) for a, b in zip(*runs)), calls[0] == calls[1]))
    return out


def test_the_overlap_computes_the_plain_layers_values_to_the_bit():
    """tp 2 and 3 (even and odd), GPT-2 and Llama blocks, the three projections or one fused QKV
    GEMM, every recompute policy: the same loss and gradients in float64, the same collectives."""
    cases = (("gpt2", ("fused_qkv",), "none"), ("llama", (), "selective"), ("gpt2", (), "full"),
             ("gpt2", ("fused_qkv", "bias_dropout_add"), "selective"))
    x = torch.randint(0, 96, (2, 24))
    for world in (2, 3):
        for rank, res in enumerate(launch(_rank, world, cases, x)):
            assert all(same for same, _ in res), (world, rank, dict(zip(cases, res)))
            assert all(calls for _, calls in res), (world, rank, dict(zip(cases, res)))


def _real_rank(cfg, layout, fusions):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    return train_step(cfg, layout, Mesh.from_layout(layout), fusions=fusions)


def test_the_clock_prices_the_overlap_and_the_dry_run_is_the_real_launch():
    """tp 2 x pp 2, SP, 8 micro-batches, Megatron-LM 2022's software: with the overlap the dry run
    (its actions replayed, async collectives and their waits taped) is the real 4-rank launch
    (step time, kernels), and faster than without it by at most the backward's re-gathers and
    reduce-scatters (what the overlap can hide)."""
    from course_lib.virtual.dry_run import model_config
    layout = Layout(tp=2, pp=2, sp=True, micro_batch=2, global_batch=16, recompute="selective")
    plain = ("scale_mask_softmax", "bias_dropout_add", "fused_qkv")
    fused = plain + ("sp_backward_overlap",)
    real = launch(_real_rank, 4, model_config(SPEC, layout), layout, fused, clock=VirtualCluster(HW))
    r = dry_run(SPEC, HW, layout, fusions=fused, progress=None)
    assert r.kernels == real[0]["kernels"] + real[2]["kernels"]
    assert r.step_time == max(run["t"] for run in real), (r.step_time, real)
    assert r.replayed > 0                       # backwards with async collectives replayed too
    before = dry_run(SPEC, HW, layout, fusions=plain, progress=None)
    assert r.kernels == before.kernels
    hidden = sum(s.duration for s in before.spans if s.dim == "tp" and s.name in
                 ("SP g: all-gather again (backward)", "SP g: reduce-scatter (backward)"))
    assert 0 < before.step_time - r.step_time <= hidden, (before.step_time, r.step_time, hidden)


def _extra_reader_rank():
    """One column layer reads the SP region (so the overlap reduce-scatters its dX itself), and
    another op also reads the gathered input: the region's gradient must be both readers' sum."""
    import torch.distributed as dist
    from course_lib.collectives.comm import Comm
    from course_lib.parallel.tensor_parallel import LinearKeepingShard, enter_sequence_parallel
    comm = Comm(dist.group.WORLD)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 6 * comm.size, 8, generator=g, dtype=torch.float64)
    w = torch.randn(4, 8, generator=g, dtype=torch.float64)
    grads = []
    for overlap in (False, True):
        x = x0[:, 6 * comm.rank:6 * (comm.rank + 1)].clone().requires_grad_()
        full = enter_sequence_parallel(x, comm)
        y = LinearKeepingShard.apply(full, x, w, None, full.sequence_shard, overlap)
        (y.square().sum() + 3.0 * full.sum()).backward()        # the second reader: not a column layer
        grads.append(x.grad)
    return torch.equal(*grads)


def test_the_overlap_leaves_a_region_with_another_reader_to_its_own_reduce_scatter():
    assert all(launch(_extra_reader_rank, 2))
