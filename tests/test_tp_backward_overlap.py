"""Megatron-LM 2022's tensor-parallel backward overlap ("tp_backward_overlap",
course_lib.virtual.software; course_lib.parallel.tp_backward_overlap): dX's all-reduce under dW's
GEMM without SP. The same values to the bit as the plain layers, the same collectives, a step
the clock prices faster by at most the all-reduces it can hide; the dry run with it is the real
launch."""
import torch

from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run

SPEC = gpt_spec("GPT test", 2, 48, 6, V=96, s=24)
HW = "a100-80gb"
# (block, fusions, recompute) -> all-reduces a step overlaps: one per region with ONE column
# layer (GPT-2's MLP W_1, the fused QKV GEMM; 2 layers) and the LM head's; unfused W_q, W_k, W_v
# and Llama's W_1, W_3 leave the sum of their dX to f
CASES = {("gpt2", ("fused_qkv",), "none"): 2 * 2 + 1, ("llama", (), "selective"): 1,
         ("gpt2", (), "full"): 2 + 1, ("gpt2", ("fused_qkv", "bias_dropout_add"), "selective"): 2 * 2 + 1}


def _rank(cases, x):
    """Each case's loss and gradients on this rank, TP without SP, plain and overlapped: equal to
    the bit? The tp collectives each issued (op, name, bytes), sorted: the same? And how many
    all-reduces were launched async (the overlap's) in each run."""
    import torch.distributed as dist
    from course_lib.gpt import GPTConfig, TinyGPT
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.tp_plan import parallelize, sync_tensor_parallel_grads
    from course_lib.virtual.software import install, overlap_tp_backward
    out = []
    for block, fusions, policy in cases:
        cfg = GPTConfig(vocab_size=96, seq_len=24, n_layers=2, hidden=48, n_heads=6, ffn_hidden=192, block=block,
                        recompute=policy)
        runs, calls, launched = [], [], []
        for overlap in (False, True):
            model = TinyGPT(cfg, seed=0).double()
            install(model, fusions)
            mesh = Mesh(tp=dist.get_world_size())
            parallelize(model, mesh, sequence_parallel=False)
            assert overlap_tp_backward(model, overlap) >= 2 * 2 + 1      # W_q (W_k, W_v), W_1 (W_3), LM head
            comm = mesh.comm("tp")
            comm.log.clear()
            plain, n_async = comm.all_reduce, []

            def counting(tensor, *a, async_op=False, **kw):
                n_async.append(async_op)
                return plain(tensor, *a, async_op=async_op, **kw)
            comm.all_reduce = counting
            loss = model(x, x)[1]
            loss.backward()
            del comm.all_reduce
            sync_tensor_parallel_grads(model)
            runs.append([loss.detach()] + [p.grad for p in model.parameters()])
            calls.append(sorted((c.op, c.name, c.payload) for c in comm.log))
            launched.append(sum(n_async))
        out.append((all(torch.equal(a, b) for a, b in zip(*runs)), calls[0] == calls[1], tuple(launched)))
    return out


def test_the_overlap_computes_the_plain_layers_values_to_the_bit():
    """tp 2 and 3 (even and odd), GPT-2 and Llama blocks, the three projections or one fused QKV
    GEMM, every recompute policy, no SP: the same loss and gradients in float64, the same
    collectives; the overlapped run launches one async all-reduce per region with one column
    layer (and the LM head's), the plain run none."""
    x = torch.randint(0, 96, (2, 24))
    for world in (2, 3):
        for rank, res in enumerate(launch(_rank, world, list(CASES), x)):
            report = (world, rank, dict(zip(CASES, res)))
            assert all(same for same, _, _ in res), report
            assert all(calls for _, calls, _ in res), report
            assert [n for _, _, n in res] == [(0, k) for k in CASES.values()], report


def _real_rank(cfg, layout, fusions):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    return train_step(cfg, layout, Mesh.from_layout(layout), fusions=fusions)


def test_the_clock_prices_the_overlap_and_the_dry_run_is_the_real_launch():
    """tp 2 x pp 2, no SP, 8 micro-batches, Megatron-LM 2022's software: with the overlap the
    dry run (async all-reduces and their waits taped and replayed) is the real 4-rank launch
    (step time, kernels) and runs the same kernels as without it. At a shape where the GPU, not
    the host, bounds the step (hidden 4096, s = 2048: dry runs only) it is faster by at most the
    backward all-reduces of f (what the overlap can hide). (At the tiny shape it saves more: the
    clock's host waits for its stream at a blocking collective, ``RankClock._host_reads``, and
    then issues every later kernel of the backward behind the GPU; an async one it does not.)"""
    from course_lib.virtual.dry_run import model_config
    layout = Layout(tp=2, pp=2, micro_batch=2, global_batch=16, recompute="selective")
    plain = ("scale_mask_softmax", "bias_dropout_add", "fused_qkv")
    fused = plain + ("tp_backward_overlap",)
    real = launch(_real_rank, 4, model_config(SPEC, layout), layout, fused, clock=VirtualCluster(HW))
    r = dry_run(SPEC, HW, layout, fusions=fused, progress=None)
    assert r.kernels == real[0]["kernels"] + real[2]["kernels"]
    assert r.step_time == max(run["t"] for run in real), (r.step_time, real)
    assert r.replayed > 0                       # backwards with async collectives replayed too
    assert r.kernels == dry_run(SPEC, HW, layout, fusions=plain, progress=None).kernels
    wide = gpt_spec("GPT wide", 2, 4096, 32, V=16384, s=2048)
    before, after = (dry_run(wide, HW, layout, fusions=f, progress=None) for f in (plain, fused))
    assert after.kernels == before.kernels
    hidden = sum(s.duration for s in before.spans if s.dim == "tp" and s.name == "f: all-reduce (backward)")
    assert 0 < before.step_time - after.step_time <= hidden, (before.step_time, after.step_time, hidden)


