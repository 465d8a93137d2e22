"""Measured bf16 GEMM rates on real GPUs, independent of the course's own H100 record: the
data the GEMM model (:mod:`course_lib.planner.gemm`) is checked against and its constants
are derived from (``benchmarks/gemm_table.py`` prints the comparison).

XLA's default matmul performance table (``kDefaultMatmulPTable``): cuBLAS GEMMs timed on an
H100 SXM ("sm_90") by the XLA team for its latency-hiding scheduler, on the grid b in
{1, 2, 4}, M, N, K in {256, ..., 4096}, key "bf16xbf16->bf16". Two campaigns of the same
grid are kept in the file's history: the one in force (re-measured 2025-10-21) and the one
before it (2025-08-12). Kept here: the 65 shapes whose measured time in the newer campaign is
at least 40 us (a few microseconds of per-kernel fixed cost are under 10% of them), as
(b, M, N, K, TFLOP/s newer, TFLOP/s older), rounded to 0.1 TFLOP/s. The table has no sm_80
(A100) entry.

MAMF (Bekman's "Maximum Achievable Matmul FLOPS", a mean of 100 iterations after 50 warm-up
per shape, the best over a sweep of shapes): the A100 SXM's and H100 SXM's bf16 rows.
"""
from __future__ import annotations

import math

from course_lib.planner.gemm import gemm_time

XLA_H100_SOURCE = ("openxla/xla xla/service/gpu/model/matmul_interpolator_data.h, key sm_90, read at "
                   "ROCm/xla commit d02afb4fc18aa82cf9a8824672fc5eba298b66aa; the newer campaign "
                   "from openxla commit 71feeddf7cc3c9c7878eee18ea43c983631e6e84 (2025-10-21), the older "
                   "from b2766086ecf90e6e0a52b32f3b1837348859027f (2025-08-12)")

# (b, M, N, K, TFLOP/s in the newer campaign, TFLOP/s in the older), H100 SXM, bf16 -> bf16
XLA_H100 = (
    (1, 1024, 4096, 4096, 751.9, 738.5),
    (1, 2048, 2048, 4096, 752.2, 738.0),
    (1, 2048, 4096, 2048, 725.5, 715.4),
    (1, 2048, 4096, 4096, 752.3, 753.6),
    (1, 4096, 1024, 4096, 751.7, 738.5),
    (1, 4096, 2048, 2048, 727.5, 716.1),
    (1, 4096, 2048, 4096, 759.4, 758.4),
    (1, 4096, 4096, 1024, 685.2, 677.4),
    (1, 4096, 4096, 2048, 735.6, 738.7),
    (1, 4096, 4096, 4096, 780.2, 783.3),
    (2, 512, 4096, 4096, 747.7, 734.7),
    (2, 1024, 2048, 4096, 754.8, 739.0),
    (2, 1024, 4096, 2048, 721.6, 714.6),
    (2, 1024, 4096, 4096, 742.7, 747.7),
    (2, 2048, 1024, 4096, 751.4, 737.2),
    (2, 2048, 2048, 2048, 723.8, 717.7),
    (2, 2048, 2048, 4096, 752.2, 756.7),
    (2, 2048, 4096, 1024, 683.9, 678.7),
    (2, 2048, 4096, 2048, 722.8, 729.1),
    (2, 2048, 4096, 4096, 771.8, 779.3),
    (2, 4096, 512, 4096, 741.0, 729.7),
    (2, 4096, 1024, 2048, 721.8, 713.4),
    (2, 4096, 1024, 4096, 746.6, 750.6),
    (2, 4096, 2048, 1024, 684.3, 680.9),
    (2, 4096, 2048, 2048, 730.6, 733.3),
    (2, 4096, 2048, 4096, 779.0, 783.2),
    (2, 4096, 4096, 512, 613.2, 607.7),
    (2, 4096, 4096, 1024, 691.8, 693.0),
    (2, 4096, 4096, 2048, 759.2, 763.0),
    (2, 4096, 4096, 4096, 804.2, 807.7),
    (4, 256, 4096, 4096, 660.6, 664.0),
    (4, 512, 2048, 4096, 748.0, 737.5),
    (4, 512, 4096, 2048, 702.7, 699.7),
    (4, 512, 4096, 4096, 724.2, 730.1),
    (4, 1024, 1024, 4096, 749.3, 735.9),
    (4, 1024, 2048, 2048, 721.1, 712.7),
    (4, 1024, 2048, 4096, 740.6, 743.6),
    (4, 1024, 4096, 1024, 679.8, 674.9),
    (4, 1024, 4096, 2048, 714.4, 718.7),
    (4, 1024, 4096, 4096, 769.8, 773.5),
    (4, 2048, 512, 4096, 743.3, 730.4),
    (4, 2048, 1024, 2048, 722.3, 710.6),
    (4, 2048, 1024, 4096, 740.6, 745.0),
    (4, 2048, 2048, 1024, 685.4, 674.0),
    (4, 2048, 2048, 2048, 723.2, 725.7),
    (4, 2048, 2048, 4096, 775.3, 779.1),
    (4, 2048, 4096, 512, 608.7, 607.3),
    (4, 2048, 4096, 1024, 688.3, 688.6),
    (4, 2048, 4096, 2048, 751.3, 752.5),
    (4, 2048, 4096, 4096, 800.7, 801.9),
    (4, 4096, 256, 4096, 611.3, 622.5),
    (4, 4096, 512, 2048, 710.1, 703.6),
    (4, 4096, 512, 4096, 720.6, 728.6),
    (4, 4096, 1024, 1024, 677.7, 673.8),
    (4, 4096, 1024, 2048, 716.5, 720.5),
    (4, 4096, 1024, 4096, 773.5, 777.6),
    (4, 4096, 2048, 512, 612.7, 607.5),
    (4, 4096, 2048, 1024, 690.2, 687.9),
    (4, 4096, 2048, 2048, 758.2, 759.3),
    (4, 4096, 2048, 4096, 804.7, 808.7),
    (4, 4096, 4096, 256, 505.2, 503.9),
    (4, 4096, 4096, 512, 620.4, 619.9),
    (4, 4096, 4096, 1024, 722.3, 725.5),
    (4, 4096, 4096, 2048, 759.5, 764.6),
    (4, 4096, 4096, 4096, 788.7, 793.1),
)

