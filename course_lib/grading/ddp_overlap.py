"""Chapter 3's performance question, graded on the virtual GPU clock (deterministic).

    check_bucket_cap(choose_bucket_cap_mb)   # DDP hides >= 90% of its all-reduces

The learner's bucket size runs for real: DDP under ``launch(..., clock=VirtualCluster(...))``
on several models and clusters, so one hard-coded number fails; while the learner's function
runs, DDP and its bucketing are switched off (:mod:`course_lib.grading.guard`). (Chapter 6's
question on virtual time: :mod:`course_lib.grading.pipeline_plan`; chapter 9's:
:mod:`course_lib.grading.placement`.)
"""
from __future__ import annotations

import torch

from course_lib.grading import Case, check, learner
from course_lib.launch import launch
from course_lib.virtual import VirtualCluster

__all__ = ["check_bucket_cap", "bucket_inputs"]

# what would answer the bucket question for the learner: running DDP under the clock
DDP_LIBRARY = ("course_lib.parallel.grad_sync:*", "course_lib.parallel.data_parallel:*",
               "course_lib.launch:launch", "course_lib.grading.ddp_overlap:_*")
HIDDEN = 0.90                                  # the fraction of all-reduce time to hide


# ----------------------------------------------------------------------------- 1. DDP buckets
def _gradient_timeline(cfg, batch):
    """One plain forward + backward of TinyGPT under the rank's clock: for every parameter in
    the order backward finishes its gradient, (name, numel, ready seconds after backward
    started), and backward's duration."""
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
    return [(n, k, t - t0) for n, k, t in ready], backward


def _ddp_step(cfg, batch, cap_mb):
    """One DDP step (overlap=True) with ``cap_mb`` buckets: the all-reduce spans of this rank,
    and when backward ended (virtual seconds)."""
    import torch.distributed as dist

    from course_lib import trace
    from course_lib.gpt import TinyGPT
    from course_lib.parallel.data_parallel import DDP
    from course_lib.parallel.mesh import Mesh

    net = DDP(TinyGPT(cfg, seed=0), bucket_cap_mb=cap_mb, mesh=Mesh(dp=dist.get_world_size()))
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    trace.reset()
    _, loss = net(x[:, :-1], x[:, 1:])
    with trace.span("backward", "compute"):
        loss.backward()
    net.finish_gradient_synchronization()
    spans = trace.spans()
    end = next(s.end for s in spans if s.name == "backward")
    return [(s.start, s.end) for s in spans if s.kind == "comm" and s.name.startswith("all-reduce b")], end


def _hidden(comms, backward_end):
    """(fraction of the all-reduce time that ran while backward computed, exposed seconds)."""
    total = sum(e - s for s, e in comms)
    exposed = sum(max(0.0, e - max(s, backward_end)) for s, e in comms)
    return 1.0 - exposed / total, exposed


def _bucket_harness(choose, cfg_dict, batch, hardware, gpus_per_node):
    import torch.distributed as dist

    from course_lib.gpt import GPTConfig

    cfg, world = GPTConfig(**cfg_dict), dist.get_world_size()
    cluster = VirtualCluster(hardware, gpus_per_node=gpus_per_node, dtype=torch.bfloat16)
    grads, backward = _gradient_timeline(cfg, batch)
    answer = learner(choose, DDP_LIBRARY, exercise="choosing the bucket size", seconds=10)
    cap = answer(list(grads), backward, world, cluster)
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        return {"error": f"expected a bucket size in MiB > 0, got {cap!r}"}
    cap = float(cap)
    comms, end = _ddp_step(cfg, batch, cap)
    return {"cap": cap, "comms": comms, "backward_end": end}


BUCKET_CASES = [  # (label, TinyGPT config, batch per rank, hardware, gpus per node, world size)
    ("12 blocks of width 256 on 2 A100 nodes (network)",
     dict(vocab_size=128, seq_len=16, n_layers=12, hidden=256, n_heads=4), 1, "a100-80gb", 1, 2),
    ("12 blocks of width 64 on 4 H100s of one 8-GPU node (NVLink)",
     dict(vocab_size=128, seq_len=16, n_layers=12, hidden=64, n_heads=4), 1, "h100-sxm", 8, 4),
]


def check_bucket_cap(choose_bucket_cap_mb):
    """choose_bucket_cap_mb(grads, backward_s, world_size, cluster) -> MiB: the learner's bucket
    size; DDP (overlap=True) runs one step with it under the virtual clock and must hide at
    least 90% of its all-reduce time behind backward, on every case."""
    cases = [Case(dict(cfg=c, batch=b, hardware=h, gpn=g), world_size=n, label=label)
             for label, c, b, h, g, n in BUCKET_CASES]

    def run(case):
        from course_lib.gpt import GPTConfig
    
        cfg = GPTConfig(**case.params["cfg"])
        h, g = case.params["hardware"], case.params["gpn"]
        res = launch(_bucket_harness, case.world_size, choose_bucket_cap_mb, dict(cfg.__dict__),
                     case.params["batch"], h, g, clock=VirtualCluster(h, gpus_per_node=g), threads=1,
                     timeout=60, quiet=True)
        if "error" in res[0]:
            return res[0]["error"]
        worst = min((_hidden(r["comms"], r["backward_end"]) + (r["comms"],) for r in res), key=lambda x: x[0])
        hidden, exposed, comms = worst
        if hidden < HIDDEN:
            k, total = len(comms), sum(e - s for s, e in comms)
            many = k > 1 and total > res[0]["backward_end"] - min(s for s, _ in comms)
            why = ("the all-reduces take longer than the backward they hide behind: "
                   "each bucket pays the latency 2(N-1) alpha, so fewer, larger buckets") if many else (
                "the last bucket starts only when backward ends: smaller buckets, so that it is short")
            return (f"{res[0]['cap']:g} MiB: {k} buckets, {total * 1e6:.0f} us of all-reduce, "
                    f"{exposed * 1e6:.0f} us exposed after backward, {hidden:.0%} hidden (< {HIDDEN:.0%}); {why}")
        return None

    return check("bucket_cap", cases, run)


def bucket_inputs(case: int = 1):
    """What the bucket question's ``case`` (1 or 2) hands ``choose_bucket_cap_mb``:
    (grads, backward_s, world_size, cluster), from one rank's run on the virtual clock
    (every rank computes the same shapes, so its timeline is every rank's)."""
    from course_lib.gpt import GPTConfig

    _, cfg, batch, hw, gpn, world = BUCKET_CASES[case - 1]
    cluster = VirtualCluster(hw, gpus_per_node=gpn, dtype=torch.bfloat16)
    (grads, backward), = launch(_gradient_timeline, 1, GPTConfig(**cfg), batch, clock=cluster, quiet=True)
    return grads, backward, world, cluster
