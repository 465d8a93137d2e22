"""The planner checked against the dry run on random valid layouts (issue #36, "Checked against
published runs", third bullet): three presets (a dense GPT, a Llama-style model with grouped-
query attention, a mixture of experts) on two GPUs, layouts drawn with a fixed seed among those
the ranks accept (:func:`~course_lib.virtual.dry_run.check_dry_run`) and the planner says fit.

    rows = sweep_rows(54)                      # minutes on 2 cores
    print(format_rows(rows)); print(sweep_summary(rows))

For each row: ``planner.estimate(..., runtime="course")`` (the course's own program, counted:
what the dry run runs) against :func:`course_lib.virtual.dry_run`, step time and peak memory;
the planner's default ``runtime="megatron"`` beside. Where they differ by more than 10%, the
row names the cause: the part of the step (compute and its launches, exposed TP, pipeline
bubble, DP, optimizer) where the planner's time and the dry run's
(:func:`course_lib.viz.dry_run.step_breakdown`) differ most, a pipeline's bubble compared at
the dry run's own forward + backward of a micro-batch (:func:`cause`: a longer pass makes a
longer bubble; then the pass is named). :func:`schedule_check` applies the planner's pipeline
formula to the dry run's own passes. The dry runs use torch's foreach AdamW, which the planner's
course runtime counts. Data parallelism is drawn as DDP, ZeRO-1, ZeRO-2 or ZeRO-3 (the MoE:
DDP, each again under ZeRO-1, 2 and 3, :func:`sweep_layouts`' ``moe_zero``; and with etp 2, its
``moe_etp``). The planner stays the instant
search; the dry run is its check.
"""
from __future__ import annotations

import ast
import dataclasses
import random
import time

from course_lib.layout import Layout
from course_lib.planner import estimate
from course_lib.planner.formulas import SPLIT
from course_lib.planner.presets import get_model

# (preset, sequence the layouts run at): the dense GPT of Korthikanti et al. 2022 Table 5's
# first row, Llama 3 8B (GQA, 8 K/V heads) at 2048 tokens, the GPT MoE preset (8 experts, top-2)
SWEEP_MODELS = (("megatron-22b", 2048), ("llama3-8b", 2048), ("gpt-1.3b-moe-8x", 2048))
SWEEP_GPUS = ("a100-80gb", "h100-sxm")
BOUND = 0.10            # a row whose step time (or memory) differs more is explained


def _draw(rng, moe: bool, s: int) -> Layout:
    """One random layout (ZeRO-3 on a tied embedding with pp > 1 is refused by FSDP; the MoE draws
    ZeRO-0, :func:`sweep_layouts` runs its ZeRO-1/2/3 twins)."""
    tp = 1 if moe else rng.choice((1, 2, 4, 8))
    sp = tp > 1 and rng.random() < 0.7
    cp = 1 if moe or tp == 8 else rng.choice((1, 1, 2))
    pp = rng.choice((1, 2, 4))
    dp = rng.choice((1, 2, 4, 8) if moe else (1, 2, 4))
    ep = rng.choice([e for e in (1, 2, 4, 8) if dp % e == 0]) if moe else 1
    schedule = rng.choice(("1f1b", "gpipe", "interleaved")) if pp > 1 else "1f1b"
    m = pp if pp > 1 else rng.choice((1, 2))
    zero = 0 if moe else rng.choice((0, 0, 1, 2, 3, 3))
    return Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, sp=sp, schedule=schedule,
                  v=2 if schedule == "interleaved" else 1, micro_batch=1, microbatches=m, seq_len=s,
                  recompute=rng.choice(("none", "selective", "full")),
                  zero=zero)


def split_twins(layout: Layout) -> list:
    """A drawn pipeline layout under each schedule that splits its backwards (ZB-H1 at its m,
    ZB-V at its m, DualPipeV at m = 2p), as close as the ranks accept: no recomputation (the
    split keeps each Linear's input, which recomputation does not) and DDP or ZeRO-1/2 (not
    FSDP, which the split's W writes around)."""
    if layout.pp == 1:
        return []
    base = layout.with_(v=1, recompute="none", zero=min(layout.zero, 2))
    return [base.with_(schedule="zb-h1"), base.with_(schedule="zb-v"),
            base.with_(schedule="dualpipe-v", microbatches=2 * layout.pp)]


