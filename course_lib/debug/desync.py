"""The desync check: before each collective, its members compare what they are about to do.

    launch(fn, 4, debug="desync")

Every collective through ``Comm`` first all-gathers, over the same group, a fixed-size
fingerprint of the call (op, shapes, dtypes, reduce op or root, group, and -- not compared --
the call site). One small exchange (``FINGERPRINT_BYTES`` per rank) per collective; off by
default. If the members disagree, every member raises :class:`DesyncError` (a ``ValueError``)
with the same message, naming each rank's call and the line of code that made it, *before*
the mismatched collective can hang, crash gloo or silently reduce garbage.

This is what ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does for torch.distributed's own calls (a
wrapper process group that checks each collective's op, shapes and dtypes with a helper
gloo group). Neither can see a rank that calls into *another* group instead: the members
then wait for it in the check itself, and the flight recorder's diagnosis explains the hang.
"""
from __future__ import annotations

import torch

from course_lib import compat
from course_lib.debug.flight_recorder import SHORT, comparable_shapes, shape_text

FINGERPRINT_BYTES = 256
_SITE = "\x1e"   # separates the compared part from the call site


class DesyncError(ValueError):
    """The members of a group are about to run different collectives."""
    launch_as = "ValueError"   # how the launcher re-raises it in the caller (a builtin type)


def fingerprint(op, tensors, extra, dim, ranks) -> str:
    """The part every member must agree on, as text (all-to-all: dim 0 sizes may differ)."""
    shapes = comparable_shapes(op, tuple(tuple(t.shape) for t in tensors))
    dtypes = ",".join(str(t.dtype).removeprefix("torch.") for t in tensors)
    return f"{SHORT.get(op, op)} {shape_text(shapes)} {dtypes} {extra}".strip() + f" on {dim or 'group'} {list(ranks)}"


def _encode(text: str, site: str, device="cpu") -> torch.Tensor:
    data = (text + _SITE + site).encode("utf-8", "replace")[:FINGERPRINT_BYTES]
    out = torch.zeros(FINGERPRINT_BYTES, dtype=torch.uint8, device="cpu")   # text is built on the host
    out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out.to(device)


def _decode(row: torch.Tensor) -> tuple:
    text = bytes(row.tolist()).rstrip(b"\0").decode("utf-8", "replace")
    what, _, site = text.partition(_SITE)
    return what, site


def mismatch_message(calls: list, seq: int | None = None) -> str:
    """``calls``: [(what, site)] in group-rank order -> the error every member raises ("" if they agree)."""
    if len({what for what, _ in calls}) == 1:
        return ""
    position = f" #{seq}" if seq is not None else ""
    lines = [f"desync: the members of a group are about to run different collectives (call{position} "
             f"on this group):"]
    lines += [f"  group rank {i}: {what}, called from {site or '?'}" for i, (what, site) in enumerate(calls)]
    return "\n".join(lines)


def check(comm, op, tensors, extra, site, entry=None):
    """All-gather this call's fingerprint over ``comm``'s group; raise DesyncError on a difference."""
    mine = _encode(fingerprint(op, tensors, extra, comm.dim, comm.ranks), site,
                   comm.backend_device)                  # NCCL: the fingerprints travel on the GPU
    rows = mine.new_empty(comm.size * FINGERPRINT_BYTES)
    compat.all_gather_into_tensor(rows, mine, group=comm.group)   # (size * 256,) bytes: one small exchange
    rows = rows.view(comm.size, FINGERPRINT_BYTES)
    seq = None
    if entry is not None:
        from course_lib.debug import flight_recorder
        rec = flight_recorder.recorder()
        seq = next((r.seq for r in reversed(rec.records()) if r.index == entry.index), None) if rec else None
    message = mismatch_message([_decode(row) for row in rows], seq)
    if message:
        if entry is not None:
            entry.complete()   # the check ended it: the diagnosis must not report a rank waiting here
        raise DesyncError(message)


__all__ = ["DesyncError", "check", "fingerprint", "mismatch_message", "FINGERPRINT_BYTES"]
