"""Run any valid pipeline schedule (``schedules.validate``) on real ranks, one action at a time.

    result = run_schedule(schedule, stages, comm, p=4, m=8, inputs=..., targets=...,
                          loss_fn=..., act_shape=(b, s, h))     # schedule: every rank's action list
    result.losses, result.peak_activation_bytes

Each rank holds the modules of its virtual stages ``{stage: module}`` (stage s on pp rank
s % p). Messages go through the pipeline's :class:`~course_lib.collectives.comm.Comm`
(group ranks, bytes counted in its TrafficCounter) with a tag per (kind, stage,
micro-batch), so an activation and a gradient travelling between the same two ranks can
never be confused, whatever order the schedule posts them in. A receive is posted one
receiving action ahead, so the transport reads the message while the rank computes, and an
action waits for its own (traced as a ``comm`` span: a rank waiting there is the bubble);
sends are posted (gloo copies the tensor into the socket there: a ``send`` span) and waited
at the end of the step. Where the next (or previous) stage lives on the same rank (p = 1 with
v chunks), the tensor is handed over in memory: no message. Every tensor handed on is first
checked against ``act_shape`` / ``act_dtype`` (a ValueError on the sending rank, before a
wrong message could crash or stall the receiving one). ``measured_costs`` reads from a trace
what a step spent between actions.

The zero-bubble split (Qi et al. 2023): ``B`` computes the gradient of the stage's input
and of every Linear layer's *output* (one backward pass through the activations, no
weight GEMM), keeping each Linear's input and output gradient; ``W`` later does the
weight GEMMs ``dW = dy^T x`` (and ``db = sum dy``). The few other parameters (norm weights,
embeddings) get their gradients in ``B``.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from course_lib import trace
from course_lib.memory import storage_bytes
from course_lib.parallel.schedules import _dependency, validate


@dataclass
class StepResult:
    losses: dict = field(default_factory=dict)        # micro-batch -> loss (last stage only)
    peak_activation_bytes: int = 0                    # saved for backward, at the worst moment
    saved_bytes: dict = field(default_factory=dict)   # (stage, mb) -> bytes its forward saved
    bytes_sent: int = 0
    messages: int = 0


RECV_DEPTH = 2   # receives posted ahead: the current one and the next (one extra activation buffer)


def _tag(kind: str, stage: int, mb: int, n_stages: int, m: int) -> int:
    return ((kind == "grad") * n_stages + stage) * m + mb


class _Saved:
    """What autograd saves during one forward (storages, parameters excluded)."""

    def __init__(self, params):
        self.params = {id(p.untyped_storage()) for p in params}
        self.tensors = []

    def pack(self, t):
        if id(t.untyped_storage()) not in self.params:
            self.tensors.append(t)
        return t

    def bytes(self):
        return storage_bytes(self.tensors)


def _linears(module):
    return [mod for mod in module.modules() if isinstance(mod, nn.Linear)]


def _outside(module, linears):
    """The trainable parameters of ``module`` that no Linear of ``linears`` holds."""
    in_linear = {id(w) for lin in linears for w in lin.parameters()}
    return [q for q in module.parameters() if q.requires_grad and id(q) not in in_linear]


def _accumulate(p, g):
    """p.grad += g; the first time, p.grad = a copy of g."""
    if g is None:
        return
    if p.grad is None:
        p.grad = g.clone()
    else:
        p.grad += g


def backward_input(y, dy, x, record):
    """B: gradients of the stage input ``x`` and of each Linear output recorded in the
    forward, in one pass; non-Linear parameters get their gradient now. Returns (dx, for_w)
    where ``for_w`` = [(linear, its input, grad of its output)] for :func:`backward_weight`."""
    calls, others = record["calls"], record["others"]
    wanted = ([x] if x is not None else []) + [out for _, _, out in calls] + others
    grads = torch.autograd.grad(y, wanted, dy, allow_unused=True)
    k = 1 if x is not None else 0
    for p, g in zip(others, grads[k + len(calls):]):
        _accumulate(p, g)
    for_w = [(mod, inp, g) for (mod, inp, _), g in zip(calls, grads[k:k + len(calls)]) if g is not None]
    return (grads[0] if x is not None else None), for_w


def backward_weight(for_w):
    """W: the weight-gradient GEMMs of every Linear, from what B kept. From the second
    micro-batch on, the GEMM adds into ``.grad`` in place (one pass, no temporary)."""
    for mod, inp, dout in for_w:
        dout2, inp2 = dout.reshape(-1, dout.shape[-1]), inp.reshape(-1, inp.shape[-1])
        w, b = mod.weight, mod.bias
        if w.requires_grad:                                              # dW = dout^T inp: (out, in)
            w.grad = dout2.t() @ inp2 if w.grad is None else w.grad.addmm_(dout2.t(), inp2)
        if b is not None and b.requires_grad:
            b.grad = dout2.sum(0) if b.grad is None else b.grad.add_(dout2.sum(0))


def run_schedule(schedule, stages: dict, comm, *, p: int, m: int, v: int = 1, inputs=None, targets=None,
                 loss_fn=None, act_shape=None, act_dtype=torch.float32, scale_grads: bool = False) -> StepResult:
    """Run this rank's actions of ``schedule`` (one list of (op, stage, mb) per pp rank, validated
    first on every rank: a bad one is a ValueError, never a hang) on its ``stages`` {stage: module}.

    inputs / targets: the m micro-batches (needed where stage 0 / stage p*v - 1 live).
    loss_fn(output, target) -> the micro-batch's loss, already scaled for the whole step
    (e.g. summed over tokens / the global token count): gradients accumulate over micro-batches.
    scale_grads=True (torch.distributed.pipelining's default): each micro-batch's loss is divided
    by m before its backward, so a mean loss_fn gives one device's mean-loss gradients
    (``losses`` still reports loss_fn's values, as torch's ``losses`` list does).
    act_shape, act_dtype: of every activation (and its gradient) sent between stages, one
    micro-batch; a stage output that differs is a ValueError naming both, raised by the sending
    rank before it sends (the receiver cannot tell: its buffer is already posted; under
    ``launch`` the failing rank stops the others).
    """
    n_stages = p * v
    me = comm.rank
    if comm.size != p:
        raise ValueError(f"a schedule for p={p} stages runs on a pipeline group of p ranks; this one has {comm.size}")
    if act_shape is None and n_stages > 1:
        raise ValueError(f"act_shape (one micro-batch's activation, e.g. (b, s, h)) is needed: "
                         f"{n_stages} stages hand activations on")
    act_shape = None if act_shape is None else tuple(act_shape)
    if not isinstance(scale_grads, bool):
        raise ValueError(f"scale_grads must be True or False, got {scale_grads!r}")
    for s in stages:
        if s % p != me:
            raise ValueError(f"stage {s} lives on pp rank {s % p}, but rank {me} was given it")
    actions = validate(schedule, p, m, v)[me]
    split = {(s, mb) for op, s, mb in actions if op == "W"}
    state, sends, live, out = {}, [], {}, StepResult()
    counter = comm.counter
    sent0 = counter.bytes_sent if counter is not None else 0
    msgs0 = counter.messages_sent if counter is not None else 0
    # per stage, once: its Linear layers, and the parameters outside them (their gradients come in B)
    linears = {s: _linears(module) for s, module in stages.items()}
    others = {s: _outside(module, linears[s]) for s, module in stages.items()}
    device = next((q.device for module in stages.values() for q in module.parameters()), None)  # NCCL: the GPU

    # Receives are posted ahead: the one an action needs, and the next one, so that the
    # message is read by the transport while this rank computes instead of after it asks.
    needs = []
    for i, (op, s, mb) in enumerate(actions):
        src = {"F": s - 1, "B": s + 1}.get(op)       # the stage whose message this action reads
        if src is not None and 0 <= src < n_stages and src % p != me:   # same rank: handed over in ``local``
            needs.append((i, ("act" if op == "F" else "grad", src, s, mb)))
    posted, nxt = {}, 0          # action index -> (work, buffer); nxt: next entry of needs to post
    local = {}                   # (kind, stage, mb) -> tensor from a stage on this rank

    def post_recvs(i):
        nonlocal nxt
        while nxt < len(needs) and (needs[nxt][0] <= i or len(posted) < RECV_DEPTH):
            j, (kind, stage_from, s, mb) = needs[nxt]
            buf = torch.empty(act_shape, dtype=act_dtype, device=device)   # (b, s, h): activation or its gradient
            posted[j] = (comm.irecv(buf, stage_from % p, tag=_tag(kind, s, mb, n_stages, m)), buf)
            nxt += 1

    def recv(i, kind, s, mb):
        if (kind, s, mb) in local:         # from this rank's own stage: validate ran it before
            return local.pop((kind, s, mb))
        post_recvs(i)
        work, buf = posted.pop(i)
        with trace.span(f"recv {kind} {mb}", "comm", "pp"):
            work.wait()
        post_recvs(i)                      # the next receive, before this action computes
        return buf

    def send(t, stage_to, kind, s, mb):
        if tuple(t.shape) != act_shape or t.dtype != act_dtype:
            what = "activation of" if kind == "act" else "input gradient of"
            raise ValueError(f"the {what} stage {s - 1 if kind == 'act' else s + 1}, micro-batch {mb}, is "
                             f"{tuple(t.shape)} {t.dtype}, but act_shape={act_shape}, act_dtype={act_dtype}: "
                             f"every tensor sent between stages must have that shape and dtype "
                             f"(the receiver's buffer)")
        if stage_to % p == me:             # the next stage is on this rank: no message
            local[(kind, s, mb)] = t.detach().clone()
            return
        t = t.detach().contiguous()
        with trace.span(f"send {kind} {mb}", "comm", "pp"):     # gloo writes to the socket here
            sends.append((comm.isend(t, stage_to % p, tag=_tag(kind, s, mb, n_stages, m)), t))

    post_recvs(-1)
    for i, (op, s, mb) in enumerate(actions):
        module = stages[s]
        if op == "F":
            x = inputs[mb] if s == 0 else recv(i, "act", s, mb).requires_grad_()
            saved, record = _Saved(module.parameters()), {"calls": []}
            hooks = []
            if (s, mb) in split:     # remember each Linear call's input and output for B and W
                hooks = [lin.register_forward_hook(lambda mod, a, o: record["calls"].append((mod, a[0], o)))
                         for lin in linears[s]]
                record["others"] = others[s]
            with trace.span(f"F{mb}" + (f"@{s}" if s else ""), "compute", "pp"), \
                    torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                y = module(x)
                if s == n_stages - 1:
                    y = loss_fn(y, targets[mb])
                    out.losses[mb] = float(y.detach())
                    if scale_grads:            # torch's default: the step's gradient is the mean over m
                        y = y / m
            for h in hooks:
                h.remove()
            live[(s, mb)] = out.saved_bytes[(s, mb)] = saved.bytes()
            out.peak_activation_bytes = max(out.peak_activation_bytes, sum(live.values()))
            if s < n_stages - 1:
                send(y, s + 1, "act", s + 1, mb)
            # stage 0's input wants a gradient only if the caller's tensor asks for one (as in
            # the full backward, where autograd fills its .grad); later stages' always do
            state[(s, mb)] = (x if s > 0 or x.requires_grad else None, y, record)
        elif op == "B":
            x, y, record = state[(s, mb)]
            dy = None if s == n_stages - 1 else recv(i, "grad", s, mb)
            with trace.span(f"B{mb}" + (f"@{s}" if s else ""), "compute", "pp"):
                if (s, mb) in split:
                    dx, for_w = backward_input(y, dy, x, record)
                    state[(s, mb)] = for_w
                    live[(s, mb)] = storage_bytes([t for _, i, g in for_w for t in (i, g)])
                else:
                    torch.autograd.backward(y, dy)
                    dx = None if x is None else x.grad
                    del state[(s, mb)]
                    del live[(s, mb)]
            if s > 0:
                send(dx, s - 1, "grad", s - 1, mb)
            elif (s, mb) in split and x is not None:
                _accumulate(x, dx)                      # the caller's input: x.grad, as backward() gives
        else:  # W
            with trace.span(f"W{mb}" + (f"@{s}" if s else ""), "compute", "pp"):
                backward_weight(state.pop((s, mb)))
            del live[(s, mb)]
    with trace.span("wait sends", "comm", "pp"):
        for work, _ in sends:
            work.wait()
    if counter is not None:
        out.bytes_sent, out.messages = counter.bytes_sent - sent0, counter.messages_sent - msgs0
    return out


def measured_costs(spans, schedule, p: int, v: int = 1) -> dict:
    """What one measured step spent between its actions, from its trace (compute spans named
    as the actions, "F3@1"; times on one clock for all ranks), in the terms of ``schedules.simulate``:

    * ``t_overhead``: mean time a rank spends between two of its actions when no message
      keeps it waiting (posting a send, Python, the transport's threads taking its core);
    * ``t_comm``: mean time from the end of a sender's action to the start of the receiver's
      when the receiver was free before it (the message's latency, on the critical path);
    * ``durations``: {action: its compute time}, to replay the step;
    * where the overhead goes: ``t_send`` (mean time to post a send: gloo writes into the
      socket there) and ``t_recv_ready`` (mean wait in a receive whose message was sent
      before the rank asked for it).

    Means, not medians: the step pays the total, tail included (a rank descheduled by another
    process counts).
    """
    compute = {s.name: s for s in spans if s.kind == "compute"}
    recvs = [s for s in spans if s.kind == "comm" and s.name.startswith("recv")]
    gaps, latencies, ready = [], [], []
    for r, actions in enumerate(validate(schedule, p, 1 + max(a[2] for row in schedule for a in row), v)):
        for prev, a in zip(actions, actions[1:]):
            before, this = compute[str(prev)], compute[str(a)]
            dep = _dependency(a, p, v)
            if dep is not None and compute[str(dep)].end > before.end:     # it waited for the message
                latencies.append(this.start - compute[str(dep)].end)
                continue
            gaps.append(this.start - before.end)
            ready += [s.end - s.start for s in recvs if s.rank == r and before.end <= s.start and s.end <= this.start]
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0
    sends = [s.end - s.start for s in spans if s.kind == "comm" and s.name.startswith("send")]
    return {"t_overhead": mean(gaps), "t_comm": mean(latencies), "t_send": mean(sends), "t_recv_ready": mean(ready),
            "durations": {name: s.end - s.start for name, s in compute.items()}}


__all__ = ["run_schedule", "StepResult", "backward_input", "backward_weight", "measured_costs"]
