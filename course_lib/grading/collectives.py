"""Graders of chapters 1-2: a learner's collectives, run on 2, 3, 4 and 5 real ranks
with sizes the world size does not divide, plus the alpha-beta fit.

    check_pipelined_broadcast(fn)             # fn(tensor, src, segments): chain, segments pipelined
    check_ring_all_reduce(ring_all_reduce)    # fn(tensor): in place SUM, 2(N-1)/N n bytes per rank
    check_ring_reduce_scatter(fn)             # fn(output, input): output <- sum of piece rank
    check_ring_all_gather(fn)                 # fn(output, input): output <- all inputs, rank order
    check_all_reduce_composed(fn)             # fn(tensor): reduce-scatter then all-gather, any size
    check_fit_alpha_beta(fn)                  # fn([(n_bytes, world_size, seconds)]) -> (alpha, beta)

Each prints one line (``ring_all_reduce: 8/8 cases passed`` or the first failing
case with a hint) and returns True/False. Beyond the values, the graders watch
the learner's messages: a :class:`P2PWatch` wraps torch.distributed's send /
recv / isend / irecv in the rank (batch_isend_irecv goes through them too) to
count the bytes each rank sends and to stamp each message with a round number
(a Lamport clock: a rank's k-th send after it has seen round t is round t + k),
so a "broadcast" that waits for every segment before forwarding the first, or a "ring"
that sends the whole buffer around, is named as such.
"""
from __future__ import annotations

import math

import torch

from course_lib.grading import Case, Mismatch, check, compare

_STAMP_TAG = 31337  # side channel of the round stamps; learners use tag 0


class P2PWatch:
    """Inside a rank: count bytes sent and rounds, by wrapping torch.distributed's p2p calls.

    Each blocking wait runs inside a trace span named after the call and the
    learner's line ("recv from rank 2, called from ring_all_reduce() line 9"), so
    a deadlock report says who waits for whom. Nested calls (torch's ``send`` is
    ``isend().wait()`` in recent versions) are counted once.
    """

    def __init__(self):
        self.bytes_sent = 0
        self.messages = 0
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
            return src

        def send(*args, **kwargs):
            if watch._inside:
                return orig["send"](*args, **kwargs)
            dst, stamp = sending(args, kwargs)
            with watch._guard(), _waiting(f"send to rank {dst}"):
                out = orig["send"](*args, **kwargs)
                orig["send"](stamp, dst, tag=_STAMP_TAG)
            return out

        def recv(*args, **kwargs):
            if watch._inside:
                return orig["recv"](*args, **kwargs)
            src = receiving(args, kwargs)
            stamp = torch.zeros(1, dtype=torch.int64)
            with watch._guard(), _waiting(f"recv from rank {src}"):
                out = orig["recv"](*args, **kwargs)
                orig["recv"](stamp, src, tag=_STAMP_TAG)
            watch.clock = max(watch.clock, int(stamp))
            return out

        def isend(*args, **kwargs):
            if watch._inside:
                return orig["isend"](*args, **kwargs)
            dst, stamp = sending(args, kwargs)
            with watch._guard():
                work = orig["isend"](*args, **kwargs)
                return _Both(work, orig["isend"](stamp, dst, tag=_STAMP_TAG), None, watch, f"isend to rank {dst}")

        def irecv(*args, **kwargs):
            if watch._inside:
                return orig["irecv"](*args, **kwargs)
            src = receiving(args, kwargs)
            stamp = torch.zeros(1, dtype=torch.int64)
            with watch._guard():
                work = orig["irecv"](*args, **kwargs)
                return _Both(work, orig["irecv"](stamp, src, tag=_STAMP_TAG), stamp, watch, f"irecv from rank {src}")

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


def _deadlock_hint(exc) -> str:
    """One line from a LaunchTimeout: who waits in which call (the span the watch opened)."""
    parts = []
    for rank, what in exc.stuck.items():
        span = what.split("in span '", 1)[1].split(" [comm]'", 1)[0] if "in span '" in what else what
        parts.append(f"rank {rank} waits in {span}")
    return ("deadlock: " + "; ".join(parts) + ". Each recv needs a matching send that is not itself stuck "
            "waiting: post isend and irecv first, then wait")


