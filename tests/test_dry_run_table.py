"""Chapter 10's table of published rows: recorded dry-run columns next to live planner ones."""
import ast
import json

import pytest

from course_lib.lab.dry_run_table import RECORDED, compact_table, literal, recorded_rows
from course_lib.lab.dry_runs import published_runs


def test_every_recorded_row_is_a_published_run_and_prints_in_the_column():
    rows = recorded_rows()
    assert len(rows) == len(published_runs())
    assert sum(r["dry_s"] is not None for r in rows) == len(RECORDED)
    for r in rows:
        if r["dry_s"] is not None:      # the error is the recorded time against the live published one
            assert r["dry_err"] == pytest.approx(r["dry_s"] / r["published_s"] - 1, rel=1e-12)
    assert max(len(line) for line in compact_table(rows).splitlines()) <= 76


def test_a_stray_recorded_row_is_refused():
    with pytest.raises(ValueError, match="not published runs"):
        recorded_rows({("Korthikanti 2022 T5", "GPT 176B", 64): (13.0, 50.0, True, 1, 1)})


def test_literal_round_trips_the_benchmarks_json(tmp_path):
    row = {"source": "Korthikanti 2022 T5", "model": "GPT 175B", "GPUs": 64, "dry_s": 13.25,
           "dry_GiB": 55.04321, "fits": True, "wall_s": 37.4, "cpu_s": 10.2}
    skipped = dict(row, model="GPT 22B", GPUs=8, dry_s=None)
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([row, skipped]))
    text = literal([path])
    recorded = ast.literal_eval(text.split("=", 1)[1].strip())
    assert recorded == {("Korthikanti 2022 T5", "GPT 175B", 64): (13.25, 55.04, True, 37, 10)}
    got = {r["model"]: r for r in recorded_rows(recorded)}
    assert got["GPT 175B"]["dry_s"] == 13.25 and got["GPT 22B"]["dry_s"] is None


FRESH = [("Korthikanti 2022 T5", "GPT 22B"), ("Korthikanti 2022 T5 full recompute", "GPT 22B, full"),
         ("Narayanan 2021 T1", "GPT 1.7B"), ("Narayanan 2021 T1", "GPT 18.4B"), ("Narayanan 2021 T1", "GPT 39.1B")]


@pytest.mark.parametrize("source,name", FRESH)
def test_the_recorded_rows_are_what_todays_code_computes(source, name):
    """The quick rows (a few seconds each: no pipeline or two stages) run again: the dry run is
    deterministic and the literal keeps every digit (repr), so the recorded step time and memory
    are today's exactly. A change
    to the clock, the program or a source's statements that moves a row fails here until the
    table is recorded again (``benchmarks/dry_run_validation.py``, ``python -m
    course_lib.lab.dry_run_table``)."""
    from course_lib.lab.dry_runs import validation_rows

    [row] = validation_rows(sources=(source,), models=(name,), progress=None)
    dry_s, gib, fits, _, _ = RECORDED[(source, name, row["GPUs"])]
    assert row["dry_s"] == dry_s
    assert round(row["dry_GiB"], 2) == gib and row["fits"] == fits


def test_the_moe_rows_run_megatron_cores_mapping_as_its_modelzoo_states_it():
    """Liu et al. 2025's rows: the experts folded TP first in Megatron's rank order (an EP group
    of 8 on one node of 8), the distributed optimizer (ZeRO-1) with fp32 gradients, 1F1B with
    micro-batch 1, no dropout, Transformer Engine's attention kernel on Hopper (cuDNN's), the
    distributed optimizer overlapped as the yaml says; the recorded dry run's rows are both there."""
    from course_lib.lab.dry_runs import DROPOUT, MOE_FOLDING, PRECISION, SOFTWARE
    from course_lib.planner.layout import fold_offsets
    from course_lib.planner.presets import cudnn_attention
    runs = [run for run in published_runs() if run[0] == MOE_FOLDING]
    assert [run[1] for run in runs] == ["Mixtral 8x22B A1", "Mixtral 8x22B A2"]
    for _, name, model, hw, layout, *_ in runs:
        assert (layout.fold_order, layout.order, layout.zero, layout.precision) == \
            ("tp_first", ("pp", "dp", "cp", "tp"), 1, PRECISION[MOE_FOLDING])
        assert (layout.n_gpus, layout.micro_batch, layout.global_batch, layout.schedule) == (128, 1, 256, "1f1b")
        assert {o // hw.gpus_per_node for o in fold_offsets(layout, "expert mesh")} == {0}
        assert (MOE_FOLDING, name, 128) in RECORDED
        assert hw == cudnn_attention("h100-sxm")
    assert DROPOUT[MOE_FOLDING] == 0.0 and PRECISION[MOE_FOLDING] == "bf16-accumulate-fp32"
    assert {"gradient_accumulation_fusion", "overlap_grad_reduce", "overlap_param_gather"} <= set(SOFTWARE[MOE_FOLDING])
    # the overlaps' what-ifs (chapter 10): the row as stated is the recorded row, to the bit
    from course_lib.lab.dry_runs import MOE_OVERLAP, MOE_OVERLAP_RECORDED
    assert set(MOE_OVERLAP_RECORDED) == {(run[1], v) for run in runs for v in MOE_OVERLAP}
    for run in runs:
        assert MOE_OVERLAP_RECORDED[(run[1], "both")] == RECORDED[(MOE_FOLDING, run[1], 128)][0]
