"""Graders of chapter 9 (N-D parallelism): choose a layout by running it, name the group of
a collective, repair the dims a composed run sums each gradient over.

    check_choose_layout(choose_layout)   # (cfg, world, budget_bytes, batch) -> dict(dp, pp, cp, tp, microbatches)
    check_group_of(group_of)             # (shape_kwargs, rank, what) -> sorted global ranks taking part
    check_data_dims(data_dims)           # (marks, sizes) -> the mesh dims a gradient is summed over

Tools the exercises use: :func:`measure_layouts` (the largest per-rank peak of each layout,
measured), :data:`WHATS` (the collectives of exercise 2), :func:`buggy_data_dims` (the bug
of exercise 3). Each checker prints one line and returns True/False; a learner's exception,
hang or wrong answer becomes the hint, never a traceback.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from course_lib.gpt import GPTConfig
from course_lib.grading import Case, Mismatch, check
from course_lib.launch import LaunchTimeout, launch

DIM_KEYS = ("dp", "pp", "cp", "tp")
STEPS = 3          # training steps of exercise 3's composed runs
TOLERANCE = 1e-5   # max |parameter difference| with one device after them


def tiny_config(**kw) -> GPTConfig:
    """The chapter's tiny Llama: 2 layers, 2 heads of 8, 8 tokens, 32-symbol vocabulary."""
    base = dict(vocab_size=32, seq_len=8, n_layers=2, hidden=16, n_heads=2)
    return GPTConfig(**{**base, **kw})


# ============================================================================ 1. choose a layout
def _layout_rank(cfg, layouts, batch):
    """On every rank: each layout in turn (a Mesh of its own), one AdamW step to create the
    optimizer's moments, then the peak bytes of the second step (forward, backward, gradient
    sums, optimizer step) under course_lib.memory's tracker. Storage bytes: deterministic."""
    import torch.nn as nn

    from course_lib.gpt import TinyGPT
    from course_lib.memory import measure
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
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


def _valid_layouts(cfg, world_size, batch):
    """Every (dp, pp, cp, tp) with product ``world_size`` and microbatches = pp that
    check_layout accepts (the reference's candidates)."""
    from course_lib.parallel.compose import check_layout

    out = []
    for dp in range(1, world_size + 1):
        for pp in range(1, world_size + 1):
            for cp in range(1, world_size + 1):
                for tp in range(1, world_size + 1):
                    if dp * pp * cp * tp != world_size:
                        continue
                    lay = dict(dp=dp, pp=pp, cp=cp, tp=tp, microbatches=pp)
                    try:
                        check_layout(cfg, **lay, world_size=world_size, batch=batch)
                    except ValueError:
                        continue
                    out.append(lay)
    return out


LAYOUT_PROBLEMS = [  # (config overrides, world size, global batch); the cheapest first
    (dict(), 2, 4),
    (dict(n_layers=3, seq_len=12), 3, 6),  # pp=3, cp=3 possible; tp=3 is not (2 heads)
    (dict(), 4, 4),
]


def _best_per_dp(measured):
    """{dp: the smallest peak of a layout with that dp}."""
    best = {}
    for lay, peak in measured:
        best[lay["dp"]] = min(best.get(lay["dp"], peak), peak)
    return best


def _budgets(measured):
    """Budgets set exactly on the boundaries: for each dp, the smallest peak of a layout with
    that dp, and one byte less (under the smallest peak of all: nothing fits)."""
    return sorted({b for peak in _best_per_dp(measured).values() for b in (peak, peak - 1)}, reverse=True)


def _largest_fitting_dp(measured, budget):
    fits = [lay["dp"] for lay, peak in measured if peak <= budget]
    return max(fits) if fits else None


def _as_layout(got):
    if not isinstance(got, dict):
        raise Mismatch(f"expected a dict(dp=, pp=, cp=, tp=, microbatches=) or None, got {type(got).__name__}")
    missing = [k for k in DIM_KEYS + ("microbatches",) if k not in got]
    if missing:
        raise Mismatch(f"the layout dict lacks {missing}: give dp, pp, cp, tp and microbatches")
    out = {}
    for k in DIM_KEYS + ("microbatches",):
        v = got[k]
        if isinstance(v, bool) or not isinstance(v, int):
            raise Mismatch(f"{k} must be an int, got {v!r}")
        out[k] = v
    return out


