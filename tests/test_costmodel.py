"""course_lib.costmodel: formulas, volumes, bandwidths, the alpha-beta fit, crossovers."""
import math

import pytest

from course_lib import costmodel as cm

A, B = 20e-6, 1e-9  # 20 us per message, 1 GB/s


@pytest.mark.parametrize("N", [1, 2, 3, 4, 5, 8])
def test_ring_all_reduce_is_reduce_scatter_plus_all_gather(N):
    n = 3 << 20
    assert cm.ring_all_reduce(n, N, A, B) == pytest.approx(
        cm.ring_reduce_scatter(n, N, A, B) + cm.ring_all_gather(n, N, A, B))
    assert cm.ring_all_reduce(n, N, A, B) == pytest.approx(2 * (N - 1) * A + 2 * (N - 1) / N * n * B)


def test_world_size_one_costs_nothing():
    for name, f in cm.COSTS.items():
        if name != "point_to_point":
            assert f(1 << 20, 1, A, B) == 0, name


def test_serialized_ring_costs_about_n_times_the_ring_in_bandwidth():
    n, N = 64 << 20, 8
    ratio = cm.serialized_ring_all_reduce(n, N, 0, B) / cm.ring_all_reduce(n, N, 0, B)
    assert ratio == pytest.approx(N)


def test_tree_and_recursive_doubling_rounds():
    assert cm.coefficients("tree_broadcast", 1, 8) == (3, 3)
    assert cm.coefficients("tree_broadcast", 1, 5) == (3, 3)
    assert cm.coefficients("recursive_doubling_all_reduce", 1, 8) == (3, 3)
    assert cm.coefficients("recursive_doubling_all_reduce", 1, 6) == (4, 4)  # 2 + 2 extra rounds


def test_volumes_are_the_standard_ones():
    n, N = 1000, 4
    assert cm.volume_per_rank("all_reduce", n, N) == pytest.approx(1500)
    assert cm.volume_per_rank("all_gather", n, N) == pytest.approx(750)   # not (N-1) * n
    assert cm.volume_per_rank("reduce_scatter", n, N) == pytest.approx(750)
    assert cm.volume_per_rank("broadcast", n, N) == n
    with pytest.raises(ValueError, match="unknown collective"):
        cm.volume_per_rank("allreduce", n, N)


def test_algbw_busbw():
    assert cm.algbw(1e9, 2.0) == 5e8
    assert cm.busbw("all_reduce", 1e9, 2.0, 4) == pytest.approx(5e8 * 1.5)


def test_fit_recovers_alpha_beta_from_exact_and_noisy_data():
    ms = [cm.Measurement(algo, n, N, cm.cost(algo, n, N, A, B))
          for algo in ("ring_all_reduce", "ring_all_gather", "tree_broadcast")
          for n in (4 << 10, 256 << 10, 16 << 20) for N in (2, 3, 4, 8)]
    fit = cm.fit_alpha_beta(ms)
    assert fit.alpha == pytest.approx(A, rel=1e-6) and fit.beta == pytest.approx(B, rel=1e-6)
    assert fit.max_abs_rel_error < 1e-9 and fit.bandwidth == pytest.approx(1 / B)
    noisy = [m._replace(seconds=m.seconds * (1.1 if i % 2 else 0.9)) for i, m in enumerate(ms)]
    fit = cm.fit_alpha_beta(noisy)
    assert fit.alpha == pytest.approx(A, rel=0.2) and fit.beta == pytest.approx(B, rel=0.2)
    assert fit.max_abs_rel_error < 0.25
    # dicts and plain tuples work too; prediction goes through the same formula
    fit2 = cm.fit_alpha_beta([m._asdict() for m in ms[:5]] + [tuple(m) for m in ms[5:]])
    assert fit2.predict("ring_all_reduce", 1 << 20, 4) == pytest.approx(cm.ring_all_reduce(1 << 20, 4, A, B))
    assert "alpha" in str(fit2)


