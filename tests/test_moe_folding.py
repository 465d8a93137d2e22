"""MoE parallel folding (course_lib/parallel/expert_parallel.py on the folded expert mesh of
course_lib/parallel/mesh.py, applied by parallelize_nd) against one device.

The MoE TinyGPT trains 4 AdamW steps in float64 on layouts where the experts' mesh
(ep x etp) folds over TP, CP, DP and pipeline stages: tp2 x ep2 and cp2 x ep2 on each of 2
stages, dp2 x tp2 with ep4, ep2 x etp2, cp2 x tp2 with etp2, dp2 x cp2 with ep2 (EP inside
DP, experts copied over CP), pp2 x dp2 with etp2 under zb-h1's split backward, the
all-gather dispatch, token dropping (capacity factors 0.5, 0.75, 1), dropless (None), a shared expert with fine-grained experts (8, top-3),
SwiGLU experts (Mixtral's) under ep2 x etp2. The
dispatch payloads logged by the Comm equal planner.formulas.moe_dispatch_payloads. Every
layout: the losses, the first step's gradients and the final weights equal the
single-device run (``MoE(groups=dp * m)``: a routing group is one micro-batch of one DP
rank) within course_lib.tolerance's bounds, and the (token, choice) pairs dropped in the
first forward are exactly the single-device ones. One launch per world size runs every
layout of that size (a Mesh per layout). Bad layouts are refused by check_layout."""
import dataclasses

import pytest
import torch

from course_lib import launch, reference, tolerance
from course_lib.gpt import GPTConfig
from course_lib.lab.nd_runs import LR, single_device
from course_lib.moe import route
from course_lib.parallel.compose import assemble_nd, check_layout
from course_lib.parallel.mesh import MeshShape
from course_lib.planner.formulas import moe_dispatch_payloads

MOE = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=16, n_heads=2, ffn_hidden=16, n_experts=4,
                top_k=2, capacity_factor=None)
STEPS, BATCH = 4, 4
FINE = dataclasses.replace(MOE, n_experts=8, top_k=3, n_shared_experts=1, capacity_factor=0.75)

# name: (config changes, mesh dims, parallelize_nd keywords) -- 4 ranks each
CASES = {
    "pp2-tp2-ep2-shared-fine": (dict(n_experts=8, top_k=3, n_shared_experts=1, capacity_factor=0.75),
                                dict(pp=2, tp=2, ep=2), dict(microbatches=2)),
    "pp2-cp2-ep2-drop": (dict(capacity_factor=0.5), dict(pp=2, cp=2, ep=2), dict(microbatches=2)),
    "dp2-tp2-ep4-gather": (dict(moe_dispatch="all_gather"), dict(dp=2, tp=2, ep=4), {}),
    "dp2-tp2-ep2-etp2-drop": (dict(capacity_factor=0.75), dict(dp=2, tp=2, ep=2, etp=2), {}),
    "dp2-tp2-ep2-etp2-swiglu": (dict(expert_mlp="swiglu", capacity_factor=0.75), dict(dp=2, tp=2, ep=2, etp=2), {}),
    "cp2-tp2-etp2-gather": (dict(moe_dispatch="all_gather", capacity_factor=1.0), dict(cp=2, tp=2, etp=2), {}),
    "dp2-cp2-ep2": (dict(), dict(dp=2, cp=2, ep=2), {}),
    "pp2-dp2-ep2": (dict(), dict(pp=2, dp=2, ep=2), dict(microbatches=2)),
    # zero-bubble's split backward with expert TP (w2's slice used by F.linear, not called)
    "pp2-dp2-etp2-zb-h1": (dict(capacity_factor=0.75), dict(pp=2, dp=2, etp=2),
                           dict(microbatches=2, schedule="zb-h1")),
}


def _dropped_hook(log):
    def hook(module, args, out):
        log.append(module.dropped.tolist())
    return hook


