"""FSDP's controls (course_lib/parallel/fsdp.py), each against one device and its formula.

One launch of 4 ranks trains TinyGPT 3 AdamW steps (float64, 2 micro-batches a step) under:
gradient sync on every micro-batch; ``set_requires_gradient_sync(False)`` on all but the last;
``reshard_after_forward`` True / False / 2; no prefetch; explicit prefetch two units ahead;
HSDP 2 x 2 with the accumulation and reshard_after_forward=False. Each equals one device; its
collectives (calls, payload bytes) and peak gathered / unsharded-gradient bytes are checked
against formulas in the units' sizes. The tied-embedding pitfall: torch's ``fully_shard``
refuses a tied weight in two FSDP groups, and runs with both modules in one group.
"""
import functools

import pytest
import torch

from course_lib import launch, reference, tolerance
from course_lib.gpt import GPTConfig, TinyGPT
from single_device import exact

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layers=3, hidden=16, n_heads=2, n_kv_heads=1)
TIED = GPTConfig(vocab_size=64, seq_len=8, n_layers=2, hidden=16, n_heads=2, n_kv_heads=1, tie_embeddings=True)
N, MICRO, STEPS, BATCH, LR = 4, 2, 3, 8, 1e-2
B = 8  # bytes per float64 element
VARIANTS = {
    "sync": {}, "no_sync": dict(no_sync=True), "raf_false": dict(reshard_after_forward=False),
    "raf_2": dict(reshard_after_forward=2), "no_prefetch": dict(prefetch=False),
    "all_three": dict(no_sync=True, reshard_after_forward=2, explicit=2),
    "prefetch_2": dict(explicit=2), "hsdp_no_sync_raf_false": dict(shard_size=2, no_sync=True,
                                                                   reshard_after_forward=False),
}


def batches(cfg=CFG):
    return reference.gpt_batches(cfg, batch=BATCH, steps=STEPS)


