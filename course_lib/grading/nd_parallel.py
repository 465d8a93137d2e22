"""Graders of chapter 9 (N-D parallelism), against the library's ``MeshShape.rank_sets``,
``check_layout``, the plan's ``data_dims`` and real runs (:mod:`course_lib.lab.nd_exercise_runs`).

    check_rank_groups(rank_groups)       # (sizes, dims) -> every group of global ranks along dims
    check_choose_layout(choose_layout)   # (cfg, world, budget_bytes, batch) -> dict(dp, pp, cp, tp, microbatches)
    check_group_of(group_of)             # (shape_kwargs, rank, what) -> sorted global ranks taking part
    check_data_dims(data_dims)           # (marks, sizes) -> the mesh dims a gradient is summed over

Tools the exercises use: :func:`measure_layouts`, :data:`WHATS`, :func:`buggy_data_dims`,
:func:`composed_runs`. While the learner's function runs, the library's mesh arithmetic and
composition rules (and this module's answers) are off.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from course_lib.grading import Case, Mismatch, check, explain
from course_lib.grading.guard import learner
from course_lib.grading.harness import check_answers, once
from course_lib.lab.nd_exercise_runs import (DATA_DIMS_RUNS, RECORDED, composed_runs_with, measure_layouts,
                                             record_and_answer, recorded_from, recorded_runs, tiny_config)
from course_lib.launch import launch
from course_lib.parallel import MeshShape, get_reduce_dims, set_reduce_dims
from course_lib.parallel.compose import check_layout, data_dims

DIM_KEYS = ("dp", "pp", "cp", "tp")
MESH_ARITHMETIC = ("course_lib.parallel.mesh:MeshShape.coords", "course_lib.parallel.mesh:MeshShape.rank_of",
                   "course_lib.parallel.mesh:MeshShape.rank_sets", "course_lib.parallel.mesh:Mesh",
                   "course_lib.parallel.mesh:GroupMesh")
ANSWERS = ("course_lib.grading.nd_parallel:_*", "course_lib.parallel.compose:data_dims")


# ============================================================================ 1. groups of a mesh
def _groups(sizes, dims):
    """The reference: the library's mesh arithmetic, each group sorted."""
    return sorted(sorted(g) for g in MeshShape(**sizes).rank_sets(tuple(dims)))


def _as_groups(got):
    if not isinstance(got, (list, tuple)):
        raise Mismatch(f"return a list of groups (lists of global ranks), got {type(got).__name__}")
    try:
        return sorted(sorted(int(r) for r in g) for g in got)
    except (TypeError, ValueError):
        raise Mismatch(f"return a list of groups (lists of global ranks), got {got!r}") from None


def check_rank_groups(rank_groups) -> bool:
    """rank_groups(sizes, dims) -> every group along ``dims`` (a tuple of names from dp, pp,
    cp, tp, ep, edp): lists of the global ranks that differ only in those dims; on meshes with
    odd sizes, every single dim and several combinations, EP inside DP."""
    shapes = [s for s in GROUP_SHAPES if s != dict(dp=2, pp=2, tp=2)]   # (3D: inside 4D's groups)
    dim_sets = [("tp",), ("cp",), ("pp",), ("dp",), ("dp", "cp"), ("dp", "cp", "tp"), ("pp", "tp"),
                ("dp", "pp", "cp")]
    cases = [Case(params=dict(args=(s, d)), label=f"{', '.join(f'{k}={v}' for k, v in s.items())}: groups "
                  f"along {'+'.join(d)}") for s in shapes
             for d in dim_sets + ([("ep",), ("edp",), ("cp", "edp")] if "ep" in s else [])]

    def differ(got, want, sizes, dims):
        if got == want:
            return None
        if sorted(r for g in got for r in g) != sorted(r for g in want for r in g):
            return f"the groups must hold every rank once: got {got}"
        if "ep" in dims and got == _groups(sizes, ("edp",)):
            return "got the edp groups: an EP group is ep CONSECUTIVE dp indexes (the ranks that split the experts)"
        return f"got {got}, expected {want} (TP innermost: rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i)"
    return check_answers("rank_groups", rank_groups, cases, _groups, guard=(MESH_ARITHMETIC, ANSWERS),
                         exercise="the mesh's rank arithmetic", read=lambda got, *_: _as_groups(got), differ=differ)


