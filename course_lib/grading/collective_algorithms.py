"""Graders of chapter 2 (collective algorithms): a learner's collectives built from
send and receive, run on 1 to 5 real ranks with sizes the world size does not divide,
roots other than 0 and integer dtypes; the messages are watched (:mod:`.p2p`): bytes,
messages and rounds, so a ring that sends the whole buffer, a "tree" that is a chain or a
broadcast that is not pipelined is named as such. While the learner's function runs,
course_lib's collectives and every torch collective are switched off (send/recv stay).

    check_pipelined_broadcast(fn)             # fn(tensor, src, segments): chain, segments pipelined
    check_tree_broadcast(fn)                  # fn(tensor, src): binomial tree, ceil(log2 N) rounds
    check_tree_reduce(fn)                     # fn(tensor, dst): binomial tree SUM onto dst
    check_ring_all_reduce(ring_all_reduce)    # fn(tensor): in place SUM, 2(N-1)/N n bytes per rank
    check_ring_reduce_scatter(fn)             # fn(output, input): output <- sum of piece rank
    check_ring_all_gather(fn)                 # fn(output, input): output <- all inputs, rank order
    check_all_reduce_composed(fn)             # fn(tensor): reduce-scatter then all-gather, any size
    check_fit_alpha_beta(fn)                  # fn([(n_bytes, world_size, seconds)]) -> (alpha, beta)
"""
from __future__ import annotations

import itertools

import torch

from course_lib.grading import Case, Mismatch, compare
from course_lib.grading.harness import check_answers
from course_lib.grading.p2p import (COLLECTIVES_LIBRARY, DTYPES, P2PWatch, bind, check_p2p, p2p_cases, rank_data,
                                    rank_info, sum_bounds, sum_of, too_many_bytes)


def _table_cases(rows, *keys):
    """Cases from rows (world_size, numel, dtype, *values of ``keys``), seeds 1, 2, ...:
    roots other than 0, sizes nothing divides, world sizes not powers of two."""
    return [Case(dict(numel=n, dtype=dt, seed=i + 1, **dict(zip(keys, rest))), N,
                 ", ".join([f"world_size={N}", f"numel={n}", f"dtype={dt}"] + [f"{k}={v}" for k, v in zip(keys, rest)]))
            for i, (N, n, dt, *rest) in enumerate(rows)]


def _p2p_check(name, harness, cases, exercise, doc=None):
    """``check_<name>(fn, timeout=10.0)``: ``harness`` on ``cases`` with the learner's fn guarded."""
    def check_it(fn, timeout: float = 10.0) -> bool:
        return check_p2p(name, bind(harness, fn, COLLECTIVES_LIBRARY, exercise=exercise), cases, timeout)
    check_it.__name__, check_it.__qualname__, check_it.__doc__ = f"check_{name}", f"check_{name}", doc
    return check_it


# ----------------------------------------------------------------------------- broadcast


def _broadcast(fn, numel, dtype, seed, src, *args):
    """(rank, world, the tensor, the watch, a mismatch or None) after fn(tensor, src, *args)."""
    r, N = rank_info()
    want = rank_data(seed, src, numel, dtype)
    x = want.clone() if r == src else torch.full((numel,), -7, dtype=DTYPES[dtype])
    with P2PWatch() as w:
        fn(x, src, *args)
    return r, N, x, w, compare(x, want, exact=True, what=f"tensor after broadcast from rank {src}")


def _chain_broadcast_harness(fn, numel, dtype, seed, src, segments):
    r, N, x, w, msg = _broadcast(fn, numel, dtype, seed, src, segments)
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


check_pipelined_broadcast = _p2p_check(  # (world_size, numel, dtype, src, segments): segments do not divide
    "pipelined_broadcast", _chain_broadcast_harness, _table_cases([
        (1, 5, "float32", 0, 2), (2, 7, "float32", 1, 3), (3, 10, "int64", 2, 4),
        (4, 9, "float32", 1, 3), (5, 11, "int64", 3, 4), (5, 6, "float32", 2, 1)], "src", "segments"),
    "the pipelined chain", """fn(tensor, src, segments): in place, along the chain src -> src+1 -> ... (mod N),
    in ``segments`` pieces, each forwarded as soon as it arrives.""")


