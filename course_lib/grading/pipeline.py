"""Graders of chapter 6 (pipeline parallelism). A learner's schedule is checked by
``schedules.validate`` (a deadlock or a missing action becomes a hint, never a hang) before
it is compared or run; while the learner's function runs, the library's schedules are
switched off (the exercise is to write them).

    check_one_f_one_b(one_f_one_b)        # (p, m) -> per-rank action lists; one case runs on real ranks
    check_interleaved(interleaved_1f1b)   # (p, m, v) -> Megatron-LM's interleaved order
    check_zero_bubble(zero_bubble)        # (p, m) -> F, B and W placed: ZB-H1's bubble, 1F1B's peak
    check_bubble(bubble_fraction)         # (spans, rank) -> idle fraction of the step, on irregular traces
    check_pipeline_step(pipeline_step)    # send / recv a real pipeline: activations forward, gradients back
"""
from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist

from course_lib.grading import Case, Mismatch, check, check_distributed, compare, reorder_tolerance
from course_lib.grading.traffic import counted_calls
from course_lib.grading.guard import learner
from course_lib.grading.harness import check_answers, number
from course_lib import schedules as S
from course_lib.models import init_uniform_
from course_lib.trace import Span

SECONDS = 10   # a learner's function that runs longer (an endless loop) is stopped with a hint


# every library function that returns a schedule (or its order): off while a learner's runs
LIBRARY_SCHEDULES = ("course_lib.schedules:gpipe", "course_lib.schedules:one_f_one_b",
                     "course_lib.schedules:interleaved_1f1b", "course_lib.schedules:zero_bubble_h1",
                     "course_lib.schedules:make_schedule", "course_lib.schedules:schedule_order")


def _as_schedule(got, p, m, v=1):
    """The learner's answer, validated: a hint string, or the schedule as Actions."""
    try:
        return S.validate(got, p, m, v)
    except ValueError as e:
        return f"invalid schedule: {e}"


def _diagnose(got, want, p):
    """The first difference, named by the classic mistake it looks like."""
    for r, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        lead_g = next((i for i, a in enumerate(g) if a.op != "F"), len(g))
        lead_w = next((i for i, a in enumerate(w) if a.op != "F"), len(w))
        if lead_g != lead_w:
            return (f"rank {r} runs {lead_g} forwards before its first backward, expected {lead_w} "
                    f"(its warm-up forwards, then one forward and one backward at a time: how many micro-batches "
                    f"must be in flight before the last stage can start a backward?)")
        bwd_g = [a for a in g if a.op == "B"]
        bwd_w = [a for a in w if a.op == "B"]
        if bwd_g != bwd_w and sorted(bwd_g) == sorted(bwd_w):
            return f"rank {r} runs its backwards in the order {[str(a) for a in bwd_g][:6]}..., expected " \
                   f"{[str(a) for a in bwd_w][:6]}... (oldest micro-batch first, chunks in reverse)"
        for i, (a, b) in enumerate(zip(g, w)):
            if tuple(a) != tuple(b):
                return f"rank {r}, action {i}: got {a}, expected {b} (stage {b.stage}, micro-batch {b.mb})"
        return f"rank {r}: {len(g)} actions, expected {len(w)}"
    return None


def _cases(shapes):
    """A case per (p, m) or (p, m, v)."""
    keys = ("p", "m", "v")
    return [Case(dict(zip(keys, s)), label=", ".join(f"{k}={x}" for k, x in zip(keys, s))) for s in shapes]


def _compare_to(fn, reference_fn, what):
    fn = learner(fn, LIBRARY_SCHEDULES, exercise=what, seconds=SECONDS)

    def run(case):
        p, m, v = case.params["p"], case.params["m"], case.params.get("v", 1)
        args = (p, m) if "v" not in case.params else (p, m, v)
        want = reference_fn(*args)                       # before the library goes off
        answer = fn(*args)
        got = _as_schedule(answer, p, m, v)
        if isinstance(got, str):
            try:                                         # name the mistake too, where the shape allows
                rows = [[S.Action(*a) for a in row] for row in answer]
            except (TypeError, ValueError):
                return got
            diff = _diagnose(rows, want, p) if len(rows) == p else None
            return got + (f"; {diff}" if diff else "")
        if got == S.gpipe(p, m) and got != want:
            return "this is GPipe's order (all forwards, then all backwards): 1F1B starts backwards early"
        # None only where every rank's order is the reference's, action for action (a run of it
        # on ranks would test the library's runner, not the answer: chapter 6 trains it there)
        return _diagnose(got, want, p)
    return run


