"""Replay of a pipeline action's price: how the dry run gets through 512 micro-batches.

Every micro-batch's forward of one stage runs the same kernels on the same shapes, and so
does every backward after the first (which creates the gradients). The dry run runs each
action (F or B of a virtual stage) for real until two runs in a row priced the same
*tape* (:class:`ActionMemo`): every kernel's seconds, every time the host read a value, every
collective (its Comm, shapes and arguments), in order. From then on an action of that stage
is its tape replayed on the clock: the kernels by the compute stream's own arithmetic
(:meth:`course_lib.virtual.compute.ComputeStream.replay`), the collectives called again on
their Comm with meta tensors of the taped shapes, made once per tape (priced as the first
time, by the clock, with this moment's streams and lanes; a blocking one of the backend straight
on the clock, :meth:`.priced.PricedComm.replay_call`; an async one waited for where the action
waited, its wait taped in order), between the same receive and send the runner makes. Where a
tape cannot be trusted (an async collective not waited for inside the action, kernels outside
the action's span, a zero-bubble split), the stage keeps running for real, and so do the
actions the runner says must (``ScheduleRunner.runs_real``: a last backward whose hooks launch
the gradient reductions). ``tests/test_dry_run.py`` checks the step time with
replays against a real launch.
"""
from __future__ import annotations

import contextlib

import torch

from course_lib import trace
from course_lib.virtual.live_memory import unfollowed

REPLAYED = "replayed"    # runner.state's mark of a micro-batch whose forward was replayed


class TapeRecorder(trace.Recorder):
    """A rank's span recorder that hands the ops of a pipeline action's compute span to its memo."""

    memo = None

    @contextlib.contextmanager
    def span(self, name: str, kind: str = "compute", dim: str = ""):
        memo = self.memo
        if memo is None or memo.taping is None or kind != "compute" or dim != "pp":
            with super().span(name, kind, dim):
                yield
            return
        memo.begin()
        try:
            with super().span(name, kind, dim):
                yield
        finally:
            memo.end()