def _all_reduce_harness(fn, numel, dtype, seed):
    r, N = rank_info()
    x = rank_data(seed, r, numel, dtype)
    with P2PWatch() as w:
        fn(x)
    msg = compare(x, sum_of(seed, N, numel, dtype), what="tensor after all-reduce", **sum_bounds(seed, N, numel, dtype))
    return msg or too_many_bytes(w, N, numel, x.element_size(), 2, "all-reduce")


_ALL_REDUCE_CASES = p2p_cases(lambda N: (2 * N + 1, 1), dtypes=("float32", "int64"))
check_ring_all_reduce = _p2p_check("ring_all_reduce", _all_reduce_harness, _ALL_REDUCE_CASES, "the ring",
                                   "fn(tensor): in place SUM over ranks, 2(N-1)/N n bytes sent per rank.")
check_all_reduce_composed = _p2p_check("all_reduce_composed", _all_reduce_harness, _ALL_REDUCE_CASES,
                                       "all-reduce from your two halves",
                                       "fn(tensor): in place SUM, as your reduce-scatter then your all-gather.")


def _reduce_scatter_harness(fn, numel, dtype, seed):
    r, N = rank_info()
    full = rank_data(seed, r, numel * N, dtype)
    out = torch.full((numel,), -7, dtype=full.dtype)
    with P2PWatch() as w:
        fn(out, full.clone())
    want = sum_of(seed, N, numel * N, dtype)[r * numel:(r + 1) * numel]
    msg = compare(out, want, what=f"output (piece {r} of the sum)",
                  **sum_bounds(seed, N, numel * N, dtype, slice(r * numel, (r + 1) * numel)))
    return msg or too_many_bytes(w, N, numel * N, full.element_size(), 1, "reduce-scatter")


check_ring_reduce_scatter = _p2p_check("ring_reduce_scatter", _reduce_scatter_harness,
                                       p2p_cases(lambda N: (3,), dtypes=("float32", "int64")),
                                       "the ring reduce-scatter", "fn(output, input): output <- sum of piece rank.")


def _all_gather_harness(fn, numel, dtype, seed):
    r, N = rank_info()
    out = torch.full((numel * N,), -7, dtype=DTYPES[dtype])
    with P2PWatch() as w:
        fn(out, rank_data(seed, r, numel, dtype))
    want = torch.cat([rank_data(seed, q, numel, dtype) for q in range(N)])
    msg = compare(out, want, exact=True, what="output (every rank's input, in rank order)")
    return msg or too_many_bytes(w, N, numel * N, out.element_size(), 1, "all-gather")


check_ring_all_gather = _p2p_check("ring_all_gather", _all_gather_harness,
                                   p2p_cases(lambda N: (3,), dtypes=("float32", "int64")),
                                   "the ring all-gather", "fn(output, input): output <- all inputs, rank order.")


# ----------------------------------------------------------------------------- alpha-beta fit


def _fit_cases():
    from course_lib import costmodel

    cases = []
    grids = [((4 << 10, 64 << 10, 1 << 20, 16 << 20), (2, 4, 8)), ((8 << 10, 1 << 20), (3, 5))]
    for alpha, beta, noise in ((50e-6, 1e-9, 0.0), (20e-6, 2.5e-10, 0.1), (200e-6, 5e-9, 0.05)):
        for sizes, worlds in grids:
            wobble = [1 + noise * (1 if k % 2 else -1) * ((k % 3) / 2) for k in range(1, len(sizes) * len(worlds) + 1)]
            rows = [(n, N, costmodel.ring_all_reduce(n, N, alpha, beta) * w)
                    for w, (n, N) in zip(wobble, itertools.product(sizes, worlds))]
            cases.append(Case(dict(args=(rows,)), 1, f"alpha={alpha * 1e6:g} us, beta={beta * 1e9:g} ns/B, "
                                                   f"noise={noise:.0%}, {len(rows)} points on world_sizes "
                                                   f"{'/'.join(map(str, worlds))}"))
    return cases


