"""``estimate(model, hardware, layout)``: memory per GPU, step time and MFU of a layout.

The pieces come from :mod:`course_lib.planner.costs`; here they are composed into a
step analytically:

- the pipeline: with equal stages a step lasts (m v + p - 1) chunk-times, m v of
  work and p - 1 of fill and drain (the bubble). With unequal stages (the first
  holds the embedding, the last the LM head) the fill and drain pass each stage
  once and the steady state runs at the slowest one:
  T_pipe = sum_i op_i + (m v - 1) max_i op_i, op_i = stage i's work on one chunk of
  one micro-batch, including its sends;
- then each stage's exposed DP communication and its optimizer step; a stage that
  finished its last backward early has that much slack.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from course_lib.planner import formulas as F
from course_lib.planner.costs import StageCost, stage_costs
from course_lib.planner.layout import Layout, intra_node, validate
from course_lib.planner.presets import Hardware, ModelSpec, get_hardware, get_model
from course_lib.planner.simulator import pipeline_phase

GiB = 2**30
MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "temporaries")
# Which FLOPs a utilization counts. Publications differ: Megatron-LM and PaLM count full
# (non-causal) attention; some count the causal half; HFU adds what recomputation re-runs.
FLOPS_CONVENTIONS = {
    "model": "model FLOPs, full attention (4 s h per layer and token forward; Megatron, PaLM): MFU",
    "model_causal": "model FLOPs, causal attention (the unmasked half, 2 s h)",
    "hardware": "hardware FLOPs: model FLOPs + what recomputation re-runs, full attention: HFU",
    "hardware_causal": "hardware FLOPs with causal attention",
    "executed": "the matmul FLOPs the planner's GPUs run (causal tiles skipped and QK^T recomputed "
                "by a fused kernel, recomputation)",
}
TIME_KINDS = ("compute", "elementwise", "launch", "tp", "cp", "ep", "pp", "zero", "bubble", "dp", "optimizer")


@dataclass(repr=False)
class Estimate:
    model: ModelSpec
    hardware: Hardware
    layout: Layout
    memory: dict                  # bytes on the GPU that needs the most, by MEMORY_KINDS + "total"
    memory_by_stage: list
    time: dict                    # seconds of the step by TIME_KINDS (they add up to step_time)
    step_time: float
    model_flops: float            # per step, whole cluster (no recomputation)
    hardware_flops: float         # per step, with recomputation
    tflops_per_gpu: float         # model TFLOP/s per GPU
    mfu: float
    hfu: float
    bubble_fraction: float        # of the pipeline phase (p-1)/(m v + p - 1) for equal stages
    comm_bytes: dict              # bytes one GPU sends per step, by dimension (the busiest GPU)
    flops: dict = field(default_factory=dict)        # per step, whole cluster, by FLOPS_CONVENTIONS
    violations: list = field(default_factory=list)   # why it cannot run as is (memory)
    notes: list = field(default_factory=list)        # what is slow about it
    stages: list = field(default_factory=list)       # the StageCost of every stage

    @property
    def fits(self) -> bool:
        return not self.violations

    def utilization(self) -> dict:
        """FLOPs per second per GPU over peak, in every convention of :data:`FLOPS_CONVENTIONS`
        (``mfu`` is "model", ``hfu`` is "hardware")."""
        denom = self.step_time * self.layout.n_gpus * self.hardware.peak_flops
        return {k: v / denom for k, v in self.flops.items()}

    def conventions(self) -> str:
        """Which FLOPs count, one line per convention, with its utilization."""
        u = self.utilization()
        return "\n".join(f"  {k:16s} {self.flops[k] / self.layout.n_gpus / self.step_time / 1e12:7.1f} TFLOP/s/GPU "
                         f"= {u[k]:6.1%} of peak: {FLOPS_CONVENTIONS[k]}" for k in FLOPS_CONVENTIONS)

    @property
    def tokens_per_second(self) -> float:
        return self.layout.global_batch * (self.layout.seq_len or self.model.seq_len) / self.step_time

    def __repr__(self) -> str:
        return (f"<Estimate {self.model.name}, {self.layout.n_gpus} x {self.hardware.name}, "
                f"{self.layout.describe()}: {self.memory['total'] / GiB:.1f} GiB/GPU, step "
                f"{self.step_time:.4g} s, MFU {self.mfu:.1%}{'' if self.fits else ', does not fit'}>")

    def summary(self) -> str:
        mem = ", ".join(f"{k} {self.memory[k] / GiB:.1f}" for k in MEMORY_KINDS)
        tm = ", ".join(f"{k} {self.time[k]:.3g}" for k in TIME_KINDS if self.time[k] > 0)
        lines = [f"{self.model.name} on {self.layout.n_gpus} x {self.hardware.name}: {self.layout.describe()}",
                 f"  memory/GPU {self.memory['total'] / GiB:.1f} GiB of {self.hardware.hbm_bytes / GiB:.0f} "
                 f"({mem} GiB)",
                 f"  step {self.step_time:.3g} s ({tm} s)",
                 f"  {self.tflops_per_gpu:.0f} TFLOP/s per GPU, MFU {self.mfu:.1%}, bubble {self.bubble_fraction:.1%}"]
        lines += [f"  VIOLATED: {v}" for v in self.violations]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def pipeline_time(stages: list[StageCost], layout: Layout) -> tuple[float, list[float]]:
    """(T_pipe, op_i): the pipeline phase of a step and each stage's time per chunk op."""
    v, p, m = layout.chunks, layout.pp, layout.microbatches
    ops = []
    for st in stages:
        sends = F.p2p_sends(layout.schedule, p, st.stage, v)
        ops.append((st.fwd_time + st.bwd_time) / v + (sends * st.p2p if p > 1 else 0.0))
    if layout.schedule in F.SPLIT and p > 1:
        # W apart from B: the action lists run on the stages' own costs (simulator.pipeline_phase):
        # DeepSeek-V3's Table 2 (F.pipeline_idle) holds for equal stages with W half a backward,
        # and a V's first rank holds the embedding and the LM head; the course's W is its GEMMs
        return pipeline_phase(stages, layout), ops
    if p > 1 and any(sum(st.host) for st in stages):
        # the course's program (runtime="course"): a stage waiting for its input has its host
        # issue the op's kernels meanwhile, and they run at its device's pace (op less its host
        # excess) once the input is there. Through the busiest stage k: its first input arrives
        # after the first stage's first forward (host-paced: it waits for nothing) and the
        # stages between at their devices' pace; its host issues all m v ops from the start,
        # its device runs them from that arrival: the later of the two; then the last
        # micro-batch's round trip through the stages after k and its backward through the
        # stages before, at their devices' pace. With no host excess: the formula below.
        half = [F.p2p_sends(layout.schedule, p, st.stage, v) * st.p2p / 2 for st in stages]
        fdev = [(st.fwd_time - st.host[0]) / v + x for st, x in zip(stages, half)]
        bdev = [(st.bwd_time - st.host[1]) / v + x for st, x in zip(stages, half)]
        first = stages[0].fwd_time / v + half[0]

        def through(k):
            fill = first + sum(fdev[1:k]) if k else 0.0
            dev = fdev[k] + bdev[k]
            return (max(m * v * ops[k], fill + m * v * dev) + sum(bdev[:k])
                    + sum(fdev[j] + bdev[j] for j in range(k + 1, p)))
        return max(through(k) for k in range(p)) + wait_round(p, m, v) * sum(ops) / p, ops
    return sum(ops) + (m * v - 1) * max(ops) + wait_round(p, m, v) * sum(ops) / p, ops