@functools.lru_cache(maxsize=None)
def one_device(cfg=CFG):
    with exact():
        model = TinyGPT(cfg, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        return reference.train_gpt(model, batches(cfg), opt, micro=MICRO)


def run_variant(no_sync=False, explicit=0, **fsdp_kw):
    """STEPS steps of FSDP(TinyGPT) with this control: state, peaks, step 0's collectives."""
    import torch.distributed as dist

    from course_lib.parallel.fsdp import FSDP

    rank = dist.get_rank()
    model = TinyGPT(CFG, seed=0)
    net = FSDP(model, divisor=1, **fsdp_kw)   # the loss is divided by the global token count
    blocks = list(model.blocks)
    for i in range(len(blocks)) if explicit else ():
        net.set_modules_to_forward_prefetch(blocks[i], blocks[i + 1:i + 1 + explicit])
        net.set_modules_to_backward_prefetch(blocks[i], blocks[max(0, i - explicit):i][::-1])
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    comms = [c for c in (net.comm, net.replicate, net.reshard_group) if c is not None]
    log = {}
    for step, (x, y) in enumerate(batches()):
        n_tokens = int((y != -100).sum())
        for c in comms:
            c.reset()
        mine = zip(x.chunk(N)[rank].chunk(MICRO), y.chunk(N)[rank].chunk(MICRO))
        for m, (xm, ym) in enumerate(mine):
            net.set_requires_gradient_sync(not no_sync or m == MICRO - 1)
            net(xm, ym, n_tokens=n_tokens)[1].backward()
        net.finish_gradient_synchronization()
        if step == 0:
            log = {c.dim: [(op, payload) for op, _, payload, _ in c.log] for c in comms}
        opt.step()
        opt.zero_grad()
    units = [(u.numel, u.grad_numel, u.is_root) for u in net.units]
    return dict(state=net.full_state_dict(), peak=dict(net.peak), log=log, units=units,
                shard=net.comm.size, reshard=net.reshard_group.ranks if net.reshard_group else None)


def tied_pitfall():
    """torch's fully_shard: a tied weight in two groups (refused), then both modules in one."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from course_lib.parallel.fsdp import FSDP

    out = {}
    x, y = batches(TIED)[0]
    rank, n_tokens = dist.get_rank(), int((y != -100).sum())
    model = TinyGPT(TIED, seed=0)
    try:
        fully_shard(model.tok_emb)
        fully_shard(model.lm_head)
        fully_shard(model)
        model(x.chunk(N)[rank], y.chunk(N)[rank], n_tokens=n_tokens)   # refused here: lazy init
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    theirs = TinyGPT(TIED, seed=0)
    fully_shard([theirs.tok_emb, theirs.lm_head])       # one group holds the tied weight
    for block in theirs.blocks:
        fully_shard(block)
    fully_shard(theirs)
    for m in theirs.modules():                      # as ours (divisor=1): the loss is already global;
        if isinstance(m, FSDPModule):               # each FSDP group has its own factor
            m.set_gradient_divide_factor(1.0)
    ours = FSDP(TinyGPT(TIED, seed=0), divisor=1)   # ours: a weight two units share is the root's
    out["ours unit of tok_emb.weight"] = next(u.name for u in ours.units for s in u.slots
                                              if s.shape == (TIED.vocab_size, TIED.hidden))
    grads = {}
    for who, net in (("torch", theirs), ("ours", ours)):
        net(x.chunk(N)[rank], y.chunk(N)[rank], n_tokens=n_tokens)[1].backward()
        if who == "ours":
            net.finish_gradient_synchronization()
            grads[who] = net.module.tok_emb.weight.grad.clone()
        else:
            grads[who] = net.tok_emb.weight.grad.to_local().clone()
    out["grads"] = grads
    return out


def torch_controls():
    """The same steps with torch's calls: fully_shard(block, reshard_after_forward=2),
    set_modules_to_forward/backward_prefetch, set_requires_gradient_sync(False) on all but
    the last micro-batch."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    rank, model = dist.get_rank(), TinyGPT(CFG, seed=0)
    blocks = list(model.blocks)
    for block in blocks:
        fully_shard(block, reshard_after_forward=2)
    fully_shard(model)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - 2):i][::-1])
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for x, y in batches():
        n_tokens = int((y != -100).sum())
        mine = zip(x.chunk(N)[rank].chunk(MICRO), y.chunk(N)[rank].chunk(MICRO))
        for m, (xm, ym) in enumerate(mine):
            model.set_requires_gradient_sync(m == MICRO - 1)
            model(xm, ym, n_tokens=n_tokens)[1].backward()
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def rank_checks():
    out = {}
    with exact():
        for name, kw in VARIANTS.items():
            out[name] = run_variant(**kw)
        out["tied"] = tied_pitfall()
        out["torch"] = torch_controls()
    out["bad"] = [refused(bad) for bad in (3, 0, "2", 2.0)]
    return out


def refused(bad):
    from course_lib.parallel.fsdp import FSDP
    try:
        FSDP(TinyGPT(CFG, seed=0), reshard_after_forward=bad)
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.fixture(scope="module")
def runs():
    return launch(rank_checks, N, threads=1, timeout=240)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_control_matches_one_device(runs, variant):
    state, _ = one_device()
    for rank, result in enumerate(runs):
        got = result[variant]["state"]
        tolerance.assert_matches(got, state, optimizer="adamw", steps=STEPS, lr=LR, what=f"{variant} rank {rank}")


def test_torch_calls_agree(runs):
    """torch's fully_shard with the three controls, and ours with the same three."""
    for result in runs:
        ours, theirs = result["all_three"]["state"], result["torch"]
        tolerance.assert_matches({n: ours[n] for n in theirs}, theirs, optimizer="adamw", steps=STEPS, lr=LR,
                                 what="ours vs torch")


def counts(log, op):
    return [b for o, b in log if o == op]


