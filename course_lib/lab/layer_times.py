"""One transformer layer of the 22B model on the virtual clock, forward and backward apart,
next to the per-layer measurement of Korthikanti et al. 2022 (Table 4).

    rows = layer_rows()                     # five configurations, seconds each on 2 cores
    print(format_layer_table(rows))

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198, Sec. 6.2, Table 4) time the forward and the backward pass of ONE transformer
layer of their 22B model (Table 3: 64 heads, hidden 6144, 48 layers, tp 8, pp 1, micro-batch 4,
global batch 4; Sec. 6: s = 2048, v = 51200, mixed precision, Selene's 80 GB A100s, NVLink and
NVSwitch inside a node) for five configurations: tensor parallel alone, with sequence
parallelism, with full recomputation, with selective recomputation, and selective + SP. It is a
measurement the step-time rows (Table 5) do not isolate: the layer's compute and its TP / SP
collectives, without the embedding, the loss, the optimizer or the master copies.

The clock's layer is the course's own program as ``lab.dry_runs`` runs the Korthikanti rows
(the source's fused kernels :data:`~course_lib.lab.dry_runs.SOFTWARE`, its dropout and its
numerics, Megatron's rank order), on ``MEGATRON_2022``: a dry run of the model with 2 layers
less the same run with 1 (one micro-batch, pp = 1): what the second layer adds to the forward
span and to the backward span. Everything outside the layers is in both runs and cancels.

The table calibrates one constant: the GEMM's per-tile fraction of Megatron-LM's 2021-22
software on the A100 (:func:`fit_gemm`, ``validation.MEGATRON_2022_GEMM``). At the a100-80gb
preset's 0.913 (MAMF's best shape on 2024's torch and CUDA) the clock ran every one of the ten
times fast (5.6-12.4%, mean 7.9%); one rate for every GEMM, 0.797, brings all ten within
3.2% (mean 1.3%; log-rms 1.6% against 8.7%), forward and backward, with and without SP and recomputation: the layer's
structure holds and its GEMMs ran slower than a best-shape benchmark. Every step-time row
(``lab.dry_runs``) is checked with that rate; none is fitted.

What the clock's layer runs that Megatron-LM 2022's did not, or the other way (the errors
left after that one rate come from these):
* its column layers' backward is Megatron's (the source's software): with SP
  (``"sp_backward_overlap"``) the re-gather under dX, the reduce-scatter under dW; without SP
  (``"tp_backward_overlap"``, ``--async-tensor-model-parallel-allreduce``, on by default at
  55ba1f7b) dX's all-reduce under dW where a region has one column layer (the fused QKV GEMM,
  the MLP's W_1): the two "baseline" rows and "selective recompute". Before it (2026-11-29),
  ``f`` waited for dW: backward 11.88 ms (no recompute), 19.96 (full), 13.28 (selective).
* the course's activations are (batch, sequence, hidden), Megatron's (sequence, batch, hidden):
  every SP all-gather and reduce-scatter along the sequence transposes its tensors around the
  collective (:func:`~course_lib.parallel.comm_ops.gather_along`), strided copies at micro-batch
  4 and none at micro-batch 1 (a size-1 batch moves for free). The source's software states
  Megatron's layout (``"sequence_first"``): those copies run unpriced (2026-11-29; before, they
  made the SP rows 17% slow in the forward, 9% in the backward; then every time was fast,
  5.6-12.4%, at the 2024 GEMM rate).
  (The Table 5 row, ``lab.dry_runs``, runs Table 3's one micro-batch of 4,
  :data:`~course_lib.planner.validation.KORTHIKANTI_SCHEDULE`: 1.161 s; 4 micro-batches of 1,
  which it ran before 2026-11-29, took 1.061 s.)
"""
from __future__ import annotations

import math
from dataclasses import replace

from course_lib.layout import Layout
from course_lib.planner.presets import MODELS
from course_lib.planner.validation import MEGATRON_2022
from course_lib.virtual import dry_run

SOURCE = "Korthikanti 2022 T5"
# Korthikanti et al. 2022, Table 4: "Time to complete the forward and backward pass of a single
# transformer layer of the 22B model", milliseconds (forward, backward), with the row's
# (sequence parallel, recompute). "Baseline" is tensor parallelism alone (Sec. 6.2).
TABLE4 = (("baseline no recompute", 7.7, 11.9, False, "none"),
          ("sequence parallelism", 7.2, 11.8, True, "none"),
          ("baseline with recompute", 7.7, 19.5, False, "full"),
          ("selective recompute", 7.7, 13.2, False, "selective"),
          ("selective + sequence", 7.2, 13.1, True, "selective"))
# Table 3's 22B row: tp 8, pp 1, micro-batch 4 (global batch 4: one micro-batch)
MODEL, TP, MICRO_BATCH = "megatron-22b", 8, 4


def pass_seconds(spans, name) -> float:
    """Virtual seconds of the pipeline action ``name`` (F0: the forward, B0: the backward) in ``spans``."""
    (sp,) = [s for s in spans if s.name == name and s.dim == "pp" and s.kind == "compute"]
    return sp.end - sp.start