def round_waits(stages, layout: Layout, t_pipe: float) -> list[float]:
    """Seconds each stage waits in its schedule for ZeRO-2's reductions chunk by chunk
    (``formulas.zero_rounds``: R of each of its c chunks a step, ``StageCost.round_reduce``
    seconds each): each but the last is waited for at the end of the round after its own, so
    one that outlasts a round (the schedule's time over its rounds) holds the stage back by the
    difference; the last one is the step's tail (``grad_sync``)."""
    rounds = F.zero_rounds(layout)
    if rounds is None:
        return [0.0] * len(stages)
    per, sched, chunks = rounds
    round_time = t_pipe / (sched * chunks)
    return [(per * chunks - 1) * max(0.0, st.round_reduce - round_time) for st in stages]


def wait_round(p: int, m: int, v: int) -> int:
    """Chunk-ops each rank waits, beyond the fill and drain, for its micro-batches to come round
    the ring: interleaved with m < p (torch's one round of N = m) waits p - m at each of the v - 1
    chunk changes, forward and backward (its step, (p v + m - 1) ops of equal stages, is
    ``schedules.bubble_fraction``'s); none with m >= p or one chunk. Priced at the stages' mean
    op: the wait is the other stages' work (within 1% of the simulated timeline, tested)."""
    return (v - 1) * max(0, p - m)


