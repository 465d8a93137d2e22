"""Llama 3 405B's Table 4 rows on the dry run: where each row's peak memory goes, read with the
dry run's own accounting (:func:`course_lib.virtual.dry_run`, ``memory_by_stage``), next to
what Dubey et al. 2024 (arXiv 2407.21783) say about memory (:data:`PAPER`).

    rows = breakdown_rows()                  # the three rows (a minute of CPU each)
    print(format_breakdown(rows))

The dry run's peak of a GPU is the largest over the step of its model states as they are at
that moment plus the tensors autograd saved for backward then, counted at moments
(``memory_by_stage[k]["moments"]``, ``DryRun.moment_memory``: every number here; the GPU's peak
over the step adds the temporaries between the moments, ``peak_memory``, chapter 10's table);
its categories stay the states after the step and the runner's peak of saved activations
(``peak_activation_bytes``: storages, parameters excluded), whose sum was the peak before
(``total`` here, the "count"). Each Llama row's chunk is one layer (``llama3_layout``: 126 layers, the embedding
and the head on 16 x 8 chunks), so a stage's activation peak is its in-flight chunk forwards
(:func:`~course_lib.planner.formulas.in_flight_microbatches` x v) times one layer's saved
bytes (:func:`course_lib.lab.dry_run_memory.layer_activations` at the row's shape);
:func:`stage_rows` checks that identity on the run. What the accounting leaves out is
sized beside it (:func:`uncounted`): the stage outputs and messages the runner holds, and the
fp32 gradient sums of ZeRO-2 with FP32 accumulation, which live during the schedule.

Measured (2026-11-29, ``benchmarks/llama3_memory.py``; unit s b h / t = 32 MiB): every row peaks
on pp rank 1 (Llama 3's balance takes a layer off rank 0, whose warm-up is the deepest), its
activations exactly its layers in flight x one layer: 8k on 8,192 GPUs 6.68 + 141 x 0.661 =
99.83 GiB; 8k on 16,384 (m = p = 16: every forward before the first backward) 6.31 + 128 x
0.661 = 90.87; 128k 6.31 + 128 x 0.697 = 95.50. A layer saves 21.14 units (8k; "none" and
"selective" alike under FlashAttention: no checkpointing, as the paper's 8K claim): attention
5.14 (x, x / rms, the norm's output that TP + SP re-gathers, Q, K and V of one KV head, the
log-sum-exp, O), MLP 16 (x, x / rms, the norm's output, w1 x, w3 x, silu(w1 x), the product: 3.25
each); at 128k 22.30 (CP: each local chunk's output kept by its kernel and again, concatenated,
by the output projection; the rank's rotary tables, K and V, positions). To fit 80 GiB a layer
could save 16.64 units (8k, 8,192) or 18.42 (the others). The stage outputs are not in the
count (interior stages: activations = layers x one layer, to the byte), so Llama 3's
deallocation of them changes no counted byte; it acts on what the count leaves out
(:func:`held_over_step`, the course's runner -> with Llama 3's deallocation, the states as they
are at each action: 123.18 -> 111.61, 96.33 -> 92.33, 100.95 -> 96.95 GiB).

The peak over the step (2026-11-29, the states at each moment): 99.83 -> 111.52 GiB (8k on
8,192: every chunk's fp32 sums, 11.88 GiB, reach the stage before its last forward, less the
owned slices' fp32 gradients, 0.19 GiB, which exist only after the step), 90.87 -> 92.26 (8k on
16,384, m = p: every forward runs before the first backward, which holds one chunk's sums of
eight), 95.50 -> 96.89 (128k); :func:`held_over_step`'s "held" gives the same to 0.01 GiB.

With fused RMSNorm and SwiGLU (kernels the paper does not name; a Hardware with
``fused_kernels``, which the dry run now runs as :mod:`course_lib.fused`'s one-kernel ops:
measured 2026-11-29, a what-if, not the recorded rows): 88.39 GiB (8k on 8,192: the fp32 sums
and 141 layers in flight still do not fit), 71.26 (8k on 16,384) and 75.89 (128k) fit; the
step 10.988 / 6.212 / 14.126 s, -12.1% / -7.6% / -7.5% against the published times (as run:
-9.6% / -5.1% / -6.4%); the planner's memory the same to 0.01 GiB on the two 8k rows.
"""
from __future__ import annotations

