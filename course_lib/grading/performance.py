"""Performance questions graded on the virtual GPU clock (deterministic: virtual time only).

    check_bucket_cap(choose_bucket_cap_mb)   # ch. 3: DDP hides >= 90% of its all-reduces
    check_pipeline_plan(choose_m_v)          # ch. 6: bubble <= 10% within a memory budget

(chapter 9's placement question, also on virtual time: :mod:`course_lib.grading.placement`.)
Each runs the learner's choice for real (ranks under ``launch(..., clock=VirtualCluster(...))``)
or on the schedule the choice names, on several models / clusters / budgets, so one
hard-coded number fails; while the learner's function runs, the library code that would
answer it (DDP and its bucketing, the schedules and the planner) is switched off (:mod:`course_lib.grading.guard`).
"""
from __future__ import annotations

import torch

from course_lib.grading import Case, check, learner
from course_lib.launch import launch
from course_lib.virtual import VirtualCluster

__all__ = ["check_bucket_cap", "bucket_inputs", "check_pipeline_plan"]

# what would answer the bucket question for the learner: running DDP under the clock
DDP_LIBRARY = ("course_lib.parallel.grad_sync:*", "course_lib.parallel.data_parallel:*",
               "course_lib.launch:launch", "course_lib.grading.performance:_*")
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


# ----------------------------------------------------------------------------- 2. pipeline m, v
# what would answer the pipeline question: the schedules, their simulation and the planner
PIPELINE_LIBRARY = ("course_lib.schedules:*", "course_lib.parallel.schedules:*", "course_lib.planner.formulas:*",
                    "course_lib.planner.simulator:*", "course_lib.planner.search:*",
                    "course_lib.grading.performance:_*")
BUBBLE = 0.10
GIB = 2**30
PIPELINE_CASES = [  # (p, layers, activation GiB of one micro-batch in one rank's layers, weights GiB, budget GiB, max m)
    (4, 16, 2.0, 30.0, 42.0, 64),     # room for interleaving: 4 chunks per rank, m = 8
    (4, 16, 2.0, 30.0, 39.0, 64),     # interleaving does not fit: 1F1B, m = 27
    (4, 8, 2.0, 30.0, 42.0, 64),      # 2 layers per rank: v <= 2, m = 16
    (4, 12, 2.0, 30.0, 40.4, 64),     # v = 3 fits, v = 2 does not (5.5 micro-batches' worth)
    (4, 24, 2.0, 30.0, 40.4, 64),     # v = 6: 4.5 micro-batches' worth, m = 8
    (4, 16, 2.0, 30.0, 39.0, 24),     # 1F1B needs m = 27 > 24 and interleaving does not fit: None
    (4, 16, 2.0, 30.0, 37.0, 64),     # not even 1F1B's 4 micro-batches fit: None
]


def _schedule_of(p, m, v):
    """(bubble of the step on equal stages, peak bytes-per-activation units on the fullest rank)
    of the schedule the course runs for (m, v): 1F1B for v = 1, interleaved 1F1B otherwise."""
    from course_lib import schedules as S

    sched = S.make_schedule("1f1b" if v == 1 else "interleaved", p, m, v)
    spans = S.simulate(sched, p, v, t_f=1.0 / v, t_b=2.0 / v)
    return max(S.bubble(spans, r) for r in range(p)), max(S.in_flight(row) for row in sched) / v


def _pipeline_problem(p, layers, m, v):
    """Why (m, v) cannot run as an interleaved schedule, or None."""
    if layers % (p * v):
        return f"{layers} layers do not split into {p} x {v} equal stages (v must divide layers / p = {layers // p})"
    if v > 1 and m % p:
        return f"interleaved 1F1B needs m to be a multiple of p = {p} (Megatron-LM's order), got m = {m}"
    return None


def _best_m(p, layers, act, weights, budget, max_m):
    """The smallest m of any (m, v) that keeps the bubble <= 10% within the budget, or None."""
    for m in range(1, max_m + 1):
        for v in range(1, layers // p + 1):
            if _pipeline_problem(p, layers, m, v) is None:
                bubble, held = _schedule_of(p, m, v)
                if bubble <= BUBBLE + 1e-9 and weights + held * act <= budget:
                    return m
    return None


def check_pipeline_plan(choose_m_v):
    """choose_m_v(p, layers, act_bytes, weight_bytes, budget_bytes, max_m) -> (m, v) or None:
    the fewest micro-batches (the smallest global batch) whose 1F1B (v = 1) or interleaved
    1F1B (v chunks per rank) schedule idles at most 10% of the step, with the activations the
    fullest rank holds at its peak plus its weights within the budget; None if none does.
    Graded on the schedule itself: simulated step (equal stages) and held micro-batches."""
    cases = [Case(dict(zip(("p", "layers", "act", "weights", "budget", "max_m"), c)),
                  label=f"p={c[0]}, {c[1]} layers, activations {c[2]:g} GiB, weights {c[3]:g} GiB, "
                        f"budget {c[4]:g} GiB, m <= {c[5]}") for c in PIPELINE_CASES]
    answer = learner(choose_m_v, PIPELINE_LIBRARY, exercise="choosing m and v", seconds=10)

    def run(case):
        k = case.params
        best = _best_m(k["p"], k["layers"], k["act"], k["weights"], k["budget"], k["max_m"])
        got = answer(k["p"], k["layers"], k["act"] * GIB, k["weights"] * GIB, k["budget"] * GIB, k["max_m"])
        if got is None:
            return None if best is None else f"returned None, but an (m, v) with m = {best} fits the budget"
        if not (isinstance(got, (tuple, list)) and len(got) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in got)):
            return f"expected (m, v), two integers >= 1, or None; got {got!r}"
        m, v = got
        if m > k["max_m"]:
            return f"m = {m} is more than max_m = {k['max_m']}"
        problem = _pipeline_problem(k["p"], k["layers"], m, v)
        if problem:
            return problem
        bubble, held = _schedule_of(k["p"], m, v)
        peak = k["weights"] + held * k["act"]
        if bubble > BUBBLE + 1e-9:
            return (f"(m={m}, v={v}): the simulated step idles {bubble:.1%} > 10% (the bubble as a fraction "
                    f"of the step is (p-1)/(v m + p - 1), not (p-1)/m)")
        if peak > k["budget"] + 1e-9:
            return (f"(m={m}, v={v}): rank 0 holds {held:g} micro-batches' activations at its peak, "
                    f"{peak:g} GiB > budget {k['budget']:g} GiB (interleaving warms up with "
                    f"2(p-1) + (v-1)p + 1 chunk forwards, each 1/v of the layers)")
        if best is None or m > best:
            return (f"(m={m}, v={v}) fits, but m = {best} micro-batches are enough (a smaller global batch; "
                    f"the bubble as a fraction of the step is (p-1)/(v m + p - 1), (p-1)/(v m) is relative to "
                    f"the ideal time)")
        return None

    return check("pipeline_plan", cases, run)


def bucket_inputs(case: int = 1):
    """What the bucket question's ``case`` (1 or 2) hands ``choose_bucket_cap_mb``:
    (grads, backward_s, world_size, cluster), from one rank's run on the virtual clock
    (every rank computes the same shapes, so its timeline is every rank's)."""
    from course_lib.gpt import GPTConfig

    _, cfg, batch, hw, gpn, world = BUCKET_CASES[case - 1]
    cluster = VirtualCluster(hw, gpus_per_node=gpn, dtype=torch.bfloat16)
    (grads, backward), = launch(_gradient_timeline, 1, GPTConfig(**cfg), batch, clock=cluster, quiet=True)
    return grads, backward, world, cluster
