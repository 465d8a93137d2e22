"""The graders of chapter 9's exercises (course_lib/grading/nd_parallel.py): the reference
answers agree with real runs, the buggy variants of exercise 3 are caught, and a learner's
exception or hang is a failed case with a hint, never a crash."""
from __future__ import annotations

import pytest

from course_lib.grading import nd_parallel as nd
from course_lib.parallel.compose import check_layout
from course_lib.parallel.mesh import MeshShape


# ----------------------------------------------------------------------------- solutions
def choose_layout(cfg, world_size, budget_bytes, batch, _peaks={}):
    key = (repr(cfg), world_size, batch)
    if key not in _peaks:
        layouts = []
        for dp in range(1, world_size + 1):
            for pp in range(1, world_size + 1):
                for cp in range(1, world_size + 1):
                    tp, rest = divmod(world_size, dp * pp * cp)
                    if rest:
                        continue
                    lay = dict(dp=dp, pp=pp, cp=cp, tp=tp, microbatches=pp)
                    try:
                        check_layout(cfg, **lay, world_size=world_size, batch=batch)
                    except ValueError:
                        continue
                    layouts.append(lay)
        _peaks[key] = list(zip(layouts, nd.measure_layouts(cfg, world_size, layouts, batch)))
    fitting = [lay for lay, peak in _peaks[key] if peak <= budget_bytes]
    return max(fitting, key=lambda lay: lay["dp"], default=None)


def data_dims(marks, sizes):
    dims = set(marks) | {"cp"}
    if "edp" not in dims:
        dims.add("dp")
    return tuple(d for d in ("dp", "pp", "cp", "tp", "edp") if d in dims)


def forgets_cp(marks, sizes):
    return tuple(d for d in data_dims(marks, sizes) if d != "cp")


def sp_norm_over_dp_only(marks, sizes):
    return tuple(d for d in data_dims(marks, sizes) if d != "tp")


def expert_over_dp(marks, sizes):
    return ("dp", "cp") if "edp" in marks else data_dims(marks, sizes)


# ----------------------------------------------------------------------------- 2. which group
def test_expected_groups_by_hand():
    four_d = dict(dp=2, pp=2, cp=2, tp=2)   # rank 5: dp 0, pp 1, cp 0, tp 1
    assert nd.expected_group(four_d, 5, "tp all-reduce") == [4, 5]
    assert nd.expected_group(four_d, 5, "attention grad") == [5, 7, 13, 15]
    assert nd.expected_group(four_d, 5, "sp norm grad") == [4, 5, 6, 7, 12, 13, 14, 15]
    assert nd.expected_group(four_d, 5, "kv send") == [5, 7]
    assert nd.expected_group(four_d, 5, "activation send") == [5]           # the last stage
    assert nd.expected_group(four_d, 1, "activation send") == [1, 5]
    assert nd.expected_group(four_d, 5, "loss all-reduce") == [1, 3, 5, 7, 9, 11, 13, 15]
    assert nd.expected_group(dict(pp=3, cp=3), 2, "kv send") == [0, 2]      # the ring wraps
    moe = dict(dp=4, pp=2, ep=2)             # rank = dp_i * 2 + pp_i; ep = consecutive dp indexes
    assert nd.expected_group(moe, 0, "expert all-to-all") == [0, 2]
    assert nd.expected_group(moe, 0, "expert grad") == [0, 4]
    assert nd.expected_group(moe, 0, "attention grad") == [0, 2, 4, 6]


def test_recorded_groups_agree_with_the_mesh_arithmetic():
    """The second answer key (groups a real run used) is complete and says what the first does."""
    recorded = nd.recorded_groups()
    shapes = {label: shape for label, _, shape, _, _ in nd.RECORDED}
    assert len(recorded) == sum(4 * len(whats) for *_, whats in nd.RECORDED)
    for (label, rank, what), ranks in recorded.items():
        assert ranks == nd.expected_group(shapes[label], rank, what), (label, rank, what)


def test_group_of_reports_a_learner_error_per_query():
    answers = nd._group_harness(lambda shape, rank, what: 1 / 0 if what == "kv send" else [rank],
                                [(dict(tp=2), 0, "kv send"), (dict(tp=2), 0, "loss all-reduce")])
    assert answers == [("error", "ZeroDivisionError: division by zero"), ("ok", [0])]


def test_group_of_hang_is_a_failed_case(capsys, monkeypatch):
    def endless(shape_kwargs, rank, what):
        while True:
            pass
    monkeypatch.setattr(nd, "RECORDED", [run for run in nd.RECORDED if run[0] == "cp=4"])   # quick to record
    assert nd.check_group_of(endless, timeout=6) is False
    out = capsys.readouterr().out.strip()
    assert out.startswith("group_of: FAILED case 1/") and "endless loop" in out, out