def check_one_f_one_b(fn) -> bool:
    """fn(p, m) -> [[(op, stage, mb), ...] per rank]: warm-up, steady 1F1B, cool-down."""
    cases = _cases([(2, 4), (3, 2), (4, 8), (4, 1), (3, 7), (1, 3), (2, 3)])
    return check("one_f_one_b", cases, _compare_to(fn, S.one_f_one_b, "the 1F1B order"))


def check_interleaved(fn) -> bool:
    """fn(p, m, v) -> the interleaved 1F1B order (stage s = chunk * p + rank)."""
    cases = _cases([(2, 4, 2), (4, 8, 2), (3, 6, 3), (2, 2, 4), (4, 4, 2), (3, 3, 2), (1, 2, 3)])
    return check("interleaved_1f1b", cases, _compare_to(fn, S.interleaved_1f1b, "the interleaved order"))


def check_zero_bubble(fn) -> bool:
    """fn(p, m) -> a schedule with every B split off its W; at most p micro-batches live
    per rank, and a simulated bubble (t_f = t_b_input = t_w = 1) no larger than ZB-H1's."""
    cases = _cases([(2, 4), (3, 6), (4, 8), (4, 12), (4, 2), (3, 5), (1, 2)])
    answer = learner(fn, LIBRARY_SCHEDULES, exercise="placing the W passes", seconds=SECONDS)

    def run(case):
        p, m = case.params["p"], case.params["m"]
        got = _as_schedule(answer(p, m), p, m)
        if isinstance(got, str):
            return got
        for r, row in enumerate(got):
            missing = [a for a in row if a.op == "B" and S.Action("W", a.stage, a.mb) not in row]
            if missing:
                return f"rank {r}: {missing[0]} has no W (split every backward)"
            if S.in_flight(row) > p:
                return f"rank {r} holds {S.in_flight(row)} micro-batches at once, more than p={p} (1F1B's peak)"
        got_bubble = S.bubble(S.simulate(got, p))
        want = S.formula_bubble("zb-h1", p, m)
        if got_bubble > want + 1e-9:
            return f"simulated bubble {got_bubble:.4f}, ZB-H1 reaches {want:.4f}: fill more idle slots with W"
        return None
    return check("zero_bubble", cases, run)


# ----------------------------------------------------------------------------- the bubble of a trace
def _irregular_trace(name, p, m, v, seed):
    """A schedule's timeline with random action times (no formula gives its bubble), shifted off
    the clock's origin, with communication and idle spans that are not work."""
    sched = S.make_schedule(name, p, m, v)
    rng = random.Random(seed)
    durations = {str(a): rng.choice((0.5, 1.0, 1.5, 2.5)) for row in sched for a in row}
    spans = S.simulate(sched, p, v, durations=durations)
    spans = [Span(s.rank, s.name, s.kind, s.start + 5.0, s.end + 5.0, s.dim) for s in spans]
    spans += [Span(r, f"send {r}", "comm", 5.0 + r, 6.0 + r, "pp") for r in range(p)]   # overlaps compute
    spans.append(Span(p - 1, "recv", "comm", 0.0, 5.0, "pp"))     # before the first compute: not the step
    rng.shuffle(spans)                                            # in no particular order
    return spans


