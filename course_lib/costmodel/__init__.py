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

    # course_lib's segmented ring, with the reduction's cost g (seconds per byte reduced):
    pipelined_ring_reduce_scatter(n, N, a, b, g=0, segments=1)   (N-2) max(k t, t + s g) + k t + s g,
                                           s = n/(N k) bytes a segment, t = a + s b one segment's hop
    pipelined_ring_all_gather(n, N, a, b, segments=1)            (N-1) k t
    pipelined_ring_all_reduce(n, N, a, b, g=0, segments=1)       the two; k = 1: the ring + (N-1)/N n g;
                                           link-bound k >= 2: 2(N-1) k a + 2(N-1)/N n b + n/(N k) g
    ring_segments(n, N, segment_bytes)     k of course_lib.collectives.ring for that segment size
    best_segments(n, N, a, b, g)           the k that minimises pipelined_ring_all_reduce
    fit_pipelined_ring([(k, n, N, seconds)], g, cores=None) -> PipelinedRingFit(alpha, beta, ...).predict(n, N, k)

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
    fit_per_regime(measurements, regime, relative=True, cores=None, cache_bytes=None) -> RegimeFit
        one fit per regime(n, N) name; RegimeFit(fits={name: AlphaBetaFit}, ..., rel_errors).predict(algo, n, N)
    CoreRegimes(cores)                 regime(n, N): "ranks <= cores" or "ranks > cores" (idle cores to
                                       wake vs busy cores taken in turns: one alpha-beta cannot fit both)
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

from course_lib.costmodel.algorithms import (  # noqa: F401
    COLLECTIVES,
    COSTS,
    GLOO_MAX_SEGMENT_BYTES,
    algbw,
    best_segments,
    bus_factor,
    busbw,
    coefficients,
    cost,
    linear_gather,
    linear_scatter,
    naive_all_gather,
    naive_all_reduce,
    naive_broadcast,
    naive_reduce,
    naive_reduce_scatter,
    pairwise_all_to_all,
    pipelined_ring_all_gather,
    pipelined_ring_all_reduce,
    pipelined_ring_reduce_scatter,
    point_to_point,
    recursive_doubling_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    ring_segments,
    segmented_ring_all_reduce,
    serialized_ring_all_reduce,
    shared_cores,
    tree_all_reduce,
    tree_broadcast,
    tree_reduce,
    volume_per_rank,
)
from course_lib.costmodel.fit import (  # noqa: F401
    AlphaBetaFit,
    CoreRegimes,
    PipelinedRingFit,
    RegimeFit,
    Measurement,
    crossover_bytes,
    fit_alpha_beta,
    fit_per_regime,
    fit_pipelined_ring,
    in_memory,
    measured_crossover,
)

__all__ = sorted(COSTS) + [
    "COSTS", "COLLECTIVES", "cost", "coefficients", "shared_cores", "bus_factor", "volume_per_rank", "algbw", "busbw",
    "Measurement", "AlphaBetaFit", "fit_alpha_beta", "in_memory", "fit_per_regime", "RegimeFit", "CoreRegimes",
    "fit_pipelined_ring", "PipelinedRingFit",
    "pipelined_ring_reduce_scatter", "pipelined_ring_all_gather", "pipelined_ring_all_reduce", "ring_segments",
    "best_segments", "GLOO_MAX_SEGMENT_BYTES", "crossover_bytes", "measured_crossover"]
