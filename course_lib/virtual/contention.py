"""What a collective running beside compute takes from it: SMs.

NCCL runs a collective as one kernel of one CTA per channel, and a CTA holds its SM for the
kernel's whole life, waiting for its peers included. Inside a DGX A100 or H100 node its ring
has 24 channels (``Hardware.nccl_channels``, derived from NCCL's topology search in
:mod:`course_lib.planner.presets`); a small collective uses fewer: NCCL drops channels while
``bytes < channels x threads x threshold`` (``src/enqueue.cc``; 512 threads, 64 bytes a thread
for the Simple protocol, 8 for LL and LL128, times the ranks for the ring's LL: :func:`ctas`).
A group that spans nodes runs on its GPUs' NICs: one channel per NIC of a node in the group,
doubled by ``ncclTopoPostset`` (an assumption: the search's inter-node case is not traced).

While the collective's kernel runs (``windows``: [start, end, CTAs] on the rank's clock), a
compute kernel beside it gets the SMs it does not hold:

* a GEMM: its output tiles go one per SM at a time (the tile x wave model of
  :mod:`course_lib.planner.gemm`), each to an SM as soon as one is free, the collective's SMs
  excepted while it runs (:func:`tiles_end`). So a GEMM of exactly one wave on 132 SMs beside a
  24-CTA all-gather runs a second wave of 24 tiles: the "tail effect" seen on an H100 (NVIDIA
  developer forum thread 337991: the GEMM's time nearly doubled). With no collective it is the
  tile model's ``ceil(tiles / SMs)`` waves, to the bit;
* a fused attention kernel (compute bound, no tile model here): its work at the free SMs'
  share of the rate (:func:`fluid_end`);
* a memory-bound kernel (elementwise, copies, a GEMM on its HBM roofline) or one at the kernel
  floor: unchanged. A part of the SMs saturates HBM; the collective's own HBM traffic, which a
  real GPU shares, is left out.

The collective itself is priced as before (NCCL's model, the links): left out, that a compute
kernel holding every SM delays the collective's CTAs (Megatron-LM launches its overlapped
collectives first for that reason, ``CUDA_DEVICE_MAX_CONNECTIONS=1``).
"""
from __future__ import annotations

import math

from course_lib.planner.gemm import tile_work

SIMPLE_THREADS, LL_THREADS, LL128_THREADS = 512, 512, 640   # device.h: NCCL_*_MAX_NTHREADS
THRESHOLD = {"Simple": 64, "LL": 8, "LL128": 8}              # comm.h: NCCL_*_THREAD_THRESHOLD
EPS = 1e-15


def ctas(hw, nbytes: float, n_ranks: int, n_nodes: int, local: int, protocol: str = "Simple") -> int:
    """CTAs (SMs) NCCL's kernel for a ring collective of ``nbytes`` (NCCL's size: the whole
    buffer) holds on each member: the channels, fewer for a small message (see the module doc).
    0 where ``hw`` states no channels or the group is one rank."""
    channels = getattr(hw, "nccl_channels", 0)
    if not channels or n_ranks <= 1:
        return 0
    if n_nodes > 1:
        channels = min(channels, 2 * local)
    proto = protocol.split("/")[-1]
    threads = {"Simple": SIMPLE_THREADS, "LL": LL_THREADS, "LL128": LL128_THREADS}[proto]
    ring_ll = proto == "LL" and protocol.startswith("ring")        # tuning.cc: the ring's LL threshold x ranks
    threshold = THRESHOLD[proto] * (n_ranks if ring_ll else 1)
    return max(1, min(channels, int(nbytes // (threads * threshold))))


class Tiles(float):
    """A compute-bound kernel's seconds on a free GPU, with what contention needs: its output
    ``tiles`` and each tile's seconds ``tau`` (a GEMM on the tile model), or ``tau = None``
    (fused attention: its work shared out by SMs). A float everywhere else."""
    __slots__ = ("tiles", "tau")

    def __new__(cls, seconds: float, tiles: int = 0, tau: float | None = None):
        self = super().__new__(cls, seconds)
        self.tiles, self.tau = tiles, tau
        return self


def gemm_tiles(M, N, K, batch, hw, seconds: float) -> Tiles | float:
    """``seconds`` (the kernel model's time for the GEMM) as :class:`Tiles` where it is the tile
    model's waves (:func:`course_lib.planner.gemm.tile_work`; not the HBM roofline, not the
    kernel floor), else as it is."""
    if not hw.sm_count:
        return seconds
    tiles, tau = tile_work(M, N, K, hw, batch)
    if math.ceil(tiles / hw.sm_count) * tau != seconds:
        return seconds
    return Tiles(seconds, tiles, tau)


def _held(t: float, windows) -> int:
    return sum(c for s, e, c in windows if s <= t < e)


def _next_boundary(t: float, windows) -> float:
    return min((x for s, e, _ in windows for x in (s, e) if x > t + EPS), default=math.inf)


def tiles_end(start: float, tiles: int, tau: float, windows, sms: int) -> float:
    """When a GEMM of ``tiles`` output tiles of ``tau`` seconds each, started at ``start``, ends
    on ``sms`` SMs of which the collectives in ``windows`` hold their CTAs while they run: each
    tile to a free SM as soon as there is one (an SM already running a tile keeps it)."""
    t, left, running, busy = start, tiles, [], 0      # running: [end, tiles] in order of end
    while True:
        while running and running[0][0] <= t + EPS:
            busy -= running.pop(0)[1]
        if left:
            n = min(left, max(1, sms - _held(t, windows)) - busy)
            if n > 0:
                running.append([t + tau, n])
                left -= n
                busy += n
            if not left:
                return running[-1][0]
        t = min(running[0][0] if running else math.inf, _next_boundary(t, windows))


def fluid_end(start: float, seconds: float, windows, sms: int) -> float:
    """When a compute-bound kernel of ``seconds`` on the whole GPU, started at ``start``, ends
    when it runs at the free SMs' share of its rate while the collectives in ``windows`` run."""
    t, left = start, seconds
    while True:
        share = max(1, sms - _held(t, windows)) / sms
        nxt = _next_boundary(t, windows)
        if left <= share * (nxt - t):
            return t + left / share
        left -= share * (nxt - t)
        t = nxt


def contended_end(start: float, seconds: Tiles, windows, sms: int) -> float:
    """The end of a compute-bound kernel (:class:`Tiles`) started at ``start`` beside ``windows``."""
    if seconds.tau is None:
        return fluid_end(start, float(seconds), windows, sms)
    return tiles_end(start, seconds.tiles, seconds.tau, windows, sms)


__all__ = ["ctas", "Tiles", "gemm_tiles", "tiles_end", "fluid_end", "contended_end"]