def check_bubble(fn) -> bool:
    """fn(spans, rank) -> the fraction of the step (first start to last end of any compute
    span) that ``rank`` spends outside its compute spans."""
    cases = []
    for seed, (name, p, m, v) in enumerate((("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2),
                                            ("zb-h1", 3, 6, 1), ("1f1b", 3, 5, 1))):
        spans = _irregular_trace(name, p, m, v, seed)
        for rank in sorted({0, p // 2, p - 1}):
            cases.append(Case(params=dict(args=(spans, rank)),
                              label=f"{name}, p={p}, m={m}, random action times, rank {rank}"))

    def differ(got, want, spans, rank):
        if math.isclose(got, want, abs_tol=1e-9):
            return None
        mine = [s for s in spans if s.rank == rank and s.kind == "compute"]
        own = 1.0 - sum(s.end - s.start for s in mine) / (max(s.end for s in mine) - min(s.start for s in mine))
        if math.isclose(got, own, abs_tol=1e-9):
            return "you measured the step on this rank's own spans only: the step runs from the first start to " \
                   "the last end of ANY rank's compute"
        every = [s for s in spans if s.rank == rank and s.kind != "compute"]
        if every and got < want - 1e-9:
            return f"got {got:.4f}, expected {want:.4f}: communication and idle spans are not work"
        return f"got {got:.4f}, expected {want:.4f} (idle time / step time, compute spans only)"
    return check_answers("bubble_fraction", fn, cases, S.bubble, read=number, differ=differ, seconds=SECONDS,
                         guard=["course_lib.schedules:bubble", "course_lib.schedules:formula_bubble",
                                "course_lib.schedules:bubble_fraction"], exercise="measuring the bubble of a trace")


# ----------------------------------------------------------------------------- a real pipeline step
H = 6   # the stages' width: activations (b, H)


def _stage(k):
    """Stage k of the graded pipeline: Linear(H, H) + tanh, float64, seeded by k."""
    return init_uniform_(torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh()).double(), 100 + k)


def _learner_line(exc) -> str:
    """' (in your f(), line N)' for the innermost frame outside course_lib and torch, or ''."""
    import traceback

    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if "course_lib" not in frame.filename and "torch" not in frame.filename:
            return f" (in your {frame.name}(), line {frame.lineno})"
    return ""


def _pipeline_harness(fn, m, b):
    r, p = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(m * b, H, generator=g, dtype=torch.float64) for _ in range(2))
    whole = torch.nn.Sequential(*[_stage(k) for k in range(p)])            # one device: the full batch
    want_loss = torch.nn.functional.mse_loss(whole(x), y)
    want_loss.backward()
    tol = reorder_tolerance(torch.float64, want_loss, *(q.grad for q in whole.parameters()))
    stage = _stage(r)
    mbs = list(x.chunk(m)) if r == 0 else None
    targets = list(y.chunk(m)) if r == p - 1 else None
    from course_lib.parallel import PipelineParallel
    answer = learner(fn, PipelineParallel, LIBRARY_SCHEDULES, exercise="the pipeline's sends and receives",
                     seconds=SECONDS)
    with counted_calls() as calls:
        try:
            got = answer(stage, mbs, targets, m, (b, H))
        except (TypeError, AttributeError) as exc:
            if "NoneType" not in str(exc) and "None" not in str(exc):
                raise
            raise Mismatch(f"{type(exc).__name__}: {exc}{_learner_line(exc)}: a gradient is None. The likely "
                           f"cause: the activation this stage received does not require grad (call "
                           f"x.requires_grad_() on it before the stage runs), so x.grad stays None and "
                           f"there is nothing to send back") from None
    if r == p - 1:
        if not isinstance(got, (int, float, torch.Tensor)):
            return f"the last stage returns the loss (a number), got {got!r}"
        msg = compare(float(got), float(want_loss), what="loss", **tol)
        if msg:
            return f"{msg}: the loss of the batch is the MEAN over its micro-batches' losses"
    mine = dict(whole[r].named_parameters())
    for name, q in stage.named_parameters():
        if q.grad is None or (not q.grad.any() and mine[name].grad.any()):
            return (f"stage {r}'s {name} has no gradient: did the gradient reach it (the received activation "
                    f"must require grad, and the next stage must send back its gradient)?")
        ratio = float(q.grad.norm() / mine[name].grad.norm())
        if abs(ratio - m) < 1e-6 * m and m > 1:
            return (f"stage {r}'s gradients are {m} times too large (m={m}): each micro-batch's loss is 1/m "
                    f"of the batch's mean loss")
        msg = compare(q.grad, mine[name].grad, what=f"stage {r} {name}.grad", **tol)
        if msg:
            return msg
    sends = calls.of("send", "isend")
    want_sends = m * ((r < p - 1) + (r > 0))                                # activations on, gradients back
    others = calls.ops() - {"send", "isend", "recv", "irecv"}
    if others:
        return f"only point-to-point messages between neighbouring stages: this rank called {sorted(others)}"
    if len(sends) != want_sends or not calls.peers("send", "isend") <= {r - 1, r + 1}:
        return (f"rank {r} sent {len(sends)} messages to ranks {sorted(calls.peers('send', 'isend'))}, expected "
                f"{want_sends}: one activation per micro-batch to the next stage, one gradient to the previous")
    return None


def check_pipeline_step(pipeline_step, timeout=15.0) -> bool:
    """pipeline_step(stage, microbatches, targets, m, act_shape) on each of p ranks: stage r of a
    Linear+tanh pipeline (float64 activations of act_shape); rank 0 holds the list of m input
    micro-batches, the last rank the list of m targets (None elsewhere);
    run every forward and backward over send/recv so that each stage's parameters hold the
    gradient of the batch's mean squared error, and the last rank returns that loss."""
    shapes = [(2, 1, 3), (2, 4, 2), (3, 3, 2), (1, 2, 2), (4, 5, 1)]
    cases = [Case({"fn": pipeline_step, "m": m, "b": b}, world_size=p, label=f"p={p}, m={m} micro-batches of {b}")
             for p, m, b in shapes]
    return check_distributed("pipeline_step", _pipeline_harness, cases, timeout=timeout)


__all__ = ["check_one_f_one_b", "check_interleaved", "check_zero_bubble", "check_bubble", "check_pipeline_step"]
