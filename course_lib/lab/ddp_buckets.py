"""Chapter 3's bucket experiment on the virtual GPU clock: when each gradient is ready, and
how long a DDP step (overlap=True) takes with a given bucket size, swept over sizes.

    grads, backward = gradient_timeline(cfg, batch)    # inside a rank under the clock
    seconds = step_seconds(cfg, batch, cap_mb)         # inside a rank: one DDP step
    sweep = bucket_sweep(cfg, batch, hw, gpus_per_node, world)   # {MiB: the slowest rank's step}
    grads, backward, world, cluster = bucket_inputs(1)  # what the chapter's question hands over

Everything is priced by the clock at run time (no stored times), so the numbers follow the
clock's prices when they change.
"""
from __future__ import annotations

import functools

import torch

from course_lib.launch import launch
from course_lib.virtual import VirtualCluster

SWEEP_MB = tuple(2.0 ** k for k in range(-2, 8))   # 1/4 .. 128 MiB, doubling
BUCKET_CASES = [  # the chapter's visible cases: (label, TinyGPT config, batch per rank, hardware,
    # gpus per node, world size)
    ("12 blocks of width 256 on 2 A100 nodes (network)",
     dict(vocab_size=128, seq_len=16, n_layers=12, hidden=256, n_heads=4), 1, "a100-80gb", 1, 2),
    ("12 blocks of width 64 on 4 H100s of one 8-GPU node (NVLink)",
     dict(vocab_size=128, seq_len=16, n_layers=12, hidden=64, n_heads=4), 1, "h100-sxm", 8, 4),
]


def gradient_timeline(cfg, batch):
    """One plain forward + backward of TinyGPT under the rank's clock: for every parameter in
    the order DDP fills its buckets (the parameters' order reversed, roughly the order backward
    finishes them), (name, numel, ready seconds after backward started), and backward's duration."""
    from course_lib import trace
    from course_lib.gpt import TinyGPT

    model = TinyGPT(cfg, seed=0)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    _, loss = model(x[:, :-1], x[:, 1:])
    names = {id(p): n for n, p in model.named_parameters()}
    ready = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: ready.append((names[id(p)], p.numel(), trace.now())))
             for p in model.parameters()]
    t0 = trace.now()
    loss.backward()
    backward = trace.now() - t0
    for h in hooks:
        h.remove()
    order = {n: i for i, (n, _) in enumerate(reversed(list(model.named_parameters())))}
    return sorted(((n, k, t - t0) for n, k, t in ready), key=lambda g: order[g[0]]), backward


def step_seconds(cfg, batch, cap_mb):
    """One DDP step (overlap=True) with ``cap_mb`` buckets on this rank's clock: forward,
    backward and finish(), in virtual seconds."""
    import torch.distributed as dist

    from course_lib import trace
    from course_lib.gpt import TinyGPT
    from course_lib.parallel.data_parallel import DDP
    from course_lib.parallel.mesh import Mesh

    net = DDP(TinyGPT(cfg, seed=0), bucket_cap_mb=cap_mb, mesh=Mesh(dp=dist.get_world_size()))
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    dist.barrier()
    start = trace.now()
    _, loss = net(x[:, :-1], x[:, 1:])
    loss.backward()
    net.finish_gradient_synchronization()
    return trace.now() - start


def _sweep_steps(cfg_dict, batch, caps):
    """In a rank: the gradient timeline first (as before a graded answer's step, so every step
    starts from the same state of the clock), then one step per cap."""
    from course_lib.gpt import GPTConfig

    cfg = GPTConfig(**cfg_dict)
    gradient_timeline(cfg, batch)
    return [step_seconds(cfg, batch, cap) for cap in caps]


def bucket_sweep(cfg: dict, batch, hardware, gpus_per_node, world) -> dict:
    """{cap in MiB: the slowest rank's step} over SWEEP_MB on ``world`` ranks of the clock,
    run once per case and per price list in this process."""
    prices = VirtualCluster(hardware, gpus_per_node=gpus_per_node).describe()
    return _cached_sweep(tuple(sorted(cfg.items())), batch, hardware, gpus_per_node, world, prices)


@functools.lru_cache(maxsize=None)
def _cached_sweep(cfg_items, batch, hardware, gpus_per_node, world, prices):
    # ``prices``: the clock's describe(), so a changed price runs the sweep again
    clock = VirtualCluster(hardware, gpus_per_node=gpus_per_node)
    res = launch(_sweep_steps, world, dict(cfg_items), batch, SWEEP_MB, clock=clock, threads=1,
                 timeout=300, quiet=True)
    return {cap: max(r[i] for r in res) for i, cap in enumerate(SWEEP_MB)}


def bucket_inputs(case: int = 1):
    """What the bucket question's ``case`` (1 or 2) hands ``choose_bucket_cap_mb``:
    (grads, backward_s, world_size, cluster), from one rank's run on the virtual clock
    (every rank computes the same shapes, so its timeline is every rank's)."""
    from course_lib.gpt import GPTConfig

    _, cfg, batch, hw, gpn, world = BUCKET_CASES[case - 1]
    cluster = VirtualCluster(hw, gpus_per_node=gpn, dtype=torch.bfloat16)
    (grads, backward), = launch(gradient_timeline, 1, GPTConfig(**cfg), batch, clock=cluster, quiet=True)
    return grads, backward, world, cluster


__all__ = ["SWEEP_MB", "BUCKET_CASES", "gradient_timeline", "step_seconds", "bucket_sweep", "bucket_inputs"]