def sweep_layouts(n: int, seed: int = 0, cp_methods: bool = True, moe_groups: bool = True,
                  split: bool = True, moe_zero: bool = True, moe_etp: bool = True) -> list:
    """``n`` (preset, GPU, Layout), cycling over models x GPUs, each layout drawn at random
    until the ranks accept it and the planner (its ``runtime="megatron"``, which the sweep does
    not change) says it fits; ``cp_methods``: after the n, each drawn CP layout (a ring) again
    with Llama 3's all-gathered K/V and with Ulysses, where the ranks accept it and it fits (the
    same draw: the n rows do not move); ``moe_groups``: each drawn MoE layout (tp = cp = 1) again
    beside tp 2 with sequence parallelism and beside cp 2 (its routing group across those ranks),
    where the ranks accept it and it fits (36 rows on 2026-11-30: 108 in all). Their first run
    found 5 over 10%, every one beside tp 2 + SP, the planner 12-17% fast: it priced a TP rank's
    experts on the whole sequence divided by tp, not at their own s / tp rows (now
    ``ep_ops.install_ep(shard=)``: none over 10%). ``split``: then each drawn pipeline layout again
    under the schedules with W actions (:func:`split_twins`), where the ranks accept it and it
    fits (2026-11-30, seventeenth session). ``moe_zero``: then each drawn MoE layout with dp > 1
    again under ZeRO-1 and ZeRO-2, an expert's slices over the ranks holding it ("edp"), and
    under ZeRO-3, each block's experts an FSDP unit over them, where the ranks accept it and it
    fits (2026-11-30, nineteenth and twentieth sessions). ``moe_etp``: then each drawn MoE layout
    again with each expert's width split over etp 2, alone and beside tp 2 with sequence
    parallelism (the etp group inside the tp ranks), where the ranks accept it and it fits
    (2026-11-30, twenty-first session: the planner had traced an etp rank as one device's loop
    and counted E / (ep etp) experts' gradients, 16-22% slow or 9% fast on such layouts)."""
    from course_lib.virtual.dry_run import check_dry_run
    out = _drawn(n, seed, check_dry_run)
    def accepted(name, hw, twin) -> bool:        # the ranks run it and the planner says it fits
        try:
            check_dry_run(get_model(name), twin)
        except (ValueError, NotImplementedError):
            return False
        return estimate(name, hw, twin).fits

    twins = []
    for name, hw, layout in out:
        if cp_methods and layout.cp > 1:
            candidates = (layout.with_(cp_comm="all_gather"), layout.with_(cp_method="ulysses"))
        elif moe_groups and get_model(name).n_experts > 1:
            candidates = (layout.with_(tp=2, sp=True), layout.with_(cp=2))
        else:
            continue
        twins += [(name, hw, twin) for twin in candidates if accepted(name, hw, twin)]
    for name, hw, layout in out if split else ():
        twins += [(name, hw, twin) for twin in split_twins(layout) if accepted(name, hw, twin)]
    for name, hw, layout in out if moe_zero else ():
        if get_model(name).n_experts > 1 and layout.dp > 1:
            twins += [(name, hw, layout.with_(zero=z)) for z in (1, 2, 3) if accepted(name, hw, layout.with_(zero=z))]
    for name, hw, layout in out if moe_etp else ():
        if get_model(name).n_experts > 1:
            candidates = (layout.with_(etp=2), layout.with_(tp=2, sp=True, etp=2))
            twins += [(name, hw, twin) for twin in candidates if accepted(name, hw, twin)]
    return out + twins


def _drawn(n: int, seed: int, check_dry_run) -> list:
    rng, out, tries = random.Random(seed), [], 0
    combos = [(m, s, g) for m, s in SWEEP_MODELS for g in SWEEP_GPUS]
    while len(out) < n:
        name, s, hw = combos[len(out) % len(combos)]
        spec = get_model(name)
        layout = _draw(rng, spec.n_experts > 1, s)
        tries += 1
        if tries > 200 * n:
            raise RuntimeError("could not draw enough valid layouts")
        try:
            check_dry_run(spec, layout)
        except (ValueError, NotImplementedError):
            continue
        if not estimate(spec, hw, layout).fits:     # (runtime="megatron": the draw stays put)
            continue
        out.append((name, hw, layout))
    return out


PARTS = {   # the planner's TIME_KINDS -> the dry run's step_breakdown parts
    "compute": ("compute", "elementwise", "launch", "cp", "ep", "zero", "pp"),
    "exposed TP": ("tp",),
    "pipeline bubble": ("bubble",),
    "DP all-reduce": ("dp",),
    "optimizer and syncs": ("optimizer",),
}