def test_fit_keeps_alpha_and_beta_nonnegative():
    # pure bandwidth data with noise that would push alpha below 0 in plain least squares
    ms = [("ring_all_reduce", n, 4, 1.5 * n * B * (0.8 if n < 1e5 else 1.0)) for n in (1e4, 1e5, 1e6, 1e7)]
    fit = cm.fit_alpha_beta(ms)
    assert fit.alpha >= 0 and fit.beta > 0


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="at least 2"):
        cm.fit_alpha_beta([("ring_all_reduce", 1, 2, 1.0)])
    with pytest.raises(ValueError, match="seconds > 0"):
        cm.fit_alpha_beta([("ring_all_reduce", 1, 2, 1.0), ("ring_all_reduce", 1, 2, 0.0)])
    with pytest.raises(ValueError, match="unknown algorithm"):
        cm.fit_alpha_beta([("ringg", 1, 2, 1.0), ("ring_all_reduce", 1, 2, 1.0)])


def test_crossover_tree_vs_ring():
    N = 4
    n = cm.crossover_bytes("recursive_doubling_all_reduce", "ring_all_reduce", N, A, B)
    assert n == pytest.approx(8 * A / B)  # 2a + 2nb = 6a + 1.5nb
    assert cm.recursive_doubling_all_reduce(n / 2, N, A, B) < cm.ring_all_reduce(n / 2, N, A, B)
    assert cm.recursive_doubling_all_reduce(n * 2, N, A, B) > cm.ring_all_reduce(n * 2, N, A, B)
    assert cm.crossover_bytes("ring_all_reduce", "ring_all_reduce", N, A, B) is None
    assert math.isfinite(cm.crossover_bytes("tree_all_reduce", "ring_all_reduce", 8, A, B))


def test_shared_cores_slows_every_step_when_ranks_outnumber_cores():
    assert cm.shared_cores(8, 2) == 4 and cm.shared_cores(2, 2) == 1 and cm.shared_cores(8, None) == 1
    ms = [("ring_all_reduce", n, N, cm.ring_all_reduce(n, N, A, B) * cm.shared_cores(N, 2))
          for n in (4 << 10, 1 << 20, 16 << 20) for N in (2, 4, 8)]
    fit = cm.fit_alpha_beta(ms, cores=2)
    assert fit.alpha == pytest.approx(A) and fit.beta == pytest.approx(B) and fit.cores == 2
    assert fit.predict("ring_all_reduce", 1 << 20, 8) == pytest.approx(4 * cm.ring_all_reduce(1 << 20, 8, A, B))
    assert cm.fit_alpha_beta(ms).max_abs_rel_error > 0.3   # ignoring the sharing fits badly
    with pytest.raises(ValueError):
        cm.shared_cores(4, 0)


def test_measured_crossover_interpolates_on_log_size():
    sizes = [1 << 10, 1 << 12, 1 << 14]
    tree, ring = [1.0, 2.0, 8.0], [2.0, 2.0 * 2 ** 0.5, 4.0]
    n = cm.measured_crossover(sizes, tree, ring)
    assert (1 << 12) < n < (1 << 14)   # log(tree / ring): -0.69, -0.35, +0.69
    assert cm.measured_crossover(sizes, [1, 1, 1], [2, 2, 2]) is None