def _check_distributed(name, harness, cases, timeout):
    """check_distributed, with the watch's deadlock hint (which call, which peer, which line)."""
    from course_lib.launch import LaunchTimeout, launch

    def run_case(case):
        try:
            results = launch(harness, case.world_size, timeout=timeout, quiet=True, **case.params)
        except LaunchTimeout as exc:
            return _deadlock_hint(exc)
        for rank, outcome in enumerate(results):
            if outcome is not None and outcome is not True:
                return f"rank {rank}: {outcome}"
        return None

    return check(name, cases, run_case)


# ----------------------------------------------------------------------------- data

DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}


def _data(seed, rank, numel, dtype):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if DTYPES[dtype].is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(DTYPES[dtype])
    return torch.randint(-100, 100, (numel,), generator=g)


def _sum_of(seed, world, numel, dtype):
    return torch.stack([_data(seed, q, numel, dtype) for q in range(world)]).sum(0)


def _cases(sizes_for, dtypes=("float32",)):
    """World sizes 2..5, sizes that world_size does not divide (and a tiny one)."""
    out = []
    for i, N in enumerate((2, 3, 4, 5)):
        for numel in sizes_for(N):
            dtype = dtypes[(i + numel) % len(dtypes)]
            out.append(Case(dict(numel=numel, dtype=dtype, seed=len(out) + 1), N, f"numel={numel}, dtype={dtype}"))
    return out


def _rank_info():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


# ----------------------------------------------------------------------------- broadcast


def _chain_broadcast_harness(fn, numel, dtype, seed, src, segments):
    r, N = _rank_info()
    want = _data(seed, src, numel, dtype)
    x = want.clone() if r == src else torch.full((numel,), -7, dtype=DTYPES[dtype])
    with P2PWatch() as w:
        fn(x, src, segments)
    msg = compare(x, want, rtol=0, atol=0, what=f"tensor after broadcast from rank {src}")
    if msg:
        return msg
    v = (r - src) % N                                   # position in the chain, the root is 0
    last = v == N - 1
    want_messages, want_bytes = (0, 0) if last else (segments, numel * x.element_size())
    if (w.messages, w.bytes_sent) != (want_messages, want_bytes):
        role = "the last rank of the chain" if last else f"position {v} of the chain"
        return (f"rank {r} ({role}) sent {w.messages} messages, {w.bytes_sent} bytes; expected "
                f"{want_messages} messages, {want_bytes} bytes: every rank but the last passes each of the "
                f"{segments} segments (tensor.view(-1).tensor_split(segments)) once, to the next rank")
    rounds = max(N - 1, 0) + segments - 1
    if w.clock > rounds:
        return (f"rank {r} was still sending or receiving in round {w.clock}: not pipelined. With "
                f"{segments} segments on {N} ranks the last segment arrives in round (N-1) + (segments-1) = "
                f"{rounds}: forward each segment as soon as it has arrived, before waiting for the next")
    return None


_CHAIN_CASES = [  # (world_size, numel, dtype, src, segments): roots other than 0, sizes segments do not divide
    (1, 5, "float32", 0, 2), (2, 7, "float32", 1, 3), (3, 10, "int64", 2, 4),
    (4, 9, "float32", 1, 3), (5, 11, "int64", 3, 4), (5, 6, "float32", 2, 1),
]


def check_pipelined_broadcast(fn, timeout: float = 30.0) -> bool:
    """fn(tensor, src, segments): in place, along the chain src -> src+1 -> ... (mod N), in
    ``segments`` pieces, each forwarded as soon as it arrives."""
    cases = [Case(dict(numel=n, dtype=dt, seed=i + 1, src=src, segments=k), N,
                  f"world_size={N}, numel={n}, dtype={dt}, src={src}, segments={k}")
             for i, (N, n, dt, src, k) in enumerate(_CHAIN_CASES)]
    return _check_distributed("pipelined_broadcast", _harness(_chain_broadcast_harness, fn), cases, timeout)


def _harness(h, fn):
    """Bind the learner's function as the harness's first argument (shipped by value)."""
    def run(**params):
        return h(fn, **params)
    return run


# ----------------------------------------------------------------------------- all-reduce family


