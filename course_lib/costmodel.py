"""The alpha-beta cost of collective algorithms, bus bandwidth, and fitting alpha and beta.

A message of ``n`` bytes between two ranks costs ``alpha + n * beta`` seconds:
``alpha`` is the fixed latency of one message (software, syscalls, wire),
``beta`` the seconds per byte (``1 / beta`` is the link bandwidth). An algorithm
is a sequence of steps; its cost is (steps on the critical path) * alpha +
(bytes on the critical path) * beta.

API (stable: the planner and the book call these; one formula, one place)::

    # one function per algorithm, all (n_bytes, world_size, alpha, beta) -> seconds
    ring_all_reduce(n, N, a, b)            2(N-1) a + 2(N-1)/N n b
    ring_reduce_scatter(n, N, a, b)        (N-1) a + (N-1)/N n b        n = the INPUT (full) size
    ring_all_gather(n, N, a, b)            (N-1) a + (N-1)/N n b        n = the OUTPUT (full) size
    tree_broadcast / tree_reduce           ceil(log2 N) (a + n b)       binomial tree
    tree_all_reduce                        2 ceil(log2 N) (a + n b)     reduce then broadcast
    recursive_doubling_all_reduce          (log2 P + 2[N != P]) (a + n b), P = largest power of 2 <= N
    naive_broadcast / naive_reduce         (N-1) (a + n b)              the root talks to each rank in turn
    naive_all_reduce                       2 (N-1) (a + n b)            reduce to a root, broadcast back
    naive_all_gather, naive_reduce_scatter through a root
    segmented_ring_all_reduce              2 S (N-1)/N a + 2(N-1)/N n b gloo's ring: S = N ceil(max(n / 1 MiB, 2N) / N) segments
    serialized_ring_all_reduce             2 (N-1) (a + n b)            the whole buffer hops rank to rank
    pairwise_all_to_all                    (N-1) (a + n/N b)            n = one rank's input size
    linear_scatter / linear_gather         (N-1) (a + n/N b)
    point_to_point(n, N, a, b)             a + n b
    COSTS                                  {name: function} of all the above

    volume_per_rank(collective, n, N)  bytes each rank sends in a bandwidth-optimal algorithm
    bus_factor(collective, N)          busbw / algbw (nccl-tests convention)
    algbw(n, seconds)                  n / seconds (bytes/s)
    busbw(collective, n, seconds, N)   algbw * bus_factor: comparable across N, vs link bandwidth
    coefficients(algorithm, n, N, cores=None)  (steps, bytes): cost = steps * alpha + bytes * beta
    shared_cores(N, cores)             max(1, N / cores): slowdown when N ranks share `cores` CPU cores
    fit_alpha_beta(measurements, relative=True, cores=None, cache_bytes=None) -> AlphaBetaFit
        measurements: iterable of (algorithm, n_bytes, world_size, seconds) tuples,
        Measurement namedtuples or dicts with those keys; least squares, all
        algorithms at once, relative errors weighted equally by default.
        cores: ranks on one machine share its cores (see shared_cores); None: they do not.
        cache_bytes: two betas, in cache and beyond it (see in_memory); None: one.
        AlphaBetaFit(alpha, beta, bandwidth, rel_errors, ..., beta_memory, cache_bytes).predict(algo, n, N)
    in_memory(n, N, cache_bytes)       N buffers of n bytes fill the cache: copies run at memory speed
    crossover_bytes(algo_a, algo_b, N, alpha, beta) -> n where both cost the same (or None)
    measured_crossover(sizes, times_a, times_b) -> n where measured times cross (log interpolation)

Sizes follow the nccl-tests convention: ``n`` is the size of the whole buffer
(all-reduce's tensor, all-gather's output, reduce-scatter's input). The model
ignores the reduction's arithmetic (it folds into beta when beta is fitted) and
contention for a shared link. Ranks that share CPU cores (a laptop running 8
ranks on 2 cores, the loopback "network" being memory copies by the CPU) take
turns: pass ``cores`` to fit and predict with every step slowed by N / cores. And
there the "link" is the CPU copying bytes, as fast as the cache while all ranks'
buffers fit in it and as slow as memory beyond: pass ``cache_bytes`` to fit a beta
for each side.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

# ----------------------------------------------------------------------------- algorithms


def _log2_ceil(world_size: int) -> int:
    return max(0, math.ceil(math.log2(world_size))) if world_size > 1 else 0


def point_to_point(n_bytes, world_size, alpha, beta):
    """One message: alpha + n beta (world_size is ignored)."""
    return alpha + n_bytes * beta


def ring_reduce_scatter(n_bytes, world_size, alpha, beta):
    """N-1 steps, each rank sends one chunk of n/N per step."""
    N = world_size
    return (N - 1) * alpha + (N - 1) / N * n_bytes * beta


def ring_all_gather(n_bytes, world_size, alpha, beta):
    """N-1 steps of n/N bytes (n = the gathered output)."""
    N = world_size
    return (N - 1) * alpha + (N - 1) / N * n_bytes * beta


def ring_all_reduce(n_bytes, world_size, alpha, beta):
    """Reduce-scatter then all-gather: 2(N-1) steps of n/N bytes. Bandwidth optimal."""
    return ring_reduce_scatter(n_bytes, world_size, alpha, beta) + ring_all_gather(n_bytes, world_size, alpha, beta)


GLOO_MAX_SEGMENT_BYTES = 1 << 20   # gloo's ring all-reduce sends at most 1 MiB per message


def segmented_ring_all_reduce(n_bytes, world_size, alpha, beta, max_segment_bytes=GLOO_MAX_SEGMENT_BYTES):
    """The ring as gloo runs it: each rank's chunk cut into segments, two messages in flight.

    gloo cuts the buffer into S segments, S a multiple of N with at least 2 per rank
    (one travels while the other is reduced) and at most ``max_segment_bytes`` each:
    S = N * ceil(max(ceil(n / max_segment_bytes), 2N) / N). Each phase sends
    S (N-1) / N segments: 2 S (N-1) / N messages in all, 4(N-1) for small buffers,
    twice the textbook ring's 2(N-1); the bytes are the ring's, 2(N-1)/N n. (Buffers of
    fewer than about 2N elements leave some segments empty, which gloo skips.)
    """
    N = world_size
    if N <= 1:
        return 0.0
    wanted = max(math.ceil(n_bytes / max_segment_bytes), 2 * N)
    segments = math.ceil(wanted / N) * N
    return 2 * (N - 1) * segments / N * alpha + 2 * (N - 1) / N * n_bytes * beta


def serialized_ring_all_reduce(n_bytes, world_size, alpha, beta):
    """The whole buffer hops from rank to rank (sum around, result around): 2(N-1) full messages.

    What a 'ring' costs when it is not split into chunks: every hop waits for
    the previous one and carries all n bytes, so the ring's parallelism is lost.
    """
    N = world_size
    return 2 * (N - 1) * (alpha + n_bytes * beta)


def tree_broadcast(n_bytes, world_size, alpha, beta):
    """Binomial tree: the number of ranks holding the data doubles each round."""
    return _log2_ceil(world_size) * (alpha + n_bytes * beta)


def tree_reduce(n_bytes, world_size, alpha, beta):
    """Binomial tree, leaves to root: ceil(log2 N) rounds of n bytes."""
    return _log2_ceil(world_size) * (alpha + n_bytes * beta)


def tree_all_reduce(n_bytes, world_size, alpha, beta):
    """Tree reduce to a root, then tree broadcast."""
    return tree_reduce(n_bytes, world_size, alpha, beta) + tree_broadcast(n_bytes, world_size, alpha, beta)


def recursive_doubling_all_reduce(n_bytes, world_size, alpha, beta):
    """Pairs exchange whole buffers at distance 1, 2, 4, ...; 2 extra rounds if N is not a power of 2."""
    if world_size <= 1:
        return 0.0
    p = 1 << (world_size.bit_length() - 1)
    rounds = int(math.log2(p)) + (2 if p != world_size else 0)
    return rounds * (alpha + n_bytes * beta)


def naive_broadcast(n_bytes, world_size, alpha, beta):
    """The root sends the whole buffer to each rank in turn."""
    return (world_size - 1) * (alpha + n_bytes * beta)


def naive_reduce(n_bytes, world_size, alpha, beta):
    """The root receives every rank's whole buffer in turn."""
    return (world_size - 1) * (alpha + n_bytes * beta)


