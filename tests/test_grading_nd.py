"""Chapter 9's graders (course_lib/grading/nd_parallel.py, runs in course_lib/lab/nd_exercise_runs.py): the
grader's own answers agree with the library and with real runs; a differently written right
answer passes; classic mistakes, an answer hard-coded to a printed case and a shortcut through
the library or the grader's answers each fail with a hint; an exception or a hang is a failed
case with a hint, never a crash."""
from __future__ import annotations

import itertools

import pytest
import torch

from course_lib.lab import nd_exercise_runs as E
from course_lib.grading import nd_parallel as nd
from course_lib.parallel import MeshShape
from course_lib.parallel.compose import check_layout
from grading_answers import fails_with, graded


# ----------------------------------------------------------------------------- 1. groups of a mesh
def rank_groups(sizes, dims):
    """Written with a tensor of ranks: (dp, pp, cp, tp) -> dims moved last, flattened."""
    ep = sizes.get("ep", 1)
    dp, pp, cp, tp = (sizes.get(d, 1) for d in ("dp", "pp", "cp", "tp"))
    ranks = torch.arange(dp * pp * cp * tp).view(dp // ep, ep, pp, cp, tp)      # dp split as (edp, ep)
    axes = {"edp": 0, "ep": 1, "pp": 2, "cp": 3, "tp": 4}
    named = {a for d in dims for a in (("edp", "ep") if d == "dp" else (d,))}
    last = [axes[d] for d in ("edp", "ep", "pp", "cp", "tp") if d in named]
    first = [a for a in range(5) if a not in last]
    groups = ranks.permute(*first, *last).reshape(-1, int(torch.tensor([ranks.shape[a] for a in last]).prod()))
    return groups.tolist()


def tp_outermost(sizes, dims):
    order = ("tp", "cp", "pp", "dp")
    sz = {d: sizes.get(d, 1) for d in order}
    groups = {}
    for idx in itertools.product(*(range(sz[d]) for d in order)):
        c = dict(zip(order, idx))
        rank = ((c["tp"] * sz["cp"] + c["cp"]) * sz["pp"] + c["pp"]) * sz["dp"] + c["dp"]
        groups.setdefault(tuple(v for d, v in c.items() if d not in dims), []).append(rank)
    return list(groups.values())


def ep_strided(sizes, dims):             # EP groups as dp indexes i, i + dp/ep, ...: that is edp
    swap = {"ep": "edp", "edp": "ep"}
    return rank_groups(sizes, tuple(swap.get(d, d) for d in dims))


def test_rank_groups(capsys):
    assert graded(capsys, nd.check_rank_groups, rank_groups)[0]
    fails_with(capsys, nd.check_rank_groups, tp_outermost, hint="TP innermost")
    fails_with(capsys, nd.check_rank_groups, ep_strided, hint="CONSECUTIVE")
    fails_with(capsys, nd.check_rank_groups, lambda sizes, dims: [[0, 1], [2, 3]], hint=("every rank", "expected"))
    fails_with(capsys, nd.check_rank_groups, lambda sizes, dims: MeshShape(**sizes).rank_sets(dims),
               hint="write this yourself")


def by_hand(sizes, dims):
    """rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i; dp_i = edp_i * ep + ep_i (ep:
    consecutive dp indexes); a group: the ranks whose coordinates differ only along ``dims``."""
    keys = ("dp", "pp", "cp", "tp")
    sz, ep = {d: sizes.get(d, 1) for d in keys}, sizes.get("ep", 1)
    covered = set(dims) | ({"ep", "edp"} if "dp" in dims else set())
    out = {}
    for idx in itertools.product(*(range(sz[d]) for d in keys)):
        c = dict(zip(keys, idx))
        rank = ((c["dp"] * sz["pp"] + c["pp"]) * sz["cp"] + c["cp"]) * sz["tp"] + c["tp"]
        c["edp"], c["ep"] = divmod(c["dp"], ep)
        out.setdefault(tuple(c[d] for d in ("pp", "cp", "tp", "edp", "ep") if d not in covered), []).append(rank)
    return sorted(sorted(g) for g in out.values())


def test_the_graders_reference_is_the_mesh_arithmetic_by_hand():
    for sizes in nd.GROUP_SHAPES:
        dim_sets = [ds for k in (1, 2, 3) for ds in itertools.combinations(("dp", "pp", "cp", "tp"), k)]
        if "ep" in sizes:
            dim_sets += [("ep",), ("edp",), ("cp", "edp"), ("pp", "ep")]
        for dims in dim_sets:
            assert nd._groups(sizes, dims) == by_hand(sizes, dims), (sizes, dims)


# ----------------------------------------------------------------------------- 2. which group
def group_of(shape_kwargs, rank, what):
    """With rank_groups and MeshShape.coords only for the ring's direction."""
    sizes = dict(shape_kwargs)

    def mine(dims):
        return next(sorted(g) for g in rank_groups(sizes, dims) if rank in g)
    if what in ("kv send", "activation send"):
        dim = "cp" if what == "kv send" else "pp"
        line = mine((dim,))
        i = line.index(rank) + 1
        if dim == "cp":
            i %= len(line)
        return [rank] if i == len(line) else sorted({rank, line[i]})
    return mine({"tp all-reduce": ("tp",), "sp norm grad": ("dp", "cp", "tp"), "expert all-to-all": ("ep",),
                 "expert grad": ("cp", "edp"), "attention grad": ("dp", "cp"),
                 "loss all-reduce": ("dp", "pp", "cp")}[what])


def test_expected_groups_by_hand():
    four_d = dict(dp=2, pp=2, cp=2, tp=2)   # rank 5: dp 0, pp 1, cp 0, tp 1
    assert nd._expected_group(four_d, 5, "tp all-reduce") == [4, 5]
    assert nd._expected_group(four_d, 5, "attention grad") == [5, 7, 13, 15]
    assert nd._expected_group(four_d, 5, "sp norm grad") == [4, 5, 6, 7, 12, 13, 14, 15]
    assert nd._expected_group(four_d, 5, "kv send") == [5, 7]
    assert nd._expected_group(four_d, 5, "activation send") == [5]           # the last stage
    assert nd._expected_group(four_d, 1, "activation send") == [1, 5]
    assert nd._expected_group(four_d, 5, "loss all-reduce") == [1, 3, 5, 7, 9, 11, 13, 15]
    assert nd._expected_group(dict(pp=3, cp=3), 2, "kv send") == [0, 2]      # the ring wraps
    moe = dict(dp=4, pp=2, ep=2)             # rank = dp_i * 2 + pp_i; ep = consecutive dp indexes
    assert nd._expected_group(moe, 0, "expert all-to-all") == [0, 2]
    assert nd._expected_group(moe, 0, "expert grad") == [0, 4]
    assert nd._expected_group(moe, 0, "attention grad") == [0, 2, 4, 6]


def test_recorded_groups_agree_with_the_graders_arithmetic():
    """The second answer key (groups a real run used) is complete and says what the first does."""
    recorded = E.recorded_groups()
    shapes = {label: shape for label, _, shape, _, _ in E.RECORDED}
    assert len(recorded) == sum(4 * len(whats) for *_, whats in E.RECORDED)
    for (label, rank, what), ranks in recorded.items():
        assert ranks == nd._expected_group(shapes[label], rank, what), (label, rank, what)


def test_group_of(capsys, monkeypatch):
    monkeypatch.setattr(nd, "RECORDED", [run for run in nd.RECORDED if run[0] == "cp=4"])   # quick to record
    assert graded(capsys, nd.check_group_of, group_of)[0]

    def ring_backwards(shape, rank, what):
        if what != "kv send":
            return group_of(shape, rank, what)
        line = next(sorted(g) for g in rank_groups(shape, ("cp",)) if rank in g)
        return sorted({rank, line[line.index(rank) - 1]})
    fails_with(capsys, nd.check_group_of, ring_backwards, hint="'kv send'")
    fails_with(capsys, nd.check_group_of,
               lambda shape, rank, what: group_of(shape, rank, "tp all-reduce") if what == "loss all-reduce"
               else group_of(shape, rank, what), hint="'loss all-reduce'")
    fails_with(capsys, nd.check_group_of,
               lambda shape, rank, what: group_of(shape, rank, "attention grad") if what == "expert grad"
               else group_of(shape, rank, what), hint="'expert grad'")
    fails_with(capsys, nd.check_group_of, lambda shape, rank, what: 1 / 0 if what == "kv send" else
               group_of(shape, rank, what), hint="ZeroDivisionError")

    def via_the_grader(shape, rank, what):
        from course_lib.grading.nd_parallel import _expected_group
        return _expected_group(shape, rank, what)
    fails_with(capsys, nd.check_group_of, via_the_grader, hint="write this yourself")


def test_group_of_hang_is_a_failed_case(capsys, monkeypatch):
    def endless(shape_kwargs, rank, what):
        while True:
            pass
    monkeypatch.setattr(nd, "RECORDED", [run for run in nd.RECORDED if run[0] == "cp=4"])
    fails_with(capsys, nd.check_group_of, endless, hint="endless loop", timeout=3)


# ----------------------------------------------------------------------------- 3. the wrong group
def data_dims(marks, sizes):
    """Every dim of size > 1 named, in the mesh's order."""
    edp = sizes["dp"] // sizes.get("ep", 1)
    out = [d for d in ("dp", "pp", "cp", "tp") if d in (*marks, "cp", "dp") and sizes[d] > 1]
    if "edp" in marks:
        out = [d for d in out if d != "dp"] + (["edp"] if edp > 1 else [])
    return tuple(out)


def forgets_cp(marks, sizes):
    return tuple(d for d in data_dims(marks, sizes) if d != "cp")


def sp_norm_over_dp_only(marks, sizes):
    return tuple(d for d in data_dims(marks, sizes) if d != "tp")


def expert_over_dp(marks, sizes):
    return ("dp", "cp") if "edp" in marks else data_dims(marks, sizes)


def expert_without_cp(marks, sizes):      # the wrong answer: no composed run has experts and cp > 1
    return ("edp",) if "edp" in marks else data_dims(marks, sizes)


def _run(label):
    return [run for run in nd.DATA_DIMS_RUNS if run[0].startswith(label)]


@pytest.mark.parametrize("variant, layout", [(forgets_cp, "cp=2 x tp=2"), (sp_norm_over_dp_only, "dp=2 x tp=2"),
                                             (expert_over_dp, "MoE")], ids=lambda v: getattr(v, "__name__", v))
def test_each_bug_is_caught_by_its_layout(variant, layout):
    """The composed runs catch each bug by themselves, not only the rule case."""
    [problem] = nd.composed_runs(variant, runs=_run(layout))
    assert problem is not None, f"{variant.__name__} matches one device on {layout}"


def test_data_dims(capsys):
    assert graded(capsys, nd.check_data_dims, data_dims)[0]
    fails_with(capsys, nd.check_data_dims, nd.buggy_data_dims, hint="missing ['cp']")
    fails_with(capsys, nd.check_data_dims, expert_without_cp, hint="missing ['cp']")
    fails_with(capsys, nd.check_data_dims, expert_over_dp, hint="different experts are added together")
    fails_with(capsys, nd.check_data_dims, sp_norm_over_dp_only, hint="missing ['tp']")
    fails_with(capsys, nd.check_data_dims, lambda marks, sizes: ("dp", "cp", "tp", "pp"), hint="too")
    fails_with(capsys, nd.check_data_dims, lambda marks, sizes: 1 / 0, hint="ZeroDivisionError")
    fails_with(capsys, nd.check_data_dims, lambda marks, sizes: "dp", hint="must return a tuple")

    def library(marks, sizes):
        from course_lib.parallel.compose import data_dims as lib
        return lib(None, sizes, False)
    fails_with(capsys, nd.check_data_dims, library, hint="write this yourself")


def test_data_dims_hang_is_a_failed_case(capsys):
    def endless(marks, sizes):
        while True:
            pass
    fails_with(capsys, nd.check_data_dims, endless, hint="ran for more than")


# ----------------------------------------------------------------------------- 4. choose a layout
def choose_layout(cfg, world_size, budget_bytes, batch, _peaks={}):
    """Candidates from itertools.product, largest dp first; the first one that fits."""
    key = (repr(cfg), world_size, batch)
    if key not in _peaks:
        layouts = []
        for dp, pp, cp, tp in itertools.product(range(world_size, 0, -1), repeat=4):
            lay = dict(dp=dp, pp=pp, cp=cp, tp=tp, microbatches=pp)
            try:
                check_layout(cfg, **lay, world_size=world_size, batch=batch)
            except ValueError:
                continue
            layouts.append(lay)
        _peaks[key] = list(zip(layouts, nd.measure_layouts(cfg, world_size, layouts, batch)))
    return next((lay for lay, peak in _peaks[key] if peak <= budget_bytes), None)


def test_budgets_sit_on_the_boundaries():
    measured = [(dict(dp=4), 100), (dict(dp=2), 60), (dict(dp=2), 70), (dict(dp=1), 40)]
    assert nd._best_per_dp(measured) == {4: 100, 2: 60, 1: 40}
    assert [nd._largest_fitting_dp(measured, b) for b in (100, 99, 60, 59, 40, 39)] == [4, 2, 2, 1, 1, None]


@pytest.fixture
def small_layout_problems(monkeypatch):
    """World size 2 only: one measuring launch per check."""
    monkeypatch.setattr(nd, "LAYOUT_PROBLEMS", [(dict(), 2, 4)])


def test_choose_layout(small_layout_problems, capsys):
    def most_sharded(cfg, world_size, budget_bytes, batch):     # fits, but not the largest dp
        return dict(dp=1, pp=2, cp=1, tp=1, microbatches=2)

    def invalid(cfg, world_size, budget_bytes, batch):
        return dict(dp=2, pp=1, cp=1, tp=1, microbatches=3)

    def via_the_grader(cfg, world_size, budget_bytes, batch):
        from course_lib.grading.nd_parallel import _valid_layouts
        return _valid_layouts(cfg, world_size, batch)[0]

    assert graded(capsys, nd.check_choose_layout, choose_layout)[0]
    fails_with(capsys, nd.check_choose_layout, most_sharded, hint="a layout with dp=2 fits too")
    fails_with(capsys, nd.check_choose_layout, invalid, hint="microbatches = pp")
    fails_with(capsys, nd.check_choose_layout, lambda *a: dict(dp=2, pp=1, cp=1, tp=1, microbatches=1),
               hint="over the budget")
    fails_with(capsys, nd.check_choose_layout, lambda *a: 1 / 0, hint="ZeroDivisionError")
    fails_with(capsys, nd.check_choose_layout, via_the_grader, hint="write this yourself")


def test_world_sizes_and_valid_layouts():
    sizes = sorted(world for _, world, _ in nd.LAYOUT_PROBLEMS)
    assert sizes == [2, 3, 4]
    cfg3 = nd.tiny_config(n_layers=3, seq_len=12)
    assert {tuple(lay[d] for d in ("dp", "pp", "cp", "tp")) for lay in nd._valid_layouts(cfg3, 3, 6)} == \
        {(3, 1, 1, 1), (1, 3, 1, 1), (1, 1, 3, 1)}                                   # not tp=3: 2 heads
    assert all(MeshShape(**{d: lay[d] for d in ("dp", "pp", "cp", "tp")}).world_size == 4
               for lay in nd._valid_layouts(nd.tiny_config(), 4, 4))


def test_measure_layouts_measures_each_layout_once_per_process(monkeypatch):
    """The grader and the learner's code read the same peaks: a layout measured once is not
    launched again (a peak can move by a buffer a gloo thread frees late, run to run)."""
    cfg = nd.tiny_config()
    one, two = dict(dp=2, pp=1, cp=1, tp=1, microbatches=1), dict(dp=1, pp=2, cp=1, tp=1, microbatches=2)
    launched = []
    real_launch = E.launch

    def counting_launch(fn, world, cfg_, layouts, *a, **kw):
        launched.append([dict(lay) for lay in layouts])
        return real_launch(fn, world, cfg_, layouts, *a, **kw)
    monkeypatch.setattr(E, "launch", counting_launch)
    monkeypatch.setattr(E, "_MEASURED", {})
    first = nd.measure_layouts(cfg, 2, [one], 4)
    both = nd.measure_layouts(cfg, 2, [two, dict(one)], 4)
    assert launched == [[one], [two]]                     # the second call launches only the new layout
    assert both[1] == first[0] and all(isinstance(p, int) and p > 0 for p in both)
    assert nd.measure_layouts(cfg, 2, [one, two], 4) == [both[1], both[0]] and len(launched) == 2
    with pytest.raises(ValueError, match="product of the dimensions"):
        nd.measure_layouts(cfg, 2, [dict(dp=4, pp=1, cp=1, tp=1, microbatches=1)], 4)
    with pytest.raises(ValueError, match="exactly the keys"):
        nd.measure_layouts(cfg, 2, [dict(dp=2)], 4)
