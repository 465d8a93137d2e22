"""What a learner's code sent, counted inside a rank: every ``torch.distributed`` call it made,
with its peer and the elements it moved, so a grader can constrain the communication
(the vocabulary loss must not move O(N V) values, a ring sends only to its neighbour).

    with counted_calls() as calls:             # inside a rank, around the learner's function
        learner_fn(...)
    calls.elements("all_reduce")               # values handed to all_reduce, summed over calls
    calls.peers("send")                        # {peer ranks this rank sent to}

The count wraps the functions of the ``torch.distributed`` module (``dist.all_reduce(...)``),
the spelling the exercises ask for. One record per top-level call: a collective that torch
implements with another (batch_isend_irecv with isend) is counted once.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

# op name -> which arguments are the tensors it moves (the largest counts): a gather's
# output is the whole gathered tensor, a reduce-scatter's input the whole reduced one
COUNTED = ("send", "isend", "recv", "irecv", "all_reduce", "all_gather", "all_gather_into_tensor",
           "reduce_scatter", "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all", "all_to_all_single",
           "gather", "scatter", "batch_isend_irecv", "all_gather_object", "broadcast_object_list",
           "send_object_list", "recv_object_list", "gather_object", "scatter_object_list")
POINT_TO_POINT = ("send", "isend", "recv", "irecv")


@dataclass
class Call:
    op: str
    elements: int                       # the largest tensor (or list of tensors) the call moves
    peer: int | None = None             # send/recv: the other rank (global)
    shape: tuple = ()


@dataclass
class CallLog:
    calls: list = field(default_factory=list)

    def of(self, *ops) -> list:
        return [c for c in self.calls if not ops or c.op in ops]

    def elements(self, *ops) -> int:
        return sum(c.elements for c in self.of(*ops))

    def peers(self, *ops) -> set:
        return {c.peer for c in self.of(*ops) if c.peer is not None}

    def ops(self) -> set:
        return {c.op for c in self.calls}


def _numel(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    if isinstance(x, (list, tuple)):
        return sum(_numel(t) for t in x)
    return 0


def _peer(op, args, kwargs):
    if op not in POINT_TO_POINT:
        return None
    for key in ("dst", "src", "group_dst", "group_src"):
        if kwargs.get(key) is not None:
            return int(kwargs[key])
    return int(args[1]) if len(args) > 1 and isinstance(args[1], int) else None


def _calls(op, args, kwargs) -> list:
    """The Calls one top-level ``op(*args, **kwargs)`` makes (a batch: one per message)."""
    if op == "batch_isend_irecv":
        return [Call("isend" if "send" in getattr(getattr(p2p, "op", None), "__name__", "") else "irecv",
                     p2p.tensor.numel(), getattr(p2p, "peer", None), tuple(p2p.tensor.shape))
                for p2p in (args[0] if args else kwargs.get("p2p_op_list", []))]
    tensors = list(args) + list(kwargs.values())
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    return [Call(op, max((_numel(t) for t in tensors), default=0), _peer(op, args, kwargs),
                 tuple(first.shape) if first is not None else ())]


@contextlib.contextmanager
def counted_calls(ops=COUNTED, record=None):
    """Count every ``torch.distributed.<op>`` call made inside the block (see the module doc);
    ``record(op, args, kwargs)``, if given, is called for each instead of the CallLog's Calls."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    log, depth, saved = CallLog(), [0], {}
    record = record or (lambda op, args, kwargs: log.calls.extend(_calls(op, args, kwargs)))

    def wrap(op, fn):
        def counted(*args, **kwargs):
            if depth[0] == 0:
                record(op, args, kwargs)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        counted.__name__ = fn.__name__
        return counted

    # both spellings: dist.isend is c10d.isend, and P2POp checks its op against c10d's names
    for op in ops:
        if hasattr(dist, op):
            saved[op] = getattr(dist, op)
            counted = wrap(op, saved[op])
            for module in (dist, c10d):
                if getattr(module, op, None) is saved[op]:
                    setattr(module, op, counted)
    try:
        yield log
    finally:
        for op, fn in saved.items():
            for module in (dist, c10d):
                if hasattr(module, op):
                    setattr(module, op, fn)


__all__ = ["Call", "CallLog", "counted_calls", "POINT_TO_POINT"]