def _describe(lay):
    return " x ".join(f"{d}={lay[d]}" for d in DIM_KEYS if lay[d] > 1) or "one rank"


def check_choose_layout(choose_layout) -> bool:
    """choose_layout(cfg, world_size, budget_bytes, batch) -> dict(dp, pp, cp, tp, microbatches)
    with microbatches = pp, that check_layout accepts, whose measured peak fits the budget on
    every rank, with the largest dp among the layouts that fit; None if none fits. Budgets
    sit exactly on the measured boundaries (a peak equal to the budget fits)."""
    from course_lib.parallel.compose import check_layout

    problems, cases = [], []
    for k, (over, world, batch) in enumerate(LAYOUT_PROBLEMS):
        cfg = tiny_config(**over)
        layouts = _valid_layouts(cfg, world, batch)
        problems.append((cfg, world, batch, layouts))
        for dp in sorted({lay["dp"] for lay in layouts}, reverse=True):   # two budgets per dp: on and under
            for under in (0, 1):
                cases.append(Case(params=dict(k=k, dp=dp, under=under, world=world, batch=batch),
                                  label=f"world_size={world}, batch={batch}, {cfg.n_layers} layers, seq_len="
                                        f"{cfg.seq_len}, budget {'one byte under' if under else 'on'} the "
                                        f"smallest peak with dp={dp}"))
    measured_of = {}

    def measured(k):  # measured when a case first needs it: a failing learner costs one launch
        if k not in measured_of:
            cfg, world, batch, layouts = problems[k]
            measured_of[k] = list(zip(layouts, measure_layouts(cfg, world, layouts, batch)))
        return measured_of[k]

    def run(case):
        p = case.params
        cfg, runs = problems[p["k"]][0], measured(p["k"])
        p["budget"] = _best_per_dp(runs)[p["dp"]] - p["under"]
        want = _largest_fitting_dp(runs, p["budget"])
        got = choose_layout(dataclasses.replace(cfg), p["world"], p["budget"], p["batch"])
        if got is None:
            if want is None:
                return None
            return f"got None, but a layout with dp={want} fits"
        lay = _as_layout(got)
        if want is None:
            smallest = min(pk for _, pk in runs)
            return f"got {_describe(lay)}, but no layout fits {p['budget']} bytes (smallest peak {smallest})"
        if lay["microbatches"] != lay["pp"]:
            return f"use microbatches = pp (one per stage): got microbatches={lay['microbatches']} with pp={lay['pp']}"
        try:
            check_layout(cfg, **lay, world_size=p["world"], batch=p["batch"])
        except ValueError as exc:
            return f"{_describe(lay)} is not a valid layout: {exc}"
        peak = dict((tuple(sorted(m.items())), pk) for m, pk in runs)[tuple(sorted(lay.items()))]
        if peak > p["budget"]:
            return f"{_describe(lay)} peaks at {peak} bytes on its fullest rank, over the budget of {p['budget']}"
        if lay["dp"] < want:
            return f"{_describe(lay)} fits, but a layout with dp={want} fits too: the largest dp is wanted"
        return None
    return check("choose_layout", cases, run)


# ============================================================================ 2. which group
WHATS = {
    "tp all-reduce": "the all-reduce of a row-parallel layer's output (TP without SP)",
    "sp norm grad": "the gradient sum of a sequence-parallel norm weight",
    "kv send": "ring attention: this rank and the rank it sends its K/V block to",
    "activation send": "this rank and the next pipeline stage it sends activations to",
    "expert all-to-all": "the MoE dispatch all-to-all",
    "expert grad": "the gradient sum of an expert weight",
    "attention grad": "the gradient sum of an attention weight (wq, a TP shard)",
    "loss all-reduce": "the all-reduce of the step's loss",
}


