"""Megatron-LM's pipeline exchange (``"megatron_p2p"``, :mod:`.software`), run by the course's
pipeline runner.

Megatron-LM moves every activation and gradient between pipeline stages with one function,
``_communicate`` (NVIDIA/Megatron-LM megatron/p2p_communication.py; at de7dc40, the commit of
Narayanan et al. 2021's sc21 scripts, L24-143; at 55ba1f7b, Korthikanti et al. 2022's era,
L24-159). Each call:

1. *scatter*: each tensor-parallel rank sends only its 1/t of the flattened tensor
   (``mpu.split_tensor_into_1d_equal_chunks``: elements [r n/t, (r+1) n/t)), the
   "scatter/gather optimization" of Narayanan et al. 2021, Sec. 4.1: the t ranks of a stage hold
   the same activation, and each sends a different 1/t of it over its own InfiniBand card
   (their Figure 18: up to 11% more throughput on communication-intensive interleaved runs);
   on by default (``--no-scatter-gather-tensors-in-pipeline`` is ``store_false``, de7dc40
   arguments.py L585-587);
2. sends and receives posted as one ``torch.distributed.batch_isend_irecv``, every request
   waited for (``req.wait()``), then ``torch.cuda.synchronize()`` ("to protect against race
   condition when using batch_isend_irecv()"): the host goes on only once the exchange, and
   everything the GPU had queued, is done (de7dc40 L104-130; 55ba1f7b L113-139);
3. *gather*: the receiver all-gathers the t pieces over its tensor-parallel group, on NVLink
   (``mpu.gather_split_1d_tensor``), and views the result in the tensor's shape.

Where the 1/t split does not apply, the whole tensor travels: under sequence parallelism
(55ba1f7b: ``not args.sequence_parallel``; each rank's activation is its own s/t rows already,
and the ranks' tensors differ), with t = 1, and where the element count is not divisible by t
(55ba1f7b L64-72 falls back to the whole tensor; de7dc40 floor-divides, and its receiver's
``.view(tensor_shape)`` of t * floor(n/t) elements raises. With Megatron's own shapes it never
arises: the hidden size is divisible by t).

On the course's :class:`~course_lib.parallel.pipeline.runner.ScheduleRunner` the exchange is
the runner's transport (:class:`MegatronP2P`, its ``comm``): every send waited for where it is
posted (the runner's ``blocking_sends``), then the host synchronised; every receive waited
for, the host synchronised, then gathered. Megatron batches a stage's send and its next
receive into one call and waits for both; the runner posts its receives ahead and waits for
each where the next action needs it: the stage's next kernel starts at the later of the two
either way. Megatron's interleaved schedule exchanges after each steady-state pair of a
forward and a backward: the forward's activation leaves with the backward's gradient
(:class:`InterleavedOrder`, on the runner when v > 1). Megatron's timers synchronise the host
around every pass and exchange too (:class:`Timers`, ``"megatron_timers"``).

On gloo the pieces and the gather move real bytes: the values are the default exchange's, bit
for bit (``tests/test_megatron_p2p.py``). On a virtual clock the pieces take the network's
lanes for 1/t of the bytes, the gather the tensor-parallel group's NVLink, and a
synchronisation moves the host to where the device's streams end (:func:`host_synchronize`).
The runner's ``bytes_sent`` still counts the tensors it hands on, not the pieces.
"""
from __future__ import annotations

import contextlib

import torch

from course_lib import trace


def host_synchronize(clock) -> None:
    """``torch.cuda.synchronize()`` on a rank's virtual clock (None, a wall-clock run: nothing to
    price): the host waits until the compute stream and every communication stream are idle,
    so the next kernel is issued from then on."""
    if clock is None or clock.muted_depth:
        return
    clock.settle()                      # async collectives issued: priced, their streams' ends known
    clock.host = max(clock.host, clock.t, clock.comm_free)


def splits(tensor, tp_size: int, scatter_gather: bool) -> bool:
    """Whether ``tensor`` travels as t pieces (Megatron-LM 55ba1f7b's rule, see the module doc)."""
    return scatter_gather and tp_size > 1 and tensor.numel() % tp_size == 0


def piece_of(tensor, tp_rank: int, tp_size: int):
    """This tensor-parallel rank's 1/t of ``tensor`` flattened (``split_tensor_into_1d_equal_chunks``):
    a view, (numel / t,)."""
    n = tensor.numel() // tp_size
    return tensor.reshape(-1)[tp_rank * n:(tp_rank + 1) * n]