def naive_all_reduce(n_bytes, world_size, alpha, beta):
    """Everything through a root: receive N-1 buffers, send N-1 results."""
    return naive_reduce(n_bytes, world_size, alpha, beta) + naive_broadcast(n_bytes, world_size, alpha, beta)


def linear_gather(n_bytes, world_size, alpha, beta):
    """The root receives N-1 pieces of n/N bytes (n = the gathered size)."""
    N = world_size
    return (N - 1) * (alpha + n_bytes / N * beta)


def linear_scatter(n_bytes, world_size, alpha, beta):
    """The root sends N-1 pieces of n/N bytes (n = the root's whole buffer)."""
    N = world_size
    return (N - 1) * (alpha + n_bytes / N * beta)


def naive_all_gather(n_bytes, world_size, alpha, beta):
    """Gather the pieces at a root, then send the whole output to every rank."""
    return linear_gather(n_bytes, world_size, alpha, beta) + naive_broadcast(n_bytes, world_size, alpha, beta)


def naive_reduce_scatter(n_bytes, world_size, alpha, beta):
    """Reduce whole buffers at a root, then scatter the pieces."""
    return naive_reduce(n_bytes, world_size, alpha, beta) + linear_scatter(n_bytes, world_size, alpha, beta)


def pairwise_all_to_all(n_bytes, world_size, alpha, beta):
    """N-1 rounds; in round s rank r sends its piece for r+s (n/N bytes) and receives from r-s."""
    N = world_size
    return (N - 1) * (alpha + n_bytes / N * beta)


