"""Graders of the pipeline chapter. A learner's schedule is checked by ``schedules.validate``
(a deadlock or a missing action becomes a hint, never a hang) before it is compared or run.

    check_one_f_one_b(one_f_one_b)        # (p, m) -> per-rank action lists; one case runs on real ranks
    check_interleaved(interleaved_1f1b)   # (p, m, v) -> Megatron-LM's interleaved order
    check_zero_bubble(zero_bubble)        # (p, m) -> F, B and W placed: ZB-H1's bubble, 1F1B's peak
    check_bubble(bubble_fraction)         # (spans, rank) -> idle fraction of the step

Each prints one line and returns True/False.
"""
from __future__ import annotations

import math

from course_lib.grading import Case, check
from course_lib.parallel import schedules as S


def _as_schedule(got, p, m, v=1):
    """The learner's answer, validated: a hint string, or the schedule as Actions."""
    try:
        return S.validate(got, p, m, v)
    except ValueError as e:
        return f"invalid schedule: {e}"


def _first_difference(got, want):
    for r, (g, w) in enumerate(zip(got, want)):
        for i, (a, b) in enumerate(zip(g, w)):
            if tuple(a) != tuple(b):
                return f"rank {r}, action {i}: got {S.Action(*a)}, expected {b}"
        if len(g) != len(w):
            return f"rank {r}: {len(g)} actions, expected {len(w)}"
    return None


def _run_on_ranks(schedule, p, m):
    """Train a tiny GPT for 2 steps with ``schedule``; return the largest difference from one device."""
    from course_lib import reference
    from course_lib.models import GPTConfig, TinyGPT
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.pipeline import PipelineParallel

    cfg = GPTConfig(vocab_size=32, seq_len=8, n_layers=4, hidden=16, n_heads=2, tie_embeddings=True)
    batches = reference.gpt_batches(cfg, batch=2 * m, steps=2)
    ref = TinyGPT(cfg, seed=0)
    state, _ = reference.train_gpt(ref, batches, lambda ps: reference.sgd_step(ps, 0.5), micro=m)
    pipe = PipelineParallel(TinyGPT(cfg, seed=0), Mesh(pp=p), schedule, microbatches=m)
    for x, y in batches:
        pipe.step(x, y, n_tokens=y.numel())
        reference.sgd_step(pipe.parameters(), 0.5)
        for q in pipe.parameters():
            q.grad = None
    return max((q.detach() - state[n]).abs().max().item() for st in pipe.stages.values()
               for n, q in st.named_in_model().items())


def _compare_to(fn, reference_fn, shape_keys):
    def run(case):
        args = [case.params[k] for k in shape_keys]
        p, m = case.params["p"], case.params["m"]
        v = case.params.get("v", 1)
        got = _as_schedule(fn(*args), p, m, v)
        if isinstance(got, str):
            return got
        diff = _first_difference(got, reference_fn(*args))
        if diff:
            return diff
        if case.params.get("on_ranks"):
            from course_lib.launch import launch
            worst = max(launch(_run_on_ranks, p, got, p, m, timeout=60, quiet=True))
            if worst > 1e-5:
                return f"ran on {p} ranks: parameters differ from one device by {worst:.3g}"
        return None
    return run


def check_one_f_one_b(fn) -> bool:
    """fn(p, m) -> [[(op, stage, mb), ...] per rank]: warm-up, steady 1F1B, cool-down."""
    shapes = [(2, 4), (3, 2), (4, 8), (4, 1), (3, 7), (2, 3)]
    cases = [Case(params=dict(p=p, m=m, on_ranks=(p, m) == (2, 3)), label=f"p={p}, m={m}") for p, m in shapes]
    return check("one_f_one_b", cases, _compare_to(fn, S.one_f_one_b, ("p", "m")))


def check_interleaved(fn) -> bool:
    """fn(p, m, v) -> the interleaved 1F1B order (stage s = chunk * p + rank)."""
    shapes = [(2, 4, 2), (4, 8, 2), (3, 6, 3), (2, 2, 4), (4, 4, 2)]
    cases = [Case(params=dict(p=p, m=m, v=v), label=f"p={p}, m={m}, v={v}") for p, m, v in shapes]
    return check("interleaved_1f1b", cases, _compare_to(fn, S.interleaved_1f1b, ("p", "m", "v")))


def check_zero_bubble(fn) -> bool:
    """fn(p, m) -> a schedule with every B split off its W; at most p micro-batches live
    per rank, and a simulated bubble (t_f = t_b_input = t_w = 1) no larger than ZB-H1's."""
    shapes = [(2, 4), (3, 6), (4, 8), (4, 12)]
    cases = [Case(params=dict(p=p, m=m), label=f"p={p}, m={m}") for p, m in shapes]

    def run(case):
        p, m = case.params["p"], case.params["m"]
        got = _as_schedule(fn(p, m), p, m)
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


def check_bubble(fn) -> bool:
    """fn(spans, rank) -> the fraction of the step (first start to last end of any compute
    span) that ``rank`` spends outside its compute spans."""
    from course_lib.trace import Span
    cases = []
    for name, p, m, v in (("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zb-h1", 3, 6, 1)):
        spans = S.simulate(S.make_schedule(name, p, m, v), p, v)
        spans = [Span(s.rank, s.name, s.kind, s.start + 5.0, s.end + 5.0, s.dim) for s in spans]  # clock origin
        spans.append(Span(0, "recv act 0", "comm", 5.0, 5.5, "pp"))                          # not compute
        for rank in (0, p - 1):
            cases.append(Case(params=dict(spans=spans, rank=rank), label=f"{name}, p={p}, m={m}, rank {rank}"))

    def run(case):
        got = fn(list(case.params["spans"]), case.params["rank"])
        want = S.bubble(case.params["spans"], case.params["rank"])
        if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isfinite(got):
            return f"expected a number, got {got!r}"
        if not math.isclose(got, want, abs_tol=1e-9):
            return f"got {got:.4f}, expected {want:.4f} (idle time / step time, compute spans only)"
        return None
    return check("bubble_fraction", cases, run)


__all__ = ["check_one_f_one_b", "check_interleaved", "check_zero_bubble", "check_bubble"]