from course_lib.lab.dry_run_memory import layer_activations
from course_lib.lab.dry_runs import DROPOUT, published_runs, row_software
from course_lib.planner import estimate
from course_lib.planner.formulas import in_flight_microbatches
from course_lib.virtual import dry_run

SOURCE = "Llama 3 T4"
GiB = 2**30

# Dubey et al. 2024, Sec. 3.3.2 ("Pipeline parallelism improvements", "Numerical stability") and
# Table 4, as printed (read 2026-11-29 in a Markdown copy of arXiv 2407.21783):
PAPER = {
    "memory imbalance": "Existing pipeline parallelism implementations lead to imbalanced resource "
                        "consumption. The first stage consumes more memory due to the embedding and the "
                        "warm-up micro-batches.",
    "balance": "To balance the pipeline, we reduce one Transformer layer each from the first and the last "
               "stages, respectively. This means that the first model chunk on the first stage has only the "
               "embedding, and the last model chunk on the last stage has only output projection and loss "
               "calculation.",
    "N": "we modify our pipeline schedule as shown in Figure 6, which allows setting N flexibly [...] finding "
         "a sweet spot between DFS and breadth first schedule (BFS) for the best communication and memory "
         "efficiency.",
    "record streams": "We enable TORCH_NCCL_AVOID_RECORD_STREAMS to reduce memory usage from asynchronous "
                      "point-to-point communication.",
    "deallocate": "Finally, to reduce memory cost, based on detailed memory allocation profiling, we "
                  "proactively deallocate tensors that will not be used for future computation, including "
                  "the input and output tensors of each pipeline stage, that will not be used for future "
                  "computation. With these optimizations, we could pre-train Llama 3 on sequences of 8K "
                  "tokens without activation checkpointing.",
    "FSDP": "Our use of FSDP for Llama 3 shards optimizer states and gradients, but for model shards we do "
            "not reshard after forward computation to avoid an extra all-gather communication during "
            "backward passes.",
    "FP32": "we use FP32 gradients accumulation during backward computation over multiple micro-batches and "
            "also reduce-scatter gradients in FP32 across data parallel workers in FSDP.",
    "Table 4": "Batch size/DP 32, 16, 16 (8,192 GPUs at 8K; 16,384 at 8K; 16,384 at 131,072 with CP 16); "
               "16M tokens per batch.",
}


# The three rows run with ZeRO-2's sums sent chunk by chunk (``Layout.grad_reduce``), a what-if:
# the recorded rows (lab.dry_run_table.RECORDED) send them after the schedule, as Megatron-LM of
# 2021-22 did, and the paper does not say when Llama 3's FSDP sent them. Measured 2026-11-30
# (sixteenth session) on the 2-core machine by :func:`grad_reduce_rows` (38-52 s a row), again
# 2026-12-01 with a bucket packed by one foreach copy (0.02-0.33% faster; 1,033 s for the five),
# and again that day with ZeRO's buffers made empty (no zeroing pass; 0.01-0.05% faster; every
# what-if of this module, the fused ones too, 31 min beside other work), and again that day
# (twenty-sixth session) with the host waiting at .tolist() (ZeRO's and DDP's flags; 0.005% slower):
# {(row, GPUs, mode): (step seconds, GiB at moments)}; "step": the recorded row (its count at
# moments; lab.dry_run_table.RECORDED keeps its peak with every tensor, 112.65 GiB).
GRAD_REDUCE_RECORDED = {
    ("Llama 3 405B, 8k", 8192, "step"): (11.389032664025638, 111.52),
    ("Llama 3 405B, 8k", 8192, "chunk"): (11.171693456221803, 111.52),
    ("Llama 3 405B, 8k", 8192, "round"): (11.184472653650163, 102.75),
    ("Llama 3 405B, 8k", 16384, "round"): (6.1134134832174905, 92.26),    # one round: "chunk"'s
    ("Llama 3 405B, 128k", 16384, "round"): (13.95734153646296, 96.89),
}


