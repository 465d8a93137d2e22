"""The real runs behind chapter 9's graders (course_lib/grading/nd_parallel.py): each layout's
peak memory measured, the groups a composed step went through recorded, and composed
training with a given ``data_dims`` compared with one device. Only public course_lib names:
the composition is ``parallelize_nd`` itself, its step 6 the function under test
(``parallelize_nd(..., dims_of=)``).

    measure_layouts(cfg, 4, [dict(dp=2, pp=2, cp=1, tp=1, microbatches=2)], batch=4)   # [peak bytes]
    recorded_groups()                      # {(layout, rank, what): global ranks}, from a real run
    composed_runs(data_dims)               # [None or what differs from one device], one per layout
"""
from __future__ import annotations

import contextlib
import itertools

import torch

from course_lib.gpt import GPTConfig
from course_lib.launch import launch

DIM_KEYS = ("dp", "pp", "cp", "tp")
STEPS = 3                # training steps of exercise 3's composed runs (AdamW at LR)
LR = 1e-2
DTYPE = torch.float64    # exactness is the claim: compared within course_lib.tolerance's float64 bounds


def tiny_config(**kw) -> GPTConfig:
    """The chapter's tiny Llama: 2 layers, 2 heads of 8, 8 tokens, 32-symbol vocabulary."""
    base = dict(vocab_size=32, seq_len=8, n_layers=2, hidden=16, n_heads=2)
    return GPTConfig(**{**base, **kw})


# ============================================================================ peaks of layouts
def _layout_rank(cfg, layouts, batch):
    """On every rank: each layout in turn (a Mesh of its own), one AdamW step to create the
    optimizer's moments, then the peak bytes of the second step (forward, backward, gradient
    sums, optimizer step) under course_lib.memory's tracker. Storage bytes: deterministic."""
    import torch.nn as nn

    from course_lib.gpt import TinyGPT
    from course_lib.memory import measure
    from course_lib.parallel import Mesh
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.reference import gpt_batches

    (x1, y1), (x2, y2) = gpt_batches(cfg, batch=batch, steps=2)
    peaks = []
    for layout in layouts:
        mesh = Mesh(**{d: layout[d] for d in DIM_KEYS})
        net = parallelize_nd(TinyGPT(cfg, seed=0), mesh, microbatches=layout["microbatches"])
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        net.step(x1, y1)
        opt.step()
        opt.zero_grad()

        def second_step():
            net.step(x2, y2)
            opt.step()
        peaks.append(measure(second_step, nn.ModuleList(list(net.modules.values())), opt).peak)
    return peaks


def _layout_to_measure(lay) -> dict:
    if not isinstance(lay, dict) or set(lay) != set(DIM_KEYS + ("microbatches",)):
        raise ValueError(f"measure_layouts: each layout is a dict with exactly the keys dp, pp, cp, tp, "
                         f"microbatches; got {lay!r}")
    bad = {k: v for k, v in lay.items() if isinstance(v, bool) or not isinstance(v, int)}
    if bad:
        raise ValueError(f"measure_layouts: the sizes of a layout are ints, got {bad}")
    return dict(lay)


_MEASURED: dict = {}   # (repr(cfg), world_size, batch, layout items) -> peak bytes of its fullest rank


