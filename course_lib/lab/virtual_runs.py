"""One training step of an N-D layout on the virtual GPU clock, next to the planner's estimate.

    h100 = VirtualCluster("h100-sxm", gpus_per_node=8, dtype=torch.bfloat16)
    run = virtual_step(cfg, dict(dp=2, tp=2), dict(), batch=8, cluster=h100)
    run.step_time, run.kernels, run.calls   # virtual seconds; kernels per rank; calls per mesh dim
    est = planner_estimate(cfg, run.layout, run.kw, batch=8, hardware=h100.hw)   # the same layout

Chapters 9 and 10 check the planner against the real program priced on the same hardware
preset: the virtual clock prices every kernel the ranks launch and every collective by its
ring cost on the link its group spans, as they happen; the planner (``runtime="course"``,
:mod:`course_lib.planner.runtime`) counts the same kernels and collectives from the layout and
the model config and composes them with its formulas. ``rank_step`` is the one rank program
both chapters run (chapter 9 measures its memory too).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from course_lib import reference
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.launch import launch
from course_lib.parallel.compose import check_layout
from course_lib.parallel.layout_rules import as_layout
from course_lib.planner.kernels import KernelCounter
from course_lib.virtual import VirtualCluster


@dataclasses.dataclass
class VirtualStep:
    layout: dict            # mesh sizes, e.g. dict(dp=2, tp=2)
    kw: dict                # parallelize_nd options (microbatches, schedule, ...)
    step_time: float        # virtual seconds: first rank's start to last rank's end
    kernels: list           # per rank: kernels its compute stream ran in the step
    comm: dict              # mesh dim -> the busiest rank's seconds in that dim's communication
    calls: dict             # mesh dim -> collectives and receives rank 0 made in that dim
    spans: list             # the step, every rank (trace.Span in virtual seconds)


def rank_step(layout, kw, cfg_dict, batch, measure_memory=False):
    """One warm-up step (first-call allocations; under the memory tracker if ``measure_memory``),
    then one step with its spans kept; every rank's clock starts the kept step at the same
    virtual time (a priced barrier). Returns the kept step's kernels (and memory, p2p bytes)."""
    from course_lib import memory, trace
    from course_lib.collectives import Comm
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    cfg = GPTConfig(**cfg_dict)
    net = parallelize_nd(TinyGPT(cfg, seed=0), Mesh(**layout), **kw)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)
    x, y = reference.gpt_batches(cfg, batch=batch, steps=1)[0]

    def step():
        net.step(x, y)
        opt.step()
    out = {}
    if measure_memory:
        out["memory"] = dataclasses.asdict(memory.measure(step, torch.nn.ModuleList(list(net.modules.values())), opt))
    else:
        step()
    opt.zero_grad()
    Comm(None).barrier()                    # every rank's clock at the same virtual time
    trace.reset()                           # keep the next step's spans only
    before = trace.clock().kernels
    with trace.span("step", "other"):
        step()
        opt.zero_grad()
    out["kernels"] = trace.clock().kernels - before
    out["p2p_bytes"] = net.last_result.bytes_sent if net.last_result else 0
    return out


def virtual_step(cfg: GPTConfig, layout: dict, kw: dict, batch: int, cluster) -> VirtualStep:
    """One step of ``cfg`` on ``layout`` (refused before any rank starts if invalid), priced on
    ``cluster`` (a VirtualCluster)."""
    shape = check_layout(cfg, **layout, batch=batch, **kw)
    cluster.check(shape.world_size)
    res = launch(rank_step, shape.world_size, layout, kw, dataclasses.asdict(cfg), batch,
                 threads=1, timeout=300, clock=cluster)
    steps = [s for s in res.spans if s.name == "step"]
    comm, calls = {}, {}
    for s in res.spans:
        # the clock's own spans: collectives and receives (a send overlaps its receive; the
        # pipeline's "recv act/grad", "wait sends" and the ring's "K/V hop" wrap the clock's)
        if s.kind == "comm" and s.dim and not s.name.startswith(("send", "wait", "recv act", "recv grad", "K/V")):
            comm.setdefault(s.dim, [0.0] * shape.world_size)[s.rank] += s.duration
            calls[s.dim] = calls.get(s.dim, 0) + (s.rank == 0)
    return VirtualStep(dict(layout), dict(kw), max(s.end for s in steps) - min(s.start for s in steps),
                       [r["kernels"] for r in res], {d: max(t) for d, t in comm.items()}, calls,
                       [s for s in res.spans if s.name != "step"])


def planner_estimate(cfg: GPTConfig, layout: dict, kw: dict, batch: int, hardware, runtime="course"):
    """``planner.estimate`` of ``cfg`` on the same layout (the one Layout the ranks run: SP as
    parallelize_nd applies it, ZeRO-3 for FSDP, gradients summed after backward) and hardware
    preset, by default as the course's runtime runs it (``runtime="course"``: its kernels,
    launches and collectives; the chapters' model writes attention out, :func:`~course_lib.planner.written_out`)."""
    from course_lib.planner import estimate, written_out
    from course_lib.planner.calibration import model_spec

    spec = model_spec(cfg)
    if cfg.n_experts:
        spec = spec.with_(n_experts=cfg.n_experts, top_k=cfg.top_k)
    hw = written_out(hardware) if runtime == "course" else hardware
    return estimate(spec, hw, as_layout(dims=layout, batch=batch, **kw), runtime=runtime)


