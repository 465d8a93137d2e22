"""Fitting alpha and beta to measured times, and where two algorithms' costs cross
(course_lib.costmodel re-exports all of it; its docstring is the API)."""
from __future__ import annotations

import math
from typing import NamedTuple

from course_lib.costmodel.algorithms import coefficients, pipelined_ring_all_reduce, shared_cores

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


def as_measurement(m) -> Measurement:
    """A Measurement from one row: a dict or an (algorithm, n_bytes, world_size, seconds) tuple."""
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
    ms = [as_measurement(m) for m in measurements]
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


# ----------------------------------------------------------------------------- one fit per regime


class CoreRegimes:
    """Which side of the core count a run of ``world_size`` ranks falls on (a regime for
    :func:`fit_per_regime`): "ranks <= cores" or "ranks > cores".

    On one machine the two behave differently. With a core per rank, a rank's core is
    idle while it waits, and every message pays for waking it; with more ranks than cores
    the cores never idle, the ranks take turns (:func:`shared_cores`), and what a message
    costs is a share of a busy core. One alpha and beta cannot describe both.
    """

    def __init__(self, cores: int):
        if not (isinstance(cores, int) and cores >= 1):
            raise ValueError(f"cores must be an int >= 1, got {cores!r}")
        self.cores = cores

    def __call__(self, n_bytes, world_size) -> str:
        return "ranks <= cores" if world_size <= self.cores else "ranks > cores"

    def __repr__(self):
        return f"CoreRegimes({self.cores})"


class RegimeFit(NamedTuple):
    fits: dict              # regime name -> AlphaBetaFit, in first-seen order
    regime: object          # (n_bytes, world_size) -> regime name
    rel_errors: tuple       # (predicted - measured) / measured, in input order
    max_abs_rel_error: float
    median_abs_rel_error: float
    n_points: int

    def predict(self, algorithm, n_bytes, world_size) -> float:
        return self.fits[self.regime(n_bytes, world_size)].predict(algorithm, n_bytes, world_size)

    def __str__(self):
        return "\n".join(f"{name} ({f.n_points} points): {f}" for name, f in self.fits.items())


def fit_per_regime(measurements, regime, relative: bool = True, cores: int | None = None,
                   cache_bytes: int | None = None) -> RegimeFit:
    """One :func:`fit_alpha_beta` per regime: ``regime(n_bytes, world_size)`` names each point's
    (e.g. :class:`CoreRegimes`); every regime needs at least 2 points."""
    ms = [as_measurement(m) for m in measurements]
    groups: dict = {}
    for i, m in enumerate(ms):
        groups.setdefault(regime(m.n_bytes, m.world_size), []).append(i)
    fits, errs = {}, [0.0] * len(ms)
    for name, idx in groups.items():
        if len(idx) < 2:
            raise ValueError(f"regime {name!r} has {len(idx)} measurement(s); a fit needs at least 2")
        fits[name] = fit_alpha_beta([ms[i] for i in idx], relative, cores, cache_bytes)
        for i, e in zip(idx, fits[name].rel_errors):
            errs[i] = e
    abs_errs = sorted(abs(e) for e in errs)
    mid = len(abs_errs) // 2
    median = abs_errs[mid] if len(abs_errs) % 2 else (abs_errs[mid - 1] + abs_errs[mid]) / 2
    return RegimeFit(fits, regime, tuple(errs), abs_errs[-1], median, len(ms))


# ----------------------------------------------------------------------------- the segmented ring


class PipelinedRingFit(NamedTuple):
    alpha: float
    beta: float
    gamma: float                # given, not fitted: seconds per byte reduced
    cores: int | None
    rel_errors: tuple           # (predicted - measured) / measured, in input order
    max_abs_rel_error: float

    def predict(self, n_bytes, world_size, segments) -> float:
        return shared_cores(world_size, self.cores) * pipelined_ring_all_reduce(
            n_bytes, world_size, self.alpha, self.beta, self.gamma, segments)

    def __str__(self):
        shared = f", ranks sharing {self.cores} cores" if self.cores else ""
        return (f"alpha = {self.alpha * 1e6:.1f} us, beta = {self.beta * 1e9:.3f} ns/B, gamma = "
                f"{self.gamma * 1e9:.3f} ns/B (given){shared}; |error| max {self.max_abs_rel_error:.0%} "
                f"over {len(self.rel_errors)} points")


def _pipelined_terms(k, n_bytes, N, alpha, beta, gamma):
    """(c_t, c_g, s): the all-reduce costs c_t (alpha + s beta) + c_g s gamma on the branch of
    pipelined_ring_reduce_scatter's max() that (alpha, beta) pick."""
    s = n_bytes / (N * k)
    t = alpha + s * beta
    link_bound = N <= 2 or k * t >= t + s * gamma
    rs_t, rs_g = ((N - 1) * k, 1) if link_bound else (N - 2 + k, N - 1)
    return rs_t + (N - 1) * k, rs_g, s


def fit_pipelined_ring(measurements, gamma: float, cores: int | None = None) -> PipelinedRingFit:
    """alpha and beta (>= 0) of :func:`pipelined_ring_all_reduce` from measured
    (segments, n_bytes, world_size, seconds), with ``gamma`` timed on its own.

    Least squares on relative errors. Within a branch of the formula's max() the cost is
    linear in alpha and beta; the fit starts on the link-bound branch and refits until
    the branches its alpha and beta pick stop changing.
    """
    ms = [(int(k), float(n), int(N), float(t)) for k, n, N, t in measurements]
    if len(ms) < 2 or any(k < 1 or N < 2 or t <= 0 for k, _, N, t in ms):
        raise ValueError("fit_pipelined_ring needs >= 2 measurements (segments >= 1, world_size >= 2, seconds > 0)")
    alpha, beta, branches = 0.0, 0.0, None
    for _ in range(5):
        rows, targets, picked = [], [], []
        for k, n, N, t in ms:
            c_t, c_g, s = _pipelined_terms(k, n, N, alpha, beta, gamma) if branches else \
                _pipelined_terms(k, n, N, 1.0, 1.0, 0.0)          # first round: link-bound
            f = shared_cores(N, cores) / t
            rows.append((c_t * f, c_t * s * f))
            targets.append(1.0 - c_g * s * gamma * f)
            picked.append((c_t, c_g))
        if picked == branches:
            break
        branches = picked
        alpha, beta = (float(v) for v in _lstsq_nonneg(rows, targets))
    fit = PipelinedRingFit(alpha, beta, gamma, cores, (), 0.0)
    errs = tuple((fit.predict(n, N, k) - t) / t for k, n, N, t in ms)
    return fit._replace(rel_errors=errs, max_abs_rel_error=max(abs(e) for e in errs))


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