def measure_layouts(cfg, world_size, layouts, batch, timeout=120.0) -> list[int]:
    """Run every layout in ``layouts`` (dicts dp, pp, cp, tp, microbatches; each passing
    ``check_layout``) on ``world_size`` ranks, one launch for all, and return for each the
    peak bytes of its FULLEST rank during a training step (the second one: Adam's moments
    exist), measured by ``course_lib.memory.measure``. What the grader runs.

    Each layout is measured once per process and its peak kept: a second call (yours, or the
    grader's) launches only the layouts not measured yet. Peaks are bytes of storages, the
    same from run to run up to a few KiB of communication buffers that a gloo thread frees
    after ``wait()`` has returned (see :mod:`course_lib.memory`); kept, they are the same
    numbers for your code and the grader, so a budget can sit one byte under a boundary."""
    from course_lib.parallel.compose import check_layout

    layouts = [_layout_to_measure(lay) for lay in layouts]
    for lay in layouts:
        check_layout(cfg, **lay, world_size=world_size, batch=batch)   # a ValueError naming the constraint
    keys = [(repr(cfg), world_size, batch, tuple(sorted(lay.items()))) for lay in layouts]
    todo = list({k: lay for k, lay in zip(keys, layouts) if k not in _MEASURED}.items())
    if todo:
        per_rank = launch(_layout_rank, world_size, cfg, [lay for _, lay in todo], batch, threads=1,
                          timeout=timeout, quiet=True)
        for i, (k, _) in enumerate(todo):
            _MEASURED[k] = max(rank[i] for rank in per_rank)
    return [_MEASURED[k] for k in keys]


# ============================================================================ groups of a real run
# (label, config overrides, mesh, parallelize_nd keywords, the collectives read off it)
RECORDED = [
    ("dp=2 x tp=2, SP", dict(), dict(dp=2, tp=2), dict(sequence_parallel=True),
     ("sp norm grad", "attention grad", "loss all-reduce")),
    ("dp=2 x tp=2, no SP", dict(), dict(dp=2, tp=2), dict(sequence_parallel=False), ("tp all-reduce",)),
    ("cp=4", dict(), dict(cp=4), dict(), ("kv send", "attention grad", "loss all-reduce")),
    ("pp=2 x tp=2", dict(), dict(pp=2, tp=2), dict(microbatches=2), ("activation send", "loss all-reduce")),
    ("MoE dp=4, ep=2", dict(n_experts=4), dict(dp=4, ep=2), dict(), ("expert all-to-all", "expert grad",
                                                                       "attention grad")),
]


def _record_rank(runs):
    """On every rank: each RECORDED layout trains one step; the global ranks of the groups its
    calls went through are read off the mesh's Comms: their logs (collectives), the gradient
    buckets (gradient sums), and a TrafficCounter on each (the peers of every send)."""
    import torch.distributed as dist

    from course_lib.collectives.comm import TrafficCounter
    from course_lib.gpt import TinyGPT
    from course_lib.parallel import Mesh
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.reference import gpt_batches

    me = dist.get_rank()
    out, meshes = {}, {}
    for label, over, shape, kw in runs:
        cfg = tiny_config(**over)
        key = tuple(sorted(shape.items()))
        mesh = meshes[key] = meshes.get(key) or Mesh(**shape)     # new_group is slow: one per shape
        net = parallelize_nd(TinyGPT(cfg, seed=0), mesh, **kw)
        used = [d for d in DIM_KEYS if mesh.sizes[d] > 1]          # every group a call can go through
        comms = {dims: mesh.comm(dims) for k in range(1, len(used) + 1)
                 for dims in itertools.combinations(used, k)}
        if mesh.ep > 1:
            comms[("ep",)] = mesh.comm("ep")
        for c in comms.values():                                    # this run's calls only
            c.reset()
            c.counter = TrafficCounter()                            # counts sends by peer
        x, y = gpt_batches(cfg, batch=4, steps=1)[0]
        net.step(x, y)
        found = {}
        for c in comms.values():
            for call in c.log:
                if call.op == "all_reduce" and c.dim == "tp":
                    found["tp all-reduce"] = sorted(c.ranks)
                if call.op == "all_to_all_single" and c.dim == "ep":
                    found["expert all-to-all"] = sorted(c.ranks)
                if call.name == "all-reduce loss":
                    found["loss all-reduce"] = sorted(c.ranks)
        buckets = net.grad_sync.buckets if net.grad_sync is not None else []
        for name, q in net.named_parameters().items():         # single-device names, every stage
            bucket = next((b for b in buckets if any(p is q for p in b.params)), None)
            ranks = sorted(bucket.comm.ranks) if bucket is not None else [me]
            if "norm" in name and "weight" in name and kw.get("sequence_parallel"):
                found.setdefault("sp norm grad", ranks)
            if name.endswith("attn.wq.weight"):
                found.setdefault("attention grad", ranks)
            if ".moe.experts." in name:
                found.setdefault("expert grad", ranks)
        sent = {dims: {c.ranks[peer] for peer, n in c.counter.sent_to.items() if n}
                for dims, c in comms.items()}
        found["kv send"] = sorted({me, *sent.get(("cp",), ())})
        found["activation send"] = sorted({me, *(p for p in sent.get(("pp",), ()) if p == mesh.pp_next)})
        out[label] = found
    return out


