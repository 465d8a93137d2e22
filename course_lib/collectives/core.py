"""What every from-scratch collective shares: the group, point-to-point messages
(counted), reduction operators, chunking, and the wrapper that traces each call.

* :class:`Comm` wraps a process group: ``rank``/``size`` inside the group, and
  ``exchange`` = post an isend and an irecv, wait for both. Every byte our
  collectives move goes through it, so a :class:`TrafficCounter` passed to a
  collective counts exactly what was sent and received (payload bytes; the
  transport's headers are not included).
* :func:`collective` makes a function a collective: a rank outside the group
  returns at once, the others run inside a trace span named after the algorithm.
* :func:`reduce_` applies a ReduceOp elementwise; :func:`chunks` splits a flat
  buffer like ``torch.tensor_split`` (the first ``n % N`` chunks one longer).
* The agreement check and each collective's argument rules: ``checks``.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib import compat
from course_lib import trace

ReduceOp = dist.ReduceOp

# Codes travel in the metadata exchange; -1 means "not supported here".
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_DTYPE_CODE = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}

# op -> (elementwise out = f(a, b, out=...), needs integers)
_OPS = {
    ReduceOp.SUM: (torch.add, False),
    ReduceOp.AVG: (torch.add, False),          # summed, divided by N at the end
    ReduceOp.PRODUCT: (torch.mul, False),
    ReduceOp.MIN: (torch.minimum, False),
    ReduceOp.MAX: (torch.maximum, False),
    ReduceOp.BAND: (torch.bitwise_and, True),
    ReduceOp.BOR: (torch.bitwise_or, True),
    ReduceOp.BXOR: (torch.bitwise_xor, True),
}
_OP_CODE = {op: int(op) for op in _OPS}


def op_name(op) -> str:
    op = getattr(op, "op", op)  # a ReduceOp instance wraps a RedOpType
    return getattr(op, "name", str(op))


def check_op(op, dtype):
    """ValueError unless ``op`` can reduce tensors of ``dtype`` here."""
    op = getattr(op, "op", op)
    if op not in _OPS:
        raise ValueError(f"ReduceOp {op_name(op)} is not supported by course_lib collectives; "
                         f"use one of {', '.join(op_name(o) for o in _OPS)}")
    if _OPS[op][1] and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"ReduceOp {op_name(op)} needs an integer dtype, got {dtype}")
    if op == ReduceOp.AVG and not dtype.is_floating_point:
        raise ValueError(f"ReduceOp.AVG needs a floating-point dtype, got {dtype} (use SUM and divide)")
    return op


def check_dtype(tensor, what="tensor"):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _DTYPE_CODE:
        raise ValueError(f"{what} has dtype {tensor.dtype}, which course_lib collectives do not support; "
                         f"supported: {', '.join(str(d).replace('torch.', '') for d in SUPPORTED_DTYPES)}")


def reduce_(out, a, b, op):
    """out = a (op) b, elementwise (``out`` may be ``a``)."""
    _OPS[getattr(op, "op", op)][0](a, b, out=out)
    return out


def finish_avg(tensor, op, size):
    """AVG is SUM followed by a division by the group size."""
    if getattr(op, "op", op) == ReduceOp.AVG:
        tensor.div_(size)
    return tensor


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """[(start, stop)] of ``parts`` nearly equal pieces (the first numel % parts are one longer)."""
    q, r = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < r else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def chunks(flat, parts: int):
    """Views of a 1-D tensor cut like ``torch.tensor_split(flat, parts)``."""
    return [flat[a:b] for a, b in chunk_bounds(flat.numel(), parts)]


@contextlib.contextmanager
def contiguous_flat(tensor):
    """Yield a contiguous 1-D view of ``tensor`` (a copy if it is not contiguous, written back after)."""
    if tensor.is_contiguous():
        yield tensor.view(-1)
    else:
        work = tensor.contiguous()
        yield work.view(-1)
        tensor.copy_(work)


@contextlib.contextmanager
def contiguous_flats(tensors):
    """:func:`contiguous_flat` for a list: contiguous 1-D views (copies written back after)."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(contiguous_flat(t)) for t in tensors]


# ----------------------------------------------------------------------------- counting


