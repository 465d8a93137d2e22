"""Every published row through the dry run, as ``benchmarks/dry_run_validation.py --json`` recorded
it, for chapter 10's table: the published step time and the planner's columns are computed live
(instant); the dry run's columns are the recorded run's (a full pass takes tens of minutes of CPU
on 2 cores, more than a notebook's budget; chapter 10 runs one row live at m = 8).

    rows = recorded_rows()
    print(compact_table(rows)); print(summary(rows))

Re-record after a change that moves the dry run: run the benchmark with ``--json F`` (per
source, in the background), then ``python -m course_lib.lab.dry_run_table F [F ...]`` prints the
:data:`RECORDED` literal to paste here, with the commit it ran on in :data:`RECORDED_ON`.
"""
from __future__ import annotations

import json
import sys

from course_lib.lab.dry_runs import published_row, published_runs, summary

RECORDED_ON = ("2026-11-29, commit 82b5952 (the 22B row) and its parent (the others, which its 'sequence_first' "
               "does not move), Megatron's fused bias + dropout + add priced as one streaming pass and its "
               "(s, b, h) activations (no layout copies); this project's 2-core machine (wall_s and cpu_s are "
               "that machine's, the 22B row alone, the others beside the test suite); Llama 3's three rows again "
               "on 2026-11-29 (twelfth session): grouped-query K/V read inside the FlashAttention kernel, not "
               "copied per query head (8k rows 0.07% faster, memory unchanged: at TP 8 one K/V head a rank was "
               "a view); every row run again on 2026-11-29 (thirteenth session) on the clock whose lanes are "
               "shared by concurrent transfers (links.Lane.shared), not served first come first served: every "
               "row the same to the bit; Llama 3's three rows again on 2026-11-29 (fourteenth session), their "
               "FlashAttention kernels on the tile x wave model fitted on an H200 (planner.gemm.ATTENTION_MODEL), "
               "not a flat 0.30 of peak: 8k rows 0.8% slower, 128k 0.5% faster; the other rows run no fused "
               "attention; the twenty A100 rows again on 2026-11-30 (fifteenth session), Megatron-LM 2021-22's "
               "GEMMs at 0.797 of peak a tile (validation.MEGATRON_2022_GEMM, fitted on Korthikanti et al.'s "
               "one-layer Table 4), not the a100-80gb preset's 0.913 (MAMF's best shape on 2024's software): "
               "each 8-13% slower; Llama 3's rows as before; every row again on 2026-11-30 (eighteenth session), "
               "its peak memory now every tensor the program holds over the step, the temporaries between "
               "the moments included (virtual.live_memory; 0.3-11.8 GiB more, the Narayanan 1.7B row's "
               "micro-batch of 16 logits the most): every step time the same to the bit; wall_s two rows at a "
               "time, the two 1T rows alone; every row again on 2026-11-30 (nineteenth session), the "
               "course's DDP buckets counted (made with the model, held all step: torch's DDP default; the "
               "rows at dp > 1 without ZeRO 3.1-5.7 GiB more, the SP norms' buckets 0.02-0.1): every step "
               "time the same to the bit, every Megatron-LM and BLOOM row still fits; Liu et al. 2025's two Mixtral "
               "8x22B rows (expert parallelism) on 2026-11-30 (twenty-third session), commit ddb786c's fold order "
               "and ZeRO-1 over every replica of an expert, one row at a time; the four ZeRO rows of BLOOM and "
               "Llama 3 again on 2026-12-01 (twenty-fourth session), ZeRO-1/2 packing a bucket with one foreach "
               "copy, not a copy per rank's row (BLOOM 0.007%, Llama 3 0.02-0.12% faster; the Mixtral rows the "
               "same to the bit), beside other work on the AVX2 machine; the six ZeRO rows (BLOOM, Llama 3, "
               "Mixtral) again on 2026-12-01 (twenty-fifth session), ZeRO's buffers made empty as FSDP2's (no "
               "zeroing pass before the pack, the all-gather and the reduce-scatter's output): 0.02-0.11% "
               "faster, memory unchanged, one source at a time beside one notebook; every row again on 2026-12-01 "
               "(twenty-sixth session), commit ddd6353: the host waits at .tolist(), .numpy() and .cpu() as at "
               ".item() (virtual.compute.HostCopies: DDP's and ZeRO's flags, the expert counts), 0 to 0.1% "
               "slower (Mixtral A1 0.10%, A2 0.08%, Llama 3 0.005%, the Megatron-LM rows 12-900 us, BLOOM and "
               "the full-recompute rows the same to the bit), memory unchanged; two sources at a time beside "
               "the Llama 3 what-ifs; the two Mixtral rows again that day, Megatron-Core's weight-gradient GEMMs "
               "accumulating into the fp32 sums (software 'gradient_accumulation_fusion', on by default and not "
               "turned off by the ModelZoo's yaml): A1 5.122 -> 4.808 s, A2 5.617 -> 5.303 s, memory unchanged, "
               "beside the test suite; the two Mixtral rows again on 2026-12-01 (twenty-seventh session), "
               "Megatron-Core's distributed optimizer overlapped as the yaml states (software 'overlap_grad_"
               "reduce' and 'overlap_param_gather': the first stage's reduce-scatters under its last backward, "
               "each stage's gathers in its own first forward): A1 4.808 -> 5.096 s, A2 5.303 -> 5.650 s "
               "(the reductions alone: 4.739 s and 5.228 s), A2's peak 0.03 GiB more (the buckets in flight), "
               "and their attention priced as the cuDNN kernel Transformer Engine picks on Hopper "
               "(lab.dry_runs.MOE_HARDWARE, planner.presets.cudnn_attention): A1 5.096 -> 4.906 s, A2 "
               "5.650 -> 5.460 s, on the Intel AVX-512 machine beside the test suite")
