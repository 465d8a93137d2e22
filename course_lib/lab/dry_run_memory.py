"""The dry run's memory (:func:`course_lib.virtual.dry_run`, its ``memory_by_stage``: "states",
"activations") next to published figures and the planner's:

* model states against ZeRO's Table 1 (Rajbhandari et al. 2020; a 7.5B model, K = 12);
* activations against Korthikanti et al. 2022: one layer's bytes (Table 2) at GPT 22B's
  and 175B's shape with TP 8, with and without SP, under each recomputation; and the first
  pipeline stage's peak over its in-flight micro-batches (Sec. 4.2.3: L x one layer x
  (1 + (p - 1) / (p v)) for interleaving).

    rows = zero_table1_rows(); print(format_rows(rows, ZERO_COLUMNS))

Every figure is read from the run: the states category is what the optimizer step leaves
on the GPU (nothing of the activations: the table's model states), one layer's activations
the peak with two layers minus the peak with one. Nothing is fitted; where the course's
program keeps other tensors than the paper's (no dropout: ``model_config`` builds the model
with dropout 0; LayerNorm's statistics) :func:`course_terms` says which.
"""
from __future__ import annotations

import dataclasses

import torch

from course_lib.layout import Layout
from course_lib.planner import estimate
from course_lib.planner import formulas as F
from course_lib.planner.activations import RECOMPUTE, activation_bytes_per_layer, layer_activation_bytes
from course_lib.planner.presets import get_model, gpt_spec
from course_lib.planner.validation import MEGATRON_2022, ZERO_PSI, ZERO_TABLE1
from course_lib.virtual import dry_run

# the paper's 7.5B model has no shape in the paper; Narayanan et al. 2021 Table 1's 7.5B GPT
# (36 layers, hidden 4096, 32 heads, vocabulary 51200): 7,467,786,240 parameters
ZERO_MODEL = gpt_spec("GPT 7.5B", 36, 4096, 32)
TABLE1_DEVICES = tuple(ZERO_TABLE1)
STATES = ("params", "grads", "optimizer")
# Korthikanti et al. 2022, Tables 3 and 5: TP 8, sequence 2048, micro-batch 1, Megatron-LM's
# fused scale-mask-softmax (lab.dry_runs.SOFTWARE, the source's statement)
KORTHIKANTI_TP = 8
FUSIONS = ("scale_mask_softmax",)


def model_state_bytes(model, hardware, dp: int, zero: int, dtype=torch.bfloat16) -> int:
    """The dry run's model-state bytes on its fullest GPU (the "states" category: parameters,
    gradients, fp32 master and AdamW moments; no activation), one sequence per dp rank."""
    r = dry_run(model, hardware, Layout(dp=dp, zero=zero, global_batch=dp), progress=None, dtype=dtype)
    return max(m["states"] for m in r.memory_by_stage)


def zero_table1_rows(devices=TABLE1_DEVICES, model=ZERO_MODEL, hardware="a100-80gb", dry_stages=(3,)) -> list[dict]:
    """Per devices N and ZeRO stage: the paper's GB, the formula's at the paper's 7.5e9
    parameters (the planner's ``zero_table1``), and for ``model`` (P parameters): the formula's,
    the planner's estimate (its params + grads + optimizer) and the dry run's for the stages in
    ``dry_stages`` (the ranks run all three: ZeRO-1/2 by :mod:`course_lib.parallel.zero_nd`,
    3 by FSDP; the others' ``dry_GB`` None)."""
    P = F.param_count(model)
    rows = []
    for n in devices:
        for stage, paper in zip((1, 2, 3), ZERO_TABLE1[n]):
            est = estimate(model, hardware, Layout(dp=n, zero=stage, global_batch=n))
            dry = model_state_bytes(model, hardware, n, stage) if stage in dry_stages else None
            same = F.zero_memory_bytes(P, stage, n)["total"]
            rows.append({"N": n, "stage": stage, "paper_GB": paper,
                         "formula_GB": F.zero_memory_bytes(ZERO_PSI, stage, n)["total"] / 1e9,
                         "P_formula_GB": same / 1e9, "planner_GB": sum(est.memory[k] for k in STATES) / 1e9,
                         "dry_GB": None if dry is None else dry / 1e9, "dry_bytes": dry, "P_formula_bytes": same})
    return rows