def expected_group(shape_kwargs, rank, what) -> list[int]:
    """The reference answer, from :class:`MeshShape`'s arithmetic and compose's rules."""
    from course_lib.parallel.mesh import MeshShape

    shape = MeshShape(**shape_kwargs)
    c = shape.coords(rank)

    def group(dims):
        return sorted(next(s for s in shape.rank_sets(dims) if rank in s))

    def with_peer(dim, step):
        i = c[dim] + step
        if dim == "cp":
            i %= shape.sizes["cp"]
        if i >= shape.sizes[dim]:
            return [rank]
        peer = shape.rank_of(**{**{d: c[d] for d in DIM_KEYS}, dim: i})
        return sorted({rank, peer})

    return {
        "tp all-reduce": lambda: group("tp"),
        "sp norm grad": lambda: group(("dp", "cp", "tp")),
        "kv send": lambda: with_peer("cp", 1),
        "activation send": lambda: with_peer("pp", 1),
        "expert all-to-all": lambda: group("ep"),
        "expert grad": lambda: group(("cp", "edp")),
        "attention grad": lambda: group(("dp", "cp")),
        "loss all-reduce": lambda: group(("dp", "pp", "cp")),
    }[what]()


GROUP_SHAPES = [  # mesh arithmetic, every rank and every collective
    dict(dp=2, tp=2),
    dict(dp=3, tp=2),                        # an odd dp
    dict(dp=2, pp=2, tp=2),                  # 3D
    dict(dp=2, pp=2, cp=2, tp=2),            # 4D
    dict(pp=3, cp=3),                        # a ring of 3: which way is "next"?
    dict(dp=1, pp=2, cp=2, tp=3),
    dict(dp=4, pp=2, ep=2),                  # EP inside DP
    dict(dp=6, tp=2, ep=3),                  # edp = 2
]

# recorded in a real run (4 ranks): (label, config overrides, mesh, NDParallel keywords, whats)
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
    """On every rank: each RECORDED layout trains one step; the global ranks of the groups
    its calls actually went through are read off the Comms (collectives), GradSync's buckets
    (gradient sums) and every point-to-point send (patched to note its global peer)."""
    import torch.distributed as dist

    from course_lib.collectives.comm import Comm
    from course_lib.gpt import TinyGPT
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    from course_lib.reference import gpt_batches

    me = dist.get_rank()
    sends = []
    original = Comm.isend

    def noted(self, tensor, peer, tag=0):
        sends.append((self.dim, self.ranks[peer]))
        return original(self, tensor, peer, tag)

    out, meshes = {}, {}
    Comm.isend = noted
    try:
        for label, over, shape, kw in runs:
            cfg = tiny_config(**over)
            key = tuple(sorted(shape.items()))
            mesh = meshes[key] = meshes.get(key) or Mesh(**shape)     # new_group is slow: one per shape
            net = parallelize_nd(TinyGPT(cfg, seed=0), mesh, **kw)
            for c in mesh._comms.values():                              # this run's calls only
                c.reset()
            sends.clear()
            x, y = gpt_batches(cfg, batch=4, steps=1)[0]
            net.step(x, y)
            comms = [c for key, c in mesh._comms.items() if key != "embedding"]
            found = {}
            for c in comms:
                for call in c.log:
                    if call.op == "all_reduce" and c.dim == "tp":
                        found["tp all-reduce"] = sorted(c.ranks)
                    if call.op == "all_to_all_single" and c.dim == "ep":
                        found["expert all-to-all"] = sorted(c.ranks)
                    if call.name == "all-reduce loss":
                        found["loss all-reduce"] = sorted(c.ranks)
            for name, q in net.stages[min(net.stages)].part.named_parameters():
                bucket = next((b for b in net.grad_sync.buckets if any(p is q for p in b.params)), None) \
                    if net.grad_sync is not None else None
                ranks = sorted(bucket.comm.ranks) if bucket is not None else [me]
                if "norm" in name and "weight" in name and kw.get("sequence_parallel"):
                    found.setdefault("sp norm grad", ranks)
                if name.endswith("attn.wq.weight"):
                    found.setdefault("attention grad", ranks)
                if ".moe.experts." in name:
                    found.setdefault("expert grad", ranks)
            cp_peers = {p for dim, p in sends if dim == "cp"}
            found["kv send"] = sorted({me, *cp_peers})
            pp_next = mesh.pp_next
            found["activation send"] = sorted({me, *(p for dim, p in sends if dim == "pp" and p == pp_next)})
            out[label] = found
    finally:
        Comm.isend = original
    return out