# (source, model, GPUs): (dry_s, dry_GiB, fits, wall_s, cpu_s): the recorded run's dry-run columns
RECORDED = {
    ('Korthikanti 2022 T5', 'GPT 22B', 8): (1.0567221322717135, 51.91, True, 7, 3),
    ('Korthikanti 2022 T5', 'GPT 175B', 64): (13.824364754312096, 54.83, True, 41, 21),
    ('Korthikanti 2022 T5', 'GPT 530B', 280): (38.852969838318174, 54.81, True, 153, 124),
    ('Korthikanti 2022 T5', 'GPT 1T', 512): (76.96771858392948, 60.47, True, 557, 341),
    ('Korthikanti 2022 Sec. 6.3', 'GPT 530B, dp 8', 2240): (39.22199235651747, 58.57, True, 173, 187),
    ('BLOOM 2022', 'BLOOM 176B', 384): (100.35186689879647, 49.57, True, 26, 24),
    ('Llama 3 T4', 'Llama 3 405B, 8k', 8192): (11.389032664025638, 112.65, False, 111, 76),
    ('Llama 3 T4', 'Llama 3 405B, 8k', 16384): (6.412967725742626, 93.23, False, 52, 49),
    ('Llama 3 T4', 'Llama 3 405B, 128k', 16384): (14.204232356899476, 97.86, False, 132, 137),
    ('Korthikanti 2022 T5 full recompute', 'GPT 22B, full', 8): (1.4020878430265458, 47.43, True, 5, 3),
    ('Korthikanti 2022 T5 full recompute', 'GPT 175B, full', 64): (18.59958100716221, 49.14, True, 20, 19),
    ('Korthikanti 2022 T5 full recompute', 'GPT 530B, full', 280): (50.94357915720968, 45.96, True, 186, 196),
    ('Korthikanti 2022 T5 full recompute', 'GPT 1T, full', 512): (100.36725131968122, 50.61, True, 328, 320),
    ('Narayanan 2021 T1', 'GPT 1.7B', 32): (3.503337766797686, 49.46, True, 4, 3),
    ('Narayanan 2021 T1', 'GPT 3.6B', 64): (3.6339136169801294, 46.32, True, 2, 2),
    ('Narayanan 2021 T1', 'GPT 7.5B', 128): (3.6161934590099754, 47.02, True, 2, 2),
    ('Narayanan 2021 T1', 'GPT 18.4B', 256): (8.961082974355087, 49.64, True, 5, 4),
    ('Narayanan 2021 T1', 'GPT 39.1B', 512): (14.41099987984794, 49.5, True, 5, 5),
    ('Narayanan 2021 T1', 'GPT 76.1B', 1024): (14.962913928649105, 48.32, True, 9, 9),
    ('Narayanan 2021 T1', 'GPT 145.6B', 1536): (23.973528320279186, 52.66, True, 15, 14),
    ('Narayanan 2021 T1', 'GPT 310.1B', 1920): (36.1607230512713, 53.93, True, 40, 31),
    ('Narayanan 2021 T1', 'GPT 529.6B', 2520): (52.3618787886591, 49.76, True, 153, 91),
    ('Narayanan 2021 T1', 'GPT 1008B', 3072): (102.54250615690685, 54.67, True, 183, 118),
    ('Liu 2025 T2-3', 'Mixtral 8x22B A1', 128): (4.905835825835336, 64.23, True, 31, 37),
    ('Liu 2025 T2-3', 'Mixtral 8x22B A2', 128): (5.459597240981879, 66.82, True, 36, 39),
}