def test_segmented_ring_counts_gloos_messages():
    MiB = 1 << 20
    # small buffers: 2 segments per rank, each phase sends N-1 chunks of 2 segments
    assert cm.coefficients("segmented_ring_all_reduce", 4096, 2) == (4, 4096)
    assert cm.coefficients("segmented_ring_all_reduce", 4096, 5)[0] == 16
    # 16 MiB on 2 ranks: 16 segments of 1 MiB; on 3 ranks: 16 rounded up to 18
    assert cm.coefficients("segmented_ring_all_reduce", 16 * MiB, 2)[0] == 16
    assert cm.coefficients("segmented_ring_all_reduce", 16 * MiB, 3)[0] == pytest.approx(24)
    for n, N in ((4096, 3), (5 * MiB + 3, 4), (64 * MiB, 8)):   # the bytes are the ring's
        assert cm.segmented_ring_all_reduce(n, N, 0, B) == pytest.approx(cm.ring_all_reduce(n, N, 0, B))
        assert cm.segmented_ring_all_reduce(n, N, A, 0) >= 2 * cm.ring_all_reduce(n, N, A, 0)
    assert cm.segmented_ring_all_reduce(MiB, 4, A, B, max_segment_bytes=MiB // 16) == pytest.approx(
        2 * 3 * 16 / 4 * A + 1.5 * MiB * B)


def test_cache_aware_fit_recovers_two_betas():
    cache, B_mem = 8 << 20, 1.6 * B
    ms = []
    for n in (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20):
        for N in (2, 3, 4, 8):
            beta = B_mem if cm.in_memory(n, N, cache) else B
            ms.append(("segmented_ring_all_reduce", n, N,
                       cm.segmented_ring_all_reduce(n, N, A, beta) * cm.shared_cores(N, 2)))
    assert cm.in_memory(4 << 20, 2, cache) and not cm.in_memory(1 << 20, 4, cache)
    fit = cm.fit_alpha_beta(ms, cores=2, cache_bytes=cache)
    assert fit.alpha == pytest.approx(A) and fit.beta == pytest.approx(B) and fit.beta_memory == pytest.approx(B_mem)
    assert fit.max_abs_rel_error < 1e-9 and "MiB of cache" in str(fit)
    assert fit.predict("ring_all_reduce", 16 << 20, 2) == pytest.approx(cm.ring_all_reduce(16 << 20, 2, A, B_mem))
    one = cm.fit_alpha_beta(ms, cores=2)                      # one beta cannot do both
    assert one.beta_memory is None and one.cache_bytes is None and one.max_abs_rel_error > 0.1
    # beta_memory >= beta even when the data say otherwise (a cache never slows a copy)
    faster = [(a, n, N, t * (0.5 if cm.in_memory(n, N, cache) else 1)) for a, n, N, t in ms]
    fit = cm.fit_alpha_beta(faster, cores=2, cache_bytes=cache)
    assert fit.beta_memory == fit.beta
    with pytest.raises(ValueError, match="cache_bytes"):
        cm.fit_alpha_beta(ms, cache_bytes=0)


@pytest.mark.parametrize("N", [2, 3, 4, 8])
def test_pipelined_ring_unsegmented_and_link_bound(N):
    n, G = 16 << 20, 0.4e-9
    # one segment: the textbook ring, plus every step's reduction on the critical path
    assert cm.pipelined_ring_all_reduce(n, N, A, B, 0.0, 1) == pytest.approx(cm.ring_all_reduce(n, N, A, B))
    assert cm.pipelined_ring_all_reduce(n, N, A, B, G, 1) == pytest.approx(
        cm.ring_all_reduce(n, N, A, B) + (N - 1) / N * n * G)
    assert cm.pipelined_ring_all_gather(n, N, A, B, 1) == pytest.approx(cm.ring_all_gather(n, N, A, B))
    # k >= 2, link-bound: k times the messages, the same bytes, one segment's reduction exposed
    for k in (2, 4, 16):
        assert cm.pipelined_ring_all_reduce(n, N, A, B, G, k) == pytest.approx(
            2 * (N - 1) * k * A + 2 * (N - 1) / N * n * B + n / (N * k) * G)
    assert cm.pipelined_ring_all_reduce(n, 1, A, B, G, 4) == 0