def _second_reader_rank():
    """The region's one column layer overlaps its dX's all-reduce, and another op also reads the
    region's input: the region's gradient must be both readers' sum, all-reduced (f's own). A
    Linear (its dX a view: the all-reduce into a copy, as f's) and the fused QKV GEMM (a fresh
    dX: summed in place, autograd handed nothing), each with and without the second reader."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from course_lib.collectives.comm import Comm
    from course_lib.parallel.comm_ops import copy_to_parallel
    from course_lib.parallel.tp_backward_overlap import LinearAllReducingInput, enter_tensor_parallel
    from course_lib.virtual.fused_qkv import FusedQKV
    comm = Comm(dist.group.WORLD)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
    ws = [torch.randn(4, 8, generator=g, dtype=torch.float64) + comm.rank for _ in range(3)]  # my rows
    bs = [torch.randn(4, generator=g, dtype=torch.float64) for _ in range(3)]

    def linear(full, ws, bs, region):
        return [LinearAllReducingInput.apply(full, ws[0], bs[0], region) if region else F.linear(full, ws[0], bs[0])]

    def fused(full, ws, bs, region):
        return FusedQKV.apply(full, None, None, *ws, *bs, False, region)
    same = []
    for layer in (linear, fused):
        for second in (False, True):
            grads = []
            for overlap in (False, True):
                x = x0.clone().requires_grad_()
                w, b = [t.clone().requires_grad_() for t in ws], [t.clone().requires_grad_() for t in bs]
                full = enter_tensor_parallel(x, comm) if overlap else copy_to_parallel(x, comm, in_place=True)
                ys = layer(full, w, b, full.replicated_region if overlap else None)
                loss = sum(y.square().sum() for y in ys) + (3.0 * full.sum() if second else 0.0)  # the second reader
                loss.backward()
                grads.append([x.grad] + [t.grad for t in w + b])
            pairs = [(a, c) for a, c in zip(*grads) if a is not None or c is not None]
            same.append(all(a is not None and c is not None and torch.equal(a, c) for a, c in pairs))
    return same


def test_the_overlap_leaves_a_region_with_another_reader_to_its_own_all_reduce():
    res = launch(_second_reader_rank, 2)
    assert all(all(r) for r in res), res


def test_the_full_recompute_column_runs_table5s_layouts_without_sp_and_the_tp_overlap():
    """Korthikanti et al. 2022 Table 5's "Full Recompute" column: the T5 rows' layouts with full
    recomputation and no SP, the same software with the TP overlap in place of the SP one."""
    from course_lib.lab.dry_runs import DROPOUT, FULL_RECOMPUTE, ORDER, PRECISION, SOFTWARE, published_runs
    runs = [run for run in published_runs() if run[0] in ("Korthikanti 2022 T5", FULL_RECOMPUTE)]
    t5 = {run[2].name: run for run in runs if run[0] == "Korthikanti 2022 T5"}
    full = {run[2].name: run for run in runs if run[0] == FULL_RECOMPUTE}
    assert set(t5) == set(full) and len(full) == 4
    assert {name: run[5] for name, run in full.items()} == {"GPT 22B": 1.42, "GPT 175B": 18.13, "GPT 530B": 49.05,
                                                            "GPT 1T": 94.42}
    for name, run in full.items():
        assert run[4] == t5[name][4].with_(sp=False, recompute="full"), name
    assert "sp_backward_overlap" in SOFTWARE["Korthikanti 2022 T5"]
    assert set(SOFTWARE[FULL_RECOMPUTE]) == set(SOFTWARE["Korthikanti 2022 T5"]) - {"sp_backward_overlap"}
    assert "tp_backward_overlap" in SOFTWARE[FULL_RECOMPUTE]
    assert all("tp_backward_overlap" not in sw for source, sw in SOFTWARE.items() if not source.startswith("Korth"))
    assert all(d[FULL_RECOMPUTE] == d["Korthikanti 2022 T5"] for d in (DROPOUT, ORDER, PRECISION))
