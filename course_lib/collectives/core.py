"""What every from-scratch collective shares: the group, point-to-point messages
(counted), reduction operators, chunking, and the wrapper that traces each call.

* :class:`Comm` (in ``comm.py``) wraps a process group: ``rank``/``size`` inside the
  group, and ``exchange`` = post an isend and an irecv, wait for both. Every byte our
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

import torch
import torch.distributed as dist

from course_lib import trace
# The group object (counted point-to-point messages, and torch's collectives traced and
# measured); the algorithms build one per call with Comm.of(group, counter).
from course_lib.collectives.comm import Comm, TrafficCounter  # noqa: F401

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


def reduction(op):
    """The elementwise function of ``op``: ``f(a, b, out=out)`` sets out = a (op) b; what
    :func:`reduce_` calls, looked up once by an algorithm that reduces many segments."""
    return _OPS[getattr(op, "op", op)][0]


def finish_avg(tensor, op, size):
    """AVG is SUM followed by a division by the group size."""
    if getattr(op, "op", op) == ReduceOp.AVG:
        tensor.div_(size)
    return tensor


def chunks(flat, parts: int):
    """Views of a 1-D tensor in ``parts`` nearly equal pieces, the first numel % parts one
    element longer (``torch.tensor_split``: one call, not one Python slice per piece)."""
    return list(flat.tensor_split(parts))


class contiguous_flat:  # noqa: N801 (named and used as a function: ``with contiguous_flat(t) as flat``)
    """Yield a contiguous 1-D view of ``tensor`` (a copy if it is not contiguous, written back
    after, unless the body raised; a 1-D contiguous tensor is yielded as it is). A class, not a
    generator: every collective enters one, and a generator's context manager costs Python
    frames and, for a 1-D tensor, a view (chapter 2's 1 MiB ring: about 1% of its time)."""
    __slots__ = ("tensor", "work")

    def __init__(self, tensor):
        self.tensor, self.work = tensor, None

    def __enter__(self):
        tensor = self.tensor
        if tensor.is_contiguous():
            return tensor if tensor.dim() == 1 else tensor.view(-1)
        self.work = tensor.contiguous()
        return self.work.view(-1)

    def __exit__(self, kind, value, traceback):
        if self.work is not None and kind is None:
            self.tensor.copy_(self.work)
        return False


@contextlib.contextmanager
def contiguous_flats(tensors):
    """:func:`contiguous_flat` for a list: contiguous 1-D views (copies written back after)."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(contiguous_flat(t)) for t in tensors]




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
            group = args[at] if len(args) > at else kwargs.get("group")
            if group is not None and Comm.outside(group):   # (the default group holds every rank)
                return None
            with trace.recorder().span(name, "comm"):   # span(name), one call less: this runs per call
                return fn(*args, **kwargs)
        return call
    return wrap
