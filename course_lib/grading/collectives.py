"""Graders of chapter 1 (collectives): using torch.distributed's collectives and
point-to-point messages the way the chapter describes them, on 1 to 5 real ranks.

    check_ring_shift(fn)                # find the bug: fn(tensor) -> the left neighbour's tensor, no deadlock
    check_global_mean(fn)               # find the bug: fn(rows) -> the mean over every rank's rows
    check_all_reduce_from_halves(fn)    # fn(tensor): all-reduce as reduce-scatter + all-gather, any size
    check_bus_bandwidth(fn)             # fn(collective, n_bytes, world_size, seconds) -> busbw

Each prints one line (``ring_shift: 4/4 cases passed`` or the first failing case with a
hint) and returns True/False (in a notebook a failure raises, see :mod:`course_lib.grading`).
While the learner's function runs, what would do the exercise is switched off.
"""
from __future__ import annotations

import math

import torch

from course_lib.grading import Case, compare
from course_lib.grading.p2p import COLLECTIVES_LIBRARY, DTYPES, P2PWatch, bind, check_p2p, p2p_cases, rank_data, rank_info
from course_lib.grading.harness import check_answers, number, table
from course_lib.grading.training import CollectiveWatch

# the course's own collectives: an exercise on torch's may not hand the work to ours
COURSE_COLLECTIVES = COLLECTIVES_LIBRARY[:-2]  # without compat and torch


# ----------------------------------------------------------------------------- find the bug: a ring shift

def _ring_shift_harness(fn, numel, dtype, seed):
    r, N = rank_info()
    x = rank_data(seed, r, numel, dtype)
    sent = x.clone()
    with P2PWatch():
        got = fn(x)
    if not isinstance(got, torch.Tensor):
        return f"expected the tensor received from the left neighbour, got {type(got).__name__}"
    msg = compare(got, rank_data(seed, (r - 1) % N, numel, dtype), exact=True,
                  what=f"the tensor rank {r} received (rank {(r - 1) % N}'s)")
    if msg:
        return msg
    if not torch.equal(x, sent):
        return "the tensor this rank passed in was changed: receive into a new tensor"
    return None


def check_ring_shift(fn, timeout: float = 10.0) -> bool:
    """fn(tensor) on every rank returns the left neighbour's tensor (rank r gets rank r-1's),
    with blocking send/recv; 1 MiB tensors, so a blocking send waits for its receive."""
    cases = p2p_cases(lambda N: (1 << 18,))
    return check_p2p("ring_shift", bind(_ring_shift_harness, fn, COLLECTIVES_LIBRARY, exercise="the ring shift"),
                     cases, timeout)


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

    def differ(got, want, collective, n_bytes, world_size, seconds):
        if compare(float(got), float(want), dtype=torch.float64):   # one float64 formula: rounding only
            return (f"got {got / 1e9:.4g} GB/s, expected {want / 1e9:.4g} GB/s (algbw is "
                    f"{n_bytes / seconds / 1e9:.4g} GB/s: which fraction of n must the busiest rank move in this collective?)")
    return check_answers("bus_bandwidth", fn, table(_BUSBW_CASES, "{0}, n = {1:,} B, N = {2}, t = {3:g} s"),
                         lambda c, n, N, t: busbw(c, n, t, N), guard=("course_lib.costmodel:*",
                         "course_lib.costmodel.algorithms:*"), exercise="bus bandwidth", read=number, differ=differ)


# ----------------------------------------------------------------------------- find the bug: the logged mean
# (world size, rows in all, features, dtype): rows split by tensor_split, so sizes differ and a rank may have none
_MEAN_CASES = [(2, 40, 3, "float32"), (2, 37, 3, "float64"), (3, 50, 2, "float32"), (3, 2, 4, "float64"),
               (4, 45, 1, "float32"), (1, 5, 3, "float32")]