def layer_time(sp: bool, recompute: str, micro_batch: int = MICRO_BATCH, hardware=MEGATRON_2022,
               fusions=None) -> tuple[float, float]:
    """(forward, backward) virtual seconds of one 22B transformer layer on the clock: the dry run
    of 2 layers less that of 1, one micro-batch of ``micro_batch`` sequences, tp 8, ``sp`` and
    ``recompute`` as given, the source's software (``fusions``: default its stated
    :data:`~course_lib.lab.dry_runs.SOFTWARE`), dropout and precision."""
    from course_lib.lab.dry_runs import DROPOUT, ORDER, PRECISION, SOFTWARE
    fusions = SOFTWARE[SOURCE] if fusions is None else fusions
    layout = Layout(tp=TP, sp=sp, recompute=recompute, micro_batch=micro_batch, global_batch=micro_batch,
                    order=ORDER[SOURCE], precision=PRECISION[SOURCE])
    out = []
    for n_layers in (1, 2):
        spec = replace(MODELS[MODEL], n_layers=n_layers, name=f"GPT 22B, {n_layers} layer(s)")
        r = dry_run(spec, hardware, layout, progress=None, fusions=fusions, dropout=DROPOUT[SOURCE])
        out.append((pass_seconds(r.spans, "F0"), pass_seconds(r.spans, "B0")))
    (f1, b1), (f2, b2) = out
    return f2 - f1, b2 - b1


def layer_rows(micro_batch: int = MICRO_BATCH, hardware=MEGATRON_2022, fusions=None) -> list[dict]:
    """Every configuration of Table 4: the paper's forward and backward (ms) next to the clock's."""
    rows = []
    for name, fwd, bwd, sp, recompute in TABLE4:
        f, b = layer_time(sp, recompute, micro_batch, hardware, fusions)
        rows.append({"experiment": name, "sp": sp, "recompute": recompute,
                     "paper_fwd_ms": fwd, "paper_bwd_ms": bwd, "clock_fwd_ms": f * 1e3, "clock_bwd_ms": b * 1e3,
                     "fwd_err": f * 1e3 / fwd - 1, "bwd_err": b * 1e3 / bwd - 1,
                     "total_err": (f + b) * 1e3 / (fwd + bwd) - 1})
    return rows


def log_rms(rows) -> float:
    """Root mean square of log(clock / paper) over the rows' forward and backward times."""
    logs = [math.log(r[f"clock_{k}_ms"] / r[f"paper_{k}_ms"]) for r in rows for k in ("fwd", "bwd")]
    return math.sqrt(sum(x * x for x in logs) / len(logs))


def gemm_error(fraction: float, hardware=MEGATRON_2022, fusions=None) -> float:
    """:func:`log_rms` of Table 4 on ``hardware`` with the clock's GEMM per-tile ``fraction``."""
    hw = hardware.with_kernel_rate("gemm", fraction, "trial")
    return log_rms(layer_rows(hardware=hw, fusions=fusions))


def fit_gemm(hardware=MEGATRON_2022, lo: float = 0.70, hi: float = 0.95, step: float = 0.001) -> float:
    """The GEMM per-tile fraction (on a grid of ``step``) that minimises :func:`gemm_error`:
    every other constant of ``hardware`` as stated, Table 4's ten times the only data. A grid
    of 0.01 over [lo, hi], then of ``step`` within 0.01 of its best (the error is one smooth
    valley in the fraction: a layer's time is its GEMMs' plus the rest)."""
    def best(grid):
        return min(grid, key=lambda g: (gemm_error(g, hardware), g))
    coarse = best([round(lo + 0.01 * i, 6) for i in range(int(round((hi - lo) / 0.01)) + 1)])
    n = int(round(0.01 / step))
    return best([round(coarse + step * i, 6) for i in range(-n, n + 1)])


def format_layer_table(rows) -> str:
    """The rows as a table 69 characters wide: milliseconds, forward (F) and backward (B)."""
    lines = [f"{'Table 4 (ms)':24}{'paper F':>8}{'B':>6}{'clock F':>9}{'B':>7}{'err F':>8}{'B':>7}"]
    for r in rows:
        lines.append(f"{r['experiment']:24}{r['paper_fwd_ms']:8.1f}{r['paper_bwd_ms']:6.1f}"
                     f"{r['clock_fwd_ms']:9.2f}{r['clock_bwd_ms']:7.2f}{r['fwd_err']:+8.1%}{r['bwd_err']:+7.1%}")
    return "\n".join(lines)


def summary(rows) -> str:
    errs = [abs(r[k]) for r in rows for k in ("fwd_err", "bwd_err")]
    return f"{len(errs)} times: mean |error| {sum(errs) / len(errs):.1%}, worst {max(errs):.1%}"


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro-batch", type=int, default=MICRO_BATCH)
    a = p.parse_args()
    rows = layer_rows(a.micro_batch)
    print(format_layer_table(rows))
    print(summary(rows))

__all__ = ["TABLE4", "pass_seconds", "layer_time", "layer_rows", "format_layer_table", "summary"]