# ----------------------------------------------------------------------------- 3. the wrong group
def _run(label):
    return [run for run in nd.DATA_DIMS_RUNS if run[0].startswith(label)]


@pytest.mark.parametrize("variant, layout", [(forgets_cp, "cp=2 x tp=2"), (sp_norm_over_dp_only, "dp=2 x tp=2"),
                                             (expert_over_dp, "MoE")], ids=lambda v: getattr(v, "__name__", v))
def test_each_bug_is_caught_by_its_layout(variant, layout):
    """One bug at a time (buggy_data_dims has two: test_data_dims_solution_passes_and_buggy_fails)."""
    [problem] = nd.composed_runs(variant, runs=_run(layout))
    assert problem is not None, f"{variant.__name__} matches one device on {layout}"


def test_data_dims_solution_passes_and_buggy_fails(capsys):
    assert nd.check_data_dims(data_dims) is True
    assert nd.check_data_dims(nd.buggy_data_dims) is False
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "data_dims: 3/3 cases passed"
    assert out[1].startswith("data_dims: FAILED case 1/3 (cp=2 x tp=2, SP)"), out[1]


def test_data_dims_exception_and_bad_answer_are_failed_cases(capsys):
    assert nd.check_data_dims(lambda marks, sizes: 1 / 0) is False
    assert nd.check_data_dims(lambda marks, sizes: "dp") is False
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("data_dims: FAILED case 1/3") and "ZeroDivisionError" in first, first
    assert "must return a tuple of mesh dimension names" in second, second


def test_data_dims_hang_is_a_failed_case(capsys, monkeypatch):
    def endless(marks, sizes):
        while True:
            pass
    monkeypatch.setattr(nd, "DATA_DIMS_RUNS", _run("cp=2"))
    assert nd.check_data_dims(endless, timeout=5) is False
    out = capsys.readouterr().out.strip()
    assert out.startswith("data_dims: FAILED case 1/1") and "hung" in out, out


# ----------------------------------------------------------------------------- 1. choose a layout
def test_budgets_sit_on_the_boundaries():
    measured = [(dict(dp=4), 100), (dict(dp=2), 60), (dict(dp=2), 70), (dict(dp=1), 40)]
    assert nd._budgets(measured) == [100, 99, 60, 59, 40, 39]
    assert [nd._largest_fitting_dp(measured, b) for b in (100, 99, 60, 59, 40, 39)] == [4, 2, 2, 1, 1, None]


@pytest.fixture
def small_layout_problems(monkeypatch):
    """World size 2 only: one measuring launch per check."""
    monkeypatch.setattr(nd, "LAYOUT_PROBLEMS", [(dict(), 2, 4)])


def test_choose_layout_right_and_wrong(small_layout_problems, capsys):
    def most_sharded(cfg, world_size, budget_bytes, batch):     # fits, but not the largest dp
        return dict(dp=1, pp=2, cp=1, tp=1, microbatches=2)

    def invalid(cfg, world_size, budget_bytes, batch):
        return dict(dp=1, pp=1, cp=1, tp=world_size, microbatches=1) if world_size > 2 else \
            dict(dp=2, pp=1, cp=1, tp=1, microbatches=3)

    assert nd.check_choose_layout(choose_layout) is True
    assert nd.check_choose_layout(most_sharded) is False
    assert nd.check_choose_layout(invalid) is False
    assert nd.check_choose_layout(lambda *a: 1 / 0) is False
    ok, sharded, bad, error = capsys.readouterr().out.splitlines()
    assert ok.startswith("choose_layout: ") and ok.endswith("cases passed"), ok
    assert "a layout with dp=2 fits too" in sharded, sharded
    assert "microbatches = pp" in bad, bad
    assert "ZeroDivisionError" in error, error


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
    real_launch = nd.launch

    def counting_launch(fn, world, cfg_, layouts, *a, **kw):
        launched.append([dict(lay) for lay in layouts])
        return real_launch(fn, world, cfg_, layouts, *a, **kw)
    monkeypatch.setattr(nd, "launch", counting_launch)
    monkeypatch.setattr(nd, "_MEASURED", {})
    first = nd.measure_layouts(cfg, 2, [one], 4)
    both = nd.measure_layouts(cfg, 2, [two, dict(one)], 4)
    assert launched == [[one], [two]]                     # the second call launches only the new layout
    assert both[1] == first[0] and all(isinstance(p, int) and p > 0 for p in both)
    assert nd.measure_layouts(cfg, 2, [one, two], 4) == [both[1], both[0]] and len(launched) == 2
    with pytest.raises(ValueError, match="product of the dimensions"):
        nd.measure_layouts(cfg, 2, [dict(dp=4, pp=1, cp=1, tp=1, microbatches=1)], 4)
    with pytest.raises(ValueError, match="exactly the keys"):
        nd.measure_layouts(cfg, 2, [dict(dp=2)], 4)