# ============================================================================ 2. choose a layout
def _refusal(cfg, lay, world_size, batch):
    """None when check_layout accepts ``lay``, else its reason."""
    try:
        check_layout(cfg, **lay, world_size=world_size, batch=batch)
    except ValueError as exc:
        return str(exc)


def _valid_layouts(cfg, world_size, batch):
    """Every (dp, pp, cp, tp) of ``world_size`` ranks, microbatches = pp, that check_layout accepts."""
    sizes = itertools.product(range(1, world_size + 1), repeat=4)
    layouts = [dict(zip(DIM_KEYS, d), microbatches=d[1]) for d in sizes if math.prod(d) == world_size]
    return [lay for lay in layouts if _refusal(cfg, lay, world_size, batch) is None]


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


def _largest_fitting_dp(measured, budget):
    fits = [lay["dp"] for lay, peak in measured if peak <= budget]
    return max(fits) if fits else None


def _as_layout(got):
    keys = DIM_KEYS + ("microbatches",)
    if not isinstance(got, dict):
        raise Mismatch(f"expected a dict(dp=, pp=, cp=, tp=, microbatches=) or None, got {type(got).__name__}")
    missing = [k for k in keys if k not in got]
    if missing:
        raise Mismatch(f"the layout dict lacks {missing}: give dp, pp, cp, tp and microbatches")
    for k in keys:
        if isinstance(got[k], bool) or not isinstance(got[k], int):
            raise Mismatch(f"{k} must be an int, got {got[k]!r}")
    return {k: got[k] for k in keys}


def _describe(lay):
    return " x ".join(f"{d}={lay[d]}" for d in DIM_KEYS if lay[d] > 1) or "one rank"


def check_choose_layout(choose_layout) -> bool:
    """choose_layout(cfg, world_size, budget_bytes, batch) -> dict(dp, pp, cp, tp, microbatches)
    with microbatches = pp, that check_layout accepts, whose measured peak fits the budget on
    every rank, with the largest dp among the layouts that fit; None if none fits. Budgets
    sit exactly on the measured boundaries (a peak equal to the budget fits)."""
    cases, guarded = [], learner(choose_layout, ANSWERS, exercise="choosing the layout", seconds=300)  # it may measure
    for over, world, batch in LAYOUT_PROBLEMS:
        cfg = tiny_config(**over)
        layouts = _valid_layouts(cfg, world, batch)   # measured when a case first needs them: a failing
        runs = once(lambda cfg=cfg, world=world, batch=batch, layouts=layouts:   # learner costs one launch
                    list(zip(layouts, measure_layouts(cfg, world, layouts, batch))))
        cases += [Case(params=dict(cfg=cfg, runs=runs, dp=dp, under=under, world=world, batch=batch),
                       label=f"world_size={world}, batch={batch}, {cfg.n_layers} layers, seq_len={cfg.seq_len}, "
                             f"budget {'one byte under' if under else 'on'} the smallest peak with dp={dp}")
                  for dp in sorted({lay["dp"] for lay in layouts}, reverse=True) for under in (0, 1)]

    def run(case):
        p = case.params
        runs = p["runs"]()
        budget = _best_per_dp(runs)[p["dp"]] - p["under"]
        want = _largest_fitting_dp(runs, budget)
        got = guarded(dataclasses.replace(p["cfg"]), p["world"], budget, p["batch"])
        if got is None:
            return None if want is None else f"got None, but a layout with dp={want} fits"
        lay = _as_layout(got)
        if want is None:
            smallest = min(pk for _, pk in runs)
            return f"got {_describe(lay)}, but no layout fits {budget} bytes (smallest peak {smallest})"
        if lay["microbatches"] != lay["pp"]:
            return f"use microbatches = pp (one per stage): got microbatches={lay['microbatches']} with pp={lay['pp']}"
        refusal = _refusal(p["cfg"], lay, p["world"], p["batch"])
        if refusal:
            return f"{_describe(lay)} is not a valid layout: {refusal}"
        peak = next(pk for m, pk in runs if m == lay)
        if peak > budget:
            return f"{_describe(lay)} peaks at {peak} bytes on its fullest rank, over the budget of {budget}"
        if lay["dp"] < want:
            return f"{_describe(lay)} fits, but a layout with dp={want} fits too: the largest dp is wanted"
        return None
    return check("choose_layout", cases, run)


# ============================================================================ 3. which group
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


