"""What the chapter 1-2 graders watch in a rank: every point-to-point message.

A :class:`P2PWatch` wraps torch.distributed's send / recv / isend / irecv in the rank
(batch_isend_irecv goes through them too) to count the bytes and messages each rank sends
and receives and to stamp each message with a round number (a Lamport clock: a rank's k-th
send after it has seen round t is round t + k), so a "broadcast" that waits for every
segment before forwarding the first, or a "ring" that sends the whole buffer around, is
named as such; a deadlock is reported as who waits for whom, in which call, at which line.

    with P2PWatch() as w:
        fn(x)
    w.bytes_sent, w.messages, w.received, w.clock
"""
from __future__ import annotations

import math

import torch

from course_lib.grading import Case, Mismatch, check_distributed, learner
from course_lib.grading.guard import TORCH_COLLECTIVES

# What would do a from-scratch collective for the learner: course_lib's algorithms and
# communication layer, and every torch collective (send / recv / isend / irecv stay).
COLLECTIVES_LIBRARY = ("course_lib.collectives:*", "course_lib.collectives.ring:*", "course_lib.collectives.tree:*",
                       "course_lib.collectives.naive:*", "course_lib.collectives.pairwise:*",
                       "course_lib.collectives.comm:*", "course_lib.compat:*", TORCH_COLLECTIVES)

# Side channel of the round stamps: a message on the learner's tag t has its stamp on tag
# _STAMP_TAG + t, so stamps pair with messages exactly as the messages pair (by peer and tag,
# in posting order), whatever order the learner posts receives of different tags in.
_STAMP_TAG = 1 << 20


class P2PWatch:
    """Inside a rank: count bytes sent and rounds, by wrapping torch.distributed's p2p calls.

    Each blocking wait runs inside a trace span named after the call and the
    learner's line ("recv from rank 2, called from ring_all_reduce() line 9"), so
    a deadlock report says who waits for whom. Nested calls (torch's ``send`` is
    ``isend().wait()`` in recent versions) are counted once.
    """

    def __init__(self):
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

        def passthrough(name):
            def call(*args, **kwargs):
                return orig[name](*args, **kwargs)
            return call

        def stamp_tag(args, kwargs):  # send/recv/isend/irecv(tensor, peer, group, tag)
            tag = kwargs.get("tag", args[3] if len(args) > 3 else 0)
            return _STAMP_TAG + int(tag or 0)

        def sending(args, kwargs):
            tensor, dst = args[0], peer_of(args, kwargs, "dst")
            watch.bytes_sent += tensor.numel() * tensor.element_size()
            watch.clock += 1
            watch.messages += 1
            return dst, torch.tensor([watch.clock], dtype=torch.int64)

        def receiving(args, kwargs):
            src = peer_of(args, kwargs, "src")
            if src is None:
                raise Mismatch("recv from any source (src=None) is not allowed here: name the rank you expect")
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
            stamp = torch.zeros(1, dtype=torch.int64)
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
            stamp = torch.zeros(1, dtype=torch.int64)
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


def deadlock_hint(exc) -> str:
    """One line from a LaunchTimeout: who waits in which call (the span the watch opened)."""
    parts = []
    for rank, what in exc.stuck.items():
        span = what.split("in span '", 1)[1].split(" [comm]'", 1)[0] if "in span '" in what else what
        parts.append(f"rank {rank} waits in {span}")
    return ("deadlock: " + "; ".join(parts) + ". Each recv needs a matching send that is not itself stuck "
            "waiting: post isend and irecv first, then wait")


def check_p2p(name, harness, cases, timeout):
    """check_distributed, with the watch's deadlock hint (which call, which peer, which line)."""
    return check_distributed(name, harness, cases, timeout, on_timeout=deadlock_hint)


# ----------------------------------------------------------------------------- data

DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}


def rank_data(seed, rank, numel, dtype):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if DTYPES[dtype].is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(DTYPES[dtype])
    return torch.randint(-100, 100, (numel,), generator=g)


def sum_of(seed, world, numel, dtype):
    """The ranks' rank_data summed exactly (float64, or integers), in rank_data's dtype."""
    xs = torch.stack([rank_data(seed, q, numel, dtype) for q in range(world)])
    return xs.double().sum(0).to(xs.dtype) if xs.is_floating_point() else xs.sum(0)


def sum_bounds(seed, world, numel, dtype, part=slice(None)):
    """``compare``'s bound for ``sum_of`` (elements ``part``), as course_lib.tolerance derives it:
    ``world`` values added in any order, + the expected value's own rounding to ``dtype``, so
    world + 1 roundings of sum |x_i|. Integers compare exactly whatever this says."""
    terms = torch.stack([rank_data(seed, q, numel, dtype) for q in range(world)]).double().abs().sum(0)[part]
    return dict(dtype=DTYPES[dtype], terms=world + 1, scale=float(terms.max()) if terms.numel() else 0.0)


def p2p_cases(sizes_for, dtypes=("float32",)):
    """World sizes 2..5, sizes that world_size does not divide (and a tiny one)."""
    out = []
    for i, N in enumerate((2, 3, 4, 5)):
        for numel in sizes_for(N):
            dtype = dtypes[(i + numel) % len(dtypes)]
            out.append(Case(dict(numel=numel, dtype=dtype, seed=len(out) + 1), N, f"numel={numel}, dtype={dtype}"))
    return out


def rank_info():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()



def bind(h, fn, *targets, exercise: str):
    """The harness ``h`` with the learner's ``fn`` as its first argument, guarded: in the rank,
    ``targets`` are switched off while fn runs (shipped by value)."""
    def run(**params):
        return h(learner(fn, *targets, exercise=exercise), **params)
    return run


def budget(N, numel, esize, phases):
    """Bytes a ring sends per rank: phases * (N-1) chunks of at most ceil(numel / N) elements."""
    return phases * (N - 1) * math.ceil(numel / N) * esize


def too_many_bytes(w, N, numel, esize, phases, what):
    limit = budget(N, numel, esize, phases)
    if w.bytes_sent > limit:
        formula = "2(N-1)/N x n" if phases == 2 else "(N-1)/N x n"
        return (f"this rank sent {w.bytes_sent} bytes; a ring {what} sends {formula} = about {limit} bytes "
                f"(n = {numel * esize} bytes, N = {N}): send one chunk of n/N per step, not the whole buffer")
    return None
