"""Run any valid pipeline schedule (``schedules.validate``) on real ranks, one action at a time.

    runner = ScheduleRunner(schedule, stages, comm, p=4, m=8)    # validated once
    result = runner.step(inputs, targets, loss_fn)               # F, B, W, send, recv: one step
    result.losses, result.peak_activation_bytes, result.bytes_sent

Each rank holds the modules of its virtual stages ``{stage: module}`` (stage s on pp
rank s % p; in V order, ``schedules.stage_rank``, for ZB-V and DualPipeV). Messages go through the
pipeline's :class:`~course_lib.collectives.comm.Comm` (group ranks; the runner counts the bytes
it sends) with a tag per (kind, stage, micro-batch), so an activation and a gradient travelling
between the same two ranks can never be confused, whatever order the schedule posts them in. A
receive is posted one receiving action ahead, so the transport reads the message while the rank
computes, and an action waits for its own (traced as a ``comm`` span: a rank waiting there is
the bubble); sends are posted (gloo copies the tensor into the socket there: a ``send`` span)
and waited at the end of the step; with ``blocking_sends=True`` each send is waited for where
it is posted, before the rank's next action (DeepSpeed's PipelineEngine, which BLOOM ran:
``p2p.send`` is a blocking ``dist.send``, its ``async_op=True`` refused). Where the next (or
previous) stage lives on the same rank (p = 1 with v chunks), the tensor is handed over in
memory: no message. Every tensor handed on is first checked against ``act_shape`` /
``act_dtype`` (a ValueError on the sending rank, before a wrong message could crash or stall
the receiving one). ``measured_costs`` reads from a trace what a step spent between actions.

The zero-bubble split of a backward (Qi et al. 2023), where a schedule has a ``W``: ``B``
computes the gradient of the stage's input and of every Linear layer's *output* (one backward
pass through the activations, no weight GEMM), keeping each Linear's input and output
gradient; ``W`` later does the weight GEMMs ``dW = dy^T x`` (and ``db = sum dy``). The
tensor-parallel layers split their own backward (:mod:`course_lib.parallel.weight_grads`: the
forward runs inside ``recording``, each layer leaves its dW in the record, W runs them; under
sequence parallelism W gathers the kept shard again). The few other parameters (norm weights,
embeddings) get their gradients in ``B``, and so do a Linear's own parameters where the
forward used them without calling it (expert TP's ``F.linear`` on w2's slice).
"""
from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from course_lib import trace
from course_lib.memory import storage_bytes
from course_lib.parallel.weight_grads import add_grad, held, recording, run_later
from course_lib.schedules import dependency, reduce_points, stage_rank, validate


def _linears(module):
    return [mod for mod in module.modules() if isinstance(mod, nn.Linear)]


def _outside(module, linears):
    """The trainable parameters of ``module`` that no Linear of ``linears`` holds."""
    in_linear = {id(w) for lin in linears for w in lin.parameters()}
    return [q for q in module.parameters() if q.requires_grad and id(q) not in in_linear]


def _shared(module):
    """ids of the parameters two modules of ``module`` hold (a tied embedding and head)."""
    seen, twice = set(), set()
    for mod in module.modules():
        for q in mod._parameters.values():
            if q is not None:
                (twice if id(q) in seen else seen).add(id(q))
    return twice


def _accumulate(p, g):
    """p.grad += g; the first time, p.grad = a copy of g (then its hooks, as autograd's)."""
    if g is not None:
        add_grad(p, lambda out: g.clone() if out is None else out.add_(g))


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
        # dW = dout^T inp: (out, in), into .grad as autograd would put it (its hooks run)
        add_grad(mod.weight, lambda out: dout2.t() @ inp2 if out is None else out.addmm_(dout2.t(), inp2))
        if mod.bias is not None:
            add_grad(mod.bias, lambda out: dout2.sum(0) if out is None else out.add_(dout2.sum(0)))