def planner_parts(est) -> dict:
    """The planner's step by the dry run's parts (ring hops, EP and ZeRO gathers sit inside
    the dry run's compute actions, as the pipeline's sends do), on the first stage, whose
    first rank the dry run's parts are of: the planner's ``time`` splits the pipeline on its
    busiest stage, the first stage's bubble is the pipeline less the first stage's own work."""
    out = {part: sum(est.time.get(k, 0.0) for k in kinds) for part, kinds in PARTS.items()}
    stages = est.stages
    if len(stages) > 1:
        pipe = out["compute"] + out["exposed TP"] + out["pipeline bubble"]
        m = est.layout.microbatches
        first = {kind: m * (stages[0].fwd.get(kind, 0.0) + stages[0].bwd.get(kind, 0.0)) for kind in PARTS["compute"]}
        first["pp"] = est.time.get("pp", 0.0)
        out["compute"] = sum(first.values())
        out["exposed TP"] = m * (stages[0].fwd.get("tp", 0.0) + stages[0].bwd.get("tp", 0.0))
        out["pipeline bubble"] = pipe - out["compute"] - out["exposed TP"]
    return out


def cause(planner: dict, dry: dict, passes: tuple | None = None) -> str:
    """The part where the planner's seconds and the dry run's differ most, signed.

    ``passes``: (planner, dry run) seconds of the busiest stage's forward + backward of one
    micro-batch. A pipeline's bubble is p - 1 such passes on the first stage: where the two
    differ in the pass, the bubble differs in the same ratio without its schedule being wrong.
    So the bubble is compared at the dry run's pass (the planner's bubble times dry / planner):
    what remains is the schedule's; the rest is named "F+B per micro-batch" with both passes."""
    planner = dict(planner)
    if passes and passes[0] > 0 and planner.get("pipeline bubble", 0.0) > 0:
        ratio = passes[1] / passes[0]
        scaled = planner["pipeline bubble"] * ratio
        per_pass = planner["pipeline bubble"] - scaled         # the bubble's share of the pass's difference
        planner["pipeline bubble"] = scaled
        planner["compute"] = planner.get("compute", 0.0) + per_pass
    part = max(dry, key=lambda k: abs(planner.get(k, 0.0) - dry[k]))
    diff = planner.get(part, 0.0) - dry[part]
    if passes and part == "compute" and passes[0] > 0 and abs(passes[0] / passes[1] - 1) > BOUND / 2:
        return (f"F+B per micro-batch {passes[0] / passes[1] - 1:+.0%} "
                f"({passes[0] * 1e3:.1f} vs {passes[1] * 1e3:.1f} ms)")
    return f"{part} {'+' if diff >= 0 else '-'}{abs(diff) * 1e3:.1f} ms"


def memory_cause(layout, est, dry_peak: float) -> str:
    """What a peak-memory difference over :data:`BOUND` is known to come from, or ''.

    The sweep compares the planner with the dry run's count at moments: the states at each
    moment of the step and the activations saved for backward then (``DryRun.moment_memory``;
    its ``peak_memory`` adds every tensor held between the moments, :mod:`course_lib.virtual.live_memory`);
    the planner's adds what a GPU holds only for a moment ("temporaries": the last stage's
    logits, under full recomputation the layer being recomputed, under ZeRO-3 the gathered
    parameters of two units). Said where the planner's peak without them is the dry run's
    within 2% (the sweep's ZeRO-3 x CP row: 2.1197 against 2.1199 GiB)."""
    if abs(est.memory["total"] / dry_peak - 1) <= BOUND:
        return ""
    held = max(st.memory["total"] - st.memory["temporaries"] for st in est.stages)
    if abs(held / dry_peak - 1) > 0.02:
        return ""
    return (f"memory: the planner's temporaries ({est.memory['temporaries'] / 2**30:.2f} GiB), which the dry "
            f"run's count at moments leaves out; without them {held / dry_peak - 1:+.1%}")


