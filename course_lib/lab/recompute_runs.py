"""Chapter 9b's recomputation runs: activation bytes measured on storages, recompute FLOPs
counted, next to their formulas and to the planner.

    rows = launch(activation_bytes, 4, cfg, dict(tp=2, cp=2), batch=2)   # per rank, per policy
    peaks = launch(pipeline_peaks, 4, cfg, dict(pp=4), batch=4, microbatches=4)
    flops = recompute_flops(cfg, batch=2)          # FlopCounterMode, one block, per policy
    bytes_ = torch_checkpoint_side_by_side(cfg, batch=2)   # ours vs torch.utils.checkpoint

Everything runs in bf16 (the 2-byte values of Korthikanti's formulas); the bytes a block keeps
are the storages alive after its forward (``memory.MemoryTracker``), minus its output.
"""
from __future__ import annotations

import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.memory import MemoryTracker, storage_bytes
from course_lib.recompute import POLICIES, every

LAYOUT_KW = ("microbatches", "schedule", "sequence_parallel", "cp_method", "cp_layout")


def kept_bytes(blocks, x, positions=None, dtype=torch.bfloat16):
    """(tracker bytes, saved bytes) the ``blocks`` keep for backward, run in order on ``x``
    (local shape). Tracker: the storages created during their forward and still alive after
    it, less the output's (``memory.MemoryTracker``); saved: the distinct storages autograd's
    pack hook was handed, parameters excluded. The first block's input is made inside
    (``x * 1``): a block that saves it owns it."""
    params = [t for blk in blocks for t in (*blk.parameters(), *blk.buffers())]
    constant = {t.untyped_storage().data_ptr() for t in params}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in constant:
            saved.append(t)
        return t

    tracker = MemoryTracker()
    tracker.track(params + ([positions] if positions is not None else []))
    x = x.detach().to(dtype).requires_grad_()
    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        before = tracker.live
        h = x * 1
        for blk in blocks:
            h = blk(h, positions)
        time.sleep(0.05)                 # gloo's threads drop the last reference to a message buffer
        tracker.serial(h)                # a little after wait() returns: those frees, applied now
        kept = tracker.live - before - storage_bytes([h])
    h.float().sum().backward()           # the recomputation runs, and everything is freed
    return kept, storage_bytes(saved)


def activation_bytes(cfg_dict, layout, batch, policies=None, **kw):
    """On each rank of ``layout`` (pp = 1): {policy name: bytes ITS blocks keep per micro-batch}
    for each recompute policy (default: none, selective, full and "full every 2nd block")."""
    import torch.distributed as dist  # noqa: F401  (ranks only)

    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.context_parallel import shard_positions
    from course_lib.parallel.mesh import Mesh

    cfg = GPTConfig(**cfg_dict)
    policies = policies or {**{p: p for p in POLICIES}, "every 2": every(2, cfg.n_layers)}
    mesh = Mesh(**layout)
    sizes, c = mesh.sizes, mesh.coord
    out = {}
    for name, policy in policies.items():
        net = parallelize_nd(TinyGPT(cfg, seed=0).to(torch.bfloat16), mesh, recompute=policy, **kw)
        part = net.stages[0].part
        s = cfg.seq_len // sizes["cp"]
        pos = None
        if sizes["cp"] > 1:
            pos = shard_positions(cfg.seq_len, sizes["cp"], c["cp"], kw.get("cp_layout", "zigzag"))
        if net.sp:
            s //= sizes["tp"]
        x = torch.randn(batch, s, cfg.hidden, generator=torch.Generator().manual_seed(c["tp"] + 10 * c["cp"]))
        out[name] = kept_bytes(list(part.blocks), x, pos)
    return out


def activation_bytes_of_layouts(cfg_dict, layouts, batch):
    """:func:`activation_bytes` for several layouts of the same world size, in one launch:
    {name: {policy: (tracker bytes, saved bytes)}}; ``layouts`` {name: (mesh sizes, keywords)}."""
    return {name: activation_bytes(cfg_dict, layout, batch, **kw) for name, (layout, kw) in layouts.items()}