def _train_all(cases):
    """On every rank: each case's losses, first gradients, final shards, first-forward drops."""
    from course_lib.gpt import TinyGPT
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.expert_parallel import ExpertParallelMoE
    from course_lib.parallel.mesh import Mesh

    out = {}
    for name, (cfg, dims, kw) in cases.items():
        mesh = Mesh(**dims)
        net = parallelize_nd(TinyGPT(cfg, seed=0).double(), mesh, **kw)
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
        drops, hooks = [], []
        for st in net.stages.values():
            moe = st.part.blocks[0].mlp.moe
            if st.layers[0] == 0 and isinstance(moe, ExpertParallelMoE):
                hooks.append(moe.register_forward_hook(_dropped_hook(drops)))
        losses, grads, logged = [], None, []
        for step, (x, y) in enumerate(reference.gpt_batches(cfg, batch=BATCH, steps=STEPS)):
            moe = next(st.part.blocks[0].mlp.moe for st in net.stages.values())
            if step == STEPS - 1:          # the last step's first dispatch and combine, counted
                for c in (moe.comm, moe.group_comm):
                    c.reset()
            losses.append(net.step(x, y))
            if step == STEPS - 1:
                comm = moe.group_comm if cfg.moe_dispatch == "all_gather" else moe.comm
                logged = [next(c.payload for c in comm.log if c.name == n) for n in ("dispatch", "combine")]
                logged.append(len(moe.token_index) if moe.token_index is not None else None)
            for h in hooks:
                h.remove()
            hooks = []
            grads = grads or net.shards(grads=True)
            opt.step()
            opt.zero_grad()
        out[name] = (losses, grads, net.shards(), drops, net.mesh.coord, logged)
    return out


def _reference_drops(cfg, groups):
    """The single-device first forward's dropped (token, choice) pairs of layer 0, per group."""
    from course_lib.gpt import TinyGPT

    model = TinyGPT(cfg, seed=0).double()
    found = []
    moe = model.blocks[0].mlp.moe

    def hook(module, args, out):
        for xg in args[0].chunk(groups):
            found.append((~route(module.router(xg), cfg.top_k, cfg.capacity_factor)[2]).nonzero().tolist())
    moe.register_forward_hook(hook)
    for blk in model.blocks:
        blk.mlp.groups = groups
    x, y = next(iter(reference.gpt_batches(cfg, batch=BATCH, steps=1)))
    model(x, y)
    return found


def test_folded_expert_layouts_equal_one_device():
    cases = {name: (dataclasses.replace(MOE, **c), dims, kw) for name, (c, dims, kw) in CASES.items()}
    for cfg, dims, kw in cases.values():
        check_layout(cfg, **dims, batch=BATCH, **kw)
    ranks = launch(_train_all, 4, cases, threads=1, timeout=240)
    for name, (cfg, dims, kw) in cases.items():
        m = kw.get("microbatches", 1)
        groups = dims.get("dp", 1) * m
        ref = single_device(cfg, BATCH, STEPS, groups=groups, dtype=torch.float64)
        shape = MeshShape(**dims)
        for r in ranks:
            tolerance.assert_matches(r[name][0], ref.losses, optimizer="adamw", steps=STEPS, lr=LR,
                                     what=f"{name}: losses")
        grads = assemble_nd([r[name][1] for r in ranks], shape)
        tolerance.assert_matches(grads, ref.grads, what=f"{name}: the first step's gradients")
        full = assemble_nd([r[name][2] for r in ranks], shape)
        assert set(full) == set(ref.state), name
        tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=STEPS, lr=LR, what=name)
        want = _reference_drops(cfg, groups)
        for r in ranks:
            drops, coord = r[name][3], r[name][4]
            if coord["pp"] == 0:        # group of each micro-batch call: dp index * m + call
                assert drops == [want[coord["dp"] * m + i] for i in range(m)], name
        if cfg.capacity_factor is not None and cfg.capacity_factor < 1:
            assert any(want), f"{name}: the capacity drops something"
        _check_dispatch_bytes(name, cfg, dims, kw, [r[name][5] for r in ranks])