def _recorded(per_rank):
    """{(label, rank, what): ranks} from every rank's findings."""
    out = {}
    for label, _, _, _, whats in RECORDED:
        for rank, found in enumerate(per_rank):
            for what in whats:
                out[(label, rank, what)] = found[label].get(what)
    return out


def _runs():
    return [(label, over, shape, kw) for label, over, shape, kw, _ in RECORDED]


def recorded_groups(timeout=120.0) -> dict:
    """{(label, rank, what): sorted global ranks} read off one real 4-rank run of each
    RECORDED layout (see :func:`_record_rank`)."""
    return _recorded(launch(_record_rank, 4, _runs(), threads=1, timeout=timeout, quiet=True))


def _record_and_answer(runs, group_of, queries):
    """One launch for both: every rank records the groups of the real runs; then rank 0 asks
    the learner's function (in this process of its own: an endless loop meets the timeout)."""
    import torch.distributed as dist

    found = _record_rank(runs)
    return found, (_group_harness(group_of, queries) if dist.get_rank() == 0 else None)


def _group_harness(group_of, queries):
    """In a process of its own: the learner's answer to each query, or the error it raised."""
    answers = []
    for shape, rank, what in queries:
        try:
            got = group_of(dict(shape), rank, what)
            if isinstance(got, torch.Tensor):
                got = got.tolist()
            if isinstance(got, (list, tuple, set, range)):
                got = [int(r) for r in got]
            answers.append(("ok", got))
        except NotImplementedError:
            answers.append(("error", "not implemented yet (NotImplementedError)"))
        except Exception as exc:  # noqa: BLE001 - a learner's error becomes a hint
            answers.append(("error", f"{type(exc).__name__}: {exc}"))
    return answers


def _judge(answer, want, shape, rank, what):
    status, got = answer
    where = f"rank {rank}, {what!r}"
    if status == "error":
        return f"{where}: {got}"
    if not isinstance(got, list):
        return f"{where}: expected a sorted list of global ranks, got {got!r}"
    if got != want:
        return f"{where}: got {got}, expected {want}"
    return None


def check_group_of(group_of, timeout=60.0) -> bool:
    """group_of(shape_kwargs, rank, what) -> the sorted global ranks taking part in ``what``
    (a key of WHATS) as seen from ``rank`` of ``MeshShape(**shape_kwargs)``; a group of one
    (a dimension of size 1, no next stage) is [rank]. Graded against the mesh arithmetic on
    GROUP_SHAPES, and against the groups a real run used (RECORDED)."""
    from course_lib.parallel.mesh import MeshShape

    queries, cases = [], []
    for shape in GROUP_SHAPES:
        n = MeshShape(**shape).world_size
        qs = [(shape, r, w) for r in range(n) for w in WHATS]
        cases.append(Case(params=dict(kind="arithmetic", start=len(queries), qs=qs),
                          label=", ".join(f"{d}={v}" for d, v in shape.items())))
        queries += qs
    for label, _, shape, _, whats in RECORDED:
        qs = [(shape, r, w) for r in range(4) for w in whats]
        cases.append(Case(params=dict(kind="recorded", label=label, start=len(queries), qs=qs),
                          label=f"{label}, groups recorded in a real run"))
        queries += qs
    try:
        per_rank = launch(_record_and_answer, 4, _runs(), group_of, queries, threads=1, timeout=timeout,
                          quiet=True)
        recorded, answers = _recorded([found for found, _ in per_rank]), per_rank[0][1]
    except LaunchTimeout:
        answers = None
        problem = f"no answer after {timeout:g} s: an endless loop?"
    except Exception as exc:  # noqa: BLE001 - e.g. group_of cannot be shipped to a process
        from course_lib.grading import _explain
        answers = None
        problem = _explain(exc)

    def run(case):
        if answers is None:
            return problem
        p = case.params
        for k, (shape, rank, what) in enumerate(p["qs"]):
            want = (expected_group(shape, rank, what) if p["kind"] == "arithmetic"
                    else recorded[(p["label"], rank, what)])
            msg = _judge(answers[p["start"] + k], want, shape, rank, what)
            if msg:
                return msg
        return None
    return check("group_of", cases, run)


