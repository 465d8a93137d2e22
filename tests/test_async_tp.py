"""Async TP (course_lib/parallel/async_tp.py) against plain TP + SP and against one device.

One launch per tp size: a column layer (input="sequence") and a row layer
(output="reduce_scatter") run with and without ``async_tp`` on the same float64 inputs; their
outputs and every gradient must agree within course_lib.tolerance's one-step bound (the
decomposed ring adds the ranks' partial sums in another order than gloo's reduce-scatter).
tp = 2, 3 (odd) and 4. At tp = 2 the same launch also trains the tiny GPT 3 AdamW steps with
``parallelize_nd(..., tp=2, sequence_parallel=True, async_tp=True)``, checked against one
device (losses, first gradients, final parameters). Bad layouts are refused before ranks start.
"""
import math

import pytest
import torch

from course_lib import launch, reference, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.lab.nd_runs import LR, single_device
from course_lib.parallel.compose import assemble_nd, check_layout

CFG = GPTConfig(vocab_size=96, seq_len=16, n_layers=2, hidden=32, n_heads=4, n_kv_heads=2)
STEPS, BATCH = 3, 2
SHAPE = (2, 12, 8)   # (b, s, h): s = 12 splits over tp = 2, 3, 4


def _layers(t):
    """Plain SP and async TP on the same column and row layers: outputs and gradients."""
    import torch.nn as nn

    from course_lib.collectives.comm import Comm
    from course_lib.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    comm = Comm(dim="tp")
    torch.manual_seed(0)                        # the same layers and data on every rank
    fc, proj = nn.Linear(8, 4 * t).double(), nn.Linear(4 * t, 8).double()
    x = torch.randn(SHAPE, dtype=torch.float64)
    g_out = torch.randn(SHAPE, dtype=torch.float64)
    n = SHAPE[1] // t
    out = {}
    for mode in (False, True):
        col = ColumnParallelLinear(fc, comm, input="sequence", async_tp=mode, check=False)
        row = RowParallelLinear(proj, comm, output="reduce_scatter", async_tp=mode, check=False)
        xs = x[:, comm.rank * n:(comm.rank + 1) * n].clone().requires_grad_(True)   # my s/t tokens
        h = col(xs)                                 # (b, s, 4): my features of every token
        y = row(torch.tanh(h))                      # (b, s/t, 8): my tokens, summed over ranks
        y.backward(g_out[:, comm.rank * n:(comm.rank + 1) * n])
        out[mode] = {"h": h.detach(), "y": y.detach(), "dx": xs.grad, "col.w": col.weight.grad,
                     "col.b": col.bias.grad, "row.w": row.weight.grad, "row.b": row.bias.grad}
    result = {"plain": out[False], "async": out[True]}
    if t == 2:
        result["gpt"] = _train_gpt()
    return result


def _train_gpt():
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    net = parallelize_nd(TinyGPT(CFG, seed=0).double(), Mesh(tp=2), sequence_parallel=True, async_tp=True)
    from course_lib.parallel.tensor_parallel import RowParallelLinear
    part = net.stages[0].part
    assert part.tensor_parallel.async_tp
    assert all(m.async_tp for m in part.modules() if isinstance(m, RowParallelLinear))
    from course_lib.parallel.tensor_parallel import ColumnParallelLinear
    regions = [m for m in part.modules()
               if any(isinstance(c, ColumnParallelLinear) and c.input == "entered" for c in m.children())]
    seen = []          # what each region module is handed: the gathered shape, one element of storage
    for m in regions:
        m.register_forward_pre_hook(lambda m, args: seen.append(
            (tuple(args[0].shape), args[0].untyped_storage().nbytes() // args[0].element_size(),
             bool(args[0].isnan().all()))))
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    losses, grads = [], None
    for x, y in reference.gpt_batches(CFG, batch=BATCH, steps=STEPS):
        losses.append(net.step(x, y))
        grads = grads or net.shards(grads=True)
        opt.step()
        opt.zero_grad()
    assert len(regions) == 2 * CFG.n_layers and len(seen) == STEPS * len(regions)
    assert set(seen) == {((BATCH, CFG.seq_len, CFG.hidden), 1, True)}, seen
    return losses, net.shards(), grads


@pytest.mark.parametrize("t", [2, 3, 4])
def test_async_tp_equals_plain_sequence_parallel(t):
    ranks = launch(_layers, t, t, threads=1)
    for r, res in enumerate(ranks):
        plain, fast = res["plain"], res["async"]
        assert set(fast) == set(plain)
        # forward: the column output is the same matmul row by row; the row output sums in ring order
        tolerance.assert_matches(fast, plain, what=f"rank {r}: async TP vs plain SP at tp={t}")
        assert not torch.equal(fast["y"], torch.zeros_like(fast["y"]))
    if t == 2:
        shape = check_layout(CFG, tp=2, sequence_parallel=True, async_tp=True, batch=BATCH)
        ref = single_device(CFG, BATCH, STEPS, groups=1, dtype=torch.float64)
        gpt = [res["gpt"] for res in ranks]
        for losses, _, _ in gpt:
            tolerance.assert_matches(losses, ref.losses, optimizer="adamw", steps=STEPS, lr=LR, what="losses")
        tolerance.assert_matches(assemble_nd([g for _, _, g in gpt], shape), ref.grads,
                                 what="the first step's gradients")
        tolerance.assert_matches(assemble_nd([s for _, s, _ in gpt], shape), ref.state,
                                 optimizer="adamw", steps=STEPS, lr=LR)


