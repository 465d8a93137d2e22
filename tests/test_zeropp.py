"""ZeRO++ (course_lib/parallel/zeropp.py, FSDP's ``zeropp=``) against one device and its bounds.

One launch of 4 ranks, nodes of G = 2 (2 nodes):

- block quantization: |x - deq(q(x))| <= max|x_block| / 254 per element (derived in zeropp's
  docstring: half a step of scale = max / 127), on random and adversarial blocks (one outlier
  in a block of tiny values, all zeros, a partial last block, +-127 steps exactly);
- qwZ's all-gather and qgZ's hierarchical reduce-scatter, float64, within the bounds derived
  from those (``reduce_scatter_bound``: level 1 per slab, level 2 per node's partial sum);
- every subset of (hpz, qwz, qgz) trains the course's MLP (tied, frozen and unused layers)
  STEPS AdamW steps in float64. hpZ alone is the same arithmetic (reshard_after_forward=G): the
  float64 bound of one device. With qwZ / qgZ the bound used is AdamW's own: each step moves a
  parameter by at most lr * B_t (B_t = ``tolerance.adam_ratio_bound``) whatever the gradient,
  so two runs differ by at most sum_t 2 lr B_t (weight decay only shrinks a difference): loose
  but derived; the tight claims are the collectives' bounds above. qgZ alone leaves the forward
  exact: its first loss equals full precision's (float64 bound);
- bytes per rank, counted from Comm's log (payload: the all-gather's output, the reduce-
  scatter's / all-to-all's input) over the units regathered in backward (the root stays
  gathered, torch's default), next to the paper's formulas. ZeRO-3: forward all-gather M,
  backward all-gather M, reduce-scatter M: 3M across nodes. Paper (fp16 weights and gradients,
  int8 weights, int4 gradients): 0.5M + 0 + 0.25M = 0.75M, 4x less. Here the master weights
  and gradients are fp32 and qgZ sends int8: int8 / fp32 = 1/4 for both, so 0.25M + 0 + 0.25M
  (+ one fp32 scale per 256 values) = 0.5M: about 6x less, checked; the paper's 4x follows
  from its dtypes (fp16 weights: 1/2 for qwZ), not from ours;
- hpZ's memory: the secondary shards held between forward and backward, N S / G values per
  unit (vs S for the primary shard), measured.
"""
import itertools

import pytest
import torch

from course_lib import launch, reference, tolerance
from course_lib.gpt import GPTConfig
from course_lib.lab.nd_runs import LR as GPT_LR
from course_lib.models import MLP
from course_lib.parallel.compose import check_layout
from course_lib.parallel.zeropp import (BLOCK, ZEROPP, dequantize, hpz_groups, quantization_bound, quantize,
                                        reduce_scatter_bound)
from single_device import AWKWARD, LR, SIZES, STEPS, assert_trained_like, exact, make_data, train

G, WORLD = 2, 4
CFG = GPTConfig(vocab_size=64, seq_len=8, n_layers=2, hidden=16, n_heads=2, n_kv_heads=1)
GPT_STEPS = 3
BYTES_SIZES = (64, 256, 64, 256)   # shards of ~4k values: block padding ~5%, not the story
SUBSETS = [s for k in range(4) for s in itertools.combinations(ZEROPP, k)]