# The 8,192-GPU row with the sums sent each round AND fused RMSNorm and SwiGLU (a Hardware with
# ``fused_kernels``: kernels the paper does not name), a what-if: (step seconds, GiB at moments,
# GiB peak) of the dry run, measured 2026-11-30 by :func:`fused_round_row` (22 s of CPU). At
# moments it holds 79.62 GiB, 0.38 GiB under 80 (seventeenth session); with every tensor the
# program holds between the moments (eighteenth session, ``live_memory``: a layer's new fp32
# sums and bf16 weight gradients beside its activation gradients and SP's gathered inputs during
# a backward) it peaks at 82.05 GiB, and does not fit.
FUSED_ROUND_RECORDED = (10.864826943287047, 79.62, 82.05)   # again 2026-12-01 (twice: see above)


def fused_round_row(name="Llama 3 405B, 8k", gpus=8192) -> tuple:
    """The row run by the dry run with ``grad_reduce="round"`` on its Hardware with
    ``fused_kernels``: (step seconds, GiB at moments, GiB peak) (:data:`FUSED_ROUND_RECORDED`)."""
    return fused_row(name, gpus, grad_reduce="round")


# The two 16,384-GPU rows with fused RMSNorm and SwiGLU alone (their sums sent as the table's
# rows send them), a what-if: (step seconds, GiB at moments, GiB peak) of the dry run, measured
# 2026-11-30 (eighteenth session) by :func:`fused_row` (about a minute of CPU each): both fit.
FUSED_RECORDED = {("Llama 3 405B, 8k", 16384): (6.245148075078489, 71.26, 72.23),   # again 2026-12-01
                  ("Llama 3 405B, 128k", 16384): (14.036159407337983, 75.89, 76.86)}


def fused_row(name: str, gpus: int, grad_reduce=None) -> tuple:
    """A Llama row run by the dry run on its Hardware with ``fused_kernels`` (and ``grad_reduce``
    if given): (step seconds, GiB at moments, GiB peak)."""
    (source, _, model, hw, layout, *_), = llama_rows([(name, gpus)])
    layout = layout if grad_reduce is None else layout.with_(grad_reduce=grad_reduce)
    r = dry_run(model, hw.with_(fused_kernels=True), layout, fusions=row_software(source, name),
                dropout=DROPOUT[source], progress=None)
    return r.step_time, round(r.moment_memory / GiB, 2), round(r.peak_memory / GiB, 2)


def grad_reduce_rows(cases=tuple(GRAD_REDUCE_RECORDED)) -> dict:
    """Each (row, GPUs, mode) of ``cases`` run by the dry run with ``grad_reduce=mode``, the row's
    own software: {case: (step seconds, peak GiB)} (:data:`GRAD_REDUCE_RECORDED`'s numbers)."""
    out = {}
    for name, gpus, mode in cases:
        (source, _, model, hw, layout, *_), = llama_rows([(name, gpus)])
        r = dry_run(model, hw, layout.with_(grad_reduce=mode), fusions=row_software(source, name),
                    dropout=DROPOUT[source], progress=None)
        out[name, gpus, mode] = (r.step_time, round(r.moment_memory / GiB, 2))
    return out


def llama_rows(names=None):
    """The Llama 3 rows of :func:`course_lib.lab.dry_runs.published_runs` (``names``: (model name,
    GPUs) pairs, e.g. ("Llama 3 405B, 8k", 8192); None: all three)."""
    rows = [run for run in published_runs() if run[0] == SOURCE]
    if names is not None:
        rows = [run for run in rows if (run[1], run[4].n_gpus) in set(names)]
    return rows


def boundary_bytes(layout, spec, value_bytes: int = 2) -> int:
    """One activation handed between two stages: (micro-batch, s / cp / tp with SP, h) 16-bit."""
    s = (layout.seq_len or spec.seq_len) // layout.cp // (layout.tp if layout.sp else 1)
    return layout.micro_batch * s * spec.hidden * value_bytes