def schedule_check(layout, dry: dict) -> float | None:
    """The pipeline's length as the planner's formula gives it from the DRY RUN's own passes
    (per stage, its slowest running rank's mean forward + backward of a micro-batch or chunk:
    sum over stages + (m v - 1) x the longest, sends left out), over the dry run's pipeline
    (the first rank's compute, exposed TP and bubble), less 1. Near 0 (the sends): the
    planner's schedule is the course's, and a difference in the step is the passes'. Under
    ZeRO-1/2 the dry run's pipeline also holds the parameters' gather before the first forward
    (its breakdown's bubble): there the check reads low by that much (-12% at most in the sweep).
    None for the schedules with W actions: the planner runs their action lists on the stages'
    costs (``simulator.pipeline_phase``), not this formula, and their passes hold B and W apart."""
    passes = dry.get("passes")
    if layout.pp == 1 or not passes or layout.schedule in SPLIT:
        return None
    per_stage = {}
    for rank, (f, b) in passes.items():
        stage = (int(rank) // (layout.tp * layout.cp)) % layout.pp
        per_stage[stage] = max(per_stage.get(stage, 0.0), f + b)
    v = layout.v if layout.schedule == "interleaved" else 1
    ops = list(per_stage.values())
    formula = sum(ops) + (layout.microbatches * v - 1) * max(ops)
    parts = dry["parts"]
    return formula / (parts["compute"] + parts["exposed TP"] + parts["pipeline bubble"]) - 1


def busiest_pass(est, layout, passes: dict | None) -> tuple | None:
    """(planner, dry run) seconds of one micro-batch's forward + backward on the busiest stage
    (the dry run's spans are per chunk: times the chunks), or None without the dry run's."""
    if not passes:
        return None
    chunks = layout.v if layout.schedule == "interleaved" else 1
    dry = max(f + b for f, b in passes.values()) * chunks
    return max(st.fwd_time + st.bwd_time for st in est.stages), dry


def dry_result(name, hw, layout) -> dict:
    """The dry run's step time, peak memory and step breakdown (rank 0's) of one layout, with
    torch's foreach AdamW: the optimizer the planner's course runtime counts."""
    from course_lib.viz.dry_run import step_breakdown
    from course_lib.virtual import dry_run
    began = time.perf_counter()
    r = dry_run(name, hw, layout, progress=None, optimizer="foreach")
    parts = step_breakdown(r.spans, min(s.rank for s in r.spans), r.step_time)
    # "peak_memory": the count at moments (DryRun.moment_memory), which the planner walks (its
    # temporaries beside); "gpu_peak": the GPU's peak over the step, every tensor (r.peak_memory)
    return {"step_time": r.step_time, "peak_memory": r.moment_memory, "gpu_peak": r.peak_memory, "parts": parts,
            "passes": pass_times(r.spans), "wall_s": time.perf_counter() - began}


def pass_times(spans) -> dict:
    """{rank: [forward seconds, backward seconds]} per micro-batch (and chunk) of each running
    rank, their means over its schedule's forward and backward spans."""
    out = {}
    for kind in "FB":
        for s in spans:
            if s.kind == "compute" and s.dim == "pp" and s.name[:1] == kind and s.name[1:2].isdigit():
                out.setdefault(str(s.rank), {"F": [], "B": []})[kind].append(s.end - s.start)
    return {r: [sum(v["F"]) / max(1, len(v["F"])), sum(v["B"]) / max(1, len(v["B"]))] for r, v in out.items()}


def layout_key(name: str, hw: str, layout: Layout) -> str:
    """A saved dry run's key: the preset, the GPU and the layout's fields that differ from
    :class:`Layout`'s defaults (a field added to Layout later leaves the key unchanged)."""
    default = Layout()
    fields = [f.name for f in dataclasses.fields(Layout) if f.repr]
    changed = ", ".join(f"{f}={getattr(layout, f)!r}" for f in fields
                        if getattr(layout, f) != getattr(default, f))
    return f"{name} | {hw} | Layout({changed})"


def stable_keys(dry: dict) -> dict:
    """``dry`` with every key as :func:`layout_key` writes it (older saved sweeps keyed by
    ``repr(Layout)`` of every field are read by their fields)."""
    out = {}
    for key, value in dry.items():
        name, hw, text = key.split(" | ", 2)
        call = ast.parse(text, mode="eval").body
        fields = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        given = {f: fields.pop(f) for f in ("micro_batch", "global_batch", "microbatches") if f in fields}
        layout = Layout(**fields, micro_batch=given.get("micro_batch"), microbatches=given.get("microbatches"))
        out[layout_key(name, hw, layout)] = value
    return out


def sweep_rows(n: int = 54, seed: int = 0, progress: bool = False, dry: dict | None = None,
               saved=None, run_missing: bool = True, moe_groups: bool = True, split: bool = True,
               moe_zero: bool = True, moe_etp: bool = True) -> list[dict]:
    """The rows of :func:`sweep_layouts`. ``dry``: {layout key: :func:`dry_result`} already run
    (the planner is instant, the dry runs take minutes: a saved sweep compares a changed
    planner at once); the runs made here are added to it, and ``saved(dry)`` called after each.
    ``run_missing=False``: only the layouts ``dry`` holds; ``moe_groups``, ``split``, ``moe_zero``,
    ``moe_etp``: see :func:`sweep_layouts`."""
    dry = {} if dry is None else dry
    rows, failed = [], []
    for name, hw, layout in sweep_layouts(n, seed, moe_groups=moe_groups, split=split, moe_zero=moe_zero,
                                          moe_etp=moe_etp):
        key = layout_key(name, hw, layout)
        if key not in dry and not run_missing:
            continue
        if key not in dry:
            try:
                dry[key] = dry_result(name, hw, layout)
            except (RuntimeError, NotImplementedError) as e:     # the dry run's limits: said, not hidden
                dry[key] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
            if saved is not None:
                saved(dry)
        d = dry[key]
        if "error" in d:
            failed.append((name, hw, layout.describe(), d["error"]))
            if progress:
                print(f"dry run failed: {name} {hw} {layout.describe()}: {d['error']}", flush=True)
            continue
        est = estimate(name, hw, layout, runtime="course")
        row = {"model": get_model(name).name, "GPU": hw, "layout": layout.describe(),
               "planner_s": est.step_time, "dry_s": d["step_time"], "time_diff": est.step_time / d["step_time"] - 1,
               "megatron_s": estimate(name, hw, layout).step_time,
               "planner_GiB": est.memory["total"] / 2**30, "dry_GiB": d["peak_memory"] / 2**30,
               "memory_diff": est.memory["total"] / d["peak_memory"] - 1,
               "cause": cause(planner_parts(est), d["parts"], busiest_pass(est, layout, d.get("passes"))),
               "planner_parts": planner_parts(est),
               "dry_parts": d["parts"], "wall_s": d["wall_s"]}
        if "gpu_peak" in d:         # (runs saved before 2026-11-30 kept only the count at moments)
            row["gpu_peak_diff"] = est.memory["total"] / d["gpu_peak"] - 1
        row["memory_cause"] = memory_cause(layout, est, d["peak_memory"])
        row["schedule_check"] = schedule_check(layout, d)
        rows.append(row)
        if progress:
            print(format_rows([row], header=len(rows) == 1), flush=True)
    return rows


COLUMNS = (("model", "{:.12}"), ("GPU", "{:.4}"), ("layout", "{}"), ("planner_s", "{:.3f}"), ("dry_s", "{:.3f}"),
           ("time_diff", "{:+.1%}"), ("planner_GiB", "{:.1f}"), ("dry_GiB", "{:.1f}"), ("memory_diff", "{:+.1%}"),
           ("cause", "{}"))


def format_rows(rows, header=True) -> str:
    lines = [" | ".join(c for c, _ in COLUMNS)] if header else []
    for r in rows:
        cells = [f.format(r[c]) for c, f in COLUMNS]
        if abs(r["time_diff"]) <= BOUND:
            cells[-1] = "-"
        if r.get("memory_cause"):
            cells[-1] = (cells[-1] + "; " if cells[-1] != "-" else "") + r["memory_cause"]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def sweep_summary(rows) -> str:
    lines = []
    checks = [r["schedule_check"] for r in rows if r.get("schedule_check") is not None]
    if checks:
        lines.append(f"pipeline from the dry run's own passes by the planner's formula / the dry run's: "
                     f"{min(checks):+.1%} to {max(checks):+.1%} over {len(checks)} pipelined rows")
    for key, what in (("time_diff", "step time"), ("memory_diff", "memory at the moments"),
                      ("gpu_peak_diff", "the GPU's peak (every tensor)")):
        errs = [abs(r[key]) for r in rows if key in r]
        if not errs:
            continue
        over = sum(e > BOUND for e in errs)
        lines.append(f"{what}: mean |planner/dry - 1| {sum(errs) / len(errs):.1%}, worst {max(errs):.1%}, "
                     f"{over} of {len(rows)} over {BOUND:.0%}")
    return "\n".join(lines)


__all__ = ["SWEEP_MODELS", "SWEEP_GPUS", "BOUND", "sweep_layouts", "sweep_rows", "dry_result", "layout_key",
           "stable_keys", "split_twins", "planner_parts", "cause", "busiest_pass", "pass_times", "memory_cause", "schedule_check",
           "format_rows", "sweep_summary"]