# ============================================================================ 3. the wrong group
def buggy_data_dims(marks, sizes):
    """The dims a gradient is summed over, as a first composition wrote it: the marks the
    earlier chapters left on the parameter, an expert over all of dp. Wrong: find why."""
    if "edp" in marks:
        return ("dp",)
    return tuple(marks)


DATA_DIMS_RUNS = [  # (label, config overrides, mesh, NDParallel keywords)
    ("cp=2 x tp=2, SP", dict(), dict(cp=2, tp=2), dict(sequence_parallel=True)),
    ("dp=2 x tp=2, SP, 2 micro-batches", dict(), dict(dp=2, tp=2), dict(sequence_parallel=True, microbatches=2)),
    ("MoE dp=4, ep=2", dict(n_experts=4), dict(dp=4, ep=2), dict()),
]


def _checked_dims(dims, marks, sizes):
    from course_lib.parallel.mesh import _invalid

    if isinstance(dims, str) or not isinstance(dims, (list, tuple, set, frozenset)):
        raise Mismatch(f"data_dims({marks}, ...) must return a tuple of mesh dimension names, got {dims!r}")
    dims = tuple(dims)
    if not all(isinstance(d, str) for d in dims):
        raise Mismatch(f"data_dims({marks}, ...) returned {dims!r}: names like 'dp', 'cp'")
    problem = _invalid(dims) if dims else ""
    if problem:
        raise Mismatch(f"data_dims({marks}, ...) returned {dims!r}: {problem}")
    return dims


def _data_dims_rank(data_dims, runs, steps):
    """On every rank, for each run: compose's ``_data_dims`` replaced by the learner's, a few
    training steps, this rank's shards and the losses; or ("error", hint) if the learner's
    function raised (it raises on every rank alike: they all go on to the next run)."""
    import course_lib.parallel.compose as C
    from course_lib.gpt import TinyGPT
    from course_lib.grading import _explain
    from course_lib.parallel.mesh import Mesh, get_reduce_dims
    from course_lib.reference import gpt_batches

    def patched(p, sizes, fsdp):
        marks = tuple(get_reduce_dims(p, ("dp",)))
        return _checked_dims(data_dims(marks, dict(sizes)), marks, sizes)

    out = []
    for over, shape, kw in runs:
        cfg = tiny_config(**over)
        mesh = Mesh(**shape)
        saved, C._data_dims = C._data_dims, patched
        try:
            net = C.parallelize_nd(TinyGPT(cfg, seed=0), mesh, **kw)
        except Exception as exc:  # noqa: BLE001 - the learner's function raised: a hint
            out.append(("error", _explain(exc)))
            continue
        finally:
            C._data_dims = saved
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        losses = []
        for x, y in gpt_batches(cfg, batch=4, steps=steps):
            losses.append(net.step(x, y))
            opt.step()
            opt.zero_grad()
        out.append(("ok", (net.shards(), losses)))
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
    """The single-device run exercise 3 compares with: state and losses."""
    with _one_thread():
        return _one_device(over, shape, kw, steps)