def unit_bytes(layout, spec, value_bytes: int = 2) -> int:
    """s b h / t at 16 bits (the rank's tokens): Korthikanti et al.'s unit of a layer's activations."""
    s = (layout.seq_len or spec.seq_len) // layout.cp
    return layout.micro_batch * s * spec.hidden * value_bytes // layout.tp


def in_flight_chunks(layout, stage: int) -> float:
    """Chunk forwards pipeline rank ``stage`` holds at its peak (the interleaved warm-up plus one):
    the planner's formula."""
    return in_flight_microbatches(layout.pp, layout.microbatches, layout.schedule, layout.v, stage) * layout.v


def peak_chunks(spec, layout, stage: int) -> dict:
    """The chunks pipeline rank ``stage`` holds when the most are live, counted on the schedule
    the ranks run (``course_lib.schedules``): how many, how many transformer layers they hold
    (``layout.stage_layers``), and how many hold no layer (the embedding-only and head-only
    chunks of Llama 3's balance)."""
    from course_lib.parallel.pipeline.rules import partition_layers
    from course_lib.schedules import chunks, make_schedule
    v = chunks(layout.schedule, layout.v)
    per = [len(r) for r in partition_layers(spec.n_layers, layout.pp * v, layout.stage_layers)]
    actions = make_schedule(layout.schedule, layout.pp, layout.microbatches, v)[stage]
    split = {(a.stage, a.mb) for a in actions if a.op == "W"}
    live, best = {}, {"chunks": 0, "layers": 0, "no_layer": 0}
    for a in actions:
        if a.op == "F":
            live[(a.stage, a.mb)] = per[a.stage]
            if len(live) > best["chunks"]:
                best = {"chunks": len(live), "layers": sum(live.values()),
                        "no_layer": sum(n == 0 for n in live.values())}
        elif a.op == "W" or (a.op == "B" and (a.stage, a.mb) not in split):
            del live[(a.stage, a.mb)]
    return best


def one_layer(spec, hw, layout, source: str = SOURCE) -> int:
    """One layer's saved bytes on one micro-batch at the row's shape (no pipeline), from the dry run."""
    one = layout.with_(pp=1, dp=1, zero=0, schedule="1f1b", v=1, stage_layers=None,
                       global_batch=layout.micro_batch, microbatches=None, order=None)
    return layer_activations(spec, hw, one, fusions=row_software(source, spec.name))


def stage_rows(run, layer: int) -> list[dict]:
    """Per pipeline stage of the DryRun ``run``: states, activations, ``total`` (their sum, the
    count before the dry run read the states at each moment), ``peak`` (the dry run's), the chunks it holds at its
    peak (:func:`peak_chunks`; the planner's count beside: ``formula_chunks``) and ``rest``:
    activations minus the layers they hold x ``layer`` (0 where every live chunk is a layer: the
    peak is in-flight layers x one layer; on the end stages, the embedding's or the head's)."""
    out = []
    for k, mem in enumerate(run.memory_by_stage):
        held = peak_chunks(run.model, run.layout, k)
        out.append({"stage": k, "states": mem["states"], "activations": mem["activations"],
                    "total": mem["states"] + mem["activations"], "peak": mem["moments"],
                    "in_flight_chunks": held["chunks"],
                    "formula_chunks": in_flight_chunks(run.layout, k), "layers_in_flight": held["layers"],
                    "no_layer_chunks": held["no_layer"], "rest": mem["activations"] - held["layers"] * layer})
    return out


def uncounted(spec, hw, layout, stage: int) -> dict:
    """Bytes a GPU running the course's program holds beyond the dry run's count (sized here by
    formula, not run): the fp32 gradient sums of rank ``stage``'s parameters (ZeRO-2 under
    "bf16-accumulate-fp32" adds each backward's gradients into whole fp32 buffers,
    ``precision.mixed.MainGrads``, and reduce-scatters them after the schedule: they live
    during it; the count takes the states after the step, when they are gone), the stage outputs
    the runner keeps from a forward to its backward at the peak (one boundary activation per
    chunk in flight: ``ScheduleRunner.state``), and what it has sent by the step's end, every
    message kept until then (``ScheduleRunner.sends``, waited after the schedule): the m v
    activations (the outputs' own storages) and the m v input gradients."""
    params = estimate(spec, hw, layout).memory_by_stage[stage]["params"] // 2     # bf16 weights
    b = boundary_bytes(layout, spec)
    return {"fp32_grad_sums": 4 * params, "outputs_kept": round(in_flight_chunks(layout, stage) * b),
            "sent_kept_at_end": 2 * layout.microbatches * layout.v * b}