def _budget(N, numel, esize, phases):
    """Bytes a ring sends per rank: phases * (N-1) chunks of at most ceil(numel / N) elements."""
    return phases * (N - 1) * math.ceil(numel / N) * esize


def _too_many_bytes(w, N, numel, esize, phases, what):
    limit = _budget(N, numel, esize, phases)
    if w.bytes_sent > limit:
        formula = "2(N-1)/N x n" if phases == 2 else "(N-1)/N x n"
        return (f"this rank sent {w.bytes_sent} bytes; a ring {what} sends {formula} = about {limit} bytes "
                f"(n = {numel * esize} bytes, N = {N}): send one chunk of n/N per step, not the whole buffer")
    return None


def _all_reduce_harness(fn, numel, dtype, seed):
    r, N = _rank_info()
    x = _data(seed, r, numel, dtype)
    with P2PWatch() as w:
        fn(x)
    msg = compare(x, _sum_of(seed, N, numel, dtype).to(x.dtype), rtol=1e-4, atol=1e-5, what="tensor after all-reduce")
    return msg or _too_many_bytes(w, N, numel, x.element_size(), 2, "all-reduce")


def check_ring_all_reduce(fn, timeout: float = 30.0) -> bool:
    cases = _cases(lambda N: (2 * N + 1, 1), dtypes=("float32", "int64"))
    return _check_distributed("ring_all_reduce", _harness(_all_reduce_harness, fn), cases, timeout)


def _reduce_scatter_harness(fn, numel, dtype, seed):
    r, N = _rank_info()
    full = _data(seed, r, numel * N, dtype)
    out = torch.full((numel,), -7, dtype=full.dtype)
    with P2PWatch() as w:
        fn(out, full.clone())
    want = _sum_of(seed, N, numel * N, dtype).to(full.dtype)[r * numel:(r + 1) * numel]
    msg = compare(out, want, rtol=1e-4, atol=1e-5, what=f"output (piece {r} of the sum)")
    return msg or _too_many_bytes(w, N, numel * N, full.element_size(), 1, "reduce-scatter")


def check_ring_reduce_scatter(fn, timeout: float = 30.0) -> bool:
    cases = _cases(lambda N: (3,), dtypes=("float32", "int64"))
    return _check_distributed("ring_reduce_scatter", _harness(_reduce_scatter_harness, fn), cases, timeout)


def _all_gather_harness(fn, numel, dtype, seed):
    r, N = _rank_info()
    out = torch.full((numel * N,), -7, dtype=DTYPES[dtype])
    with P2PWatch() as w:
        fn(out, _data(seed, r, numel, dtype))
    want = torch.cat([_data(seed, q, numel, dtype) for q in range(N)])
    msg = compare(out, want, what="output (every rank's input, in rank order)")
    return msg or _too_many_bytes(w, N, numel * N, out.element_size(), 1, "all-gather")


def check_ring_all_gather(fn, timeout: float = 30.0) -> bool:
    cases = _cases(lambda N: (3,), dtypes=("float32", "int64"))
    return _check_distributed("ring_all_gather", _harness(_all_gather_harness, fn), cases, timeout)


def check_all_reduce_composed(fn, timeout: float = 30.0) -> bool:
    cases = _cases(lambda N: (2 * N + 1, 1), dtypes=("float32", "int64"))
    return _check_distributed("all_reduce_composed", _harness(_all_reduce_harness, fn), cases, timeout)


# ----------------------------------------------------------------------------- alpha-beta fit


def _fit_cases():
    from course_lib import costmodel

    cases = []
    grids = [((4 << 10, 64 << 10, 1 << 20, 16 << 20), (2, 4, 8)), ((8 << 10, 1 << 20), (3, 5))]
    for alpha, beta, noise in ((50e-6, 1e-9, 0.0), (20e-6, 2.5e-10, 0.1), (200e-6, 5e-9, 0.05)):
        for sizes, worlds in grids:
            rows, k = [], 0
            for n in sizes:
                for N in worlds:
                    k += 1
                    wobble = 1 + noise * (1 if k % 2 else -1) * ((k % 3) / 2)
                    rows.append((n, N, costmodel.ring_all_reduce(n, N, alpha, beta) * wobble))
            cases.append(Case(dict(rows=rows), 1, f"alpha={alpha * 1e6:g} us, beta={beta * 1e9:g} ns/B, "
                                                   f"noise={noise:.0%}, {len(rows)} points on world_sizes "
                                                   f"{'/'.join(map(str, worlds))}"))
    return cases


