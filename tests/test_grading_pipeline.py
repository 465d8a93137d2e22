"""Chapter 6's graders (course_lib/grading/pipeline.py): the solution and a differently written
right answer pass; classic mistakes, an answer hard-coded to the lecture's printed case and a
library shortcut each fail with a hint that names the mistake."""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.grading import pipeline as G
from course_lib import schedules as S
from course_lib.schedules import Action
from grading_answers import fails_with, graded

LECTURE = {"1f1b": S.one_f_one_b(3, 4), "interleaved": S.interleaved_1f1b(2, 4, 2), "zb": S.zero_bubble_h1(3, 4)}


# ----------------------------------------------------------------------------- 1F1B
def one_f_one_b(p, m):
    """Written as a queue per rank: forwards until p - r are in flight (or none left), then oldest backward."""
    out = []
    for r in range(p):
        row, f, b = [], 0, 0
        while b < m:
            if f < m and f - b < p - r:
                row.append(Action("F", r, f))
                f += 1
            else:
                row.append(Action("B", r, b))
                b += 1
        out.append(row)
    return out


def gpipe_order(p, m):
    return [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)] for r in range(p)]


def warmup_off_by_one(p, m):
    out = []
    for r in range(p):
        w = min(p - r, m)
        row = [Action("F", r, i) for i in range(w)]
        for i in range(m - w):
            row += [Action("F", r, w + i), Action("B", r, i)]
        out.append(row + [Action("B", r, i) for i in range(m - w, m)])
    return out


def newest_backward_first(p, m):
    """1F1B's slots, the backwards taken newest first."""
    out = []
    for row in one_f_one_b(p, m):
        bwd = iter(reversed([a for a in row if a.op == "B"]))
        out.append([next(bwd) if a.op == "B" else a for a in row])
    return out


def test_one_f_one_b(capsys):
    assert graded(capsys, G.check_one_f_one_b, one_f_one_b)[0]
    fails_with(capsys, G.check_one_f_one_b, gpipe_order, hint="GPipe")
    fails_with(capsys, G.check_one_f_one_b, warmup_off_by_one, hint="warm-up")
    fails_with(capsys, G.check_one_f_one_b, newest_backward_first, hint=("oldest", "before its F", "deadlock"))
    fails_with(capsys, G.check_one_f_one_b, lambda p, m: LECTURE["1f1b"], hint="invalid schedule")
    fails_with(capsys, G.check_one_f_one_b, lambda p, m: S.one_f_one_b(p, m), hint="write this yourself")
    fails_with(capsys, G.check_one_f_one_b, lambda p, m: S.make_schedule("1f1b", p, m), hint="write this yourself")