COSTS: dict[str, Callable] = {f.__name__: f for f in (
    point_to_point, ring_reduce_scatter, ring_all_gather, ring_all_reduce, segmented_ring_all_reduce,
    serialized_ring_all_reduce,
    tree_broadcast, tree_reduce, tree_all_reduce, recursive_doubling_all_reduce,
    naive_broadcast, naive_reduce, naive_all_reduce, linear_gather, linear_scatter,
    naive_all_gather, naive_reduce_scatter, pairwise_all_to_all)}


def cost(algorithm: str, n_bytes, world_size, alpha, beta) -> float:
    """``COSTS[algorithm](n_bytes, world_size, alpha, beta)`` with a clear error for a bad name."""
    return _lookup(algorithm)(n_bytes, world_size, alpha, beta)


def _lookup(algorithm) -> Callable:
    if callable(algorithm):
        return algorithm
    try:
        return COSTS[algorithm]
    except KeyError:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {sorted(COSTS)}") from None


def shared_cores(world_size: int, cores: int | None) -> float:
    """How much slower each step is when ``world_size`` ranks share ``cores`` CPU cores.

    Every rank's share of a step (syscalls, copies through the loopback device,
    the reduction) is CPU work; with more ranks than cores they take turns:
    max(1, N / cores). 1 when ``cores`` is None (a rank per device, as on a cluster).
    """
    if cores is None:
        return 1.0
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    return max(1.0, world_size / cores)


def coefficients(algorithm, n_bytes, world_size, cores=None) -> tuple[float, float]:
    """(steps, bytes) with cost = steps * alpha + bytes * beta (every cost here is linear in both)."""
    f = _lookup(algorithm)
    k = shared_cores(world_size, cores)
    return k * f(n_bytes, world_size, 1.0, 0.0), k * f(n_bytes, world_size, 0.0, 1.0)


# ----------------------------------------------------------------------------- volumes and bandwidths

_BUS_FACTORS = {
    "all_reduce": lambda N: 2 * (N - 1) / N,
    "all_gather": lambda N: (N - 1) / N,
    "reduce_scatter": lambda N: (N - 1) / N,
    "all_to_all": lambda N: (N - 1) / N,
    "scatter": lambda N: (N - 1) / N,
    "gather": lambda N: (N - 1) / N,
    "broadcast": lambda N: 1.0,
    "reduce": lambda N: 1.0,
    "send_recv": lambda N: 1.0,
}
COLLECTIVES = tuple(_BUS_FACTORS)