@pytest.mark.parametrize("kw", [dict(tp=2, sequence_parallel=False, async_tp=True),
                                dict(tp=1, async_tp=True)])
def test_async_tp_needs_sequence_parallelism_and_tp(kw):
    with pytest.raises(ValueError, match="async_tp .*needs sequence_parallel=True and tp > 1"):
        check_layout(CFG, **kw)


# The clock's runs for the planner's formula: H100 with the host's issue hidden (CUDA graphs)
# and NVLink slowed 16 x (~28 GB/s a lane, a PCIe-class link), so that CPU-sized shapes reach
# both regimes: "latency" (a chunk of 16 KiB or less at tp = 2: the hop is NCCL's latency),
# "mixed" (a long row matmul step beside a latency-bound hop), "bandwidth" (1 MiB at tp = 2:
# the hop's bytes take twice its latency).
CLOCK_SHAPES = {"latency": dict(b=1, s=64, h=128, f=512), "mixed": dict(b=1, s=256, h=256, f=8192),
                "bandwidth": dict(b=1, s=1024, h=512, f=1024)}


@pytest.mark.parametrize("t", [2, 4, 8])
def test_async_tp_exposed_time_equals_the_planners_formula(t):
    """The virtual clock's exposed TP time of one MLP layer (layer - the same layer on free
    links) equals the planner's sum over its 4 decomposed ops of (t - 1) max(0, hop - step):
    the planner's hop (its own NCCL point-to-point price) and each op's step compute (measured
    with free links). Bound: float rounding of sums of ~100 terms below 1 ms, 1e-9 relative
    (1e-12 s absolute where nothing is exposed). Plain SP equals its NCCL formula alike."""
    from course_lib.lab.async_tp_runs import exposed_tps
    from course_lib.planner.async_tp import P2P_LL_MAX_BYTES, async_tp_hop
    from course_lib.virtual import VirtualCluster

    hw = VirtualCluster("h100-sxm").hw
    hw = hw.with_(launch_overhead=0.0, nvlink_bandwidth=hw.nvlink_bandwidth / 16)
    cluster = VirtualCluster(hw, 8, torch.bfloat16)
    rows = exposed_tps(t, list(CLOCK_SHAPES.values()), cluster)
    for (name, shape), r in zip(CLOCK_SHAPES.items(), rows):
        f = r["formula"]
        nbytes = shape["b"] * shape["s"] * shape["h"] * 2 / t         # one chunk, bf16
        latency = async_tp_hop(hw, 0.0 if nbytes <= P2P_LL_MAX_BYTES else P2P_LL_MAX_BYTES + 1)
        if t == 2:      # the regimes the shapes are named for
            assert (f["hop"] > 2 * latency) == (name == "bandwidth"), (name, f["hop"], latency)
            assert (max(f["steps"]) > f["hop"]) == (name == "mixed"), (name, f["steps"], f["hop"])
        assert r["async"] > 0
        assert math.isclose(r["async"], f["async"], rel_tol=1e-9, abs_tol=1e-12), (name, t, r["async"], f)
        assert math.isclose(r["plain"], f["plain"], rel_tol=1e-9), (name, t, r["plain"], f["plain"])


def test_planner_prices_async_tp_as_hidden_hops():
    """planner.estimate: async TP's exposed TP time is, per decomposed op, each of its t - 1 hops'
    excess over one step's matmuls (async_tp_exposed; the first hop hides under the rank's own
    chunk); its hop is NCCL's point-to-point price. At Llama 3 70B's shape it hides most of
    plain SP's collectives; with no matmul to hide under it costs t - 1 hops."""
    from course_lib import planner
    from course_lib.layout import Layout
    from course_lib.planner.async_tp import async_tp_exposed, async_tp_hop
    from course_lib.planner.presets import get_hardware

    assert async_tp_exposed(1.0, 0.0, 8) == 7.0                  # latency bound: t - 1 hops, nothing hidden
    assert async_tp_exposed(1.0, 10.0, 8) == 0.0                 # a step longer than a hop hides it
    assert async_tp_exposed(3.0, 2.0, 2) == 1.0                  # the one hop exceeds its step by 1
    hw = get_hardware("h100-sxm")
    assert math.isclose(async_tp_hop(hw, 1 << 20), (8.4 + 3.4) * 1e-6 + (1 << 20) / hw.link(True)[1])
    assert math.isclose(async_tp_hop(hw, 1 << 14), (6.6 + 0.6) * 1e-6 + (1 << 14) / min(hw.link(True)[1] / 4, 87.7e9))
    plain, fast = (planner.estimate("llama3-70b", "h100-sxm", Layout(tp=8, sp=True, async_tp=a, global_batch=8,
                                                                      microbatches=8)) for a in (False, True))
    assert fast.time["tp"] < 0.25 * plain.time["tp"]
    assert fast.step_time < plain.step_time
    assert fast.time["compute"] == plain.time["compute"]         # the same matmuls, only communication hidden
