"""DualPipe's point on the virtual clock: an MoE model's all-to-all hidden by F&B overlap.

    run = dualpipe_overlap(cfg, dict(pp=2, dp=2, ep=2), m=4, batch=8, cluster=h100)
    run.plain, run.overlapped         # step times (virtual seconds), DualPipeV without / with
    run.pairs                         # per F&B pair of the busiest rank: its a2a and compute
    run.hidden, run.hidden_formula    # that rank's a2a hidden: on the clock, the formula's

One launch runs the same step of ``cfg`` (an MoE model, ep > 1) with ``schedule="dualpipe-v"``
twice from the same weights: the actions one after the other, then every F&B pair
(``runner.fb_pairs``) overlapped on the clock (:mod:`course_lib.virtual.overlap`). The
arithmetic is the same (losses and gradients compared bit for bit, ``same``).

The formula (DeepSeek-V3 report, Sec. 3.2.1): in a pair, a forward's all-to-all can hide
under the backward's compute and the backward's under the forward's, so per pair at most

    hidden = min(a2a_F, compute_B) + min(a2a_B, compute_F)

with each action's compute and exposed all-to-all read from the plain step's spans (the time
inside its action span spent in ``ep`` collectives, and the rest). ``hidden`` (the clock's) is
per pair the two actions' plain durations less the overlapped pair's span.
"""
from __future__ import annotations

import dataclasses

import torch

from course_lib import reference, trace
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.launch import launch
from course_lib.parallel.compose import check_layout


@dataclasses.dataclass
class OverlapRun:
    plain: float            # step time, DualPipeV with its pairs one action after the other
    overlapped: float       # ... with every F&B pair overlapped
    same: bool              # losses and gradients bit-equal between the two
    loss: float             # the step's loss (the same in both)
    rank: int               # the rank whose pairs are listed (the one with the most a2a)
    pairs: list             # (F name, B name, a2a_F, compute_F, a2a_B, compute_B, hidden on the clock)
    hidden: float           # sum over ``pairs`` of the clock's hidden time
    hidden_formula: float   # sum over ``pairs`` of the formula's


def _rank(cfg_dict, layout, m, batch):
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    from course_lib.collectives import Comm

    cfg = GPTConfig(**cfg_dict)
    net = parallelize_nd(TinyGPT(cfg, seed=0), Mesh(**layout), schedule="dualpipe-v", microbatches=m)
    x, y = reference.gpt_batches(cfg, batch=batch, steps=1)[0]
    out = {}
    for overlap in (False, True):
        for q in net.parameters():
            q.grad = None
        net.runner.overlap_fb = overlap
        Comm(None).barrier()                # every rank's clock at the same virtual time
        trace.reset()
        with trace.span("step", "other"):
            loss = net.step(x, y)
        grads = [q.grad.clone() if q.grad is not None else None for q in net.parameters()]
        out[overlap] = (loss, grads, trace.spans())
    (l0, g0, plain), (l1, g1, over) = out[False], out[True]
    same = l0 == l1 and all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                            for a, b in zip(g0, g1))
    pairs = [(str(net.runner.actions[i]), str(net.runner.actions[i + 1]))
             for i in sorted(_pairs(net.runner))]
    return {"same": same, "plain": plain, "over": over, "pairs": pairs, "loss": l1}


def _pairs(runner):
    from course_lib.parallel.pipeline.runner import fb_pairs
    return fb_pairs(runner.actions, runner.split)


def _action_costs(spans, rank):
    """{action name: (a2a seconds inside its span, compute seconds)} of one rank's step."""
    mine = [s for s in spans if s.rank == rank]
    out = {}
    for a in mine:
        if a.kind != "compute" or a.dim != "pp":
            continue
        comm = sum(c.duration for c in mine if c.kind == "comm" and c.dim == "ep"
                   and a.start <= c.start and c.end <= a.end)
        out[a.name] = (comm, a.duration - comm)
    return out


def _span(spans, rank, name):
    return next(s for s in spans if s.rank == rank and s.kind == "compute" and s.name == name)


def dualpipe_overlap(cfg: GPTConfig, layout: dict, m: int, batch: int, cluster) -> OverlapRun:
    """One step of ``cfg`` with DualPipeV on ``layout`` (pp >= 2, an MoE model with ep >= 2),
    plain and with its F&B pairs overlapped, priced on ``cluster`` (see the module doc)."""
    if not cfg.n_experts or layout.get("ep", 1) < 2 or layout.get("pp", 1) < 2:
        raise ValueError(f"DualPipe's overlap hides an MoE all-to-all: it needs an MoE model (n_experts > 0, "
                         f"got {cfg.n_experts}), ep >= 2 and pp >= 2, got {layout}")
    shape = check_layout(cfg, **layout, batch=batch, schedule="dualpipe-v", microbatches=m)
    cluster.check(shape.world_size)
    res = launch(_rank, shape.world_size, dataclasses.asdict(cfg), layout, m, batch,
                 threads=1, timeout=300, clock=cluster, quiet=True)

    def step_time(key):
        steps = [s for r in res for s in r[key] if s.name == "step"]
        return max(s.end for s in steps) - min(s.start for s in steps)
    plain = [s for r in res for s in r["plain"]]
    over = [s for r in res for s in r["over"]]
    a2a = {}
    for s in plain:
        if s.kind == "comm" and s.dim == "ep":
            a2a[s.rank] = a2a.get(s.rank, 0.0) + s.duration
    rank = max(sorted(a2a), key=a2a.get) if a2a else 0
    costs, rows = _action_costs(plain, rank), []
    for f, b in res[rank]["pairs"]:
        (af, cf), (ab, cb) = costs[f], costs[b]
        sf, sb = _span(over, rank, f), _span(over, rank, b)
        hidden = (af + cf + ab + cb) - (max(sf.end, sb.end) - min(sf.start, sb.start))
        rows.append((f, b, af, cf, ab, cb, hidden))
    return OverlapRun(step_time("plain"), step_time("over"), all(r["same"] for r in res), res[0]["loss"], rank, rows,
                      sum(r[6] for r in rows), sum(min(af, cb) + min(ab, cf) for _, _, af, cf, ab, cb, _ in rows))


__all__ = ["dualpipe_overlap", "OverlapRun"]