@contextlib.contextmanager
def off_the_tape(clock):
    """The gather belongs to the exchange, not to the pipeline action whose receive it ends: a dry
    run's :class:`~course_lib.virtual.replay.ActionMemo` does not tape it (a replayed action's
    receive runs it again)."""
    memo = getattr(clock, "memo", None)
    taping = memo.taping if memo is not None else None
    if memo is not None:
        memo.taping = None
    try:
        yield
    finally:
        if memo is not None:
            memo.taping = taping


class Synchronized:
    """A send's or receive's work handle: ``wait()`` waits for it, then synchronises the host
    (``sync``; DeepSpeed's exchange does not); a receive sent in pieces is then gathered over the
    tensor-parallel group into ``full``."""
    __slots__ = ("work", "piece", "full", "tp", "done", "sync")

    def __init__(self, work, piece=None, full=None, tp=None, sync=True):
        self.work, self.piece, self.full, self.tp, self.done, self.sync = work, piece, full, tp, False, sync

    def wait(self, timeout=None):
        if self.done:
            return True
        self.work.wait()
        clock = trace.clock()
        if self.sync:
            host_synchronize(clock)
        if self.piece is not None:      # (n,) <- t pieces of (n/t,), in tp rank order
            with off_the_tape(clock):
                self.tp.all_gather_into_tensor(self.full.view(-1), self.piece, name="all-gather p2p")
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class InterleavedOrder:
    """Where Megatron-LM's interleaved schedule exchanges (``forward_backward_pipelining_with_
    interleaving``, de7dc40 megatron/schedules.py L271-340): in its steady state each iteration
    runs a forward, then a backward, then ONE ``send_forward_backward_recv_forward_backward``: the
    forward's activation leaves together with the backward's input gradient, after the backward.
    On ``runner`` (this instance only: its ``send`` and ``backward_done``) the activation of a
    forward that the schedule follows with a backward is held, and sent when that backward is
    done (after its gradient, if it sends one); every other message where the runner sends it
    (warm-up and cool-down send at once, as Megatron's ``send_forward_recv_forward`` and
    ``send_backward_recv_backward`` do)."""

    def __init__(self, runner):
        acts = runner.actions
        ops = [a[0] for a in acts]
        # no steady state on this rank (every forward a warm-up one: m * v chunks within Megatron's
        # warm-up count, e.g. m = p): Megatron sends each warm-up activation at once
        # (send_forward_recv_forward, its last one with the first gradient's receive), never
        # after a backward; holding the last one for the first backward would deadlock
        steady = "B" in ops and "F" in ops and ops.index("B") < len(ops) - 1 - ops[::-1].index("F")
        self.pairs = {(s, mb): (s2, mb2) for (op, s, mb), (op2, s2, mb2) in zip(acts, acts[1:])
                      if op == "F" and op2 == "B"} if steady else {}
        self.runner, self.held = runner, None
        self._send, self._done = runner.send, runner.backward_done
        runner.send, runner.backward_done = self.send, self.backward_done

    def send(self, t, kind, s, mb):
        pair = self.pairs.get((s - 1, mb)) if kind == "act" else None
        if pair is not None and self.runner.rank_of(s) != self.runner.me:
            self.held = (pair, (t, kind, s, mb))    # (the forward's own output: kept as is until sent)
            return
        self._send(t, kind, s, mb)

    def backward_done(self, s, mb):
        self._done(s, mb)
        if self.held is not None and self.held[0] == (s, mb):
            held, self.held = self.held[1], None
            self._send(*held)


