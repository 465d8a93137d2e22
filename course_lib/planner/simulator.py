"""A discrete-event simulator of one training step, GPU by GPU, on a virtual clock.

Each GPU runs a program: its pipeline schedule (GPipe, 1F1B, interleaved, or the V schedules
ZB-V and DualPipeV from their action lists, ``course_lib.schedules``), each
forward or backward made of compute and the communication its dimensions add
(durations from :mod:`course_lib.planner.costs`, the same numbers ``estimate``
uses), activation sends to the next stage, then the data-parallel gradient
reduction as a real ring: in every step all N members send their n/N chunk at
once, and a member's step k waits for its own and its left neighbour's step k-1.
Events are processed in virtual-time order; nothing sleeps. The output is a list
of :class:`course_lib.trace.Span`, drawn by the same ``viz.timeline`` that draws
measured runs; idle time (the pipeline bubble) is recorded as ``idle`` spans.
"""
from __future__ import annotations

import heapq
from collections import defaultdict

from course_lib.planner import formulas as F
from course_lib.planner.costs import dp_pieces, stage_costs
from course_lib.planner.layout import Layout, intra_node, validate
from course_lib.planner.presets import get_hardware, get_model
from course_lib.schedules import V_SCHEDULES, make_schedule, schedule_order, stage_rank
from course_lib.trace import Span

ACTION_LISTS = ("zb-h1", *V_SCHEDULES)     # simulated from their action lists (W apart)

PIPE_KINDS = ("compute", "elementwise", "launch", "tp", "cp", "ep", "zero")


class SimulatedStep(list):
    """The simulated spans (a list of Span) plus ``step_time``, ``ranks`` and ``row_names``."""

    step_time: float
    ranks: list
    row_names: dict

    def bubble(self, rank: int) -> float:
        """Fraction of the pipeline phase (up to the last backward of any stage) that
        ``rank`` spends outside its forwards and backwards (and their communication)."""
        end = max(s.end for s in self if s.name[:1] in ("F", "B"))
        busy = sum(min(s.end, end) - s.start for s in self if s.rank == rank and s.kind != "idle"
                   and s.start < end and not s.name.startswith(("dp ", "optimizer")))
        return 1.0 - busy / end if end > 0 else 0.0


def _rank(layout: Layout, dp_i: int, pp_i: int, cp_i: int, tp_i: int) -> int:
    return ((dp_i * layout.pp + pp_i) * layout.cp + cp_i) * layout.tp + tp_i


def simulate(model, hardware, layout: Layout, max_gpus: int = 64, runtime: str = "megatron",
             w_fraction: float | None = 0.5) -> SimulatedStep:
    """Simulate one step; every GPU when the layout has at most ``max_gpus``, else one
    GPU per pipeline stage (the others of its TP, CP and DP groups run the same program).
    ``runtime``: as in :func:`~course_lib.planner.estimate` ("course": the course's program).
    ``w_fraction``: for the V schedules, the part of a backward's work that is its weight
    gradient W, run apart (default 1/2: the weight GEMMs are half a backward's, the megatron
    runtime's convention; less where a backward holds more than GEMMs, e.g. recomputation; None:
    each stage's own, ``StageCost.w_time``, which runtime="course" traces)."""
    model, hw = get_model(model), get_hardware(hardware)
    validate(model, hw, layout)
    if w_fraction is not None and (isinstance(w_fraction, bool) or not isinstance(w_fraction, (int, float))
                                   or not 0 <= w_fraction <= 1):
        raise ValueError(f"w_fraction (W's part of a backward) must be a number in [0, 1], got {w_fraction!r}")
    stages = stage_costs(model, hw, layout, runtime)
    p, m, v = layout.pp, layout.microbatches, layout.chunks
    every = layout.n_gpus <= max_gpus
    coords = [(d, st, c, t) for d in range(layout.dp) for st in range(p)
              for c in range(layout.cp) for t in range(layout.tp)] if every else \
        [(0, st, 0, 0) for st in range(p)]

    programs = {}
    for d, st, c, t in coords:
        sc = stages[st]
        prog = action_program(layout, sc, (d, c, t), st, w_fraction) if layout.schedule in ACTION_LISTS else []
        for phase, mb, ch in (schedule_order(p, m, layout.schedule, v, st) if not prog else ()):
            vs = ch * p + st                               # virtual stage of this chunk
            parts = sc.fwd if phase == "F" else sc.bwd
            if phase == "F" and vs > 0:
                prog.append(("wait", ("act", d, c, t, mb, vs - 1)))
            if phase == "B" and vs < p * v - 1:
                prog.append(("wait", ("grad", d, c, t, mb, vs + 1)))
            if phase == "B" and mb == m - 1 and ch == 0:
                prog.append(("mark", "last backward"))
            work = (parts["compute"] + parts["elementwise"] + parts.get("launch", 0.0)) / v
            prog.append(("span", f"{phase}{mb}" + (f".{ch}" if v > 1 else ""), "compute", work))
            for kind in ("tp", "cp", "ep", "zero"):
                if parts[kind] > 0:
                    prog.append(("span", f"{kind} {phase}{mb}", "comm", parts[kind] / v))
            if phase == "F" and vs < p * v - 1:
                prog += [("span", f"send {phase}{mb}", "comm", sc.p2p), ("signal", ("act", d, c, t, mb, vs))]
            if phase == "B" and vs > 0:
                prog += [("span", f"send {phase}{mb}", "comm", sc.p2p), ("signal", ("grad", d, c, t, mb, vs))]
        if runtime == "course":     # its buckets' all-reduces, then the loss's, after the schedule
            prog += [("span", "dp all-reduces", "comm", sc.grad_sync + sc.loss_sync),
                     ("span", "optimizer", "compute", sc.optimizer)]
        else:
            prog += _data_parallel_tail(hw, layout, sc, t)
        programs[_rank(layout, d, st, c, t)] = prog
    spans = run_programs(programs)
    out = SimulatedStep(sorted(spans, key=lambda s: (s.rank, s.start)))
    out.step_time = max((s.end for s in out), default=0.0)
    out.ranks = sorted(programs)
    out.row_names = {r: f"gpu {r} (stage {(r // (layout.tp * layout.cp)) % p})" for r in out.ranks}
    return out