def pipeline_peaks(cfg_dict, layout, batch, policies=POLICIES, count_ids=True, **kw):
    """One bf16 pipeline step per recompute policy: {policy: this rank's peak of saved activations
    (every micro-batch in flight), the bytes one micro-batch's forward kept (in all its chunks),
    its stage (rank), chunks (virtual stages: several with ``v`` > 1) and layers}, counted on
    storages by the schedule runner. ``count_ids=False``: stage 0's embedding keeps its token
    ids for backward, views of the whole batch's; counted as the weights are (not at all)."""
    from course_lib import reference
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    cfg = GPTConfig(**cfg_dict)
    mesh = Mesh(**layout)
    x, y = reference.gpt_batches(cfg, batch=batch, steps=1)[0]
    out = {}
    for policy in policies:
        net = parallelize_nd(TinyGPT(cfg, seed=0).to(torch.bfloat16), mesh, recompute=policy, **kw)
        if 0 in net.stages and not count_ids:   # the batch's token ids: a buffer, as the weights
            net.stages[0].part.register_buffer("token_ids", x, persistent=False)
        net.step(x, y)
        res, stages = net.last_result, net.stages      # v > 1: this rank's chunks, stage % p
        out[policy] = dict(stage=min(stages), chunks=sorted(stages),
                           layers=[i for s in sorted(stages) for i in stages[s].layers],
                           peak=res.peak_activation_bytes,
                           per_microbatch=sum(res.saved_bytes[(s, 0)] for s in stages),
                           first=any(st.first for st in stages.values()),
                           last=any(st.last for st in stages.values()))
    return out


def recompute_flops(cfg, batch, policies=POLICIES):
    """{policy: (forward, backward) matmul FLOPs of one block}, counted by torch's FlopCounterMode."""
    out = {}
    for policy in policies:
        block = TinyGPT(GPTConfig(**{**cfg.__dict__, "recompute": policy}), seed=0).blocks[0]
        x = torch.randn(batch, cfg.seq_len, cfg.hidden, requires_grad=True)
        with FlopCounterMode(display=False) as fwd:
            y = block(x)
        with FlopCounterMode(display=False) as bwd:
            y.sum().backward()
        out[policy] = (fwd.get_total_flops(), bwd.get_total_flops())
    return out


def torch_checkpoint_side_by_side(cfg, batch):
    """Ours ("full") and ``torch.utils.checkpoint`` on the same block (fp32): bytes kept after
    forward, backward FLOPs, and the gradients (input and parameters) of both."""
    from torch.utils.checkpoint import checkpoint

    out = {}
    x0 = torch.randn(batch, cfg.seq_len, cfg.hidden, generator=torch.Generator().manual_seed(0))
    for who in ("none", "ours", "torch"):
        block = TinyGPT(GPTConfig(**{**cfg.__dict__, "recompute": "full" if who == "ours" else "none"}),
                        seed=0).blocks[0]
        run = (lambda h: checkpoint(block.layer, h, use_reentrant=False)) if who == "torch" else block
        x = x0.clone().requires_grad_()
        tracker = MemoryTracker()
        tracker.track([*block.parameters(), *block.buffers(), x])
        with tracker:
            before = tracker.live
            y = run(x * 1)
            kept = tracker.live - before - storage_bytes([y])
        with FlopCounterMode(display=False) as bwd:
            y.square().sum().backward()
        grads = {"input": x.grad, **{n: p.grad for n, p in block.named_parameters()}}
        out[who] = dict(kept=kept, backward_flops=bwd.get_total_flops(), grads=grads)
    return out


__all__ = ["kept_bytes", "activation_bytes", "activation_bytes_of_layouts", "pipeline_peaks", "recompute_flops", "torch_checkpoint_side_by_side"]