def _one_device(over, shape, kw, steps):
    from course_lib.gpt import TinyGPT
    from course_lib.reference import gpt_batches, train_gpt

    cfg = tiny_config(**over)
    model = TinyGPT(cfg, seed=0)
    m = kw.get("microbatches", 1)
    for block in model.blocks:  # MoE: one routing group per DP rank's micro-batch
        if hasattr(block.mlp, "aux_weight"):
            block.mlp.groups = shape.get("dp", 1) * m
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return train_gpt(model, gpt_batches(cfg, batch=4, steps=steps), opt, micro=m)


def _compare(per_rank, over, shape, kw, steps):
    """None if the assembled state and the losses match one device within TOLERANCE."""
    from course_lib.parallel.compose import assemble_nd
    from course_lib.parallel.mesh import MeshShape

    want_state, want_losses = one_device(over, shape, kw, steps)
    try:
        state = assemble_nd([shards for shards, _ in per_rank], MeshShape(**shape))
    except AssertionError as exc:
        name = str(exc).split(":")[0]
        return (f"after {steps} steps the copies of {name} on different ranks differ: its gradient was not "
                f"summed over every dimension it is replicated on (and sees other data)")
    for name, want in want_state.items():
        got = state.get(name)
        if got is None:
            return f"{name} is missing from the assembled state"
        if float((got - want).abs().max()) > TOLERANCE:
            return f"{name} differs from one device by more than {TOLERANCE:g} after {steps} steps"
    for k, (got, want) in enumerate(zip(per_rank[0][1], want_losses)):
        if abs(got - float(want)) > TOLERANCE:
            return f"the loss of step {k} differs from one device by more than {TOLERANCE:g}"
    return None


def composed_runs(data_dims, runs=None, steps=STEPS, timeout=90.0) -> list:
    """Train every run of ``runs`` (default DATA_DIMS_RUNS: (label, config overrides, mesh,
    keywords)) for ``steps`` steps with ``data_dims`` patched into compose, all in ONE 4-rank
    launch; for each, None if it matches one device within TOLERANCE, else what differs."""
    runs = DATA_DIMS_RUNS if runs is None else runs
    per_rank = launch(_data_dims_rank, 4, data_dims, [(o, s, k) for _, o, s, k in runs], steps,
                      threads=1, timeout=timeout, quiet=True)
    out = []
    for i, (_, over, shape, kw) in enumerate(runs):
        results = [rank[i] for rank in per_rank]
        errors = [r[1] for r in results if r[0] == "error"]
        out.append(errors[0] if errors else _compare([r[1] for r in results], over, shape, kw, steps))
    return out


def check_data_dims(data_dims, timeout=90.0) -> bool:
    """data_dims(marks, sizes) -> the mesh dims a parameter's gradient is summed over, given
    the dims the earlier chapters marked it with (("dp",) for most, ("dp", "tp") for a
    sequence-parallel norm, ("edp",) for an expert) and the mesh sizes (dp, pp, cp, tp, ep).
    Patched into compose on every rank; each layout of DATA_DIMS_RUNS (4 ranks) trains STEPS
    steps and must match one device within TOLERANCE. One launch runs them all."""
    cases = [Case(params=dict(i=i), label=label) for i, (label, *_) in enumerate(DATA_DIMS_RUNS)]
    outcome = {}

    def run(case):
        if not outcome:
            try:
                outcome["results"] = composed_runs(data_dims, timeout=timeout)
            except LaunchTimeout as exc:
                stuck = "; ".join(f"rank {r} {what}" for r, what in sorted(exc.stuck.items())[:2])
                outcome["problem"] = (f"hung (no result after {timeout:g} s): do the ranks of a group all "
                                      f"agree on its dims? {stuck}")
            except Exception as exc:  # noqa: BLE001 - a rank died: its hint
                from course_lib.grading import _explain
                outcome["problem"] = _explain(exc)
        return outcome.get("problem") or outcome["results"][case.params["i"]]
    return check("data_dims", cases, run)


__all__ = ["tiny_config", "measure_layouts", "check_choose_layout", "WHATS", "expected_group", "GROUP_SHAPES",
           "RECORDED", "recorded_groups", "check_group_of", "buggy_data_dims", "DATA_DIMS_RUNS",
           "one_device", "composed_runs", "check_data_dims"]