# The kernels the course's runtime adds to a TinyGPT step, counted on its own code. The planner
# (planner/runtime.py, which sits below parallel/) holds them as numbers;
# tests/test_planner_runtime.py checks its numbers against these counts.

@functools.lru_cache(maxsize=1)
def count_vocab_parallel_loss_kernels() -> int:
    """Kernels of the course's vocabulary-parallel cross entropy (forward and backward) less
    those of the plain one it replaces (log-softmax, NLL and their backwards): counted on a
    small CPU instance with its two all-reduces left out (the count does not depend on sizes)."""
    from course_lib.parallel.vocab_parallel import VocabParallelCrossEntropy

    class Alone:                                      # the group's all-reduces: nothing to add
        def all_reduce(self, tensor, op=None, name=""):
            return None
    logits = torch.zeros(4, 8, requires_grad=True)
    with KernelCounter(None, 2) as c:
        VocabParallelCrossEntropy.apply(logits, torch.zeros(4, dtype=torch.long), Alone(), 0).sum().backward()
    plain = torch.zeros(4, 8, requires_grad=True)
    with KernelCounter(None, 2) as d:
        torch.nn.functional.cross_entropy(plain, torch.zeros(4, dtype=torch.long), reduction="none").sum().backward()
    return c.total.count - d.total.count


@functools.lru_cache(maxsize=16)
def count_ring_attention_kernels(cp: int, grouped: bool) -> tuple[int, int]:
    """(forward, backward) kernels the course's ring attention (zigzag) adds to one layer on the
    busiest of ``cp`` ranks, over the plain causal attention it replaces; counted on a small CPU
    instance whose K/V messages are not sent (the counts do not depend on sizes)."""
    from course_lib.gpt import GPTConfig, TinyGPT
    from course_lib.parallel.context_parallel import context_parallel, shard_positions

    class Ring:                                       # a rank of the ring, its messages not sent
        def __init__(self, r):
            self.size, self.rank, self.prev, self.next, self.dim = cp, r, (r - 1) % cp, (r + 1) % cp, "cp"

        def irecv(self, tensor, peer, tag=0):
            return self

        isend = irecv

        def wait(self, *works):
            return True
    cfg = GPTConfig(vocab_size=8, seq_len=4 * cp, n_layers=1, hidden=32, n_heads=4, n_kv_heads=2 if grouped else 4)
    busiest = (0, 0)
    for r in range(cp):
        attn = TinyGPT(cfg, seed=0).blocks[0].attn
        counts = []
        for ring in (None, Ring(r)):
            if ring is not None:
                context_parallel(attn, ring)
            x = torch.zeros(1, 4, cfg.hidden, requires_grad=True)              # (b, s/cp, h)
            args = (x,) if ring is None else (x, shard_positions(cfg.seq_len, cp, r, "zigzag"))
            with KernelCounter(None, 2) as f:
                y = attn(*args).sum()
            with KernelCounter(None, 2) as b:
                y.backward()
            counts.append((f.total.count, b.total.count))
        busiest = max(busiest, (counts[1][0] - counts[0][0], counts[1][1] - counts[0][1]), key=sum)
    return busiest


# ----------------------------------------------------------------------------- placing a mesh on nodes
def _placed_steps(cfg_dict, sizes, kw, batch, placements):
    """One warm-up step, then one step per placement (the clock's node map switched between
    steps): per placement, this rank's (start, end) of the step in virtual seconds."""
    from course_lib import trace
    from course_lib.collectives import Comm
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh

    cfg = GPTConfig(**cfg_dict)
    net = parallelize_nd(TinyGPT(cfg, seed=0), Mesh(**sizes), **kw)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = reference.gpt_batches(cfg, batch=batch, steps=1)[0]
    cluster, out = trace.clock().cluster, []
    for nodes in [None] + list(placements):
        cluster.nodes = nodes
        Comm(None).barrier()
        trace.reset()
        with trace.span("step", "other"):
            net.step(x, y)
            opt.step()
            opt.zero_grad()
        s = next(s for s in trace.spans() if s.name == "step")
        out.append((s.start, s.end))
    return out[1:]


class PlacedCluster(VirtualCluster):
    """A VirtualCluster whose rank r sits on node ``nodes[r]`` (set between steps; None: blocks
    of ``gpus_per_node`` consecutive ranks, VirtualCluster's own placement)."""

    nodes = None

    def node(self, rank: int) -> int:
        return self.nodes[rank] if self.nodes is not None else rank // self.gpus_per_node


def placement_step_times(cfg: GPTConfig, sizes: dict, kw: dict, batch: int, placements, hardware,
                         gpus_per_node: int) -> list:
    """The virtual step time of one ``parallelize_nd`` training step for each placement
    (placement[r] = the node of the course mesh's rank r), all in one launch: the clock's node
    map is switched between steps."""
    world = len(placements[0])
    res = launch(_placed_steps, world, dict(cfg.__dict__), sizes, kw, batch, list(placements),
                 clock=PlacedCluster(hardware, gpus_per_node, torch.bfloat16), threads=1, timeout=60, quiet=True)
    return [max(r[i][1] for r in res) - min(r[i][0] for r in res) for i in range(len(placements))]


__all__ = ["VirtualStep", "virtual_step", "rank_step", "planner_estimate",
           "count_vocab_parallel_loss_kernels", "count_ring_attention_kernels", "PlacedCluster",
           "placement_step_times"]