@dataclass
class TrafficCounter:
    """Payload bytes and messages this rank sent and received through our collectives."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    sent_to: dict = field(default_factory=lambda: defaultdict(int))  # group peer -> bytes

    def reset(self):
        self.bytes_sent = self.bytes_received = self.messages_sent = 0
        self.sent_to.clear()


# ----------------------------------------------------------------------------- the group


class Comm:
    """A process group seen from one rank: group ranks, counted point-to-point messages.

    ``Comm.of(group)`` is None on a rank outside ``group``: like torch.distributed,
    a collective called there returns at once and does nothing.
    """

    def __init__(self, group=None, counter: TrafficCounter | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: run inside course_lib.launch(fn, world_size)")
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the group")
        self.size = dist.get_world_size(group)
        self._peers = [compat.global_rank(group, r) for r in range(self.size)]
        self.counter = counter

    @staticmethod
    def outside(group) -> bool:
        """True on a rank that is not a member of ``group``."""
        return dist.is_initialized() and group is not None and dist.get_rank(group) < 0

    @classmethod
    def of(cls, group=None, counter: TrafficCounter | None = None):
        return None if cls.outside(group) else cls(group, counter)

    def group_rank(self, global_rank: int, what: str = "root") -> int:
        """The group rank of a global rank (torch's src/dst are global ranks)."""
        if not isinstance(global_rank, int) or isinstance(global_rank, bool):
            raise TypeError(f"{what} must be an int (a global rank), got {global_rank!r}")
        members = self._peers
        if global_rank not in members:
            raise ValueError(f"{what}={global_rank} is not a rank of this group (its global ranks: {members})")
        return members.index(global_rank)

    def isend(self, tensor, peer: int):
        """Start sending ``tensor`` (contiguous) to group rank ``peer``; returns the work handle."""
        if self.counter is not None:
            nbytes = tensor.numel() * tensor.element_size()
            self.counter.bytes_sent += nbytes
            self.counter.messages_sent += 1
            self.counter.sent_to[peer] += nbytes
        return dist.isend(tensor, self._peers[peer], group=self.group)

    def irecv(self, tensor, peer: int):
        if self.counter is not None:
            self.counter.bytes_received += tensor.numel() * tensor.element_size()
        return dist.irecv(tensor, self._peers[peer], group=self.group)

    def post_send(self, tensor, peer: int):
        """isend, or None for an empty tensor (nothing to send; the receiver skips it too)."""
        return self.isend(tensor, peer) if tensor.numel() else None

    def post_recv(self, tensor, peer: int):
        return self.irecv(tensor, peer) if tensor.numel() else None

    @staticmethod
    def wait(*works):
        for w in works:
            if w is not None:
                w.wait()

    def send(self, tensor, peer: int):
        if tensor.numel():
            self.isend(tensor, peer).wait()

    def recv(self, tensor, peer: int):
        if tensor.numel():
            self.irecv(tensor, peer).wait()

    def exchange(self, send=None, to: int | None = None, recv=None, frm: int | None = None):
        """Send ``send`` to ``to`` while receiving ``recv`` from ``frm``; return when both are done.

        Posting both before waiting is what keeps a ring from deadlocking:
        every rank sends right and receives left at the same time. Empty
        tensors are skipped on both sides (both sides know the sizes).
        """
        works = []
        if recv is not None and recv.numel():
            works.append(self.irecv(recv, frm))
        if send is not None and send.numel():
            works.append(self.isend(send, to))
        for w in works:
            w.wait()


# ----------------------------------------------------------------------------- one call


def span(name):
    """A trace span for one collective call (its name shows in a stuck rank's report)."""
    return trace.span(name, kind="comm")


def collective(name):
    """Decorator for a collective ``fn(..., group=None, ...)``: like torch.distributed, a
    rank outside ``group`` returns None at once; elsewhere ``fn`` runs in ``span(name)``."""
    def wrap(fn):
        at = list(inspect.signature(fn).parameters).index("group")   # where group sits positionally

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if Comm.outside(args[at] if len(args) > at else kwargs.get("group")):
                return None
            with span(name):
                return fn(*args, **kwargs)
        return call
    return wrap