def action_program(layout, sc, where, rank, w_fraction=None):
    """The program of pp rank ``rank`` under a schedule with W actions, from its action list:
    ZB-H1 (one chunk, the stage) or a V (two chunks, stages ``rank`` and 2p - 1 - ``rank``,
    each half the stage's work and communication); a split backward's W is ``w_fraction`` of
    the chunk's backward work (None: the stage's own ``w_time``, else half), its B the rest;
    messages only between ranks (the turn of the V, stage p - 1 to p, stays on rank p - 1)."""
    p, m = layout.pp, layout.microbatches
    k, placement = (2, "v") if layout.schedule in V_SCHEDULES else (1, "loop")
    row = make_schedule(layout.schedule, p, m)[rank]
    split = {(a.stage, a.mb) for a in row if a.op == "W"}
    last_b = max(i for i, a in enumerate(row) if a.op == "B")
    own_w = sc.w_time or (sc.bwd["compute"] + sc.bwd["elementwise"] + sc.bwd.get("launch", 0.0)) / 2
    prog = []
    for i, a in enumerate(row):
        parts = sc.fwd if a.op == "F" else sc.bwd
        work = (parts["compute"] + parts["elementwise"] + parts.get("launch", 0.0)) / k
        w = (w_fraction * (sc.bwd["compute"] + sc.bwd["elementwise"] + sc.bwd.get("launch", 0.0))
             if w_fraction is not None else own_w) / k
        src = {"F": a.stage - 1, "B": a.stage + 1}.get(a.op)
        if src is not None and 0 <= src < k * p:
            prog.append(("wait", ("act" if a.op == "F" else "grad", *where, a.mb, src)))
        if i == last_b:
            prog.append(("mark", "last backward"))
        if a.op == "W":
            prog.append(("span", f"W{a.mb}.{a.stage}", "compute", w))
            continue
        split_b = a.op == "B" and (a.stage, a.mb) in split      # (B + W: the whole less W's own adds)
        prog.append(("span", f"{a.op}{a.mb}.{a.stage}", "compute", work - w - sc.w_fused / k if split_b else work))
        for kind in ("tp", "cp", "ep", "zero"):
            if parts[kind] > 0:
                prog.append(("span", f"{kind} {a.op}{a.mb}", "comm", parts[kind] / k))
        dst = {"F": a.stage + 1, "B": a.stage - 1}[a.op]
        if 0 <= dst < k * p:
            if stage_rank(dst, p, placement) != rank:
                prog.append(("span", f"send {a.op}{a.mb}", "comm", sc.p2p))
            prog.append(("signal", ("act" if a.op == "F" else "grad", *where, a.mb, a.stage)))
    return prog


