"""Count what a send/recv algorithm does inside a rank: messages, bytes and rounds.

    with MessageRounds() as w:          # inside a rank, around a collective built from send/recv
        ring_all_reduce(x)
    w.bytes_sent, w.messages, w.received, w.clock

The watch wraps torch.distributed's send / recv / isend / irecv (batch_isend_irecv goes through
them too) and stamps each message with a round number, a Lamport clock (Lamport 1978): a
rank's k-th send after it has seen round t is round t + k, so ``clock`` at the end is the
round in which the rank last sent or received. That is the latency term of the alpha-beta
model counted on the real program: a binomial tree finishes in ceil(log2 N) rounds, a chain
broadcast of k segments in (N-1) + (k-1), a ring all-reduce in 2(N-1). Each blocking wait
runs inside a trace span named after the call and the caller's line ("recv from rank 2,
called from ring_all_reduce() line 9"), so a hang reads as who waits for whom.
"""
from __future__ import annotations

import torch

# Side channel of the round stamps: a message on the learner's tag t has its stamp on tag
# _STAMP_TAG + t, so stamps pair with messages exactly as the messages pair (by peer and tag,
# in posting order), whatever order the learner posts receives of different tags in.
_STAMP_TAG = 1 << 20


class MessageRounds:
    """Inside a rank: count bytes sent and rounds, by wrapping torch.distributed's p2p calls.

    Nested calls (torch's ``send`` is ``isend().wait()`` in recent versions) are counted once.
    """

    def __init__(self, refuse=ValueError):
        self.refuse = refuse   # raised for a recv from any source (src=None): its stamp cannot be paired
        self.bytes_sent = 0
        self.messages = 0   # sent
        self.received = 0   # messages received
        self.clock = 0      # the round in which this rank last sent or received
        self._inside = False

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self._saved = {name: getattr(c10d, name) for name in ("send", "recv", "isend", "irecv")}
        orig, watch = self._saved, self

        def peer_of(args, kwargs, key):
            if len(args) > 1 and args[1] is not None:
                return args[1]
            return kwargs.get(key) if kwargs.get(key) is not None else kwargs.get(f"group_{key}")

        def stamp_tag(args, kwargs):  # send/recv/isend/irecv(tensor, peer, group, tag)
            tag = kwargs.get("tag", args[3] if len(args) > 3 else 0)
            return _STAMP_TAG + int(tag or 0)

        def sending(args, kwargs):
            tensor, dst = args[0], peer_of(args, kwargs, "dst")
            watch.bytes_sent += tensor.numel() * tensor.element_size()
            watch.clock += 1
            watch.messages += 1
            return dst, torch.tensor([watch.clock], dtype=torch.int64, device=tensor.device)

        def receiving(args, kwargs):
            src = peer_of(args, kwargs, "src")
            if src is None:
                raise watch.refuse("recv from any source (src=None) is not allowed here: name the rank you expect")
            watch.received += 1
            return src

        def send(*args, **kwargs):
            if watch._inside:
                return orig["send"](*args, **kwargs)
            dst, stamp = sending(args, kwargs)
            with watch._guard(), _waiting(f"send to rank {dst}"):
                out = orig["send"](*args, **kwargs)
                orig["send"](stamp, dst, tag=stamp_tag(args, kwargs))
            return out

        def recv(*args, **kwargs):
            if watch._inside:
                return orig["recv"](*args, **kwargs)
            src = receiving(args, kwargs)
            stamp = torch.zeros(1, dtype=torch.int64, device=(args[0] if args else kwargs['tensor']).device)
            with watch._guard(), _waiting(f"recv from rank {src}"):
                out = orig["recv"](*args, **kwargs)
                orig["recv"](stamp, src, tag=stamp_tag(args, kwargs))
            watch.clock = max(watch.clock, int(stamp))
            return out

        def isend(*args, **kwargs):
            if watch._inside:
                return orig["isend"](*args, **kwargs)
            dst, stamp = sending(args, kwargs)
            with watch._guard():
                work = orig["isend"](*args, **kwargs)
                stamp_work = orig["isend"](stamp, dst, tag=stamp_tag(args, kwargs))
                return _Both(work, stamp_work, None, watch, f"isend to rank {dst}")

        def irecv(*args, **kwargs):
            if watch._inside:
                return orig["irecv"](*args, **kwargs)
            src = receiving(args, kwargs)
            stamp = torch.zeros(1, dtype=torch.int64, device=(args[0] if args else kwargs['tensor']).device)
            with watch._guard():
                work = orig["irecv"](*args, **kwargs)
                stamp_work = orig["irecv"](stamp, src, tag=stamp_tag(args, kwargs))
                return _Both(work, stamp_work, stamp, watch, f"irecv from rank {src}")

        for name, fn in (("send", send), ("recv", recv), ("isend", isend), ("irecv", irecv)):
            fn.__name__ = name
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
        return self

    def _guard(self):
        import contextlib

        @contextlib.contextmanager
        def inside():
            self._inside = True
            try:
                yield
            finally:
                self._inside = False
        return inside()

    def __exit__(self, *exc):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for name, fn in self._saved.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
        return False


def _waiting(what):
    """A comm span named after the call and the innermost frame outside this file and torch."""
    import sys

    from course_lib import trace

    frame = sys._getframe(1)
    while frame is not None and ("torch" + "/distributed" in frame.f_code.co_filename
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    where = f", called from {frame.f_code.co_name}() line {frame.f_lineno}" if frame is not None else ""
    return trace.span(f"{what}{where}", kind="comm")


class _Both:
    """A work handle that also waits for the round stamp travelling with the message."""

    def __init__(self, work, stamp_work, stamp, watch, what):
        self._work, self._stamp_work, self._stamp, self._watch, self._what = work, stamp_work, stamp, watch, what

    def wait(self, *args, **kwargs):
        with _waiting(f"wait for {self._what}"):
            ok = self._work.wait(*args, **kwargs)
            self._stamp_work.wait()
        if self._stamp is not None:
            self._watch.clock = max(self._watch.clock, int(self._stamp))
        return ok

    def is_completed(self):
        return self._work.is_completed()

    def __bool__(self):
        return True

    def __getattr__(self, name):
        return getattr(self._work, name)


__all__ = ["MessageRounds"]