@dataclass
class StepResult:
    losses: dict = field(default_factory=dict)        # micro-batch -> loss (last stage only)
    peak_activation_bytes: int = 0                    # saved for backward, at the worst moment
    peak_held_bytes: int = 0                          # ``memory_probe``'s largest (0 without one)
    saved_bytes: dict = field(default_factory=dict)   # (stage, mb) -> bytes its forward saved
    bytes_sent: int = 0
    messages: int = 0


RECV_DEPTH = 2   # receives posted ahead: the current one and the next (one extra activation buffer)


class _SavedBytes:
    """What autograd saves during one forward (storages; parameters and buffers excluded: not activations)."""

    def __init__(self, params):
        self.params = {id(p.untyped_storage()) for p in params}
        self.tensors = []

    def pack(self, t):
        if id(t.untyped_storage()) not in self.params:
            self.tensors.append(t)
        return t

    def bytes(self):
        return storage_bytes(self.tensors)


class ScheduleRunner:
    """This rank's actions of a pipeline schedule (one list of (op, stage, mb) per pp rank,
    validated here, on every rank, unless ``validate`` returned it: a bad one is a ValueError,
    never a hang), run on its ``stages`` {stage: module} over ``comm`` (the "pp" group);
    :meth:`step` runs one step.

    act_shape, act_dtype: of every tensor handed between stages (one micro-batch's activation,
    and its gradient); a tensor that differs is a ValueError raised by the sending rank before
    it sends. ``act_shape=None``: inferred at the first step as torch's ``PipelineStage`` does,
    by one forward of micro-batch 0 through the stages in order (no gradient, the random state
    restored), each rank sending the next its output's shape and dtype.
    scale_grads=True (torch.distributed.pipelining's default): each micro-batch's loss is divided
    by m before its backward (``losses`` still reports loss_fn's values, as torch's list does).
    blocking_sends=True: every send is waited for before the rank goes on (the sender idles
    until its message has left: on a virtual clock, until its last byte is delivered); settable
    between steps (``runner.blocking_sends``).
    gradients_done (settable, default None): called with (stage s, round_end, last) once a
    micro-batch's weight gradients of s are complete (after its B, or its W where one is split
    off): ``round_end``, the next such action is another stage's; ``last``, s's last this step.
    ZeRO's reductions chunk by chunk (``ZeroSync.gradients_done``); ``gradients_starting`` (s,
    last), before each B or W of s (``last``: it completes s's last weight gradients of the
    step): where ZeRO freed s's sums after a round, their buffers come back there, as a first
    backward makes them, and where ZeRO reduces each bucket as that last backward fills it,
    its hooks are armed (``ZeroSync.gradients_starting``). hooked_last (settable, default
    False): that last backward and its forward always run as the program (:meth:`runs_real`).
    memory_probe (settable, default None): ``probe(saved, states_changed, excess)`` -> the bytes the GPU
    holds now, given the bytes saved for backward now (or the most it held since the last call, where larger);
    called after each forward and at the end of each backward (B, W), with the saved bytes the
    backward let go of (``going``: counted beside the gradients it made, where they meet);
    the step's largest is ``peak_held_bytes`` (the dry run's peak over the step).
    """

    def __init__(self, schedule, stages: dict, comm, *, p: int, m: int, v: int = 1, act_shape=None,
                 act_dtype=torch.float32, scale_grads: bool = False, overlap_fb: bool = False,
                 blocking_sends: bool = False):
        for name, flag in (("overlap_fb", overlap_fb), ("blocking_sends", blocking_sends)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        self.overlap_fb, self.blocking_sends = overlap_fb, blocking_sends
        self.memory_probe = None
        self.gradients_done = None      # settable: (s, round_end, last) when a micro-batch's weight gradients of s are complete
        self.gradients_starting = None  # settable: (s, last) before each backward (B or W) of stage s
        self.hooked_last = False        # settable: each stage's last backward runs hooks (runs_real)
        if comm.size != p:
            raise ValueError(f"a schedule for p={p} stages runs on a pipeline group of p ranks; this one has {comm.size}")
        if not isinstance(scale_grads, bool):
            raise ValueError(f"scale_grads must be True or False, got {scale_grads!r}")
        self.me, self.p, self.m, self.n = comm.rank, p, m, p * v
        self.schedule = validate(schedule, p, m, v)
        for s in stages:
            if self.rank_of(s) != self.me:
                raise ValueError(f"stage {s} lives on pp rank {self.rank_of(s)} ({self.schedule.placement} "
                                 f"placement), but rank {self.me} was given it")
        self.actions = self.schedule[self.me]
        self.stages, self.comm, self.scale_grads = stages, comm, scale_grads
        self.split = {(s, mb) for op, s, mb in self.actions if op == "W"}   # B and W apart (zero bubble)
        self.grad_ends = reduce_points(self.actions)     # where each stage's gradient sums are complete
        # boundary s (stage s -> s + 1): (shape, dtype) of the activation and of its gradient
        self.shapes = None if act_shape is None else {s: (tuple(act_shape), act_dtype) for s in range(self.n - 1)}
        self.linears = {s: _linears(mod) for s, mod in stages.items()}     # their W comes apart from B
        self.others = {s: _outside(mod, self.linears[s]) for s, mod in stages.items()}
        self.shared = {s: _shared(mod) for s, mod in stages.items()}     # held by two modules (tied)
        self.device = next((q.device for mod in stages.values() for q in mod.parameters()), None)  # NCCL: GPU
        # the receives, in action order: (action index, (kind, from stage, stage, mb))
        self.needs = [(i, ("act" if op == "F" else "grad", src, s, mb)) for i, (op, s, mb) in enumerate(self.actions)
                      for src in [{"F": s - 1, "B": s + 1}.get(op)]
                      if src is not None and 0 <= src < self.n and self.rank_of(src) != self.me]  # same: ``local``

    def rank_of(self, s):
        """The pp rank of stage ``s``: the schedule's placement ("loop": s % p; "v")."""
        return stage_rank(s, self.p, self.schedule.placement)

    def step(self, inputs=None, targets=None, loss_fn=None, act_shape=None, act_dtype=None) -> StepResult:
        """One step: inputs / targets, the m micro-batches (where stage 0 / the last stage live);
        loss_fn(output, target) -> the micro-batch's loss, scaled for the whole step;
        act_shape, act_dtype: this step's, where the caller knows them."""
        if act_shape is not None:
            self.shapes = {s: (tuple(act_shape), act_dtype or torch.float32) for s in range(self.n - 1)}
        if self.shapes is None and self.n > 1:
            self.shapes = self._infer_shapes(inputs[0])
        self.inputs, self.targets, self.loss_fn = inputs, targets, loss_fn
        self.state, self.sends, self.live, self.local, self.posted, self.nxt = {}, [], {}, {}, {}, 0
        self.out = StepResult()
        self.note_held()                            # the states as the step starts (the probe's first ask)
        self._post_recvs(-1)
        pairs = fb_pairs(self.actions, self.split) if self.overlap_fb else set()
        clock = trace.clock() if pairs else None
        overlapped = getattr(clock, "overlapped", None)     # a virtual clock prices the pairs
        i = 0
        while i < len(self.actions):
            op, s, mb = self.actions[i]
            if i in pairs and overlapped is not None:
                self._post_recvs(i + 1)             # both receives posted before the pair starts
                if self.gradients_starting is not None:
                    self.gradients_starting(self.actions[i + 1][1], self.last_gradients(*self.actions[i + 1]))
                with overlapped() as pair:
                    self.F(i, s, mb)
                    pair.next()
                    self.B(i + 1, *self.actions[i + 1][1:])
                self._gradients_complete(*self.actions[i + 1])
                i += 2
                continue
            if op != "F" and self.gradients_starting is not None:
                self.gradients_starting(s, self.last_gradients(op, s, mb))
            getattr(self, op)(i, s, mb)
            self._gradients_complete(op, s, mb)
            i += 1
        with trace.span("wait sends", "comm", "pp"):
            for work, _ in self.sends:
                work.wait()
        return self.out

    def F(self, i, s, mb):
        """Forward of stage s, micro-batch mb: receive, compute, send the activation on."""
        x = self.inputs[mb] if s == 0 else self.recv(i, "act", s, mb).requires_grad_()
        saved, record, hooks = _SavedBytes([*self.stages[s].parameters(), *self.stages[s].buffers()]), {"calls": []}, []
        if (s, mb) in self.split:      # remember each Linear call's input and output for B and W
            hooks = [lin.register_forward_hook(lambda mod, a, o: record["calls"].append((mod, a[0], o)))
                     for lin in self.linears[s]]
            record["others"] = self.others[s]
        with trace.span(f"F{mb}" + (f"@{s}" if s else ""), "compute", "pp"), \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), \
                (recording(record) if (s, mb) in self.split else contextlib.nullcontext()):
            y = self.stages[s](x)
            if s == self.n - 1:
                y = self.loss_fn(y, self.targets[mb])
                self.out.losses[mb] = float(y.detach())
                y = y / self.m if self.scale_grads else y   # torch's default: the mean over m
        for h in hooks:
            h.remove()
        if hooks:   # a Linear used without its forward (F.linear on its weight) gets its gradient in B
            called = {id(mod) for mod, _, _ in record["calls"]}
            record["others"] = record["others"] + [q for lin in self.linears[s] if id(lin) not in called
                                                   for q in lin.parameters() if q.requires_grad]
        if record.get("deferred"):   # a tensor-parallel layer's dW comes in W (weight_grads): not in B,
            later = {id(q) for q in record["deferred"]} - self.shared[s]     # unless tied elsewhere
            record["others"] = [q for q in record["others"] if id(q) not in later]
        self.live[(s, mb)] = self.out.saved_bytes[(s, mb)] = saved.bytes()
        self.out.peak_activation_bytes = max(self.out.peak_activation_bytes, sum(self.live.values()))
        self.note_held(states_changed=False)
        if s < self.n - 1:
            self.send(y, "act", s + 1, mb)
        # stage 0's input wants a gradient only if the caller's tensor asks for one
        self.state[(s, mb)] = (x if s > 0 or x.requires_grad else None, y, record)

    def B(self, i, s, mb):
        """Backward of stage s, micro-batch mb (input gradients only where a W follows)."""
        x, y, record = self.state[(s, mb)]
        dy = None if s == self.n - 1 else self.recv(i, "grad", s, mb)
        with trace.span(f"B{mb}" + (f"@{s}" if s else ""), "compute", "pp"):
            if (s, mb) in self.split:
                dx, for_w = backward_input(y, dy, x, record)
                self.state[(s, mb)] = (for_w, record.get("later", []))
                saved = self.live[(s, mb)]
                self.live[(s, mb)] = storage_bytes([t for _, inp, g in for_w for t in (inp, g)] +
                                                   held(record.get("later", [])))
                del y, record
                self.note_held(going=max(0, saved - self.live[(s, mb)]))
            else:
                torch.autograd.backward(y, dy)
                dx = None if x is None else x.grad
                saved = self.live.pop((s, mb))
                del self.state[(s, mb)], y, record
                self.note_held(going=saved)
        if s > 0:
            self.send(dx, "grad", s - 1, mb)
        elif (s, mb) in self.split and x is not None:
            _accumulate(x, dx)                          # the caller's input: x.grad, as backward() gives
        self.backward_done(s, mb)

    def last_gradients(self, op, s, mb) -> bool:
        """Whether action (op, s, mb) completes stage s's last weight gradients of the step."""
        return self.grad_ends.get((op, s, mb), (False, False))[1]

    def runs_real(self, s, mb) -> bool:
        """Whether the forward and backward of stage s, micro-batch mb, must run as the program
        (a dry run replays the others' price, :mod:`course_lib.virtual.replay`): with
        ``hooked_last`` set, the step's last backward of each stage, where gradient hooks
        launch collectives (:meth:`ZeroSync.overlap_grad_reduce`), and its forward."""
        return self.hooked_last and self.last_gradients("B", s, mb)

    def _gradients_complete(self, op, s, mb):
        """After an action (outside it: a dry run's replayed action runs no runner code): tell
        ``gradients_done`` when it completed a micro-batch's weight gradients of stage s."""
        if self.gradients_done is not None and (op == "W" or (op == "B" and (s, mb) not in self.split)):
            self.gradients_done(s, *self.grad_ends[(op, s, mb)])

    def backward_done(self, s, mb):
        """Called when the backward of stage s, micro-batch mb, has sent its gradient: nothing here;
        a runtime that exchanges after it (Megatron-LM's interleaving, ``virtual.megatron_p2p``) sets it."""

    def W(self, i, s, mb):
        """The weight gradients B left for later."""
        with trace.span(f"W{mb}" + (f"@{s}" if s else ""), "compute", "pp"):
            for_w, later = self.state.pop((s, mb))
            backward_weight(for_w)
            run_later(later)                 # the tensor-parallel layers' (weight_grads)
            del for_w, later
        self.note_held(going=self.live.pop((s, mb)))

    def note_held(self, states_changed: bool = True, excess: int = 0, going: int = 0):
        """Ask ``memory_probe`` (if set) what the GPU holds now; keep the step's largest.
        ``states_changed=False`` (after a forward): no gradient buffer came or went since the last ask.
        ``excess``: what the action since the last ask held for a while above both asks, where
        it ran no op (a dry run's replayed action: its real runs' excess). ``going``: the saved
        bytes the action just let go of (a backward's), counted once more in the moment's count."""
        if self.memory_probe is not None:
            held = self.memory_probe(sum(self.live.values()), states_changed, excess, going)
            self.out.peak_held_bytes = max(self.out.peak_held_bytes, held)

    def send(self, t, kind, s, mb):
        """Hand ``t`` to stage s (its activation input, or its output's gradient)."""
        boundary = s - 1 if kind == "act" else s
        shape, dtype = self.shapes[boundary]
        if tuple(t.shape) != shape or t.dtype != dtype:
            what = "activation of" if kind == "act" else "input gradient of"
            raise ValueError(f"the {what} stage {s - 1 if kind == 'act' else s + 1}, micro-batch {mb}, is "
                             f"{tuple(t.shape)} {t.dtype}, but act_shape={shape}, act_dtype={dtype}: every "
                             f"tensor sent between stages must have that shape and dtype (the receiver's buffer)")
        if self.rank_of(s) == self.me:      # the next stage is on this rank: no message
            self.local[(kind, s, mb)] = t.detach()     # handed over as is: no copy kernel
            return
        t = t.detach().contiguous()
        with trace.span(f"send {kind} {mb}", "comm", "pp"):      # gloo writes to the socket here
            work = self.comm.isend(t, self.rank_of(s), tag=self._tag(kind, s, mb))
        if self.blocking_sends:                 # a blocking send: the rank waits for it here
            with trace.span(f"wait send {kind} {mb}", "comm", "pp"):
                work.wait()
        else:
            self.sends.append((work, t))
        self.out.bytes_sent += t.numel() * t.element_size()
        self.out.messages += 1

    def recv(self, i, kind, s, mb):
        """The tensor action i reads: from this rank's own stage, or a message posted ahead."""
        if (kind, s, mb) in self.local:
            return self.local.pop((kind, s, mb))
        self._post_recvs(i)
        work, buf = self.posted.pop(i)
        with trace.span(f"recv {kind} {mb}", "comm", "pp"):
            work.wait()
        self._post_recvs(i)                 # the next receive, before this action computes
        return buf

    def _post_recvs(self, i):
        """Post the receive action i needs, and RECV_DEPTH ahead: the transport reads the
        message while this rank computes."""
        while self.nxt < len(self.needs) and (self.needs[self.nxt][0] <= i or len(self.posted) < RECV_DEPTH):
            j, (kind, src, s, mb) = self.needs[self.nxt]
            shape, dtype = self.shapes[s - 1 if kind == "act" else s]
            buf = torch.empty(shape, dtype=dtype, device=self.device)  # (b, s, h): activation or its gradient
            self.posted[j] = (self.comm.irecv(buf, self.rank_of(src), tag=self._tag(kind, s, mb)), buf)
            self.nxt += 1

    def _tag(self, kind, s, mb):
        return ((kind == "grad") * self.n + s) * self.m + mb

    def _infer_shapes(self, x0):
        """{boundary: (shape, dtype)}: micro-batch 0 through the stages in order, no gradient."""
        header = torch.zeros(2 + MAX_DIMS, dtype=torch.int64,               # dtype, ndim, dims
                             device=self.comm.backend_device)                # NCCL: on the GPU
        shapes = {}
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for s in range(self.n):
                if self.rank_of(s) != self.me:
                    continue
                if s > 0 and self.rank_of(s - 1) != self.me:            # the previous rank's output
                    self.comm.recv(header, self.rank_of(s - 1))
                    dims = header[2:2 + int(header[1])].tolist()
                    shapes[s - 1] = (tuple(dims), DTYPES[int(header[0])])
                x = x0 if s == 0 else torch.zeros(shapes[s - 1][0], dtype=shapes[s - 1][1], device=self.device)
                if s < self.n - 1:
                    y = self.stages[s](x)
                    shapes[s] = (tuple(y.shape), y.dtype)
                    if self.rank_of(s + 1) != self.me:
                        header.zero_()
                        header[:2 + y.dim()] = torch.tensor([DTYPES.index(y.dtype), y.dim(), *y.shape],
                                                            device=header.device)
                        self.comm.send(header.clone(), self.rank_of(s + 1))
        return shapes