def _data_parallel_tail(hw, layout, sc, t):
    """Gradient reduction over the dp * cp ranks holding the same parameters, the
    optimizer step, the ZeRO parameter all-gather."""
    N = layout.dp * layout.cp
    alpha, bw = hw.link(intra_node(layout, hw, "dp"))
    # one ring step carries every layer's chunk, each layer its own message (costs.dp_pieces)
    alpha *= dp_pieces(layout, sc.stage, sc.layers)
    window_f = sc.fwd_time / layout.chunks if layout.overlap_dp else 0.0
    # (name, bf16 bytes, ring size): dense weights over all dp * cp replicas, experts
    # over the replicas that hold the same experts (the expert mesh folded over dp x cp x tp)
    parts = [("dp", (sc.params - sc.expert_params) * 2, N),
             ("dp experts", sc.expert_params * 2, max(1, N * layout.tp // (layout.ep * layout.etp)))]
    parts = [x for x in parts if x[1] > 0 and x[2] > 1]
    tail = []
    if layout.zero in (0, 1):
        kind = "all_reduce" if layout.zero == 0 else "reduce_scatter"
        for i, (name, n, size) in enumerate(parts):
            # the first ring starts with the last backward; the next one right after it
            overlap = ("last backward" if i == 0 else "ring end") if layout.overlap_dp else 0.0
            tail.append(("collective", (name, sc.stage, t, kind), kind, n, size, alpha, bw,
                         f"{name} {kind}", overlap))
    tail.append(("span", "optimizer", "compute", sc.optimizer))
    if layout.zero in (1, 2):
        for i, (name, n, size) in enumerate(parts):
            tail.append(("collective", (name, sc.stage, t, "all_gather"), "all_gather", n, size, alpha, bw,
                         f"{name} all_gather", window_f if i == 0 else 0.0))
    return tail


def pipeline_phase(stages, layout: Layout) -> float:
    """The pipeline phase of a schedule with W actions (:data:`ACTION_LISTS`): each pp rank's
    action list run on its stage's costs (``stages``, one GPU per stage; W its own ``w_time``),
    up to its last action; the latest end over the ranks. Exact where a formula assumes equal
    stages (a V's first rank holds the embedding and the LM head) or a W of half a backward."""
    programs = {st.stage: action_program(layout, st, (0, 0, 0), st.stage) for st in stages}
    return max((sp.end for sp in run_programs(programs)), default=0.0)


def run_programs(programs: dict) -> list[Span]:
    """Process the programs' events in virtual-time order."""
    spans, ready, waiters, marks = [], {}, defaultdict(list), {}
    pending = defaultdict(dict)
    members = defaultdict(set)
    for r, prog in programs.items():
        for op in prog:
            if op[0] == "collective":
                members[op[1]].add(r)
    pc = {r: 0 for r in programs}
    clock = {r: 0.0 for r in programs}
    heap = [(0.0, r) for r in programs]
    heapq.heapify(heap)
    while heap:
        _, r = heapq.heappop(heap)
        while pc[r] < len(programs[r]):
            op = programs[r][pc[r]]
            if op[0] == "wait":
                if op[1] not in ready:
                    waiters[op[1]].append(r)
                    break
                if ready[op[1]] > clock[r]:
                    spans.append(Span(r, "idle", "idle", clock[r], ready[op[1]]))
                    clock[r] = ready[op[1]]
            elif op[0] == "span":
                if op[3] > 0:
                    spans.append(Span(r, op[1], op[2], clock[r], clock[r] + op[3]))
                    clock[r] += op[3]
            elif op[0] == "signal":
                ready[op[1]] = clock[r]
                for w in waiters.pop(op[1], []):
                    heapq.heappush(heap, (clock[r], w))
            elif op[0] == "mark":
                marks[(r, op[1])] = clock[r]
            elif op[0] == "collective":
                _, key, kind, n, N, alpha, bw, name, overlap = op
                start = marks.get((r, overlap), clock[r]) if isinstance(overlap, str) else clock[r] - overlap
                pending[key][r] = (start, clock[r])
                if len(pending[key]) < len(members[key]):
                    pc[r] += 1
                    break                                # wait for the rest of the group
                arrivals = pending.pop(key)
                for q, end in _ring(kind, n, N, alpha, bw, arrivals, name, spans).items():
                    marks[(q, "ring end")] = end
                    clock[q] = max(clock[q], end)
                    if q != r:
                        heapq.heappush(heap, (clock[q], q))
            pc[r] += 1
            # yield to earlier events after every blocking-capable op
            if heap and heap[0][0] < clock[r]:
                heapq.heappush(heap, (clock[r], r))
                break
    return spans


def _ring(kind, n, N, alpha, bw, arrivals, name, spans):
    """Ring steps of a collective over the simulated members (ring order = rank order).

    Step k of member j starts when j and its left neighbour finished step k-1; each
    step moves n/N bytes on every link at once. Members not simulated (one GPU per
    stage) behave like the simulated ones. Spans before a member's own clock are
    hidden behind its compute (overlap), so only the exposed part is drawn.
    Returns {member: time its collective ends} (possibly before the member's clock).
    """
    ranks = sorted(arrivals)
    steps = F.ring_steps(kind, N)
    dur = F.collective_time(kind, n, N, alpha, bw) / steps if steps else 0.0
    end = {q: arrivals[q][0] for q in ranks}
    for k in range(steps):
        prev = dict(end)
        for i, q in enumerate(ranks):
            left = ranks[i - 1] if len(ranks) > 1 else q
            start = max(prev[q], prev[left])
            end[q] = start + dur
            shown = max(start, arrivals[q][1])
            if end[q] > shown:
                spans.append(Span(q, f"{name} {k + 1}/{steps}", "comm", shown, end[q]))
    return end