def _check_dispatch_bytes(name, cfg, dims, kw, logged):
    """Payloads logged by the Comm = moe_dispatch_payloads (float64: 8 bytes), where exact:
    the all-gather dispatch always; the all-to-all when nothing is dropped (T k rows)."""
    ep, etp = dims.get("ep", 1), dims.get("etp", 1)
    tokens = BATCH // (dims.get("dp", 1) * kw.get("microbatches", 1)) * cfg.seq_len // (dims.get("cp", 1) *
                                                                                      dims.get("tp", 1))
    want = moe_dispatch_payloads(tokens, cfg.hidden, cfg.top_k, ep, etp, cfg.moe_dispatch, dtype_bytes=8)
    for dispatch, combine, seen in logged:
        assert seen in (None, tokens), (name, seen, tokens)
        if cfg.moe_dispatch == "all_gather":
            assert dispatch == want["all_gather"] and combine == want["reduce_scatter"], (name, dispatch, want)
        elif cfg.capacity_factor is None:   # combine: the rows this rank's experts ran (T k in all)
            assert dispatch == want["all_to_all"] // 2, (name, dispatch, want)
    if cfg.moe_dispatch == "all_to_all" and cfg.capacity_factor is None:
        assert sum(c for _, c, _ in logged) == sum(d for d, _, _ in logged), name


def test_planner_prices_the_folded_expert_mesh():
    """planner.estimate on Mixtral: experts held by ep x etp ranks (not TP), EP bytes from
    ep_bytes_per_layer (etp, all-gather dispatch), the all-gather dispatch dearer at top-2, ep 8."""
    from course_lib.layout import Layout
    from course_lib.planner import estimate
    from course_lib.planner.formulas import ep_bytes_per_layer
    from course_lib.planner.presets import MODELS

    mixtral = MODELS["mixtral-8x7b"]
    base = dict(dp=4, tp=2, pp=1, global_batch=8, micro_batch=1, sp=True)
    a2a = estimate(mixtral, "h100-sxm", Layout(**base, ep=8))      # ep folded over dp x tp
    etp = estimate(mixtral, "h100-sxm", Layout(**base, ep=4, etp=2))
    gather = estimate(mixtral.with_(moe_dispatch="all_gather"), "h100-sxm", Layout(**base, ep=8))
    s, h = mixtral.seq_len, mixtral.hidden
    per_layer = ep_bytes_per_layer(s, 1, h, 8, 2) / 2                  # tokens of one TP rank (SP)
    assert a2a.comm_bytes["ep"] == pytest.approx(2 * 32 * per_layer)   # 2 micro-batches x 32 layers
    assert gather.comm_bytes["ep"] == pytest.approx(2 * 32 * ep_bytes_per_layer(s, 1, h, 8, 2,
                                                                               dispatch="all_gather") / 2)
    assert gather.comm_bytes["ep"] == pytest.approx(a2a.comm_bytes["ep"] * 8 / 2)   # N / k
    assert etp.comm_bytes["ep"] > 0 and gather.time["ep"] > a2a.time["ep"]
    with pytest.raises(ValueError, match="must divide dp"):
        estimate(mixtral, "h100-sxm", Layout(**base, ep=4, etp=4))     # 16 ranks over a stage of 8


@pytest.mark.parametrize("cfg,kw,message", [
    (dataclasses.replace(MOE, n_experts=3, top_k=1), dict(tp=2, ep=2), "divisible by ep=2"),
    (MOE, dict(dp=2, tp=3, ep=4), r"ep \* etp = 4 \* 1 must divide dp \* cp \* tp = 2 \* 1 \* 3"),
    (MOE, dict(cp=2, ep=2, etp=2), "must divide"),
    (dataclasses.replace(MOE, ffn_hidden=18), dict(dp=2, tp=2, etp=4), "not divisible"),
    (MOE, dict(tp=2, ep=2, sequence_parallel=False), "sequence_parallel=True"),
    (MOE, dict(dp=4, cp=2, ep=2, data="fsdp", zeropp=("hpz",), gpus_per_node=4), "zeropp"),
    (MOE, dict(dp=4, etp=4, data="hsdp", shard_size=4), "under HSDP: its one shard group"),
    (dataclasses.replace(MOE, n_experts=0), dict(dp=2, etp=2), "has none"),
])
def test_bad_expert_layouts_are_refused_before_any_rank_starts(cfg, kw, message):
    with pytest.raises(ValueError, match=message):
        check_layout(cfg, **kw)