def recorded_rows(recorded=None) -> list[dict]:
    """Every row of :func:`~course_lib.lab.dry_runs.published_runs`, its published and planner
    columns live, its dry-run columns from ``recorded`` (default :data:`RECORDED`; a row not
    recorded keeps them empty)."""
    recorded = RECORDED if recorded is None else recorded
    known = {(run[0], run[1], run[4].n_gpus) for run in published_runs()}
    stray = set(recorded) - known
    if stray:
        raise ValueError(f"recorded rows that are not published runs: {sorted(stray)}")
    rows = []
    for run in published_runs():
        row = published_row(*run)
        got = recorded.get((row["source"], row["model"], row["GPUs"]))
        if got is not None:
            dry_s, gib, fits, wall_s, cpu_s = got
            row.update(dry_s=dry_s, dry_err=dry_s / row["published_s"] - 1, dry_GiB=gib, fits=fits,
                       wall_s=wall_s, cpu_s=cpu_s)
        rows.append(row)
    return rows


def compact_table(rows) -> str:
    """The table within a book's column (76 characters): model, layout, published, dry run and
    planner seconds, their errors."""
    lines = [f"{'row':<16}{'layout':<22}{'paper s':>8}{'dry s':>8}{'plan s':>8}{'dry':>7}{'plan':>7}"]
    for r in rows:
        dry = "-" if r["dry_s"] is None else f"{r['dry_s']:.3f}"
        dry_err = "-" if r["dry_err"] is None else f"{r['dry_err']:+.1%}"
        name = r["model"].replace("Llama 3 405B, ", "Llama 405B ").replace("GPT ", "").replace(" 8x22B", "")
        layout = r["layout"].replace(" CP1 ", " ").replace(" ETP", "x")     # EP4x2: EP 4 x ETP 2
        lines.append(f"{name[:15]:<16}{layout[:21]:<22}{r['published_s']:8.3f}{dry:>8}"
                     f"{r['planner_s']:8.3f}{dry_err:>7}{r['planner_err']:+7.1%}")
    return "\n".join(lines)


def literal(paths) -> str:
    """The :data:`RECORDED` literal of the rows in the JSON files ``paths`` (later files win)."""
    rows = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f):
                if r.get("dry_s") is not None:
                    rows[(r["source"], r["model"], r["GPUs"])] = (r["dry_s"], round(r["dry_GiB"], 2), r["fits"],
                                                       round(r["wall_s"]), round(r["cpu_s"]))
    body = "".join(f"    {k!r}: {v!r},\n" for k, v in rows.items())
    return "RECORDED = {\n" + body + "}"


__all__ = ["RECORDED", "RECORDED_ON", "recorded_rows", "compact_table", "literal", "summary"]

if __name__ == "__main__":
    print(literal(sys.argv[1:]))