MAMF_SOURCE = ("stas00/ml-engineering compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS "
               "comparison table', BF16, commit 744d01e18b79512572f64a6bbd8b5f4a725203a7")

# GPU: (TFLOP/s, (M, N, K) of the best shape, torch version of the measurement)
MAMF = {
    "A100 SXM": (271.2, (1024, 10240, 5120), "2.6.0+cu126"),
    "H100 SXM": (794.5, (2048, 2048, 13312), "2.7.0+cu126"),
}

# Beyond XLA's grid (K <= 4096): one GEMM family timed at K up to 16384, M = N = 8192, fp16, on an
# H800 SXM (the H100 SXM's SMs, clocks and HBM; only its NVLink is cut), by TileLang's autotuned
# kernels (not cuBLAS: their level differs, so only the TREND over K is compared; see k_trend).
TILELANG_H800_SOURCE = ("xwhzz/tilelang (a fork of tile-ai/tilelang) benchmark/matmul/README.md, "
                        "'FP16 Matmul Benchmark (8192x8192)', read at commit "
                        "b2acfc3791d5ddeef3772214222461c85659c904; measured at tilelang 17bd0a6c, "
                        "driver 560.35.05")
# K: TFLOP/s (the README's latency column is in milliseconds: 2 M N K / latency gives these)
TILELANG_H800 = {256: 386, 512: 520, 1024: 628, 2048: 705, 4096: 736, 8192: 758, 16384: 766}



def measured_seconds(row) -> tuple:
    """(newer, older) measured seconds of one :data:`XLA_H100` row."""
    b, M, N, K, new, old = row
    flops = 2.0 * b * M * N * K
    return flops / (new * 1e12), flops / (old * 1e12)


def model_ratios(hw, rows=XLA_H100) -> list:
    """(b, M, N, K, model seconds / measured seconds) per row, ``hw``'s tile x wave model
    (:func:`course_lib.planner.gemm.gemm_time`, its ``matmul_efficiency`` per tile)."""
    return [(*r[:4], gemm_time(r[1], r[2], r[3], hw, r[0]) / measured_seconds(r)[0]) for r in rows]


def k_trend(hw, rates=TILELANG_H800, M=8192, N=8192, base=4096) -> dict:
    """K: (measured rate at K / at ``base``, the model's rate at K / at ``base``) for an
    M x N x K family measured at several K (default :data:`TILELANG_H800`): how a GEMM's rate
    grows with K, the kernel's level divided out. The model's ratio above the measured one
    at large K: the model would be optimistic for the big models' GEMMs (K 12,288-25,600)."""
    def rate(K):
        return 2.0 * M * N * K / gemm_time(M, N, K, hw)
    return {K: (r / rates[base], rate(K) / rate(base)) for K, r in sorted(rates.items())}


def tile_fraction(hw, M, N, K, seconds) -> float:
    """The per-tile fraction of peak that puts an M x N x K GEMM's model time at ``seconds``."""
    return gemm_time(M, N, K, hw.with_(matmul_efficiency=1.0)) / seconds


def log_rms(ratios) -> float:
    """Root mean square of log(model / measured): the scatter, either side alike."""
    return math.sqrt(sum(math.log(r[-1]) ** 2 for r in ratios) / len(ratios))


def fit_tile_overhead(hw, record, candidates=range(0, 513, 32)) -> tuple:
    """(K_0, per-tile fraction) that fit :data:`XLA_H100` best (least log_rms), the fraction
    tied for each K_0 to ``record`` = (M, N, K, seconds) of one measured GEMM (the course's
    H100 record), so the record stays exact and the table decides K_0 alone."""
    def fitted(k0):
        one = hw.with_(gemm_tile_overhead=float(k0))
        return one.with_(matmul_efficiency=tile_fraction(one, *record))
    best = min(candidates, key=lambda k0: log_rms(model_ratios(fitted(k0))))
    return best, fitted(best).matmul_efficiency


__all__ = ["XLA_H100", "XLA_H100_SOURCE", "MAMF", "MAMF_SOURCE", "TILELANG_H800", "TILELANG_H800_SOURCE",
           "measured_seconds", "model_ratios", "k_trend", "tile_fraction", "log_rms", "fit_tile_overhead"]