def test_no_sync_reduce_scatters_once_per_step(runs):
    """k micro-batches: k reduce-scatters per unit with sync, 1 without; the all-gathers are
    the same; the price: each unit's full (N * S) gradient held between micro-batches."""
    for result in runs:
        units = result["sync"]["units"]
        full = [N * S * B for S, _, _ in units]
        sync, no_sync = result["sync"]["log"]["dp"], result["no_sync"]["log"]["dp"]
        assert len(counts(sync, "reduce_scatter_tensor")) == MICRO * len(units)
        assert len(counts(no_sync, "reduce_scatter_tensor")) == len(units)
        assert sum(counts(sync, "reduce_scatter_tensor")) == MICRO * sum(counts(no_sync, "reduce_scatter_tensor"))
        assert counts(sync, "all_gather_into_tensor") == counts(no_sync, "all_gather_into_tensor")
        assert result["sync"]["peak"]["unsharded gradients"] == 0
        assert result["no_sync"]["peak"]["unsharded gradients"] == sum(full)   # every unit's at once


def gather_formula(units, raf, k=1, ahead=1):
    """Peak gathered bytes: the root, the running unit and ``ahead`` prefetched ones, and the
    1/k kept by every other block after forward (raf=k); raf False: every unit at once."""
    root = next(N * S * B for S, _, r in units if r)
    block = max(N * S * B for S, _, r in units if not r)
    n_blocks = len(units) - 1
    if raf is False:
        return sum(N * S * B for S, _, _ in units)
    kept = 0 if raf is True else (n_blocks - 1 - ahead) * block // k
    return root + (1 + ahead) * block + kept


def test_reshard_after_forward_memory_and_all_gathers(runs):
    for result in runs:
        units = result["sync"]["units"]
        L = len(units)
        ag = {v: counts(result[v]["log"]["dp"], "all_gather_into_tensor") for v in ("sync", "raf_false", "raf_2")}
        assert len(ag["sync"]) == MICRO * (2 * L - 1)       # forward all, backward all but the root
        assert len(ag["raf_false"]) == MICRO * L            # forward only: kept to backward
        assert len(ag["raf_2"]) == MICRO * L                # the backward ones run inside the pair:
        pair = result["raf_2"]["log"]["dp_reshard2"]
        assert [op for op, _ in pair] == ["all_gather_into_tensor"] * (MICRO * (L - 1))
        assert result["raf_2"]["reshard"] in ([0, 1], [2, 3])   # consecutive ranks: one node
        assert result["sync"]["peak"]["gathered parameters"] == gather_formula(units, True)
        assert result["raf_false"]["peak"]["gathered parameters"] == gather_formula(units, False)
        assert result["raf_2"]["peak"]["gathered parameters"] == gather_formula(units, 2, k=2)


def test_prefetch_depth_sets_the_gathered_peak(runs):
    for result in runs:
        units = result["sync"]["units"]
        assert result["no_prefetch"]["peak"]["gathered parameters"] == gather_formula(units, True, ahead=0)
        assert result["prefetch_2"]["peak"]["gathered parameters"] == gather_formula(units, True, ahead=2)


def test_hsdp_with_controls(runs):
    for result in runs:
        got = result["hsdp_no_sync_raf_false"]
        assert got["shard"] == 2
        assert len(counts(got["log"]["dp_shard"], "reduce_scatter_tensor")) == len(got["units"])
        assert len(got["log"]["dp_replicate"]) == len(got["units"])   # one all-reduce of each shard


def test_tied_weight_in_two_groups_torch_refuses_grouping_both_works(runs):
    for result in runs:
        tied = result["tied"]
        assert tied["refused"] is not None and "already managed by another FSDP group" in tied["refused"]
        assert tied["ours unit of tok_emb.weight"] == "root"
        ours, theirs = tied["grads"]["ours"], tied["grads"]["torch"]
        assert ours.shape == theirs.shape
        tolerance.assert_matches(ours, theirs, what="tied weight's gradient shard: ours vs torch")


def test_bad_reshard_after_forward_is_refused(runs):
    for message in runs[0]["bad"]:
        assert "reshard_after_forward must be True, False or an int dividing" in message