MAX_DIMS = 6
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def fb_pairs(actions, split=()) -> set:
    """Where DualPipe overlaps: the indices i of ``actions`` (one rank's) whose action is a forward
    followed by the full backward (not split: its W is not in ``split``) of another stage
    (chunk) and micro-batch: the two share no data, so they can run as one F&B pair, a
    forward's all-to-all hidden under the backward's compute and the other way round
    (DeepSeek-V3 report, Sec. 3.2.1). DualPipeV's main phase is made of such pairs."""
    out, i = set(), 0
    while i + 1 < len(actions):
        (op, s, mb), (op2, s2, mb2) = actions[i], actions[i + 1]
        if op == "F" and op2 == "B" and s != s2 and mb != mb2 and (s2, mb2) not in split:
            out.add(i)
            i += 2
        else:
            i += 1
    return out


def run_schedule(schedule, stages: dict, comm, *, p: int, m: int, v: int = 1, inputs=None, targets=None,
                 loss_fn=None, act_shape=None, act_dtype=torch.float32, scale_grads: bool = False) -> StepResult:
    """One step of :class:`ScheduleRunner` (built, and the schedule validated, for this call)."""
    return ScheduleRunner(schedule, stages, comm, p=p, m=m, v=v, act_shape=act_shape, act_dtype=act_dtype,
                          scale_grads=scale_grads).step(inputs, targets, loss_fn)


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
            dep = dependency(a, p, v)
            if dep is not None and compute[str(dep)].end > before.end:     # it waited for the message
                latencies.append(this.start - compute[str(dep)].end)
                continue
            gaps.append(this.start - before.end)
            ready += [s.end - s.start for s in recvs if s.rank == r and before.end <= s.start and s.end <= this.start]
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0
    sends = [s.end - s.start for s in spans if s.kind == "comm" and s.name.startswith("send")]
    return {"t_overhead": mean(gaps), "t_comm": mean(latencies), "t_send": mean(sends), "t_recv_ready": mean(ready),
            "durations": {name: s.end - s.start for name, s in compute.items()}}


__all__ = ["ScheduleRunner", "run_schedule", "fb_pairs", "StepResult", "backward_input", "backward_weight", "measured_costs"]