def check_fit_alpha_beta(fn) -> bool:
    from course_lib import costmodel

    def read(got, rows):
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise Mismatch(f"return (alpha, beta), got {got!r}")
        return got

    # a fit of noisy measurements, not one computation done two ways: no rounding bound applies.
    # 2% is the stated agreement with the reference fit (the noise of the cases is 5-10%), the
    # atol a floor far below any alpha (1 ns) or beta (1e-14 s/B) of the cases
    return check_answers(
        "fit_alpha_beta", fn, _fit_cases(),
        lambda rows: costmodel.fit_alpha_beta([("ring_all_reduce", n, N, t) for n, N, t in rows], relative=True),
        guard=("course_lib.costmodel:*", "course_lib.costmodel.fit:*", "course_lib.costmodel.algorithms:*"),
        exercise="the least-squares fit", seconds=20, read=read,
        differ=lambda got, ref, rows: (compare(float(got[0]), ref.alpha, rtol=0.02, atol=1e-9, what="alpha")
                                       or compare(float(got[1]), ref.beta, rtol=0.02, atol=1e-14, what="beta")))


# ----------------------------------------------------------------------------- binomial trees
def _log2_ceil(n):
    return max(n - 1, 0).bit_length()


_TREE_ROWS = [  # (world_size, numel, dtype, root): roots other than 0, world sizes not powers of two
    (1, 4, "float32", 0), (2, 5, "int64", 1), (3, 6, "float32", 2), (4, 7, "float64", 1), (5, 3, "int64", 3),
    (5, 9, "float32", 0),
]


def _tree_broadcast_harness(fn, numel, dtype, seed, src):
    r, N, x, w, msg = _broadcast(fn, numel, dtype, seed, src)
    if msg:
        return msg
    rounds, n = _log2_ceil(N), numel * x.element_size()
    if r != src and w.received != 1:
        return f"rank {r} received {w.received} messages: in a broadcast every rank but the root receives once"
    if w.bytes_sent > rounds * n:
        return (f"rank {r} sent {w.bytes_sent} bytes: a binomial tree sends the whole buffer at most "
                f"ceil(log2 N) = {rounds} times per rank (n = {n} bytes)")
    if w.clock > rounds:
        return (f"the data reached rank {r} in round {w.clock}, after more than ceil(log2 N) = {rounds} rounds: "
                f"in round k every rank that already has the data sends it to one that has not, doubling "
                f"the ranks that have it (a chain or the root sending to everyone takes N-1 = {N - 1})")
    return None


check_tree_broadcast = _p2p_check("tree_broadcast", _tree_broadcast_harness, _table_cases(_TREE_ROWS, "src"),
                                  "the binomial tree", """fn(tensor, src): in place, every rank's tensor <- rank
    src's, along a binomial tree: ceil(log2 N) rounds, each rank receiving once.""")


def _tree_reduce_harness(fn, numel, dtype, seed, dst):
    r, N = rank_info()
    x = rank_data(seed, r, numel, dtype)
    with P2PWatch() as w:
        fn(x, dst)
    rounds, n = _log2_ceil(N), numel * x.element_size()
    if r == dst:
        msg = compare(x, sum_of(seed, N, numel, dtype), what=f"rank {dst}'s tensor after reduce (the sum over ranks)",
                      **sum_bounds(seed, N, numel, dtype))
        if msg:
            return msg
        if w.messages:
            return f"the root (rank {dst}) sent {w.messages} messages: in a reduce the root only receives"
    elif (w.messages, w.bytes_sent) != (1, n):
        return (f"rank {r} sent {w.messages} messages, {w.bytes_sent} bytes: in a tree reduce every rank but the "
                f"root sends its partial sum once ({n} bytes), after adding what its children sent it")
    if w.received > rounds:
        return (f"rank {r} received {w.received} messages: a binomial tree receives at most ceil(log2 N) = {rounds} "
                f"(the root receiving from everyone is the naive reduce: N-1 = {N - 1} messages in a row)")
    if w.clock > rounds:
        return f"rank {r} was still busy in round {w.clock}: a binomial tree reduce takes ceil(log2 N) = {rounds} rounds"
    return None


check_tree_reduce = _p2p_check("tree_reduce", _tree_reduce_harness, _table_cases(_TREE_ROWS, "dst"),
                               "the binomial tree", """fn(tensor, dst): SUM of every rank's tensor into rank dst's
    tensor, along a binomial tree (other ranks' tensors may be used as scratch).""")


__all__ = ["check_pipelined_broadcast", "check_tree_broadcast", "check_tree_reduce", "check_ring_all_reduce",
           "check_ring_reduce_scatter", "check_ring_all_gather", "check_all_reduce_composed", "check_fit_alpha_beta"]