class Timers:
    """Megatron-LM's timers on ``runner`` (``"megatron_timers"``; this instance only: its ``send``,
    ``recv`` and ``backward_done``). Megatron of 2021-22 times every pass and every exchange,
    always: ``timers('forward-compute')`` and ``timers('backward-compute')`` around each forward
    and backward (de7dc40 megatron/schedules.py L53/L63, L79/L95), ``timers('forward-recv')``,
    ``timers('forward-send')`` and the batched exchanges' around each call of p2p_communication
    (schedules.py passes ``timers=timers``), and each ``start()`` and ``stop()`` calls
    ``torch.cuda.synchronize()`` (megatron/global_vars.py L192-203). Here the host is synchronised
    (:func:`host_synchronize`) before and after each send and receive (after the gather: the
    timer stops once ``_communicate`` returns) and when a backward is done. Where the runner has
    no hook, the host is synchronised already: a forward starts after the previous action's
    stop, and the last stage's forward ends reading its loss (``float(loss)``)."""

    def __init__(self, runner):
        self._send, self._recv, self._done = runner.send, runner.recv, runner.backward_done
        runner.send, runner.recv, runner.backward_done = self.send, self.recv, self.backward_done

    def send(self, t, kind, s, mb):
        clock = trace.clock()
        host_synchronize(clock)
        self._send(t, kind, s, mb)
        host_synchronize(clock)

    def recv(self, i, kind, s, mb):
        clock = trace.clock()
        host_synchronize(clock)
        out = self._recv(i, kind, s, mb)
        host_synchronize(clock)
        return out

    def backward_done(self, s, mb):
        host_synchronize(trace.clock())     # timers('backward-compute').stop()
        self._done(s, mb)


class MegatronP2P:
    """Megatron-LM's ``_communicate`` as the transport of ``runner`` (a ScheduleRunner; this
    instance only: it becomes ``runner.comm``, and its sends block): messages over the runner's
    pipeline Comm, in pieces of 1/t gathered over ``tp`` (the stage's tensor-parallel Comm)
    where :func:`splits` says so; ``scatter_gather=False`` (sequence parallelism) sends whole
    tensors; ``synchronize=False``: no host synchronisation after a wait (DeepSpeed's
    partitioned pipe, :mod:`.deepspeed_order`). The same messages, tags and order as the
    runner's own; a step's values unchanged."""

    def __init__(self, runner, tp=None, scatter_gather: bool = True, synchronize: bool = True):
        if isinstance(runner.comm, MegatronP2P):
            raise ValueError("megatron_p2p: this runner already exchanges as Megatron-LM does")
        self.pp, self.tp, self.sync = runner.comm, tp, bool(synchronize)
        self.scatter_gather = bool(scatter_gather) and tp is not None and tp.size > 1
        self.rank, self.size, self.backend_device = self.pp.rank, self.pp.size, self.pp.backend_device
        runner.comm, runner.blocking_sends = self, True
        self.order = InterleavedOrder(runner) if runner.n > runner.p else None    # v > 1: Megatron's interleaving

    def _splits(self, tensor) -> bool:
        return splits(tensor, self.tp.size if self.tp is not None else 1, self.scatter_gather)

    def isend(self, tensor, peer: int, tag: int = 0):
        if self._splits(tensor):
            tensor = piece_of(tensor, self.tp.rank, self.tp.size)     # (numel / t,) of this rank
        return Synchronized(self.pp.isend(tensor, peer, tag), sync=self.sync)

    def irecv(self, tensor, peer: int, tag: int = 0):
        if not self._splits(tensor):
            return Synchronized(self.pp.irecv(tensor, peer, tag), sync=self.sync)
        piece = torch.empty(tensor.numel() // self.tp.size, dtype=tensor.dtype, device=tensor.device)
        return Synchronized(self.pp.irecv(piece, peer, tag), piece, tensor, self.tp, sync=self.sync)

    def send(self, tensor, peer: int):      # (the runner's shape headers: plain messages)
        self.pp.send(tensor, peer)

    def recv(self, tensor, peer: int):
        self.pp.recv(tensor, peer)


def install_megatron_p2p(net, software) -> None:
    """``"megatron_p2p"`` in ``software`` (:mod:`.software`'s names): ``net``'s pipeline runner
    exchanges as Megatron-LM's ``_communicate`` (:class:`MegatronP2P`): in 1/t pieces gathered over
    the stage's "tp" group, unless the layout runs sequence parallelism (``net.sp``); with
    ``"megatron_timers"`` the host synchronised where Megatron's timers start and stop
    (:class:`Timers`). Once (a second call keeps what the first installed)."""
    runner = net.runner
    if "megatron_p2p" not in software:
        return
    if isinstance(runner.comm, MegatronP2P):
        runner.blocking_sends = True
        return
    mesh = net.mesh
    tp = mesh.comm("tp") if mesh.sizes.get("tp", 1) > 1 else None
    MegatronP2P(runner, tp, scatter_gather=not getattr(net, "sp", False))
    if "megatron_timers" in software:
        Timers(runner)


__all__ = ["install_megatron_p2p", "MegatronP2P", "InterleavedOrder", "Timers", "Synchronized", "host_synchronize",
           "splits", "piece_of", "off_the_tape"]
