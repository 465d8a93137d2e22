"""The alpha-beta cost of each collective algorithm, bus bandwidth and per-rank volumes
(course_lib.costmodel re-exports all of it; its docstring is the API)."""
from __future__ import annotations

import math
from typing import Callable

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


# ----------------------------------------------------------------------------- the segmented ring, with
# the reduction's own cost: gamma seconds per byte reduced (not a COSTS entry: not linear in alpha, beta alone)


def ring_segments(n_bytes, world_size, segment_bytes) -> int:
    """Segments per chunk of course_lib's segmented ring: ceil((n / N) / segment_bytes), at least 1."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if segment_bytes is None:
        return 1
    if segment_bytes <= 0:
        raise ValueError(f"segment_bytes must be > 0 or None, got {segment_bytes}")
    return max(1, math.ceil(n_bytes / world_size / segment_bytes))


def pipelined_ring_reduce_scatter(n_bytes, world_size, alpha, beta, gamma=0.0, segments=1):
    """Ring reduce-scatter with each chunk sent in ``segments`` (k) pieces, reducing at gamma s/B.

    A segment of s = n / (N k) bytes takes t = alpha + s beta to cross a link. A step's k
    segments occupy the link for k t; the first segment of the next step can leave only
    once this step's first one has arrived and been reduced: t + s gamma. Each of the N-2
    steps that forward a partial sum lasts the longer of the two; the last step adds its k
    arrivals and the last reduction: (N-2) max(k t, t + s gamma) + k t + s gamma.

    k = 1 is the unsegmented ring, (N-1)(alpha + n/N (beta + gamma)): each step waits for
    its whole chunk to be reduced. With k >= 2 and (k-1) t >= s gamma (the link is the
    bottleneck) it is (N-1) k alpha + (N-1)/N n beta + n/(N k) gamma: the reduction hides
    behind the next segment's transfer except for the last segment (the pipelining term),
    at the price of (N-1)(k-1) more messages.
    """
    N, k = world_size, segments
    if N <= 1:
        return 0.0
    if not (isinstance(k, int) and k >= 1):
        raise ValueError(f"segments must be an int >= 1, got {k!r}")
    s = n_bytes / (N * k)
    t = alpha + s * beta
    return (N - 2) * max(k * t, t + s * gamma) + k * t + s * gamma


def pipelined_ring_all_gather(n_bytes, world_size, alpha, beta, segments=1):
    """Ring all-gather in ``segments`` pieces per chunk: (N-1) k (alpha + n/(N k) beta).

    Nothing to reduce: segments only add messages in this model (a segment is forwarded
    as soon as it arrives, but every link was busy at every step anyway)."""
    N, k = world_size, segments
    if N <= 1:
        return 0.0
    return (N - 1) * k * (alpha + n_bytes / (N * k) * beta)


def pipelined_ring_all_reduce(n_bytes, world_size, alpha, beta, gamma=0.0, segments=1):
    """Segmented ring all-reduce: pipelined reduce-scatter + all-gather.

    k = 1: 2(N-1) alpha + 2(N-1)/N n beta + (N-1)/N n gamma (the textbook ring plus its
    reductions). Link-bound k >= 2: 2(N-1) k alpha + 2(N-1)/N n beta + n/(N k) gamma,
    smallest near k = sqrt(n gamma / (2 N (N-1) alpha)) (:func:`best_segments`).
    """
    return (pipelined_ring_reduce_scatter(n_bytes, world_size, alpha, beta, gamma, segments)
            + pipelined_ring_all_gather(n_bytes, world_size, alpha, beta, segments))


def best_segments(n_bytes, world_size, alpha, beta, gamma, max_segments=4096) -> int:
    """The k in 1..max_segments that makes :func:`pipelined_ring_all_reduce` smallest."""
    return min(range(1, max_segments + 1),
               key=lambda k: pipelined_ring_all_reduce(n_bytes, world_size, alpha, beta, gamma, k))


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