def adversarial(n, seed):
    """Random values with awkward blocks: an outlier among tiny values, zeros, exact steps."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x[:BLOCK] *= 1e-6
    x[7] = 3e3                                  # one outlier: the rest of its block rounds to 0
    x[BLOCK:2 * BLOCK] = 0                      # all zeros: scale 0, sent exactly
    x[2 * BLOCK:2 * BLOCK + 255] = torch.arange(-127, 128, dtype=torch.float64)   # exact steps
    return x


def collectives(rank):
    """qwZ's all-gather and qgZ's reduce-scatter on float64 data every rank can rebuild."""
    from course_lib.collectives.comm import Comm
    from course_lib.parallel.zeropp import node_comms, quantized_all_gather, quantized_reduce_scatter

    comm = Comm(None, dim="dp")
    C = 3 * BLOCK + 17                                   # a partial last block
    data = [adversarial(WORLD * C, seed=r).view(WORLD, C) for r in range(WORLD)]
    data[1][2] *= 1e4                                    # one rank's row dominates
    out = torch.empty(C, dtype=torch.float64)
    quantized_reduce_scatter(*node_comms(comm, G), out, data[rank])
    exact_sum = sum(d[rank] for d in data)
    shard = data[rank][0]
    gathered = torch.empty(WORLD * C, dtype=torch.float64)
    quantized_all_gather(comm, gathered, shard)
    return dict(rs=(out - exact_sum).abs(), rs_bound=reduce_scatter_bound(data, G, rank),
                ag=(gathered - torch.cat([d[0] for d in data])).abs(),
                ag_bound=torch.cat([quantization_bound(d[0]) for d in data]))


def zeropp_mlp(zeropp, rank, dtype=torch.float64, steps=None, sizes=None):
    """STEPS AdamW steps of FSDP(zeropp=...) on this rank's rows: losses, the full state, one
    step's collectives per group, hpZ's held bytes after a forward."""
    from course_lib.parallel.fsdp import FSDP

    model = MLP(sizes or SIZES, seed=rank, **({} if sizes else AWKWARD)).to(dtype)   # rank 0's broadcast
    net = FSDP(model, zeropp=zeropp, gpus_per_node=G)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    X, Y, perms = make_data() if sizes is None else reference.mlp_data(0, 24, 1, sizes)
    X, Y = X.to(dtype), Y.to(dtype)
    comms = {c.dim: c for c in (net.comm, net.reshard_group, *(net.qgz or ())) if c is not None}
    out = {"losses": []}
    for step, (x, y) in enumerate(reference.shuffled(X, Y, perms)[:steps]):
        for c in comms.values():
            c.reset()
        loss = reference.mse_loss(net, x.chunk(WORLD)[rank], y.chunk(WORLD)[rank])
        if step == 0:
            out["secondary"] = sum(u.post.numel() * u.post.element_size() for u in net.units if u.post is not None)
            out["kept"] = [(u.post, u.flat_shard.detach().clone()) for u in net.units if u.post is not None]
            out["hpz_group"] = net.reshard_group.ranks if net.reshard_group is not None else None
        loss.backward()
        net.finish_gradient_synchronization()
        out["losses"].append(loss.item())
        if step == 0:
            out["log"] = {d: [(op, name, p) for op, name, p, _ in c.log] for d, c in comms.items()}
            out["units"] = [(u.name, u.numel, u.grad_numel, len(u.trainable_slots)) for u in net.units]
        opt.step()
        opt.zero_grad()
    out["state"] = net.full_state_dict()
    return out


def zeropp_gpt(zeropp):
    """parallelize_nd(data="fsdp", zeropp=...) on Mesh(dp=4), TinyGPT in float64: losses, params."""
    from course_lib.gpt import TinyGPT
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    net = parallelize_nd(TinyGPT(CFG, seed=0).double(), Mesh(dp=WORLD), data="fsdp", zeropp=zeropp,
                         gpus_per_node=G)
    opt = torch.optim.AdamW(net.parameters(), lr=GPT_LR, weight_decay=0.1)
    losses = []
    for x, y in reference.gpt_batches(CFG, batch=8, steps=GPT_STEPS):
        losses.append(net.step(x, y))
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, params={n: t for n, (t, _) in net.shards().items()})


def rank_checks():
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {"collectives": collectives(rank)}
    with exact():
        for subset in SUBSETS:
            out[subset] = zeropp_mlp(subset, rank)
        out["gpt"] = {z: zeropp_gpt(z) for z in ((), ZEROPP)}
    for subset in ((), ZEROPP):            # bytes in the master dtype the paper's count assumes
        out["fp32", subset] = zeropp_mlp(subset, rank, torch.float32, steps=1, sizes=BYTES_SIZES)
    return out


@pytest.fixture(scope="module")
def runs():
    return launch(rank_checks, WORLD, threads=1, timeout=180)


@pytest.fixture(scope="module")
def reference_state():
    with exact():
        X, Y, perms = make_data()
        return train(MLP(SIZES, seed=0, **AWKWARD), X, Y, perms)


def test_quantization_bound_random_and_adversarial():
    for x in (torch.randn(1000) * 5, adversarial(3 * BLOCK + 5, 1), adversarial(4 * BLOCK, 2).float(),
              torch.zeros(10), torch.tensor([1e-30, -1e-30, 2e-30])):
        q, s = quantize(x)
        err = (dequantize(q, s, x.numel(), x.dtype) - x).abs()
        assert q.dtype == torch.int8 and q.numel() == s.numel() * BLOCK
        assert (err <= quantization_bound(x)).all(), float((err - quantization_bound(x)).max())
    steps = adversarial(4 * BLOCK, 3)[2 * BLOCK:3 * BLOCK - 1]   # integer steps of scale 1: no error
    assert torch.equal(dequantize(*quantize(steps), BLOCK - 1, steps.dtype), steps)


def test_collectives_within_derived_bounds(runs):
    for r in runs:
        c = r["collectives"]
        assert (c["ag"] <= c["ag_bound"]).all() and c["ag"].max() > 0
        assert (c["rs"] <= c["rs_bound"]).all(), float((c["rs"] - c["rs_bound"]).max())
        assert c["rs"].max() > 0   # quantized: not exact


def test_plain_and_hpz_equal_one_device(runs, reference_state):
    for subset in ((), ("hpz",)):
        assert_trained_like(runs[0][subset]["state"], reference_state, what=f"zeropp={subset}")
    for r in runs:   # hpZ: the same arithmetic as ZeRO-3, bit for bit
        assert r[("hpz",)]["losses"] == r[()]["losses"]


def test_quantized_subsets_within_adamw_bound(runs, reference_state):
    bound = sum(2 * LR * tolerance.adam_ratio_bound(t) for t in range(1, STEPS + 1))
    for subset in SUBSETS:
        state = runs[0][subset]["state"]
        diff = max(float((state[k] - reference_state[k]).abs().max()) for k in reference_state)
        assert diff <= bound, (subset, diff, bound)
        if {"qwz", "qgz"} & set(subset):
            assert diff > 0, subset   # quantization really ran
    for r in runs:   # qgZ alone: the forward is exact, so the first loss is full precision's
        tolerance.assert_matches([r[("qgz",)]["losses"][0]], [r[()]["losses"][0]], what="qgz first loss")


def _cross_node(log, regathered):
    """Bytes over the network per step (units regathered in backward): the whole group's calls
    and the across-nodes all-to-all; the in-node group ("dp_reshard2", "dp_node") stays inside."""
    return sum(p for dim, calls in log.items() if dim in ("dp", "dp_across")
               for op, name, p in calls if name.split(" ")[1] in regathered)


def test_bytes_against_the_papers_formulas(runs):
    plain, zpp = runs[0]["fp32", ()], runs[0]["fp32", ZEROPP]
    units = [u for u in plain["units"] if u[0] != "root"]
    names = {u[0] for u in units}
    N, nodes = WORLD, WORLD // G
    M = sum(N * S * 4 for _, S, _, _ in units)               # one fp32 all-gather of the units
    flags = sum(N * T * 4 for *_, T in units)                # "used" flags, exact, tiny
    pad = lambda n: -(-n // BLOCK) * BLOCK                   # noqa: E731
    assert _cross_node(plain["log"], names) == 3 * M + flags   # ZeRO-3's 3M (S_grad = S here)
    qwz = sum(N * (pad(S) + pad(S) // BLOCK * 4) for _, S, _, _ in units)          # int8 + scales
    qgz_across = sum(nodes * (pad(Sg) + pad(Sg) // BLOCK * 4) for _, _, Sg, _ in units)
    assert _cross_node(zpp["log"], names) == qwz + qgz_across + flags
    in_node_a2a = sum(p for op, name, p in zpp["log"]["dp_node"] if name.split(" ")[1] in names)
    assert in_node_a2a == sum(G * (pad(nodes * Sg) + pad(nodes * Sg) // BLOCK * 4) for _, _, Sg, _ in units)
    paper_count = qwz + in_node_a2a       # the paper's: weights 1/4 (int8/fp32), gradients 1/4, hpZ 0
    assert 3 * M / paper_count >= 4       # the 4x claim, with our dtypes: 6x less padding and scales
    assert paper_count <= 0.5 * M * (1 + 4 / BLOCK) + 2 * N * (BLOCK + 4) * len(units)


def test_hpz_secondary_shard_memory(runs):
    for r in runs:
        units = [u for u in r[()]["units"] if u[0] != "root"]
        assert r[("hpz",)]["secondary"] == sum(WORLD * S // G * 8 for _, S, _, _ in units)  # float64
        assert r[()]["secondary"] == 0


def test_hpz_groups_are_what_fsdp_builds(runs):
    """hpz_groups (the graded question's reference): FSDP's secondary group is this rank's node,
    and the 1/G it keeps after forward is the primary shards of the ranks ``holds`` names."""
    primary, secondary, holds = hpz_groups(WORLD, G)
    assert primary == [list(range(WORLD))] and secondary == [[0, 1], [2, 3]]
    for rank, r in enumerate(runs):
        assert r[("hpz",)]["hpz_group"] == secondary[rank // G] and r[()]["hpz_group"] is None
        for unit, (kept, _) in enumerate(r[("hpz",)]["kept"]):
            assert torch.equal(kept, torch.cat([runs[o][("hpz",)]["kept"][unit][1] for o in holds[rank]]))
    assert hpz_groups(6, 2)[2] == [[0, 1, 2], [3, 4, 5]] * 3 and hpz_groups(4, 4)[1] == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="dividing"):
        hpz_groups(6, 4)
    with pytest.raises(ValueError, match="positive int"):
        hpz_groups(0, 2)


def test_tinygpt_through_parallelize_nd(runs):
    """TinyGPT, all of ZeRO++ vs plain FSDP, GPT_STEPS AdamW steps: AdamW's bound (module doc)."""
    bound = sum(2 * GPT_LR * tolerance.adam_ratio_bound(t) for t in range(1, GPT_STEPS + 1))
    plain, zpp = runs[0]["gpt"][()], runs[0]["gpt"][ZEROPP]
    diff = max(float((zpp["params"][k] - plain["params"][k]).abs().max()) for k in plain["params"])
    assert 0 < diff <= bound, (diff, bound)
    assert all(abs(a - b) < 1 for a, b in zip(zpp["losses"], plain["losses"]))   # finite, close


@pytest.mark.parametrize("keywords, rule", [
    (dict(data="fsdp", zeropp=("qwz", "zpz")), "unknown"),
    (dict(data="ddp", zeropp=("qwz",)), "needs data='fsdp'"),
    (dict(data="hsdp", shard_size=2, zeropp=("hpz",)), "needs data='fsdp'"),
    (dict(data="fsdp", zeropp=("hpz",), gpus_per_node=3), "dividing"),
    (dict(data="fsdp", zeropp="qgz", gpus_per_node=0), "dividing"),
])
def test_bad_layouts_refused_before_ranks_start(keywords, rule):
    with pytest.raises(ValueError, match=rule):
        check_layout(CFG, dp=4, **keywords)


def test_planner_knows_zeropp():
    """zeropp_bytes_per_step: no option is ZeRO-3's dp_bytes_per_step; with all three, the bytes
    across nodes (paper's dtypes: fp16 weights and gradients) fall over 4x: qwZ's int8 forward
    all-gather, hpZ's backward all-gather in the node, qgZ's second all-to-all over dp / G ranks
    of P / G values. planner.estimate prices it: fewer dp bytes, less exposed ZeRO time."""
    from course_lib import planner
    from course_lib.layout import Layout
    from course_lib.planner.formulas import (QUANT_BYTES, collective_bytes_per_rank as vol, dp_bytes_per_step,
                                             zeropp_bytes_per_step)

    P, N, G = 1e9, 32, 8
    assert zeropp_bytes_per_step(P, N, (), G) == {"inter": dp_bytes_per_step(P, N, 3), "intra": 0.0}
    every = zeropp_bytes_per_step(P, N, ZEROPP, G)
    assert every["inter"] == vol("all_gather", P * QUANT_BYTES, N) + vol("all_to_all", P * QUANT_BYTES / G, N // G)
    assert every["intra"] == vol("all_gather", 2 * P, G) + vol("all_to_all", P * QUANT_BYTES, G)
    assert dp_bytes_per_step(P, N, 3) / every["inter"] >= 4
    assert zeropp_bytes_per_step(P, 8, ZEROPP, 8)["inter"] == 0     # one node: nothing crosses
    with pytest.raises(ValueError, match="divide"):
        zeropp_bytes_per_step(P, 12, ZEROPP, 8)
    est = {z: planner.estimate("llama3-8b", "h100-sxm", Layout.of(dp=16, global_batch=64, micro_batch=1,
                                                                    data="fsdp", zeropp=z)) for z in ((), ZEROPP)}
    assert est[ZEROPP].comm_bytes["dp"] < est[()].comm_bytes["dp"]
    assert est[ZEROPP].time.get("zero", 0.0) < est[()].time["zero"]
    # hpZ's secondary copy: the 16-bit parameters again, sharded over the node, 2P/G per GPU
    from course_lib.planner.presets import get_model
    dense = get_model("llama3-8b").n_params
    hpz = planner.estimate("llama3-8b", "h100-sxm", Layout.of(dp=16, global_batch=64, micro_batch=1, data="fsdp",
                                                              zeropp=("hpz",)))
    extra = hpz.memory["params"] - est[()].memory["params"]
    assert extra == 2 * dense / 8