def bus_factor(collective: str, world_size: int) -> float:
    """busbw / algbw: the fraction of n each rank must move (nccl-tests' convention)."""
    if collective not in _BUS_FACTORS:
        raise ValueError(f"unknown collective {collective!r}; known: {list(_BUS_FACTORS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return _BUS_FACTORS[collective](world_size)


def volume_per_rank(collective: str, n_bytes, world_size: int) -> float:
    """Bytes each rank sends in a bandwidth-optimal algorithm for a buffer of n bytes.

    all_reduce 2(N-1)/N n; all_gather and reduce_scatter (N-1)/N n (n = the full
    tensor, not the shard); all_to_all (N-1)/N n; broadcast and reduce n (every
    non-root rank receives n, resp. sends n); scatter / gather (N-1)/N n at the root.
    """
    return bus_factor(collective, world_size) * n_bytes


def algbw(n_bytes, seconds) -> float:
    """Algorithm bandwidth: buffer size / time (bytes per second)."""
    return n_bytes / seconds


def busbw(collective: str, n_bytes, seconds, world_size: int) -> float:
    """Bus bandwidth: algbw * bus_factor. Comparable to the link's bandwidth, whatever N."""
    return algbw(n_bytes, seconds) * bus_factor(collective, world_size)


# ----------------------------------------------------------------------------- fitting


class Measurement(NamedTuple):
    algorithm: str      # a key of COSTS, e.g. "ring_all_reduce"
    n_bytes: float
    world_size: int
    seconds: float


class AlphaBetaFit(NamedTuple):
    alpha: float            # seconds per message
    beta: float             # seconds per byte (buffers in the cache, when cache_bytes is set)
    bandwidth: float        # 1 / beta, bytes per second
    rel_errors: tuple       # (predicted - measured) / measured, one per measurement, in input order
    max_abs_rel_error: float
    median_abs_rel_error: float
    n_points: int
    cores: int | None = None    # the fit assumed ranks share this many cores (None: they do not)
    beta_memory: float | None = None    # seconds per byte once the ranks' buffers outgrow the cache
    cache_bytes: int | None = None      # the cache size that separates the two (None: one beta)

    def beta_for(self, n_bytes, world_size) -> float:
        """beta, or beta_memory when the buffers of all ranks together do not fit in the cache."""
        return self.beta_memory if in_memory(n_bytes, world_size, self.cache_bytes) else self.beta

    def predict(self, algorithm, n_bytes, world_size) -> float:
        steps, nbytes = coefficients(algorithm, n_bytes, world_size, self.cores)
        return steps * self.alpha + nbytes * self.beta_for(n_bytes, world_size)

    def __str__(self):
        shared = f", ranks sharing {self.cores} cores" if self.cores else ""
        beta = f"beta = {self.beta * 1e9:.3f} ns/B (bandwidth {self.bandwidth / 1e9:.2f} GB/s{shared})"
        if self.cache_bytes:
            beta = (f"beta = {self.beta * 1e9:.3f} ns/B while N n < {self.cache_bytes / 2**20:g} MiB of cache, "
                    f"{self.beta_memory * 1e9:.3f} ns/B beyond{shared}")
        return (f"alpha = {self.alpha * 1e6:.1f} us, {beta}; |error| median "
                f"{self.median_abs_rel_error:.0%}, max {self.max_abs_rel_error:.0%} over {self.n_points} points")


def in_memory(n_bytes, world_size, cache_bytes) -> bool:
    """True when ``world_size`` buffers of ``n_bytes`` (every rank's) fill ``cache_bytes`` or more.

    On one machine the "link" is the CPU copying bytes: while all ranks' buffers fit in
    the last-level cache the copies run at cache speed, beyond it at memory speed.
    """
    return cache_bytes is not None and world_size * n_bytes >= cache_bytes


def _as_measurement(m) -> Measurement:
    if isinstance(m, dict):
        return Measurement(m["algorithm"], float(m["n_bytes"]), int(m["world_size"]), float(m["seconds"]))
    algorithm, n_bytes, world_size, seconds = m
    return Measurement(algorithm, float(n_bytes), int(world_size), float(seconds))


def _lstsq_nonneg(rows, targets):
    """min ||A x - t|| over x >= 0, for a few unknowns: the best unconstrained solution
    over every subset of columns (the others held at zero) that comes out nonnegative."""
    import itertools

    import numpy as np

    A, t = np.asarray(rows, dtype=float), np.asarray(targets, dtype=float)
    k = A.shape[1]
    best, best_res = np.zeros(k), float(t @ t)
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            sub = A[:, cols]
            if not sub.any():
                continue
            sol, *_ = np.linalg.lstsq(sub, t, rcond=None)
            if (sol < 0).any():
                continue
            x = np.zeros(k)
            x[list(cols)] = sol
            res = float(np.sum((A @ x - t) ** 2))
            if res < best_res - 1e-15 * max(1.0, best_res):
                best, best_res = x, res
    return best


def fit_alpha_beta(measurements, relative: bool = True, cores: int | None = None,
                   cache_bytes: int | None = None) -> AlphaBetaFit:
    """Least-squares alpha and beta (both >= 0) from measured times of known algorithms.

    Each measurement is (algorithm, n_bytes, world_size, seconds); its predicted
    time is steps * alpha + bytes * beta (:func:`coefficients`). With
    ``relative=True`` each row is divided by its measured time, so a 4 KiB point
    counts as much as a 16 MiB one (plain least squares would fit only the big ones).
    ``cores``: the ranks shared this many CPU cores (:func:`shared_cores`).
    ``cache_bytes``: fit two betas, ``beta`` while the ranks' buffers fit in this much
    cache and ``beta_memory >= beta`` beyond (:func:`in_memory`); None: one beta.
    """
    ms = [_as_measurement(m) for m in measurements]
    if len(ms) < 2:
        raise ValueError(f"fit_alpha_beta needs at least 2 measurements, got {len(ms)}")
    for m in ms:
        if not (m.seconds > 0 and m.n_bytes >= 0 and m.world_size >= 1):
            raise ValueError(f"bad measurement {m}: need seconds > 0, n_bytes >= 0, world_size >= 1")
    if cache_bytes is not None and not cache_bytes > 0:
        raise ValueError(f"cache_bytes must be > 0 or None, got {cache_bytes}")
    rows, targets = [], []
    for m in ms:
        steps, nbytes = coefficients(m.algorithm, m.n_bytes, m.world_size, cores)
        w = 1.0 / m.seconds if relative else 1.0
        extra = nbytes if in_memory(m.n_bytes, m.world_size, cache_bytes) else 0.0
        rows.append((steps * w, nbytes * w, extra * w))
        targets.append(m.seconds * w)
    if all(r[:2] == (0.0, 0.0) for r in rows):
        raise ValueError("every measurement has zero cost in the model (world_size 1?): nothing to fit")
    alpha, beta, beta_extra = (float(v) for v in _lstsq_nonneg(rows, targets))
    fit = AlphaBetaFit(alpha, beta, (1.0 / beta) if beta > 0 else math.inf, (), 0.0, 0.0, len(ms), cores,
                       beta + beta_extra if cache_bytes else None, cache_bytes)
    errs = tuple((fit.predict(m.algorithm, m.n_bytes, m.world_size) - m.seconds) / m.seconds for m in ms)
    abs_errs = sorted(abs(e) for e in errs)
    mid = len(abs_errs) // 2
    median = abs_errs[mid] if len(abs_errs) % 2 else (abs_errs[mid - 1] + abs_errs[mid]) / 2
    return fit._replace(rel_errors=errs, max_abs_rel_error=abs_errs[-1], median_abs_rel_error=median)


def crossover_bytes(algo_a, algo_b, world_size, alpha, beta):
    """The buffer size where ``algo_a`` and ``algo_b`` cost the same, or None if they never do.

    Below it the algorithm with fewer steps (e.g. a tree) wins; above it the one
    moving fewer bytes (a ring) wins.
    """
    sa, ba = coefficients(algo_a, 1.0, world_size)   # (steps, bytes moved per byte of buffer)
    sb, bb = coefficients(algo_b, 1.0, world_size)
    d_bytes = (ba - bb) * beta                       # cost = steps * alpha + n * bytes * beta
    if d_bytes == 0:
        return None
    n = (sb - sa) * alpha / d_bytes
    return n if n > 0 else None


def measured_crossover(sizes, times_a, times_b):
    """Where two measured curves cross: the first sign change of log(t_a / t_b) between
    neighbouring sizes, interpolated on log(size). None if they never cross."""
    pts = sorted(zip(sizes, times_a, times_b))
    diffs = [(n, math.log(a / b)) for n, a, b in pts]
    for (n0, d0), (n1, d1) in zip(diffs, diffs[1:]):
        if d0 == 0:
            return float(n0)
        if (d0 < 0) != (d1 < 0):
            f = d0 / (d0 - d1)
            return float(math.exp(math.log(n0) + f * (math.log(n1) - math.log(n0))))
    return float(diffs[-1][0]) if diffs and diffs[-1][1] == 0 else None


__all__ = sorted(COSTS) + [
    "COSTS", "COLLECTIVES", "cost", "coefficients", "shared_cores", "bus_factor", "volume_per_rank", "algbw", "busbw",
    "Measurement", "AlphaBetaFit", "fit_alpha_beta", "in_memory", "GLOO_MAX_SEGMENT_BYTES", "crossover_bytes", "measured_crossover"]
