"""DeepSpeed's TrainSchedule send order (``"deepspeed_p2p_order"``, :mod:`.software`), run by the
course's pipeline runner.

DeepSpeed's PipelineEngine (BLOOM's Megatron-DeepSpeed) runs the instructions its TrainSchedule
yields, step by step (deepspeed/runtime/pipe/schedule.py, from the engine's first release,
microsoft/DeepSpeed#392 of September 2020, to #2862 of March 2023, which moved ``SendGrad``
before ``RecvActivation``). A stage's forwards and backwards come in 1F1B's order; each step
exchanges messages, then computes:

* a forward step: ``RecvActivation`` (this forward's input), ``SendGrad`` (the previous
  backward's input gradient), ``ForwardPass``;
* a backward step: ``SendActivation`` (the previous forward's output), ``RecvGrad``,
  ``BackwardPass``.

So an activation leaves right after its forward (the course's runner sends it there too), but an
input gradient leaves only once the stage's next activation has arrived: the previous stage
waits for its gradient until this stage has received the activation that stage sent. In
cool-down (no forward left) the gradient leaves in the (empty) forward step, before the next
``RecvGrad``; the stage's last gradient at once.
"""
from __future__ import annotations

import torch

from course_lib.schedules import make_schedule, validate
from course_lib import trace
from course_lib.virtual.megatron_p2p import MegatronP2P, off_the_tape, piece_of, splits


class DeepSpeedP2POrder:
    """DeepSpeed's TrainSchedule send order on a 1F1B :class:`~course_lib.parallel.pipeline.runner.
    ScheduleRunner` (this instance only: its ``send`` and ``recv``): a backward's gradient is
    sent after the stage's next activation is received (``RecvActivation``, then ``SendGrad``),
    or, where no forward follows, before its next gradient is received; the stage's last one
    at once. Activations leave where the runner sends them (``SendActivation`` opens the step
    after the forward, before ``RecvGrad``)."""

    def __init__(self, runner):
        p, m = runner.p, runner.m
        one_f_one_b = validate(make_schedule("1f1b", p, m, 1), p, m, 1)[runner.me] if runner.n == p else None
        if runner.split or one_f_one_b is None or list(runner.actions) != list(one_f_one_b):
            raise ValueError("deepspeed_p2p_order: DeepSpeed's TrainSchedule runs 1F1B, one stage per rank "
                             "(schedule='1f1b', v=1)")
        self.runner, self.held, self.regather = runner, [], None
        self._send, self._recv = runner.send, runner.recv
        runner.send, runner.recv = self.send, self.recv

    def flush(self) -> None:
        while self.held:
            self._send(*self.held.pop(0))

    def send(self, t, kind, s, mb):
        if kind == "grad" and mb < self.runner.m - 1:
            self.held.append((t, kind, s, mb))      # (the tensor is this backward's own: kept as is)
            return
        self.flush()
        self._send(t, kind, s, mb)

    def recv(self, i, kind, s, mb):
        if kind == "grad":
            self.flush()
            grad = self._recv(i, kind, s, mb)
            tp = getattr(self, "regather", None)
            if tp is not None and splits(grad, tp.size, True):
                # the backward first rebuilds this stage's own output, freed after its pieces left
                # (engine.py _exec_backward_pass: part_output.full()): its shape is the gradient's
                full = torch.empty(grad.numel(), dtype=grad.dtype, device=grad.device)
                with off_the_tape(trace.clock()):      # the exchange's, not the backward action's
                    tp.all_gather_into_tensor(full, piece_of(grad, tp.rank, tp.size), name="all-gather output")
            return grad
        buf = self._recv(i, kind, s, mb)
        self.flush()
        return buf


def install_partitioned_pipe(net, order) -> None:
    """``"deepspeed_partitioned_pipe"``: DeepSpeed's PipelineEngine (its ``is_pipe_partitioned`` and
    ``is_grad_partitioned`` are ``is_model_parallel``: deepspeed/runtime/pipe/engine.py L132-134,
    at 735406e53 of June 2022, BLOOM's version) sends a stage's output and a backward's input
    gradient as a ``PartitionedTensor`` over the model-parallel group: each tensor-parallel rank
    its 1/t (L663-680, L991-1003), the receiver gathers them (``.full()``, an all-gather, L642-651
    and L749-756); the sender frees its output after the send and gathers it again at the start
    of that micro-batch's backward (L735-746). Run on ``net``'s pipeline runner with the pieces
    and gathers of :class:`~course_lib.virtual.megatron_p2p.MegatronP2P` (no host
    synchronisation) and ``order`` (:class:`DeepSpeedP2POrder`, whose gradient receive then
    gathers the output). Not sent: the pieces' meta tensor (a few int64 a message); not freed: the output (the
    runner keeps it, so the memory counted is the course's program's). The same
    values; nothing to do without tensor parallelism or under sequence parallelism."""
    mesh = net.mesh
    if mesh.sizes.get("tp", 1) == 1 or getattr(net, "sp", False):
        return
    tp = mesh.comm("tp")
    MegatronP2P(net.runner, tp, scatter_gather=True, synchronize=False)
    order.regather = tp


__all__ = ["DeepSpeedP2POrder", "install_partitioned_pipe"]
