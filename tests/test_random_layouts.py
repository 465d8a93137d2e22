"""course_lib.lab.random_layouts draws what an outside check would: every schedule, MoE with
its folded mesh (DP or TP first), sharded data parallelism, odd worlds; only layouts check_layout accepts,
the same ones for the same seed. (Running them is the lab tool's job, minutes of launches:
``python -m course_lib.lab.random_layouts --seed 3 --cases 30``.)"""
from course_lib.lab.random_layouts import SCHEDULES, draw


def test_draws_cover_the_layout_space_and_repeat_by_seed():
    drawn = draw(150, seed=11)
    assert drawn == draw(150, seed=11) and drawn != draw(150, seed=12)
    kws = [kw for *_, kw, _ in drawn]
    assert {kw.get("schedule") for kw in kws} >= set(SCHEDULES)
    assert any("n_experts" in cfg and dims.get("etp", 1) > 1 for _, _, cfg, dims, _, _ in drawn)
    assert {kw.get("data") for kw in kws} >= {"fsdp", "hsdp"} and any(kw.get("async_tp") for kw in kws)
    assert {world for world, *_ in drawn} >= {3, 5, 6}
    folds = {dims.get("fold_order", "dp_first") for _, _, cfg, dims, _, _ in drawn if "n_experts" in cfg}
    assert folds == {"dp_first", "tp_first"}
