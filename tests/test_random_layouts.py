"""course_lib.lab.random_layouts draws what an outside check would: every schedule, MoE with
its folded mesh, sharded data parallelism, odd worlds; only layouts check_layout accepts,
the same ones for the same seed. (Running them is the lab tool's job: ``python -m
course_lib.lab.random_layouts``; one case runs here.)"""
from course_lib.lab.random_layouts import SCHEDULES, check, draw


def test_draws_cover_the_layout_space_and_repeat_by_seed():
    drawn = draw(150, seed=11)
    assert drawn == draw(150, seed=11) and drawn != draw(150, seed=12)
    kws = [kw for *_, kw, _ in drawn]
    assert {kw.get("schedule") for kw in kws} >= set(SCHEDULES)
    assert any("n_experts" in cfg and dims.get("etp", 1) > 1 for _, _, cfg, dims, _, _ in drawn)
    assert {kw.get("data") for kw in kws} >= {"fsdp", "hsdp"} and any(kw.get("async_tp") for kw in kws)
    assert {world for world, *_ in drawn} >= {3, 5, 6}


def test_a_drawn_layout_runs_equal_to_one_device():
    one = [d for d in draw(40, seed=11) if d[0] == 2][:1]
    assert check(one) == [(one[0][1], None)]