class ActionMemo:
    """The tapes of one running rank's actions; :meth:`install` wraps its runner's F and B."""

    def __init__(self, clock, early: bool = True):
        self.clock, self.early = clock, early
        self.taping = None          # the action being taped: ("F" | "B", stage)
        self.tape, self.active = None, False     # its tape; whether its compute span is open
        self.tapes = {}             # (op, stage) -> [tape of run 2, matches of run 3+] ...
        self.ready = {}             # (op, stage) -> a replayable tape (segments)
        self.bad = set()            # (op, stage) never replayed
        self.runs = {}              # (op, stage) -> real runs so far
        self.extra = {}             # (op, stage) -> what the runner keeps (saved bytes)
        self.excess = {}            # (op, stage) -> its last real run's MemoryProbe.excess
        self.runner = None          # the runner it wraps (install)
        self.replays = 0
        self.sent = {}              # boundary -> the meta tensor replayed actions send

    # ---------------------------------------------------------------- taping
    def begin(self):
        self.tape, self.active = [], True
        self.clock.stream_tape(self.tape)

    def end(self):
        self.active = False
        self.clock.stream_tape(None)

    def comm_call(self, comm, op, name, payload, async_op, args, kwargs):
        """A collective inside the action being taped (PricedComm calls this): its place in the
        tape (None: not taped). An async one is replayable once the action waits for it inside
        its compute span (:meth:`comm_wait`: its wait is taped where it happens)."""
        if self.taping is None or self.clock.muted_depth:
            return None
        if not self.active:            # a collective of the action outside its compute span
            self.bad.add(self.taping)
            return None
        shapes = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else ("value", a) for a in args)
        self.tape.append((comm, op, name, payload, async_op, shapes, kwargs, repr(sorted(kwargs.items()))))
        return len(self.tape) - 1

    def comm_wait(self, at) -> None:
        """The wait for the async collective taped at ``at`` (PricedComm's handle calls this)."""
        if self.taping is None or self.clock.muted_depth or self.tape is None:
            return
        if not self.active:            # waited for outside the action's compute span
            self.bad.add(self.taping)
            return
        self.tape.append(("wait", at))

    def _run_real(self, key, run):
        clock, self.taping, self.tape = self.clock, key, None
        k0 = clock.kernels
        try:
            run()
        finally:
            self.taping = None
            self.clock.stream_tape(None)
        # what the action held above both of the memory's moments around it, for its replays
        self.excess[key] = getattr(getattr(self.runner, "memory_probe", None), "excess", 0)
        tape, self.tape = self.tape, None
        n = self.runs[key] = self.runs.get(key, 0) + 1
        if tape is None or clock.kernels - k0 != sum(1 for x in tape if x is not None and not isinstance(x, tuple)):
            self.bad.add(key)          # kernels priced outside the action's span: not a replayable unit
            return
        waited = {x[1] for x in tape if isinstance(x, tuple) and x[0] == "wait"}
        if any(isinstance(x, tuple) and x[0] != "wait" and x[4] and i not in waited for i, x in enumerate(tape)):
            self.bad.add(key)          # an async collective the action does not wait for
        if key in self.bad or n < 2:
            return                     # (run 1: the first backward makes the gradients)
        signature = [x if not isinstance(x, tuple) or x[0] == "wait" else (id(x[0]),) + x[1:6] + (x[7],)
                     for x in tape]
        if n == 2:
            self.tapes[key] = signature
        elif signature == self.tapes[key]:
            with unfollowed(clock.stream()):      # (templates, not the program's memory)
                self.ready[key] = _segments(tape)
        else:
            self.bad.add(key)

    def _replayable(self, s) -> bool:
        """Whether the forward of stage ``s`` may be replayed: its tape is ready, and its backward's
        is too, or (``early``) is still being taped from the real forwards already run (a
        backward runs its micro-batches in order: its first three, whose forwards ran for
        real, decide its tape). Early: a deep interleaved pipeline's warm-up runs hundreds of
        forwards before a stage's third backward."""
        if ("F", s) not in self.ready or ("F", s) in self.bad or ("B", s) in self.bad:
            return False
        return ("B", s) in self.ready or self.early

    def play(self, key) -> None:
        stream, pending = self.clock.stream(), {}
        for kind, item in self.ready[key]:
            if kind == "ops":
                stream.replay(item)
            elif kind == "wait":                # an async collective's wait, where the action waited
                pending.pop(item).wait()
            else:
                at, comm, op, name, payload, async_op, args, kwargs = item
                handle = comm.replay_call(op, name, payload, async_op, args, kwargs)
                if async_op:
                    pending[at] = handle
        self.replays += 1

    # ---------------------------------------------------------------- the runner's actions
    def install(self, runner) -> None:
        """Wrap ``runner``'s F and B (this instance only) with taping and replay. A schedule that
        splits some backwards (zero bubble: DualPipeV's first ones) replays a forward only once
        its stage's full backward has a tape: its first backwards do not tape the full one."""
        real_f, real_b = runner.F, runner.B
        self.runner = runner
        if runner.split:
            self.early = False

        def F(i, s, mb):
            if (s, mb) in runner.split or not self._replayable(s) or runner.runs_real(s, mb):
                before = dict(runner.live)
                self._run_real(("F", s), lambda: real_f(i, s, mb))
                if runner.live.keys() - before.keys() == {(s, mb)}:
                    self.extra[("F", s)] = runner.live[(s, mb)]
                return
            if s > 0:
                runner.recv(i, "act", s, mb)
            with trace.span(f"F{mb}" + (f"@{s}" if s else ""), "compute", "pp"):
                self.play(("F", s))
            runner.live[(s, mb)] = runner.out.saved_bytes[(s, mb)] = self.extra[("F", s)]
            runner.out.peak_activation_bytes = max(runner.out.peak_activation_bytes, sum(runner.live.values()))
            runner.note_held(states_changed=False, excess=self.excess.get(("F", s), 0))
            if s < runner.n - 1:
                runner.send(self._sent(runner, s), "act", s + 1, mb)
            else:
                runner.out.losses[mb] = 1.0
            runner.state[(s, mb)] = REPLAYED

        def B(i, s, mb):
            if runner.state.get((s, mb)) is not REPLAYED:      # (an input-gradient-only B: a tape of its own)
                return self._run_real(("B", s) if (s, mb) not in runner.split else ("B input", s),
                                      lambda: real_b(i, s, mb))
            if ("B", s) not in self.ready:      # (early replay: the backward's tape did not repeat)
                raise RuntimeError(f"stage {s}: the forward of micro-batch {mb} was replayed, but its "
                                   f"backward's price did not repeat; run the dry run with replay=False")
            if s < runner.n - 1:
                runner.recv(i, "grad", s, mb)
            with trace.span(f"B{mb}" + (f"@{s}" if s else ""), "compute", "pp"):
                self.play(("B", s))
            del runner.state[(s, mb)]
            runner.note_held(excess=self.excess.get(("B", s), 0),     # (its stage's first backward
                             going=runner.live.pop((s, mb)))           #  made its buffers)
            if s > 0:
                runner.send(self._sent(runner, s - 1), "grad", s - 1, mb)
            runner.backward_done(s, mb)

        runner.F, runner.B = F, B

    def _sent(self, runner, boundary: int) -> torch.Tensor:
        """What a replayed action hands on across ``boundary`` (stage -> stage + 1): a meta tensor
        of the runner's shape, made once (the runner sends a detached copy of it)."""
        t = self.sent.get(boundary)
        if t is None:
            shape, dtype = runner.shapes[boundary]
            with unfollowed(self.clock.stream()):
                t = self.sent[boundary] = torch.empty(shape, dtype=dtype, device="meta")
        return t


def _segments(tape) -> list:
    """[("ops", [seconds or None, ...]) | ("comm", (place, comm, op, name, payload, async, args, kwargs))
    | ("wait", the place of the async collective waited for)]:
    a collective's arguments made once, meta tensors of the shapes taped (every replay passes
    the same ones: the dry run's backend moves nothing into them, the clock reads their shapes)."""
    out = []
    for at, x in enumerate(tape):
        if isinstance(x, tuple) and x[0] == "wait":
            out.append(("wait", x[1]))
        elif isinstance(x, tuple):
            comm, op, name, payload, async_op, shapes, kwargs = x[:7]
            args = tuple(torch.empty(shape, dtype=dtype, device="meta") if shape != "value" else dtype
                         for shape, dtype in shapes)
            out.append(("comm", (at, comm, op, name, payload, async_op, args, kwargs)))
        elif out and out[-1][0] == "ops":
            out[-1][1].append(x)
        else:
            out.append(("ops", [x]))
    return out


__all__ = ["ActionMemo", "TapeRecorder", "REPLAYED"]