def recorded_from(per_rank, recorded=None):
    """{(label, rank, what): ranks} from every rank's findings of the runs ``recorded`` (default RECORDED)."""
    out = {}
    for label, _, _, _, whats in (RECORDED if recorded is None else recorded):
        for rank, found in enumerate(per_rank):
            for what in whats:
                out[(label, rank, what)] = found[label].get(what)
    return out


def recorded_runs(recorded=None):
    """The (label, config overrides, mesh, keywords) of ``recorded`` (default RECORDED)."""
    return [(label, over, shape, kw) for label, over, shape, kw, _ in (RECORDED if recorded is None else recorded)]


def recorded_groups(timeout=120.0) -> dict:
    """{(label, rank, what): sorted global ranks} read off one real 4-rank run of each RECORDED layout."""
    return recorded_from(launch(_record_rank, 4, recorded_runs(), threads=1, timeout=timeout, quiet=True))


def record_and_answer(runs, answer, queries):
    """One launch for both: every rank records the groups of the real runs; rank 0 also asks
    ``answer`` (the learner's function, guarded) every query, in this process of its own."""
    import torch.distributed as dist

    found = _record_rank(runs)
    return found, (answer(queries) if dist.get_rank() == 0 else None)


# ============================================================================ composed training
DATA_DIMS_RUNS = [  # (label, config overrides, mesh, parallelize_nd keywords)
    ("cp=2 x tp=2, SP", dict(), dict(cp=2, tp=2), dict(sequence_parallel=True)),
    ("dp=2 x tp=2, SP, 2 micro-batches", dict(), dict(dp=2, tp=2), dict(sequence_parallel=True, microbatches=2)),
    ("MoE dp=4, ep=2", dict(n_experts=4), dict(dp=4, ep=2), dict()),
]


def build_with_dims(model, mesh, dims_of, microbatches=1, sequence_parallel=True):
    """``parallelize_nd``'s plan (DDP, 1F1B) with ``dims_of(p, sizes, fsdp)`` deciding step 6."""
    from course_lib.parallel.compose import parallelize_nd

    return parallelize_nd(model, mesh, microbatches=microbatches, sequence_parallel=sequence_parallel,
                          dims_of=dims_of)


def _data_dims_rank(dims_of, runs, steps):
    """On every rank, for each run: the plan built with ``dims_of``, a few AdamW steps, this
    rank's shards and the losses; or ("error", hint) if ``dims_of`` raised (it raises on every
    rank alike: they all go on to the next run)."""
    from course_lib.gpt import TinyGPT
    from course_lib.parallel import Mesh
    from course_lib.reference import gpt_batches

    out = []
    for over, shape, kw in runs:
        cfg = tiny_config(**over)
        try:
            net = build_with_dims(TinyGPT(cfg, seed=0).to(DTYPE), Mesh(**shape), dims_of, **kw)
        except Exception as exc:  # noqa: BLE001 - the function under test raised: a hint
            name = type(exc).__name__
            out.append(("error", " ".join(str(exc).split()) if name in ("Shortcut", "TimeLimit", "Mismatch")
                        else f"{name}: {exc}"))
            continue
        opt = torch.optim.AdamW(net.parameters(), lr=LR)
        losses, grads = [], None
        for x, y in gpt_batches(cfg, batch=4, steps=steps):
            losses.append(net.step(x, y))
            grads = net.shards(grads=True) if grads is None else grads    # the first step's, summed
            opt.step()
            opt.zero_grad()
        out.append(("ok", (net.shards(), losses, grads)))
    return out


