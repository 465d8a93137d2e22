"""The GEMM model against GEMMs measured on real GPUs (planner.gemm_measured), not the course's.

The bound, derived from the data, not tuned: two independent measurements of the same H100
GEMMs differ by (a) the table's two campaigns, at most NOISE = max |log(older / newer)| over
the 65 shapes (2.1%), and (b) two H100s measured by different people: the course's record
and MAMF's H100 row imply per-tile fractions apart by OFFSET = |log(record's / MAMF's)| (1.6%).
A model that contradicts the table by more than NOISE + OFFSET (3.7%) in its median, or in its
trend over K, contradicts a real GPU."""
import math
import statistics

import pytest

from course_lib.planner import gemm_measured as GM
from course_lib.planner.gemm import gemm_time
from course_lib.planner.presets import HARDWARE
from course_lib.virtual.gpu_check import H100

H100_HW, A100_HW = HARDWARE["h100-sxm"], HARDWARE["a100-80gb"]


def record():
    by = {r["label"]: r["measured"] for r in H100["rows"]}
    return 8192, 8192, 8192, by["GEMM 8192^3"] - H100["issue_interval"]


def mamf(gpu, hw):
    tf, shape, _ = GM.MAMF[gpu]
    return GM.tile_fraction(hw, *shape, 2 * math.prod(shape) / (tf * 1e12))


def clock(hw):
    return hw.with_(matmul_efficiency=hw.efficiencies()["gemm"])


def bound():
    noise = max(abs(math.log(old / new)) for new, old in map(GM.measured_seconds, GM.XLA_H100))
    offset = abs(math.log(clock(H100_HW).matmul_efficiency / mamf("H100 SXM", H100_HW)))
    return noise, offset


def contradictions(hw, limit):
    """What of the table ``hw``'s GEMM model contradicts beyond ``limit`` (log): its median
    ratio, and its trend from K = 1024 to K = 4096 (10 and 31 shapes)."""
    ratios = GM.model_ratios(hw)
    median = statistics.median(r[-1] for r in ratios)
    by_k = {K: statistics.median(r[-1] for r in ratios if r[3] == K) for K in (1024, 4096)}
    found = []
    if abs(math.log(median)) > limit:
        found.append(f"median model/measured {median:.3f}")
    if abs(math.log(by_k[4096] / by_k[1024])) > limit:
        found.append(f"K trend {by_k[1024]:.3f} at K=1024, {by_k[4096]:.3f} at K=4096")
    return found


def test_the_bound_is_small_and_the_data_is_what_was_read():
    noise, offset = bound()
    assert len(GM.XLA_H100) == 65 and {r[0] for r in GM.XLA_H100} == {1, 2, 4}
    assert all(2 * r[0] * r[1] * r[2] * r[3] / (r[4] * 1e12) >= 40e-6 for r in GM.XLA_H100)
    assert 0.005 < noise < 0.03 and 0.005 < offset < 0.03, (noise, offset)


def test_the_h100_model_does_not_contradict_xlas_table_and_the_old_one_did():
    limit = sum(bound())
    assert contradictions(clock(H100_HW), limit) == []
    # the model before K_0 (the record's 0.834 a tile, K_0 = 0) contradicts it on both counts
    old = H100_HW.with_(gemm_tile_overhead=0.0, matmul_efficiency=0.834)
    assert len(contradictions(old, limit)) == 2, contradictions(old, limit)
    assert GM.log_rms(GM.model_ratios(clock(H100_HW))) < GM.log_rms(GM.model_ratios(old)) / 2


def test_k0_is_the_fit_of_the_table_and_the_fraction_the_fit_of_the_record():
    k0, fraction = GM.fit_tile_overhead(H100_HW, record())
    assert k0 == H100_HW.gemm_tile_overhead == A100_HW.gemm_tile_overhead == 192
    assert fraction == pytest.approx(H100_HW.efficiencies()["gemm"], abs=1e-3)
    # the record stays exact: the model prices the 8192^3 GEMM at its measured time
    M, N, K, seconds = record()
    assert gemm_time(M, N, K, clock(H100_HW)) == pytest.approx(seconds, rel=1e-3)


def test_the_a100_fraction_is_mamfs_a100_row_and_the_same_route_agrees_on_the_h100():
    assert A100_HW.efficiencies()["gemm"] == pytest.approx(mamf("A100 SXM", A100_HW), abs=1e-3)
    tf, shape, _ = GM.MAMF["H100 SXM"]
    priced = 2 * math.prod(shape) / gemm_time(*shape, clock(H100_HW)) / 1e12
    assert abs(math.log(priced / tf)) <= sum(bound()), (priced, tf)
    # the H100's fraction, assumed for the A100 before, prices MAMF's A100 shape 6% slow
    tf, shape, _ = GM.MAMF["A100 SXM"]
    assumed = 2 * math.prod(shape) / gemm_time(*shape, A100_HW.with_(matmul_efficiency=0.854)) / 1e12
    assert assumed / tf < 1 - sum(bound())


def test_beyond_the_table_the_models_k_trend_is_tilelangs():
    """XLA's table stops at K = 4096; the big models' weight GEMMs run at K = 12,288-25,600.
    TileLang's H800 family (M = N = 8192, K to 16,384; not cuBLAS, so only rate(K) / rate(4096)
    is compared) shows the rate still rising 4.1% from 4096 to 16,384: the model's K_0 gives
    3.5%, no more, so the model is not optimistic at large K. The model without K_0 (a flat
    rate over K) contradicts it beyond the same bound."""
    limit = sum(bound())
    trend = GM.k_trend(clock(H100_HW))
    assert set(GM.TILELANG_H800) >= {2048, 4096, 8192, 16384}
    for K in (2048, 8192, 16384):
        measured, model = trend[K]
        assert abs(math.log(model / measured)) <= limit, (K, measured, model)
    measured, model = trend[16384]
    assert model <= measured, "the model's rate rises faster over K than measured"
    flat = GM.k_trend(H100_HW.with_(gemm_tile_overhead=0.0, matmul_efficiency=0.834))
    assert abs(math.log(flat[16384][1] / flat[16384][0])) > limit