def test_pipelined_ring_reduction_bound_and_best_segments():
    n, N = 16 << 20, 4
    G = 3 * B                    # reducing slower than the link: each step waits for a reduction
    s = n / (N * 2)
    assert cm.pipelined_ring_reduce_scatter(n, N, A, B, G, 2) == pytest.approx(
        (N - 2) * (A + s * B + s * G) + 2 * (A + s * B) + s * G)
    k = cm.best_segments(n, N, A, B, G)
    assert all(cm.pipelined_ring_all_reduce(n, N, A, B, G, k) <= cm.pipelined_ring_all_reduce(n, N, A, B, G, j)
               for j in range(1, 200))
    assert cm.best_segments(n, N, A, B, 0.0) == 1          # nothing to hide: segments only add alphas
    with pytest.raises(ValueError, match="segments"):
        cm.pipelined_ring_all_reduce(n, N, A, B, G, 0)


def test_ring_segments_matches_the_implementation():
    import torch

    from course_lib.collectives import ring
    for n_bytes, N, seg in ((16 << 20, 4, 1 << 20), (1000 * 4 * 3, 3, 1000), (64 << 10, 4, 1 << 20)):
        chunk = torch.empty(n_bytes // 4 // N)
        assert cm.ring_segments(n_bytes, N, seg) == len(ring.segments(chunk, seg))
    assert cm.ring_segments(1 << 20, 4, None) == 1
    with pytest.raises(ValueError, match="segment_bytes"):
        cm.ring_segments(1 << 20, 4, 0)


def test_fit_per_regime_recovers_each_regimes_alpha_beta():
    # ranks <= cores: idle cores to wake (a larger alpha); beyond: busy cores shared
    cores, regimes = 2, cm.CoreRegimes(2)
    truth = {"ranks <= cores": (2 * A, B), "ranks > cores": (A, 1.5 * B)}
    ms = []
    for N in (2, 3, 4, 8):
        a, b = truth[regimes(0, N)]
        k = cm.shared_cores(N, cores)
        ms += [cm.Measurement("ring_all_reduce", n, N, k * cm.ring_all_reduce(n, N, a, b))
               for n in (4 << 10, 256 << 10, 16 << 20)]
    fit = cm.fit_per_regime(ms, regimes, cores=cores)
    assert list(fit.fits) == ["ranks <= cores", "ranks > cores"]
    for name, (a, b) in truth.items():
        assert fit.fits[name].alpha == pytest.approx(a, rel=1e-6) and fit.fits[name].beta == pytest.approx(b, rel=1e-6)
    assert fit.max_abs_rel_error < 1e-9 and len(fit.rel_errors) == len(ms)
    assert fit.predict("ring_all_reduce", 1 << 20, 4) == pytest.approx(2 * cm.ring_all_reduce(1 << 20, 4, A, 1.5 * B))
    assert cm.fit_alpha_beta(ms, cores=cores).max_abs_rel_error > 0.1     # one alpha-beta cannot fit both
    with pytest.raises(ValueError, match="at least 2"):
        cm.fit_per_regime(ms[:4], regimes, cores=cores)
    with pytest.raises(ValueError, match="cores"):
        cm.CoreRegimes(0)


@pytest.mark.parametrize("G", [0.2e-9, 3e-9])          # link-bound; reduction-bound for small k
def test_fit_pipelined_ring_recovers_alpha_beta(G):
    n, N, cores = 16 << 20, 4, 2
    ms = [(k, n, N, cm.shared_cores(N, cores) * cm.pipelined_ring_all_reduce(n, N, A, B, G, k))
          for k in (1, 2, 4, 8, 16, 64)]
    fit = cm.fit_pipelined_ring(ms, G, cores=cores)
    assert fit.alpha == pytest.approx(A, rel=1e-6) and fit.beta == pytest.approx(B, rel=1e-6)
    assert fit.max_abs_rel_error < 1e-9 and fit.predict(n, N, 4) == pytest.approx(ms[2][3])
    with pytest.raises(ValueError, match="needs"):
        cm.fit_pipelined_ring(ms[:1], G)