def held_over_step(spec, layout, stage: int, layer: int, states: int, stage_params: int,
                   deallocate: bool = False, owned: int | None = None) -> dict:
    """A model of what an interior rank ``stage`` holds over the step, action by action on the
    schedule the ranks run (not run; ``layer``, ``states``: the dry run's), peaks returned:

    - "count": the states after the step + the saved activations (the dry run's count before
      it read the states at each moment);
    - "held" (with ``owned``, the parameters of the rank's ZeRO-2 slices): the states as they
      are at each action + the saved activations, after each forward and at the end of each
      backward, and the states after the step: the owned slices' fp32 gradients (4 ``owned``
      bytes) exist only after the step, the fp32 sums during it (a chunk's, 4 bytes a
      parameter, from its first backward): the dry run's ``peak`` (sent tensors not counted);
    - "program": the states (before any backward, with ``owned``) + the fp32 gradient sums (a
      chunk's from its first backward; ``stage_params``
      parameters, 4 bytes each, on equal one-layer chunks), the activations it sent (the stage
      outputs, kept for backward and then in the runner's ``sends``) and the input gradients it
      sent, both to the step's end, and the RECV_DEPTH receive buffers posted ahead: the course's
      runner as it runs;
    - with ``deallocate``: Llama 3's "proactively deallocate ... the input and output tensors of
      each pipeline stage" read as Megatron-LM's ``deallocate_output_tensor`` does it: a sent
      tensor's storage freed once its send is done, taken as the rank's next action (the
      receiver posts its receives ahead), the autograd graph kept."""
    from course_lib.parallel.pipeline.rules import partition_layers
    from course_lib.schedules import chunks, make_schedule
    v = chunks(layout.schedule, layout.v)
    per = [len(r) for r in partition_layers(spec.n_layers, layout.pp * v, layout.stage_layers)]
    actions = make_schedule(layout.schedule, layout.pp, layout.microbatches, v)[stage]
    mine = sorted({a.stage for a in actions})
    if any(per[s] == 0 for s in mine) or any(a.op == "W" for a in actions):
        raise ValueError(f"held_over_step models a rank of layer chunks without W actions; rank {stage} is not")
    b, sums = boundary_bytes(layout, spec), 4 * stage_params // len(mine)
    saved = held = fp32 = 0
    sent_last, started = 0, set()
    peak = {"count": 0, "program": 0}
    during = None if owned is None else states - 4 * owned      # the states before any backward
    base = states if during is None else during
    if during is not None:
        peak["held"] = states
    for a in actions:
        if deallocate:
            held -= sent_last               # what the last action sent: delivered, freed
        sent_last = 0
        if a.op == "F":
            saved += per[a.stage] * layer
            sent_last = b if a.stage < layout.pp * v - 1 else 0      # the stage's output
            if during is not None:
                peak["held"] = max(peak["held"], during + fp32 + saved)
        else:
            if a.stage not in started:      # a chunk's fp32 sums, from its first backward on
                started.add(a.stage)
                fp32 += sums
            peak["program"] = max(peak["program"], base + fp32 + saved + held + 2 * b)
            if during is not None:
                peak["held"] = max(peak["held"], during + fp32 + saved)
            saved -= per[a.stage] * layer
            sent_last = b if a.stage > 0 else 0                        # its input's gradient
        held += sent_last
        peak["count"] = max(peak["count"], states + saved)
        peak["program"] = max(peak["program"], base + fp32 + saved + held + 2 * b)
    return peak