@contextlib.contextmanager
def _one_thread():
    """Tiny matrices: one intra-op thread is as fast, and immune to cores busy with the ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_device(over, shape, kw, steps=STEPS):
    """The single-device run exercise 3 compares with: state, losses and the first step's
    gradients, in DTYPE."""
    from course_lib.gpt import TinyGPT
    from course_lib.reference import gpt_batches, train_gpt

    with _one_thread():
        cfg = tiny_config(**over)
        model = TinyGPT(cfg, seed=0).to(DTYPE)
        m = kw.get("microbatches", 1)
        for block in model.blocks:  # MoE: one routing group per DP rank's micro-batch
            if hasattr(block.mlp, "aux_weight"):
                block.mlp.groups = shape.get("dp", 1) * m
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        first = {}

        def update(params):
            if not first:
                first.update({n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                              for n, p in model.named_parameters()})
            opt.step()
        state, losses = train_gpt(model, gpt_batches(cfg, batch=4, steps=steps), update, micro=m)
        return state, losses, first


def _compare(per_rank, over, shape, kw, steps):
    """None if the first step's gradients, the assembled state after ``steps`` AdamW steps and
    the losses match one device within the bounds of course_lib.tolerance (float64: rounding
    only), else what differs. The gradients first: AdamW divides by each gradient's own scale,
    so a sum taken twice would hide in the parameters."""
    from course_lib import tolerance
    from course_lib.parallel import MeshShape
    from course_lib.parallel.compose import assemble_nd

    want_state, want_losses, want_grads = one_device(over, shape, kw, steps)
    mesh = MeshShape(**shape)
    try:
        grads = assemble_nd([g for _, _, g in per_rank], mesh)
        state = assemble_nd([shards for shards, _, _ in per_rank], mesh)
    except AssertionError as exc:
        name = str(exc).split(":")[0]
        return (f"the copies of {name} on different ranks differ: its gradient was not summed over every "
                f"dimension it is replicated on (and sees other data)")
    missing = sorted(set(want_state) - set(state))
    if missing:
        return f"{missing[0]} is missing from the assembled state"
    state = {n: state[n] for n in want_state}
    bounds = dict(dtype=DTYPE, optimizer="adamw", steps=steps, lr=LR)
    for what, check in (("its first step's gradient", tolerance.compare(grads, want_grads, dtype=DTYPE)),
                        (f"after {steps} AdamW steps", tolerance.compare(state, want_state, **bounds)),
                        ("the step losses", tolerance.compare(per_rank[0][1], want_losses, **bounds))):
        if not check:
            name = "" if what == "the step losses" else f"{check.worst}: "
            return (f"{name}{what} differs from one device by {check.diff:.2g} (float64 rounding allows "
                    f"{check.bound:.2g})")
    return None


def composed_runs_with(dims_of, runs=None, steps=STEPS, timeout=90.0) -> list:
    """Train every run of ``runs`` (default DATA_DIMS_RUNS) for ``steps`` steps in float64 with
    the plan's step 6 decided by ``dims_of(p, sizes, fsdp)``, all in ONE 4-rank launch; for
    each, None if it matches one device (:func:`_compare`), else what differs."""
    runs = DATA_DIMS_RUNS if runs is None else runs
    per_rank = launch(_data_dims_rank, 4, dims_of, [(o, s, k) for _, o, s, k in runs], steps,
                      threads=1, timeout=timeout, quiet=True)
    out = []
    for i, (_, over, shape, kw) in enumerate(runs):
        results = [rank[i] for rank in per_rank]
        errors = [r[1] for r in results if r[0] == "error"]
        out.append(errors[0] if errors else _compare([r[1] for r in results], over, shape, kw, steps))
    return out


__all__ = ["tiny_config", "measure_layouts", "RECORDED", "recorded_groups", "recorded_runs", "recorded_from",
           "record_and_answer",
           "DATA_DIMS_RUNS", "build_with_dims", "one_device", "composed_runs_with", "STEPS", "LR", "DTYPE"]