def precision_rows(model=ZERO_MODEL, hardware="a100-80gb") -> list[dict]:
    """Bytes per parameter of the dry run's model states (dp 1, DDP) for the cluster's dtype,
    next to the formula's for the same training: bf16 mixed precision (2 + 2 + K = 12) and
    pure fp32 AdamW (4 + 4 + K = 8). The dry run counts an fp32 master copy in both."""
    P = F.param_count(model)
    out = []
    for dtype, training, (pb, gb, k) in ((torch.bfloat16, "bf16 mixed, K=12", (2, 2, 12)),
                                         (torch.float32, "fp32, K=8", (4, 4, 8))):
        dry = model_state_bytes(model, hardware, 1, 0, dtype)
        formula = F.zero_memory_bytes(P, 0, 1, pb, gb, k)["total"]
        out.append({"dtype": str(dtype).replace("torch.", ""), "training": training,
                    "dry_per_param": dry / P, "formula_per_param": formula / P})
    return out


def sharded_optimizer_rows() -> list[dict]:
    """ZeRO-1 and -2 as the course runs them (chapter 4's ``ShardedOptimizer``, measured on real
    ranks: ``lab.zero_measurements``, fp32 AdamW, K = 8) next to the formula: what the dry run
    does not run. The few extra bytes are AdamW's fp32 step count, one per tensor updated."""
    from course_lib.lab.zero_measurements import MEASURED_BYTES, MEASURED_PARAMS
    rows = []
    for (stage, n), got in sorted(MEASURED_BYTES.items()):
        if stage in (1, 2):
            formula = F.zero_memory_bytes(MEASURED_PARAMS, stage, n, 4, 4, 8)
            rows.append({"stage": stage, "N": n, "measured": sum(got), "formula": int(formula["total"]),
                         "extra": sum(got) - int(formula["total"])})
    return rows


def with_layers(model, n_layers: int):
    spec = get_model(model)
    return dataclasses.replace(spec, n_layers=n_layers, name=f"{spec.name} ({n_layers} layers)")


def layer_activations(model, hardware, layout: Layout, fusions=FUSIONS) -> int:
    """The dry run's bytes of one layer on one micro-batch (pp 1): its activation peak with
    two layers minus its peak with one (the embedding, final norm and loss cancel)."""
    peaks = [dry_run(with_layers(model, n), hardware, layout, progress=None, fusions=fusions)
             .memory_by_stage[0]["activations"] for n in (1, 2)]
    return peaks[1] - peaks[0]


