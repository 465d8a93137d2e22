"""The published rows the dry run is held to (course_lib.lab.dry_runs): each source's layout as
the source ran it."""
import pytest

from course_lib.lab.dry_runs import NARAYANAN_SC21, narayanan_sc21, published_row, published_runs
from course_lib.planner.validation import NARAYANAN_TABLE1
from course_lib.virtual.dry_run import check_dry_run


def test_narayanan_rows_run_the_micro_batch_and_schedule_of_the_papers_scripts():
    """examples/sc21/run_table_1.sh: MBS 16 / 16 / 16 / 8 / 4 / 2 / 2 / 1 / 1 / 1, and 5, 5, 3
    and 1 layers per virtual stage on the 76B, 145B, 310B and 530B rows. Every row passes the
    rules the ranks apply, as the script's global batch divides into micro-batches."""
    rows = {run[1]: run for run in published_runs() if run[0] == "Narayanan 2021 T1"}
    assert len(rows) == len(NARAYANAN_TABLE1) == len(NARAYANAN_SC21)
    seen = {}
    for billions, a, h, L, tp, pp, gpus, gbs, tflops in NARAYANAN_TABLE1:
        source, name, model, hw, layout = rows[f"GPT {billions:g}B"][:5]
        seen[billions] = (layout.micro_batch, layout.schedule, layout.v, layout.microbatches)
        assert layout.overlap_dp == (pp == 1)        # --DDP-impl torch on the PP = 1 rows, local on the others
        assert layout.micro_batch * layout.microbatches * layout.dp == gbs
        assert (layout.tp, layout.pp, layout.n_gpus, layout.recompute) == (tp, pp, gpus, "full")
        check_dry_run(model, layout, dropout=0.1)          # ValueError naming a rule the ranks refuse
        assert published_row(*rows[name])["planner_s"] > 0
    assert seen[7.5] == (16, "1f1b", 1, 1)                  # 512 sequences over dp 32: one micro-batch of 16
    assert seen[18.4] == (8, "1f1b", 1, 4)
    assert seen[76.1] == (2, "interleaved", 3, 28)          # 60 layers / pp 4 = 15 a stage, 5 a virtual stage
    assert seen[145.6][1:3] == ("interleaved", 2) and seen[310.1][1:3] == ("interleaved", 2)
    assert seen[529.6] == (1, "interleaved", 3, 280)        # 105 / 35 = 3 layers a stage, one a chunk
    assert seen[1008.0] == (1, "1f1b", 1, 512)


def test_a_size_not_in_the_table_is_refused_by_name():
    assert narayanan_sc21(1.7, 24, 1) == {"micro_batch": 16, "overlap_dp": True}
    with pytest.raises(ValueError, match="no row of Narayanan et al. 2021 Table 1 has 2.0 billion"):
        narayanan_sc21(2.0, 24, 1)


def test_ddp_under_the_backward_only_where_the_script_ran_torchs_ddp():
    """--DDP-impl torch on the four PP = 1 rows: the source's software plus "overlapped_dp"; the
    pipelined rows (--DDP-impl local) and the other sources run their software as stated."""
    from course_lib.lab.dry_runs import SOFTWARE, SOURCES, row_software
    runs = published_runs()
    for run in runs:
        source, name = run[:2]
        want = SOFTWARE[source]
        if source == "Narayanan 2021 T1" and name in ("GPT 1.7B", "GPT 3.6B", "GPT 7.5B", "GPT 18.4B"):
            want = want + ("overlapped_dp",)
        assert row_software(source, name) == want == tuple(published_row(*run)["fusions"]), (source, name)
    assert set(SOURCES) == {run[0] for run in runs}
