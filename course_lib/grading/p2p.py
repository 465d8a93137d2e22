"""What the graders of chapters 0-4 share in a rank: every point-to-point message watched
(:class:`course_lib.collectives.rounds.MessageRounds`: bytes, messages and rounds, so a
"broadcast" that waits for every segment before forwarding the first, or a "ring" that sends
the whole buffer around, is named as such), a deadlock reported as who waits for whom, in
which call, at which line; the ranks' data and the cases; ranks held to the same collective
calls (:class:`SameCollectives`), so a rank that skips one fails at once, not after a timeout.
"""
from __future__ import annotations

import functools
import math

import torch

from course_lib.collectives.rounds import MessageRounds
from course_lib.grading import Case, Mismatch, check_distributed, learner
from course_lib.grading.guard import TORCH_COLLECTIVES

# What would do a from-scratch collective for the learner: course_lib's algorithms and
# communication layer, and every torch collective (send / recv / isend / irecv stay).
COLLECTIVES_LIBRARY = ("course_lib.collectives:*", "course_lib.collectives.ring:*", "course_lib.collectives.tree:*",
                       "course_lib.collectives.naive:*", "course_lib.collectives.pairwise:*",
                       "course_lib.collectives.comm:*", "course_lib.compat:*", TORCH_COLLECTIVES)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}
P2PWatch = functools.partial(MessageRounds, refuse=Mismatch)   # a recv from any source: a hint


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


def too_many_bytes(w, N, numel, esize, phases, what):
    """A hint when this rank sent more than a ring's phases * (N-1) chunks of ceil(numel / N)."""
    limit = phases * (N - 1) * math.ceil(numel / N) * esize
    if w.bytes_sent > limit:
        formula = "2(N-1)/N x n" if phases == 2 else "(N-1)/N x n"
        return (f"this rank sent {w.bytes_sent} bytes; a ring {what} sends {formula} = about {limit} bytes "
                f"(n = {numel * esize} bytes, N = {N}): send one chunk of n/N per step, not the whole buffer")
    return None


class SameCollectives:
    """Inside a rank, around the learner's function: before each collective it starts, the ranks
    compare on a group of their own which call it is (op, elements), and a rank whose function
    returned says so; so a rank that skips a collective its peers make (a None gradient, no
    rows) is named at once instead of hanging its peers until the time limit."""

    OPS = {"all_reduce": 1, "broadcast": 2, "all_gather": 3, "all_gather_into_tensor": 4, "reduce_scatter": 5,
           "reduce_scatter_tensor": 6, "reduce": 7, "returned": 0}

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.world, self.calls, self.saved = dist.get_world_size(), 0, {}
        if self.world > 1:
            if not hasattr(self, "side"):   # made once, by every rank at the same point
                self.side, self.gather = dist.new_group(backend="gloo"), c10d.all_gather_into_tensor
            for op in self.OPS:
                if op != "returned":
                    self.saved[op] = getattr(dist, op)
                    setattr(dist, op, self._before(op, self.saved[op]))
        return self

    def _before(self, op, fn):
        def call(*args, **kwargs):
            tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self._agree(op, tensor.numel() if tensor is not None else 0)
            return fn(*args, **kwargs)
        return call

    def _agree(self, op, numel):
        self.calls += 1
        rows = torch.empty(self.world, 2, dtype=torch.int64)
        self.gather(rows.view(-1), torch.tensor([self.OPS[op], numel]), group=self.side)
        if not (rows == rows[0]).all():
            names = {code: name for name, code in self.OPS.items()}
            what = ", ".join(f"rank {r} had returned" if code == 0 else f"rank {r} {names[code]} of {n} elements"
                             for r, (code, n) in enumerate(rows.tolist()))
            raise Mismatch(f"deadlock or hang (caught before it): collective call #{self.calls}: {what}. Every "
                           f"rank must make the same collective calls, in the same order, with the same sizes")

    def __exit__(self, exc_type, *exc):
        import torch.distributed as dist

        for op, fn in self.saved.items():
            setattr(dist, op, fn)
        if self.saved and exc_type is None:
            self._agree("returned", 0)
        return False