def course_terms(s, b, h, a, t=1, sp=False, recompute="none", value_bytes=2) -> dict:
    """Korthikanti et al.'s per-layer bytes (Table 2, :func:`activation_bytes_per_layer`) split
    into what the course's program keeps and what it does not:

    - "values": the 32 s b h of 16-bit values (8 of them replicated over TP without SP);
    - "softmax": the softmax output, 2 a s^2 b / t (what Megatron's fused scale-mask-softmax
      keeps too; recomputed under selective);
    - "dropout": the paper's dropout terms the course's model (dropout 0) does not keep: two
      1-byte masks, 2 s b h, and the attention dropout's mask and output, 3 a s^2 b / t;
    - "norm_stats": LayerNorm's mean and rstd (fp32, one each per token, two norms), which the
      paper leaves out; the dry run counts every saved tensor at the activations' 2 bytes
      (:func:`~course_lib.virtual.dry_run.gpu_memory` scales its fp32 meta tensors), so 8
      bytes per token where a bf16 run keeps 16.
    ``course`` = values + softmax + norm_stats; ``paper`` = values + softmax + dropout."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    paper = activation_bytes_per_layer(s, b, h, a, t, sp, recompute, value_bytes=value_bytes)
    split = t if sp else 1
    if recompute == "full":        # the layer input only
        terms = {"values": paper, "softmax": 0.0, "dropout": 0.0, "norm_stats": 0.0}
    else:
        scores = recompute == "none"
        softmax = value_bytes * a * s * s * b / t if scores else 0.0
        dropout = 2.0 * s * b * h / split + (3.0 * a * s * s * b / t if scores else 0.0)
        terms = {"values": paper - softmax - dropout, "softmax": softmax, "dropout": dropout,
                 "norm_stats": 2 * 2 * 2 * s * b / split}
    terms["paper"] = terms["values"] + terms["softmax"] + terms["dropout"]
    terms["course"] = terms["values"] + terms["softmax"] + terms["norm_stats"]
    return terms


def activation_rows(models=("megatron-22b", "megatron-175b"), hardware=MEGATRON_2022, s=2048, b=1) -> list[dict]:
    """One layer's bytes per micro-batch at TP 8, each model x SP x recomputation: the paper's
    Table 2 formula, the planner's (:func:`layer_activation_bytes` on ``hardware``), the course
    terms' (:func:`course_terms`) and the dry run's."""
    rows = []
    for name in models:
        spec = get_model(name)
        h, a, t = spec.hidden, spec.n_heads, KORTHIKANTI_TP
        for sp in (False, True):
            for rc in RECOMPUTE:
                layout = Layout(tp=t, sp=sp, recompute=rc, global_batch=b, seq_len=s)
                terms = course_terms(s, b, h, a, t, sp, rc)
                planner = layer_activation_bytes(spec, s, b, t, sp, rc, fused_attention=hardware.fused_attention)
                rows.append({"model": spec.name, "sp": sp, "recompute": rc, "sbh": s * b * h,
                             "paper": terms["paper"], "planner": planner, "course_terms": round(terms["course"]),
                             "dry": layer_activations(spec, hardware, layout), "dropout": terms["dropout"]})
    return rows


def first_stage_rows(model="megatron-175b", n_layers=None, hardware=MEGATRON_2022, pp=8, v=2,
                     microbatches=16) -> list[dict]:
    """The first stage's activation peak (the paper's layout: TP 8 + SP, selective, pp 8) under
    1F1B and interleaving (v chunks), next to Korthikanti et al.'s L x one layer x (1 + (p - 1) /
    (p v)) (1F1B: L x one layer, p micro-batches of L / p layers) with the paper's layer
    (34 s b h / t), the planner's first stage and the same rule with the dry run's own layer.
    ``n_layers``: the model cut to so many layers (the peak is L / p layers deep; fast)."""
    spec = with_layers(model, n_layers) if n_layers else get_model(model)
    s, h, a, t, L = spec.seq_len, spec.hidden, spec.n_heads, KORTHIKANTI_TP, spec.n_layers
    layer = layer_activations(spec, hardware, Layout(tp=t, sp=True, recompute="selective", global_batch=1))
    paper_layer = activation_bytes_per_layer(s, 1, h, a, t, True, "selective")
    rows = []
    for schedule, chunks in (("1f1b", 1), ("interleaved", v)):
        layout = Layout(tp=t, pp=pp, sp=True, recompute="selective", schedule=schedule, v=chunks,
                        global_batch=microbatches)
        r = dry_run(spec, hardware, layout, progress=None, fusions=FUSIONS)
        factor = 1 + (pp - 1) / (pp * chunks) if chunks > 1 else 1.0
        est = estimate(spec, hardware, layout)
        rows.append({"model": spec.name, "schedule": schedule, "v": chunks, "L": L, "factor": factor,
                     "in_flight": F.in_flight_microbatches(pp, layout.microbatches, schedule, chunks),
                     "paper": L * paper_layer * factor, "planner": est.memory_by_stage[0]["activations"],
                     "rule_dry_layer": L * layer * factor, "dry": r.memory_by_stage[0]["activations"]})
        rows[-1]["rest"] = rows[-1]["dry"] - round(rows[-1]["rule_dry_layer"])
    return rows


def fsdp_activations(model, hardware, dp: int = 4, **layout) -> dict:
    """The dry run's activation category for the same step under DDP and under FSDP (zero 3):
    equal, since FSDP's own ``saved_tensors_hooks`` (a saved view of a gathered parameter becomes
    a token; torch calls only the innermost pair) hand every other saved tensor to the pipeline
    runner's count around them. Returns {"ddp": bytes, "fsdp": bytes}."""
    out = {}
    for name, zero in (("ddp", 0), ("fsdp", 3)):
        r = dry_run(model, hardware, Layout(dp=dp, zero=zero, global_batch=dp, **layout), progress=None)
        out[name] = r.memory_by_stage[0]["activations"]
    return out


ZERO_COLUMNS = (("N", "{}"), ("stage", "{}"), ("paper_GB", "{:g}"), ("formula_GB", "{:.2f}"),
                ("P_formula_GB", "{:.2f}"), ("planner_GB", "{:.2f}"), ("dry_GB", "{:.2f}"))


def format_rows(rows, columns) -> str:
    """A table, ' | ' between columns; '-' where a row has no value."""
    lines = [" | ".join(c for c, _ in columns)]
    for r in rows:
        lines.append(" | ".join("-" if r.get(c) is None else f.format(r[c]) for c, f in columns))
    return "\n".join(lines)


__all__ = ["ZERO_MODEL", "TABLE1_DEVICES", "model_state_bytes", "zero_table1_rows", "precision_rows",
           "sharded_optimizer_rows", "with_layers", "layer_activations", "course_terms", "activation_rows",
           "first_stage_rows", "fsdp_activations", "format_rows", "ZERO_COLUMNS"]