def breakdown(run_row, progress=None) -> dict:
    """One row run and taken apart: the dry run's peak stage, its states and activations, one
    layer's bytes (and in units of s b h / t), the in-flight layers, the most bytes a layer could
    save and fit the GPU (``fit_units``), :func:`uncounted`, and the peak stage's
    :func:`held_over_step` without and with Llama 3's deallocation."""
    source, name, spec, hw, layout = run_row[:5]
    r = dry_run(spec, hw, layout, progress=progress, fusions=row_software(source, name), dropout=DROPOUT[source])
    layer = one_layer(spec, hw, layout, source)
    stages = stage_rows(r, layer)
    peak = max(stages, key=lambda s: s["peak"])
    unit = unit_bytes(layout, spec)
    budget = (hw.hbm_bytes - peak["states"]) / peak["layers_in_flight"]
    params = estimate(spec, hw, layout).memory_by_stage[peak["stage"]]["params"] // 2
    owned = params // (layout.dp * layout.cp) if layout.zero == 2 else None   # ZeRO-2's slices (padding left out)
    held = {d: held_over_step(spec, layout, peak["stage"], layer, peak["states"], params, deallocate=d, owned=owned)
            for d in (False, True)}
    return {"model": name, "GPUs": layout.n_gpus, "m": layout.microbatches, "step_time": r.step_time,
            "peak": r.moment_memory, "fits": r.moment_memory <= hw.hbm_bytes, "gpu_peak": r.peak_memory,
            "stages": stages, "peak_stage": peak["stage"],
            "layer": layer, "layer_units": layer / unit, "fit_units": budget / unit, "unit": unit,
            "uncounted": uncounted(spec, hw, layout, peak["stage"]), "held": held[False],
            "held_deallocated": held[True]}


def breakdown_rows(names=None, progress=None) -> list[dict]:
    return [breakdown(run, progress) for run in llama_rows(names)]


def format_breakdown(rows) -> str:
    lines = []
    for b in rows:
        p = b["stages"][b["peak_stage"]]
        u = b["uncounted"]
        lines += [f"{b['model']} on {b['GPUs']} GPUs, m = {b['m']}: peak {b['peak'] / GiB:.2f} GiB on stage "
                  f"{b['peak_stage']} (fits: {b['fits']}), step {b['step_time']:.3f} s",
                  f"  states {p['states'] / GiB:.2f} GiB + activations {p['activations'] / GiB:.2f} GiB = "
                  f"{p['layers_in_flight']:g} layers in flight x {b['layer'] / GiB:.3f} GiB "
                  f"({b['layer_units']:.2f} s b h / t) + {p['rest'] / GiB:.3f} GiB",
                  f"  to fit 80 GiB a layer may save {b['fit_units']:.2f} s b h / t",
                  f"  not counted: fp32 gradient sums {u['fp32_grad_sums'] / GiB:.2f} GiB, stage outputs "
                  f"kept {u['outputs_kept'] / GiB:.2f} GiB, sent and kept at the step's end "
                  f"{u['sent_kept_at_end'] / GiB:.2f} GiB",
                  f"  the dry run's peak over the step {b['peak'] / GiB:.2f} GiB (the model: "
                  f"{b['held'].get('held', 0) / GiB:.2f}); states after + activations {p['total'] / GiB:.2f} GiB",
                  f"  held over the step (model): count {b['held']['count'] / GiB:.2f} GiB, the course's "
                  f"program {b['held']['program'] / GiB:.2f} GiB, with Llama 3's deallocation "
                  f"{b['held_deallocated']['program'] / GiB:.2f} GiB"]
        lines += [f"  stage {s['stage']:2d}: states {s['states'] / GiB:6.2f} activations {s['activations'] / GiB:6.2f}"
                  f" = {s['layers_in_flight']:6.2f} layers + {s['rest'] / GiB:.3f} GiB" for s in b["stages"]]
    return "\n".join(lines)


__all__ = ["PAPER", "SOURCE", "GRAD_REDUCE_RECORDED", "grad_reduce_rows", "FUSED_ROUND_RECORDED", "fused_round_row", "FUSED_RECORDED", "fused_row", "llama_rows", "boundary_bytes", "unit_bytes", "in_flight_chunks", "one_layer",
           "peak_chunks", "stage_rows", "uncounted", "held_over_step", "breakdown", "breakdown_rows", "format_breakdown"]