# ----------------------------------------------------------------------------- interleaved
def interleaved(p, m, v):
    """Megatron's order written from a list of (chunk, micro-batch) groups of p."""
    out = []
    for r in range(p):
        fwd = [Action("F", c * p + r, g * p + i) for g in range(m // p) for c in range(v) for i in range(p)]
        bwd = [Action("B", (v - 1 - c) * p + r, g * p + i) for g in range(m // p) for c in range(v) for i in range(p)]
        w = min(2 * (p - r - 1) + (v - 1) * p, m * v)
        row = fwd[:w]
        for a, b in zip(fwd[w:], bwd):
            row += [a, b]
        out.append(row + bwd[m * v - w:])
    return out


def interleaved_chunks_in_order(p, m, v):     # backward chunks not reversed
    return [[Action(a.op, ((a.stage // p) if a.op == "F" else (a.stage // p)) * p + r, a.mb)
             for a in row] for r, row in enumerate(interleaved(p, m, v))] if v == 1 else \
        [[Action("B", (v - 1 - a.stage // p) * p + r, a.mb) if a.op == "B" else a for a in row]
         for r, row in enumerate(interleaved(p, m, v))]


def interleaved_plain_warmup(p, m, v):        # 1F1B's warm-up, p - r - 1
    out = []
    for r, row in enumerate(interleaved(p, m, v)):
        fwd, bwd = [a for a in row if a.op == "F"], [a for a in row if a.op == "B"]
        w = min(p - r - 1, m * v)
        new = fwd[:w]
        for a, b in zip(fwd[w:], bwd):
            new += [a, b]
        out.append(new + bwd[m * v - w:])
    return out


def test_interleaved(capsys):
    assert graded(capsys, G.check_interleaved, interleaved)[0]
    fails_with(capsys, G.check_interleaved, interleaved_chunks_in_order, hint=("reverse", "deadlock", "action"))
    fails_with(capsys, G.check_interleaved, interleaved_plain_warmup, hint=("warm-up", "deadlock"))
    fails_with(capsys, G.check_interleaved, lambda p, m, v: LECTURE["interleaved"], hint="invalid schedule")
    fails_with(capsys, G.check_interleaved, lambda p, m, v: S.interleaved_1f1b(p, m, v), hint="write this yourself")


# ----------------------------------------------------------------------------- zero bubble
def zero_bubble(p, m):
    """A different right answer: a time-stepped unit clock; at each tick a rank runs its next
    F/B if its message is there (and an F would not hold a (p+1)-th micro-batch), else its
    oldest pending W, else idles."""
    base = one_f_one_b(p, m)
    rows, pending, nxt, live, finished = [[] for _ in range(p)], [[] for _ in range(p)], [0] * p, [0] * p, {}
    t = 0
    while any(nxt[r] < len(base[r]) or pending[r] for r in range(p)):
        ran = []
        for r in range(p):
            if nxt[r] < len(base[r]):
                a = base[r][nxt[r]]
                need = (("F", a.stage - 1, a.mb) if a.op == "F" and a.stage > 0 else
                        ("B", a.stage + 1, a.mb) if a.op == "B" and a.stage < p - 1 else None)
                if (need is None or finished.get(need, t + 1) <= t) and (a.op != "F" or live[r] < p):
                    ran.append((r, a))
                    nxt[r] += 1
                    live[r] += a.op == "F"
                    if a.op == "B":
                        pending[r].append(Action("W", a.stage, a.mb))
                    continue
            if pending[r]:
                w = pending[r].pop(0)
                ran.append((r, w))
                live[r] -= 1
        for r, a in ran:
            rows[r].append(a)
            finished[tuple(a)] = t + 1
        t += 1
    return rows


def w_at_the_end(p, m):
    return [row + [Action("W", a.stage, a.mb) for a in row if a.op == "B"] for row in one_f_one_b(p, m)]


def w_right_after_b(p, m):
    return [[x for a in row for x in ([a, Action("W", a.stage, a.mb)] if a.op == "B" else [a])]
            for row in one_f_one_b(p, m)]


def no_w(p, m):
    return one_f_one_b(p, m)


def test_zero_bubble(capsys):
    assert graded(capsys, G.check_zero_bubble, zero_bubble)[0]
    fails_with(capsys, G.check_zero_bubble, w_at_the_end, hint="micro-batches at once")
    fails_with(capsys, G.check_zero_bubble, w_right_after_b, hint="fill more idle slots with W")
    fails_with(capsys, G.check_zero_bubble, no_w, hint="has no W")
    fails_with(capsys, G.check_zero_bubble, lambda p, m: LECTURE["zb"], hint="invalid schedule")
    fails_with(capsys, G.check_zero_bubble, lambda p, m: S.zero_bubble_h1(p, m), hint="write this yourself")


# ----------------------------------------------------------------------------- bubble of a trace
def bubble_fraction(spans, rank):
    work = sorted((s.start, s.end) for s in spans if s.kind == "compute")
    first, last = work[0][0], max(e for _, e in work)
    idle = (last - first) - sum(s.end - s.start for s in spans if s.kind == "compute" and s.rank == rank)
    return idle / (last - first)


def own_step_only(spans, rank):
    mine = [s for s in spans if s.kind == "compute" and s.rank == rank]
    t0, t1 = min(s.start for s in mine), max(s.end for s in mine)
    return 1 - sum(s.end - s.start for s in mine) / (t1 - t0)


def comm_counts_as_work(spans, rank):
    compute = [s for s in spans if s.kind == "compute"]
    t0, t1 = min(s.start for s in compute), max(s.end for s in compute)
    return 1 - sum(s.end - s.start for s in spans if s.rank == rank and s.kind != "idle") / (t1 - t0)


def narayanan(spans, rank):                   # idle over the ideal compute time, not the step
    compute = [s for s in spans if s.kind == "compute"]
    t0, t1 = min(s.start for s in compute), max(s.end for s in compute)
    busy = sum(s.end - s.start for s in compute if s.rank == rank)
    return (t1 - t0 - busy) / busy


def from_the_formula(spans, rank):            # the textbook value, for unit times only
    p = 1 + max(s.rank for s in spans)
    m = sum(1 for s in spans if s.rank == 0 and s.name.startswith("F"))
    return (p - 1) / (m + p - 1)


def test_bubble(capsys):
    assert graded(capsys, G.check_bubble, bubble_fraction)[0]
    fails_with(capsys, G.check_bubble, own_step_only, hint="ANY rank")
    fails_with(capsys, G.check_bubble, comm_counts_as_work, hint="not work")
    fails_with(capsys, G.check_bubble, narayanan, hint="idle time / step time")
    fails_with(capsys, G.check_bubble, from_the_formula, hint="expected")
    fails_with(capsys, G.check_bubble, lambda spans, rank: S.bubble(spans, rank), hint="write this yourself")


# ----------------------------------------------------------------------------- a real pipeline step
def pipeline_step(stage, microbatches, targets, m, act_shape):
    """1F1B-ordered, with isend/irecv (a different right answer than the solution's GPipe);
    sends are waited at the end: a blocking send in 1F1B waits for a receive that waits for it."""
    r, p = dist.get_rank(), dist.get_world_size()
    ins, outs, loss, posted = {}, {}, 0.0, []

    def forward(k):
        nonlocal loss
        if r == 0:
            x = microbatches[k].detach().requires_grad_()
        else:
            x = torch.empty(act_shape, dtype=torch.float64)
            dist.irecv(x, r - 1).wait()
            x.requires_grad_()
        y = stage(x)
        if r < p - 1:
            posted.append(dist.isend(y.detach(), r + 1))
        else:
            y = torch.nn.functional.mse_loss(y, targets[k]) * (1.0 / m)
            loss += y.item()
        ins[k], outs[k] = x, y

    def backward(k):
        if r < p - 1:
            g = torch.empty(act_shape, dtype=torch.float64)
            dist.irecv(g, r + 1).wait()
            torch.autograd.backward(outs[k], g)
        else:
            outs[k].backward()
        if r > 0:
            posted.append(dist.isend(ins[k].grad, r - 1))

    w = min(p - r - 1, m)
    for k in range(w):
        forward(k)
    for k in range(m - w):
        forward(w + k)
        backward(k)
    for k in range(m - w, m):
        backward(k)
    for work in posted:
        work.wait()
    return loss if r == p - 1 else None


def _variant(**change):
    def step(stage, microbatches, targets, m, act_shape):
        r, p = dist.get_rank(), dist.get_world_size()
        ins, outs, loss = [], [], 0.0
        for k in range(m):
            if r == 0:
                x = microbatches[k].clone().requires_grad_(not change.get("no_requires_grad"))
            else:
                x = torch.empty(act_shape, dtype=torch.float64)
                if change.get("deadlock"):
                    g = torch.empty(act_shape, dtype=torch.float64)
                    dist.recv(g, (r + 1) % p)
                dist.recv(x, r - 1)
                x.requires_grad_(not change.get("no_requires_grad"))
            y = stage(x)
            if r < p - 1:
                dist.send(y.detach(), r + 1)
            else:
                y = torch.nn.functional.mse_loss(y, targets[k]) / (1 if change.get("no_scale") else m)
                loss += y.item()
            ins.append(x)
            outs.append(y)
        for k in range(m):
            if r < p - 1:
                g = torch.empty(act_shape, dtype=torch.float64)
                dist.recv(g, r + 1)
                outs[k].backward(g)
            else:
                outs[k].backward()
            if r > 0:
                dist.send(ins[k].grad if ins[k].grad is not None else torch.zeros(act_shape, dtype=torch.float64),
                          r - 1)
        if change.get("all_reduce_loss"):
            t = torch.tensor([loss])
            dist.all_reduce(t)
        return loss if r == p - 1 else None
    return step


def for_two_stages_only(stage, microbatches, targets, m, act_shape):     # the lecture's p=2
    r = dist.get_rank()
    if r == 0:
        outs = [stage(x) for x in microbatches]
        for y in outs:
            dist.send(y.detach(), 1)
        for y in outs:
            g = torch.empty(act_shape, dtype=torch.float64)
            dist.recv(g, 1)
            y.backward(g)
        return None
    ins = []
    loss = 0.0
    for k in range(m):
        x = torch.empty(act_shape, dtype=torch.float64)
        dist.recv(x, 0)
        x.requires_grad_()
        ins.append(x)
        out = torch.nn.functional.mse_loss(stage(x), targets[k]) / m
        out.backward()
        loss += out.item()
        dist.send(x.grad, 0)
    return loss


def library_pipeline(stage, microbatches, targets, m, act_shape):
    from course_lib.parallel import Mesh, PipelineParallel
    PipelineParallel(stage, Mesh(pp=dist.get_world_size()), "1f1b", microbatches=m)


def test_pipeline_step(capsys):
    assert graded(capsys, G.check_pipeline_step, pipeline_step)[0]
    fails_with(capsys, G.check_pipeline_step, _variant(no_scale=True), hint="times too large")
    fails_with(capsys, G.check_pipeline_step, _variant(no_requires_grad=True), hint="has no gradient")
    fails_with(capsys, G.check_pipeline_step, _variant(all_reduce_loss=True), hint="only point-to-point")
    fails_with(capsys, G.check_pipeline_step, _variant(deadlock=True), hint=("deadlock", "timed out"), timeout=4)
    # (p = 3 hangs in a recv: 4 s, as the deadlock above, not the grader's 15 s, ~11 s waited out)
    fails_with(capsys, G.check_pipeline_step, for_two_stages_only, hint="case", timeout=4)
    fails_with(capsys, G.check_pipeline_step, library_pipeline, hint="write this yourself")


def test_pipeline_step_names_the_likely_cause_of_a_none_gradient(capsys):
    """Issue 34: forgetting requires_grad on the received activation gave a bare
    "TypeError ... NoneType ... <dynamic-code> line 25"; the hint now names the likely cause."""
    def forgot_requires_grad(stage, microbatches, targets, m, act_shape):
        r, p = dist.get_rank(), dist.get_world_size()
        ins, outs, loss = [], [], 0.0
        for k in range(m):
            if r == 0:
                x = microbatches[k].clone().requires_grad_()
            else:
                x = torch.empty(act_shape, dtype=torch.float64)
                dist.recv(x, r - 1)                      # no x.requires_grad_(): x.grad stays None
            y = stage(x)
            if r < p - 1:
                dist.send(y.detach(), r + 1)
            else:
                y = torch.nn.functional.mse_loss(y, targets[k]) / m
                loss += y.item()
            ins.append(x)
            outs.append(y)
        for k in range(m):
            if r < p - 1:
                g = torch.empty(act_shape, dtype=torch.float64)
                dist.recv(g, r + 1)
                outs[k].backward(g)
            else:
                outs[k].backward()
            if r > 0:
                dist.send(ins[k].grad, r - 1)
        return loss if r == p - 1 else None
    line = fails_with(capsys, G.check_pipeline_step, forgot_requires_grad, hint="requires_grad_()", timeout=6)
    assert "in your forgot_requires_grad(), line" in line and "likely cause" in line, line