WHAT_DIMS = {"tp all-reduce": ("tp",), "sp norm grad": ("dp", "cp", "tp"), "expert all-to-all": ("ep",),
             "expert grad": ("cp", "edp"), "attention grad": ("dp", "cp"), "loss all-reduce": ("dp", "pp", "cp"),
             "kv send": ("cp",), "activation send": ("pp",)}   # the sends: my line along that dim


def _expected_group(shape_kwargs, rank, what) -> list[int]:
    """The reference answer: my group along WHAT_DIMS[what]; a send: me and the next rank of
    my line (a ring along cp wraps, the last pipeline stage sends nothing)."""
    group = next(g for g in _groups(shape_kwargs, WHAT_DIMS[what]) if rank in g)
    if not what.endswith("send"):
        return group
    i = group.index(rank) + 1
    i = i % len(group) if what == "kv send" else i
    return [rank] if i >= len(group) else sorted({rank, group[i]})


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


def _answers(group_of):
    """In a rank: the learner's answer to each query (a list of ints), or a hint."""
    def answer(queries):
        out = []
        for shape, rank, what in queries:
            try:
                got = group_of(dict(shape), rank, what)
                got = got.tolist() if hasattr(got, "tolist") else got
                if not isinstance(got, (list, tuple, set, range)):
                    raise Mismatch(f"expected a sorted list of global ranks, got {got!r}")
                out.append([int(r) for r in got])
            except Exception as exc:  # noqa: BLE001 - a learner's error becomes a hint
                out.append(explain(exc))
        return out
    return answer


def check_group_of(group_of, timeout=60.0) -> bool:
    """group_of(shape_kwargs, rank, what) -> the sorted global ranks taking part in ``what``
    (a key of WHATS) as seen from ``rank`` of ``MeshShape(**shape_kwargs)``; a group of one
    (a dimension of size 1, no next stage) is [rank]. Graded against the mesh arithmetic on
    GROUP_SHAPES, and against the groups a real run used (RECORDED)."""
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
    guarded = learner(_answers(group_of), ANSWERS, exercise="naming the group")

    def answers():   # one launch: the groups a real run used, and the learner's answers
        per_rank = launch(record_and_answer, 4, recorded_runs(RECORDED), guarded, queries, threads=1,
                          timeout=timeout, quiet=True)
        return recorded_from([found for found, _ in per_rank], RECORDED), per_rank[0][1]
    results = once(answers, hang=lambda exc: f"no answer after {timeout:g} s: an endless loop?")

    def run(case):
        out, p = results(), case.params
        if isinstance(out, str):
            return out
        recorded, got_all = out
        for k, (shape, rank, what) in enumerate(p["qs"]):
            want = (_expected_group(shape, rank, what) if p["kind"] == "arithmetic"
                    else recorded[(p["label"], rank, what)])
            got = got_all[p["start"] + k]
            if got != want:
                return f"rank {rank}, {what!r}: " + (got if isinstance(got, str) else f"got {got}, expected {want}")
        return None
    return check("group_of", cases, run)


# ============================================================================ 4. the wrong group
def buggy_data_dims(marks, sizes):
    """The dims a gradient is summed over, as a first composition wrote it: the marks the
    earlier chapters left on the parameter, an expert over all of dp. Wrong: find why."""
    if "edp" in marks:
        return ("dp",)
    return tuple(marks)


def _checked_dims(dims, marks, sizes):
    """The answer as a tuple of mesh dimension names, or Mismatch saying what is wrong with it."""
    if isinstance(dims, str) or not isinstance(dims, (list, tuple, set, frozenset)):
        raise Mismatch(f"data_dims({marks}, ...) must return a tuple of mesh dimension names, got {dims!r}")
    dims = tuple(dims)
    if not all(isinstance(d, str) for d in dims):
        raise Mismatch(f"data_dims({marks}, ...) returned {dims!r}: names like 'dp', 'cp'")
    if dims:
        try:
            MeshShape(**{d: sizes.get(d, 1) for d in DIM_KEYS + ("ep",)}).rank_sets(dims)
        except ValueError as exc:
            raise Mismatch(f"data_dims({marks}, ...) returned {dims!r}: {exc}") from None
    return dims


def _dims_of(data_dims):
    """``data_dims(marks, sizes)`` in the plan's form ``dims_of(p, sizes, fsdp)``."""
    def dims_of(p, sizes, fsdp):
        marks = tuple(get_reduce_dims(p, ("dp",)))
        return _checked_dims(data_dims(marks, dict(sizes)), marks, sizes)
    return dims_of