def _global_mean_harness(fn, rows, features, dtype, seed):
    r, N = rank_info()
    everything = torch.randn(rows, features, generator=torch.Generator().manual_seed(seed),
                             dtype=torch.float64).to(DTYPES[dtype])
    mine = everything.tensor_split(N)[r].clone()        # (rows_r, features), rows_r may be 0
    with CollectiveWatch() as watch:
        got = fn(mine)
    # a sum of all the rows in some order, then a division (course_lib.tolerance): rows + 1 roundings
    # of the mean of |x| per feature
    msg = compare(got, everything.double().mean(0).to(mine.dtype), dtype=mine.dtype, terms=rows + 1,
                  scale=float(everything.double().abs().mean(0).max()) if rows else 0.0,
                  what=f"the mean over all {rows} rows ({len(mine)} on this rank)")
    if msg:
        return msg
    moved = sum(nbytes for _, nbytes in watch.calls)
    limit = 2 * (features + 1) * 8
    if moved > limit:
        return (f"this rank passed {moved} bytes to collectives: the answer needs only a sum of {features} "
                f"numbers and a row count from each rank, never the rows themselves")
    return None


def check_global_mean(fn, timeout: float = 10.0) -> bool:
    """fn(rows) on every rank, rows (rows_r, features) with rows_r different per rank (maybe 0):
    returns the (features,) mean over every rank's rows, on every rank."""
    cases = [Case(dict(rows=n, features=f, dtype=dt, seed=i + 1), N,
                  f"{n} rows on {N} ranks ({', '.join(str(len(c)) for c in torch.arange(n).tensor_split(N))}), {dt}")
             for i, (N, n, f, dt) in enumerate(_MEAN_CASES)]
    return check_p2p("global_mean", bind(_global_mean_harness, fn, COURSE_COLLECTIVES, "course_lib.compat:all_reduce_avg",
                                         exercise="the global mean"), cases, timeout)


# ----------------------------------------------------------------------------- all-reduce from its two halves
def _halves_harness(fn, numel, dtype, seed, shape):
    r, N = rank_info()
    x = rank_data(seed, r, numel, dtype).reshape(shape)
    xs = torch.stack([rank_data(seed, q, numel, dtype) for q in range(N)]).double()   # (N, numel)
    want = xs.sum(0).to(x.dtype).reshape(shape)
    with CollectiveWatch() as watch:
        fn(x)
    # N ranks' values added in any order, + the expected value's own rounding: N + 1 terms of sum |x_i|
    msg = compare(x, want, dtype=x.dtype, terms=N + 1, scale=float(xs.abs().sum(0).max()),
                  what="tensor after all-reduce (in place)")
    if msg:
        return msg
    kinds = [k for k, _ in watch.calls]
    if N > 1 and sorted(kinds) != ["all_gather", "reduce_scatter"]:
        return (f"collectives called: {kinds or 'none'}; expected exactly one reduce-scatter and one "
                f"all-gather (pad the flat tensor to a multiple of the world size)")
    padded = math.ceil(numel / N) * N * x.element_size()
    too_big = [(k, b) for k, b in watch.calls if b > padded]
    if too_big:
        return (f"{too_big[0][0]} of {too_big[0][1]} bytes: pad to the next multiple of the world size only "
                f"({padded} bytes for {numel} elements on {N} ranks)")
    return None


_HALVES_CASES = [  # (world size, shape, dtype): sizes the world size does not divide, fewer elements than ranks
    (2, (4, 3), "float32"), (3, (7,), "float32"), (3, (2,), "int64"), (4, (3, 3), "float64"), (5, (11,), "int64"),
    (1, (3,), "float32")]


def check_all_reduce_from_halves(fn, timeout: float = 10.0) -> bool:
    """fn(tensor): in place SUM over ranks, as one reduce-scatter and one all-gather of torch's
    (course_lib.compat's), for any shape and any number of elements."""
    cases = [Case(dict(numel=math.prod(s), dtype=dt, seed=i + 1, shape=s), N, f"shape {s}, dtype={dt}")
             for i, (N, s, dt) in enumerate(_HALVES_CASES)]
    return check_p2p("all_reduce_from_halves", bind(_halves_harness, fn, COURSE_COLLECTIVES,
                                                    "torch.distributed.distributed_c10d:all_reduce",
                                                    "torch._C._distributed_c10d:ProcessGroup.allreduce",
                                                    "course_lib.compat:all_reduce_avg",
                                                    exercise="all-reduce from its two halves"), cases, timeout)


__all__ = ["check_ring_shift", "check_global_mean", "check_all_reduce_from_halves", "check_bus_bandwidth"]