def check_fit_alpha_beta(fn) -> bool:
    from course_lib import costmodel

    def run_case(case):
        rows = case.params["rows"]
        got = fn([tuple(r) for r in rows])
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            return f"return (alpha, beta), got {got!r}"
        ref = costmodel.fit_alpha_beta([("ring_all_reduce", n, N, t) for n, N, t in rows], relative=True)
        return (compare(float(got[0]), ref.alpha, rtol=0.02, atol=1e-9, what="alpha")
                or compare(float(got[1]), ref.beta, rtol=0.02, atol=1e-14, what="beta"))

    return check("fit_alpha_beta", _fit_cases(), run_case)


# ----------------------------------------------------------------------------- find the bug: a ring shift

def _ring_shift_harness(fn, numel, dtype, seed):
    r, N = _rank_info()
    x = _data(seed, r, numel, dtype)
    sent = x.clone()
    with P2PWatch():
        got = fn(x)
    if not isinstance(got, torch.Tensor):
        return f"expected the tensor received from the left neighbour, got {type(got).__name__}"
    msg = compare(got, _data(seed, (r - 1) % N, numel, dtype), rtol=0, atol=0,
                  what=f"the tensor rank {r} received (rank {(r - 1) % N}'s)")
    if msg:
        return msg
    if not torch.equal(x, sent):
        return "the tensor this rank passed in was changed: receive into a new tensor"
    return None


def check_ring_shift(fn, timeout: float = 20.0) -> bool:
    """fn(tensor) on every rank returns the left neighbour's tensor (rank r gets rank r-1's),
    with blocking send/recv; 1 MiB tensors, so a blocking send waits for its receive."""
    cases = _cases(lambda N: (1 << 18,))
    return _check_distributed("ring_shift", _harness(_ring_shift_harness, fn), cases, timeout)


# ----------------------------------------------------------------------------- bus bandwidth

_BUSBW_CASES = [  # (collective, n_bytes, world_size, seconds): the nccl-tests convention decides
    ("all_reduce", 64 << 20, 8, 2.5e-3), ("all_reduce", 1 << 20, 2, 4e-4), ("all_gather", 256 << 20, 16, 0.02),
    ("reduce_scatter", 3 << 20, 3, 1e-3), ("broadcast", 8 << 20, 4, 3e-3), ("all_to_all", 16 << 20, 8, 0.01),
    ("all_reduce", 4 << 10, 1, 1e-5),
]


def check_bus_bandwidth(fn) -> bool:
    """fn(collective, n_bytes, world_size, seconds) -> busbw in bytes per second, for all_reduce,
    all_gather, reduce_scatter, broadcast and all_to_all (n = the whole buffer, as nccl-tests)."""
    from course_lib.costmodel import busbw

    def run_case(case):
        got = fn(*case.params["args"])
        want = busbw(*case.params["args"][:2], case.params["args"][3], case.params["args"][2])
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
            return f"expected bytes per second as a number, got {got!r}"
        if not math.isclose(got, want, rel_tol=1e-9):
            algbw = case.params["args"][1] / case.params["args"][3]
            return (f"got {got / 1e9:.4g} GB/s, expected {want / 1e9:.4g} GB/s (algbw is {algbw / 1e9:.4g} GB/s: "
                    f"which fraction of n must the busiest rank move in this collective?)")
        return None
    cases = [Case({"args": c}, label=f"{c[0]}, n = {c[1]:,} B, N = {c[2]}, t = {c[3]:g} s") for c in _BUSBW_CASES]
    return check("bus_bandwidth", cases, run_case)


__all__ = ["P2PWatch", "check_pipelined_broadcast", "check_ring_all_reduce", "check_ring_reduce_scatter",
           "check_ring_all_gather", "check_all_reduce_composed", "check_fit_alpha_beta", "check_bus_bandwidth",
           "check_ring_shift"]