def composed_runs(data_dims, runs=None, **kw) -> list:
    """Train every run of ``runs`` (default DATA_DIMS_RUNS) with ``data_dims(marks, sizes)``
    deciding each gradient's dims, in one 4-rank launch; for each, None if it matches one
    device (float64: first-step gradients, parameters after AdamW steps, losses, within
    course_lib.tolerance's bounds), else what differs (see lab.nd_exercise_runs.composed_runs_with)."""
    return composed_runs_with(_dims_of(data_dims), runs, **kw)


def _expected_dims(marks, sizes):
    """The reference: the plan's own rule (``compose.data_dims``) on a parameter marked ``marks``;
    an expert marked as the plan marks it, by the ranks that hold it (``expert_replicas``: "edp"
    and the stage dims outside the expert mesh's fold, here "cp")."""
    p = torch.empty(0)
    shape = MeshShape(**sizes)
    set_reduce_dims(p, shape.expert_replicas() if "edp" in marks else marks)
    return set(data_dims(p, dict(sizes, **shape.expert_sizes), False))


RULE_CASES = [  # (marks, sizes): every dimension, odd sizes, experts with cp > 1 (no composed run has that)
    (("dp",), dict(dp=2, pp=2, cp=2, tp=2, ep=1)),
    (("dp", "tp"), dict(dp=3, pp=1, cp=2, tp=2, ep=1)),
    (("edp",), dict(dp=4, pp=1, cp=2, tp=1, ep=2)),
    (("edp",), dict(dp=6, pp=2, cp=3, tp=1, ep=3)),
    (("edp",), dict(dp=4, pp=2, cp=1, tp=1, ep=2)),   # (with tp > 1 an expert outside the fold sums over tp too)
    (("dp", "tp"), dict(dp=1, pp=3, cp=1, tp=3, ep=1)),
]


def check_data_dims(data_dims, timeout=90.0) -> bool:
    """data_dims(marks, sizes) -> the mesh dims a parameter's gradient is summed over, given
    the dims the earlier chapters marked it with (("dp",) for most, ("dp", "tp") for a
    sequence-parallel norm, ("edp",) for an expert) and the mesh sizes (dp, pp, cp, tp, ep).
    First the rule on meshes with every dimension (experts with cp > 1 included); then each
    layout of DATA_DIMS_RUNS (4 ranks) trains with it for 3 steps in float64 and must match
    one device within rounding (course_lib.tolerance). One launch runs them all."""
    guarded = learner(data_dims, ANSWERS, exercise="the dims a gradient is summed over", seconds=5)
    cases = [Case(params=dict(rules=True), label="the rule on 6 meshes, experts with cp > 1 among them")]
    cases += [Case(params=dict(i=i), label=label) for i, (label, *_) in enumerate(DATA_DIMS_RUNS)]
    results = once(lambda: composed_runs(guarded, timeout=timeout), hang=lambda exc: (
        f"hung (no result after {timeout:g} s): do the ranks of a group all agree on its dims? "
        + "; ".join(f"rank {r} {what}" for r, what in sorted(exc.stuck.items())[:2])))

    def rules():
        for marks, sizes in RULE_CASES:
            want = _expected_dims(marks, sizes)
            got = _checked_dims(guarded(marks, dict(sizes)), marks, sizes)
            size = {**sizes, "edp": sizes["dp"] // sizes["ep"]}
            got = {d for d in got if size.get(d, 1) > 1}
            if got != want:
                missing, extra = sorted(want - got), sorted(got - want)
                if "edp" in marks and "dp" in got:
                    return (f"marks {marks} on {sizes}: an expert lives on one rank of each EP group; summed over "
                            f"all of dp, different experts are added together (sum over edp)")
                why = (f"missing {missing}: every rank along it holds this parameter and sees other data" if missing
                       else f"{extra} too: along it the ranks hold different parts (or it doubles a sum)")
                return f"marks {marks} on {sizes}: {why}"
        return None

    def run(case):
        if case.params.get("rules"):
            return rules()
        out = results()
        return out if isinstance(out, str) else out[case.params["i"]]
    return check("data_dims", cases, run)


__all__ = ["tiny_config", "measure_layouts", "check_rank_groups", "check_choose_layout", "WHATS", "GROUP_SHAPES",
           "check_group_of", "buggy_data_dims", "DATA_DIMS_RUNS", "composed_runs", "check_data_dims"]