def estimate(model, hardware, layout: Layout, n_gpus: int | None = None, runtime: str = "megatron") -> Estimate:
    """Predict one training step of ``model`` on ``hardware`` GPUs laid out as ``layout``.

    ``runtime``: "megatron" (default) models the published systems of the validation (fused
    kernels, launches hidden); "course" the course's own program, kernel by kernel with the
    preset's launch overhead and every collective it issues (:mod:`course_lib.planner.runtime`).

    Raises ValueError naming the constraint if the layout is impossible; a layout that
    runs out of memory is returned with ``violations`` saying so.
    """
    model, hw = get_model(model), get_hardware(hardware)
    validate(model, hw, layout, n_gpus)
    stages = stage_costs(model, hw, layout, runtime)
    v, m = layout.chunks, layout.microbatches
    t_pipe, ops = pipeline_time(stages, layout)

    # tail: each stage's exposed DP communication and optimizer, after its last backward
    finish, slack = [], 0.0
    # the course's program sums the gradients after the schedule (GradSync.finish), where
    # the published systems overlap them with the last backward (runtime.py's module doc)
    overlap = layout.overlap_dp and runtime != "course"
    waits = round_waits(stages, layout, t_pipe)
    for st, op, wait in zip(stages, ops, waits):
        # the last backward op (and its send, on stages after the first) hides the gradient ring
        window_b = st.bwd_time / v + (st.p2p if st.stage > 0 else 0.0) if overlap else 0.0
        window_f = st.fwd_time / v if overlap else 0.0
        tail = (max(0.0, st.grad_sync - window_b) + st.loss_sync + st.optimizer
                + max(0.0, st.param_gather - window_f) + wait)
        finish.append((t_pipe - slack + tail, tail, st))
        # the last backward passes the stage at its device's pace (its host issued it ahead)
        slack += (st.bwd_time - (st.host[1] if layout.pp > 1 else 0.0)) / v + (st.p2p if layout.pp > 1 else 0.0)
    step, tail, st_end = max(finish, key=lambda x: x[0])
    step = max(step, t_pipe)

    k = max(range(len(ops)), key=lambda i: ops[i])
    busy = stages[k]
    work = m * v
    time = {kind: work * (busy.fwd.get(kind, 0.0) + busy.bwd.get(kind, 0.0)) / v
            for kind in ("compute", "elementwise", "launch", "tp", "cp", "ep", "zero")}
    time["pp"] = work * (ops[k] - (busy.fwd_time + busy.bwd_time) / v)
    time["bubble"] = max(0.0, t_pipe - work * ops[k])
    time["optimizer"] = min(st_end.optimizer, step - t_pipe)
    time["dp"] = max(0.0, step - t_pipe - time["optimizer"])
    for kind in time:                       # rounding leftovers of the subtractions above
        if time[kind] < 1e-12 * step:
            time[kind] = 0.0

    s = layout.seq_len or model.seq_len
    tokens = layout.global_batch * s
    model_flops = F.flops_per_token(model, s, "none") * tokens
    hw_flops = F.flops_per_token(model, s, layout.recompute) * tokens
    flops = {"model": model_flops, "model_causal": F.flops_per_token(model, s, "none", causal=True) * tokens,
             "hardware": hw_flops, "hardware_causal": F.flops_per_token(model, s, layout.recompute, causal=True) * tokens,
             "executed": m * layout.dp * layout.tp * layout.cp * sum(st.gemm_flops for st in stages)}
    G = layout.n_gpus
    worst = max(stages, key=lambda x: x.memory["total"])
    comm = max(stages, key=lambda x: sum(x.comm_bytes.values())).comm_bytes
    est = Estimate(
        model=model, hardware=hw, layout=layout, memory=dict(worst.memory),
        memory_by_stage=[dict(x.memory) for x in stages], time=time, step_time=step,
        model_flops=model_flops, hardware_flops=hw_flops,
        tflops_per_gpu=model_flops / (step * G) / 1e12,
        mfu=model_flops / (step * G * hw.peak_flops), hfu=hw_flops / (step * G * hw.peak_flops),
        bubble_fraction=F.bubble_fraction(layout.pp, m, layout.schedule, layout.v) if layout.pp > 1 else 0.0,
        comm_bytes=dict(comm), stages=stages, flops=flops)
    if worst.memory["total"] > hw.hbm_bytes:
        est.violations.append(
            f"memory: stage {worst.stage} needs {worst.memory['total'] / GiB:.1f} GiB per GPU, "
            f"more than the {hw.hbm_bytes / GiB:.0f} GiB of HBM")
    for dim, size in (("tp", layout.tp), ("cp", layout.cp)):
        if size > 1 and not intra_node(layout, hw, dim):
            est.notes.append(f"{dim.upper()} group spans nodes: its collectives run on the network, "
                             f"not NVLink")
    if layout.pp > 1 and m < layout.pp:
        est.notes.append(f"fewer micro-batches ({m}) than stages ({layout.pp}): the bubble dominates")
    return est
