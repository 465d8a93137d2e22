"""Graders of chapter 10's dry-run questions (issue #36). The reference is the planner.

    check_layout_for_mfu(choose_layout)   # a layout reaching a target MFU within the memory
    check_largest_loss(largest_loss)      # a published row's largest loss, by name

Each prints one line and returns True/False; a learner's exception becomes a hint. While the
learner's function runs, the planner's search, the dry run's breakdown (``course_lib.viz.dry_run``)
and this module's references are switched off; ``planner.estimate``, the tool the questions
are about, stays on.
"""
from __future__ import annotations

from course_lib.grading import Case, check, learner
from course_lib.grading.harness import check_answers
from course_lib.grading.planner import fitting_estimate
from course_lib.planner import Layout, estimate
from course_lib.planner import validation as V
from course_lib.planner.presets import MODELS, ModelSpec, gpt_spec
from course_lib.planner.search import search

GiB = 2**30
REFERENCES = ("course_lib.grading.dry_run:_best_mfu", "course_lib.grading.dry_run:_reference_largest_loss",
              "course_lib.grading.dry_run:_losses")
SEARCH = ("course_lib.planner.search:*",)
BREAKDOWN = ("course_lib.viz.dry_run:*",)

# ----------------------------------------------------------------------------- a layout for a target MFU

MFU_SHARE = 0.9     # the target: this share of the best MFU the planner's search finds
MFU_TASKS = [       # model, GPU, GPUs, global batch (sequences), memory limit per GPU
    (gpt_spec("GPT 16L h1024", 16, 1024, 16, V=32000, s=1024), "a100-80gb", 16, 64, 20 * GiB),
    (ModelSpec("Llama-style 16L h1024 GQA", 16, 1024, 16, 4, 2816, 32000, 1024), "h100-sxm", 8, 32, 16 * GiB),
    (gpt_spec("GPT 24L h2048", 24, 2048, 16, V=50304, s=2048), "a100-80gb", 32, 128, 30 * GiB),
]


def _best_mfu(model, hardware, n_gpus, global_batch, memory_limit):
    """(MFU, layout) of the best layout the planner's search finds for the task."""
    best = search(model, hardware, n_gpus, global_batch, memory_limit=memory_limit).best
    return best.mfu, best.layout


def _target(best_mfu: float) -> float:
    return int(MFU_SHARE * best_mfu * 1000) / 1000          # rounded down to 0.1%


def mfu_target(model, hardware, n_gpus, global_batch, memory_limit) -> float:
    """The task's target MFU: :data:`MFU_SHARE` of the search's best, rounded down to 0.1%."""
    return _target(_best_mfu(model, hardware, n_gpus, global_batch, memory_limit)[0])


def check_layout_for_mfu(choose_layout) -> bool:
    """choose_layout(model, hardware, n_gpus, global_batch, memory_limit, target_mfu) -> a
    planner Layout on ``n_gpus`` GPUs, within ``memory_limit`` bytes per GPU, whose planner MFU
    reaches ``target_mfu`` (90% of the best the planner's search finds)."""
    answer = learner(choose_layout, SEARCH, REFERENCES, exercise="the search for a layout", seconds=60)

    def run(case):
        model, hw, n, batch, limit = (case.params[k] for k in ("model", "hardware", "n_gpus", "global_batch",
                                                               "memory_limit"))
        best, _ = _best_mfu(model, hw, n, batch, limit)
        target = _target(best)
        layout = answer(model, hw, n, batch, limit, target)
        est = fitting_estimate(layout, model, hw, n, batch, limit)   # a ValueError (not valid on n GPUs): a hint
        if isinstance(est, str):
            return est
        if est.mfu < target:
            return (f"{layout.describe()} fits but reaches MFU {est.mfu:.1%}, under the target "
                    f"{target:.1%} (the search's best: {best:.1%})")
        return None
    cases = [Case(dict(model=m, hardware=hw, n_gpus=n, global_batch=g, memory_limit=lim),
                  label=f"{m.name}, {n} x {hw}, {g} sequences, <= {lim / GiB:.0f} GiB")
             for m, hw, n, g, lim in MFU_TASKS]
    return check("layout_for_mfu", cases, run)


# ----------------------------------------------------------------------------- the largest loss of a row

CHOICES = ("pipeline bubble", "exposed TP communication", "DP all-reduce", "recompute")


def published_rows():
    """[(label, ModelSpec, Hardware, Layout)]: Korthikanti et al. 2022 Table 5, and three rows of
    Narayanan et al. 2021 Table 1 (the planner validation's layout rule for each)."""
    rows = []
    for name, pp, gbs, _, _ in V.KORTHIKANTI_TABLE5:
        model = MODELS[name]
        rows.append((f"Korthikanti 2022 T5, {model.name}", model, V.MEGATRON_2022, V.korthikanti_layout(model, pp, gbs)))
    for billions, a, h, L, tp, pp, gpus, gbs, _ in V.NARAYANAN_TABLE1:
        if billions in (1.7, 18.4, 145.6):
            model = gpt_spec(f"GPT {billions:g}B", L, h, a)
            rows.append((f"Narayanan 2021 T1, {model.name}", model, V.MEGATRON_2022,
                         Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, global_batch=gbs, recompute="full")))
    return rows


def _losses(est) -> dict:
    """Seconds of the step lost to each of :data:`CHOICES`, from the planner's breakdown: the
    bubble with the pipeline messages, TP and DP (with ZeRO's) collectives left exposed, and the
    share of compute spent recomputing (hardware FLOPs over model FLOPs)."""
    t = est.time
    return {"pipeline bubble": t["bubble"] + t["pp"], "exposed TP communication": t["tp"],
            "DP all-reduce": t["dp"] + t["zero"],
            "recompute": t["compute"] * (1 - est.model_flops / est.hardware_flops)}


def _reference_largest_loss(model, hardware, layout) -> str:
    losses = _losses(estimate(model, hardware, layout))
    return max(losses, key=losses.get)


def check_largest_loss(largest_loss) -> bool:
    """largest_loss(model, hardware, layout) -> which of :data:`CHOICES` costs a published row
    the most time, by the planner's breakdown (``estimate(...).time`` and its FLOP counts)."""
    def differ(got, want, model, hw, layout):
        if got not in CHOICES:
            return f"expected one of {', '.join(map(repr, CHOICES))}, got {got!r}"
        if got != want:
            est = estimate(model, hw, layout)
            shares = ", ".join(f"{k} {v / est.step_time:.1%}" for k, v in _losses(est).items())
            return f"got {got!r}, but the planner's breakdown of the step is: {shares}"
    cases = [Case(dict(args=(m, hw, lay)), label=f"{label}: {lay.describe()}")
             for label, m, hw, lay in published_rows()]
    return check_answers("largest_loss", largest_loss, cases, _reference_largest_loss,
                         guard=(SEARCH, BREAKDOWN, REFERENCES), exercise="naming the largest loss", seconds=20,
                         differ=differ)


__all__ = ["check_layout_for_mfu", "check_largest_loss", "mfu_target", "published_rows", "CHOICES"]
