"""The GEMM model (course_lib.planner.gemm) against measured GEMMs on real GPUs.

    python benchmarks/gemm_table.py

1. XLA's measured H100 table (course_lib.planner.gemm_measured.XLA_H100, 65 shapes of at
   least 40 us): model seconds / measured seconds, median and spread, by K and by b M N, for
   the clock's GEMM (the preset's per-tile fraction and K_0) and for the model without K_0
   (the fraction the course's H100 record gives then), and for the planner's (the preset's
   matmul_efficiency, 0.70 a tile, assumed); the table's two campaigns against each other
   (the noise floor).
2. MAMF's best shapes (A100 SXM, H100 SXM): the per-tile fraction each implies.
2b. Beyond the table's K: TileLang's H800 family (M = N = 8192, K 256-16,384), rate(K) /
   rate(4096) measured and modelled (the kernels' level divided out).
3. The published validation rows' GEMMs (planner.gemm.layer_gemms, one micro-batch of one
   layer on one GPU): their shapes, the FLOP-weighted K, whether the table covers them, and
   the GEMM part's efficiency with and without K_0 (the A100 rows: its MAMF fraction).
Ratio < 1: the model is faster than the GPU (optimistic).
"""
import math
import statistics

from course_lib.lab.dry_runs import published_runs
from course_lib.planner import gemm_measured as GM
from course_lib.planner.gemm import gemm_time, layer_gemms
from course_lib.planner.presets import HARDWARE
from course_lib.virtual.gpu_check import H100


def record_gemm():
    """(M, N, K, seconds) of the course's H100 record's 8192^3 GEMM, less one issue."""
    by = {r["label"]: r["measured"] for r in H100["rows"]}
    return 8192, 8192, 8192, by["GEMM 8192^3"] - H100["issue_interval"]


def clock_hw(name, k0=None):
    """The preset as the clock prices a GEMM (its "gemm" per-tile fraction); ``k0`` another
    K_0 with the fraction refitted to the record (the H100's; an A100 keeps its own)."""
    hw = HARDWARE[name]
    hw = hw.with_(matmul_efficiency=hw.efficiencies()["gemm"])
    if k0 is None:
        return hw
    hw = hw.with_(gemm_tile_overhead=float(k0))
    if name == "a100-80gb":
        tf, shape, _ = GM.MAMF["A100 SXM"]
        return hw.with_(matmul_efficiency=GM.tile_fraction(hw, *shape, 2 * math.prod(shape) / (tf * 1e12)))
    return hw.with_(matmul_efficiency=GM.tile_fraction(hw, *record_gemm()))


def spread(values):
    q = sorted(values)
    return f"median {statistics.median(q):5.3f}  min {q[0]:5.3f}  max {q[-1]:5.3f}  n {len(q):2d}"


def table_section():
    print("1. XLA's measured H100 table, model seconds / measured (< 1: optimistic)")
    print("   " + GM.XLA_H100_SOURCE[:70] + "...")
    noise = [o / n for n, o in map(GM.measured_seconds, GM.XLA_H100)]
    print(f"   the table's older campaign / newer: {spread(noise)}")
    before = HARDWARE["h100-sxm"].with_(gemm_tile_overhead=0.0, matmul_efficiency=0.834)
    for label, hw in (("clock before (K_0 = 0)", before), ("clock now", clock_hw("h100-sxm")),
                      ("planner (preset's matmul_efficiency)", HARDWARE["h100-sxm"])):
        ratios = GM.model_ratios(hw)
        print(f"   {label}: per tile {hw.matmul_efficiency:.4f}, K_0 {hw.gemm_tile_overhead:g}, "
              f"log-rms {GM.log_rms(ratios):.3f}")
        print(f"     all      {spread(r[-1] for r in ratios)}")
        for K in sorted({r[3] for r in ratios}):
            print(f"     K {K:4d}   {spread(r[-1] for r in ratios if r[3] == K)}")
        for mn in sorted({r[0] * r[1] * r[2] for r in ratios}):
            print(f"     bMN 2^{int(math.log2(mn)):2d} {spread(r[-1] for r in ratios if r[0] * r[1] * r[2] == mn)}")
        for mn in sorted({r[0] * r[1] * r[2] for r in ratios if r[3] == 4096}):
            print(f"     K 4096, bMN 2^{int(math.log2(mn)):2d} "
                  f"{spread(r[-1] for r in ratios if r[0] * r[1] * r[2] == mn and r[3] == 4096)}")


def mamf_section():
    print("2. MAMF's best shapes: the per-tile fraction they imply (K_0 of the preset)")
    for gpu, name in (("A100 SXM", "a100-80gb"), ("H100 SXM", "h100-sxm")):
        tf, shape, torch_version = GM.MAMF[gpu]
        hw = clock_hw(name)
        implied = GM.tile_fraction(hw, *shape, 2 * math.prod(shape) / (tf * 1e12))
        model = 2 * math.prod(shape) / gemm_time(*shape, hw) / 1e12
        print(f"   {gpu}: {tf} TFLOP/s at {'x'.join(map(str, shape))} (torch {torch_version}): "
              f"per tile {implied:.3f}; preset {hw.matmul_efficiency:.3f} prices it at {model:.1f}")


def k_trend_section():
    print("2b. Rate over K beyond the table: TileLang on an H800 SXM, M = N = 8192, fp16")
    print("   " + GM.TILELANG_H800_SOURCE[:70] + "...")
    print(f"   {'K':>6s} {'TFLOP/s':>8s} {'measured / K=4096':>18s} {'model / K=4096':>15s} {'model / measured':>17s}")
    for K, (measured, model) in GM.k_trend(clock_hw("h100-sxm")).items():
        print(f"   {K:6d} {GM.TILELANG_H800[K]:8d} {measured:18.4f} {model:15.4f} {model / measured:17.4f}")
    print("   > 1 at small K: TileLang's kernels are slower there than cuBLAS (XLA's table: 1.08 at K=256)")


def efficiency(gemms, hw):
    flops = sum(w * 2 * M * N * K * b for M, N, K, b, _, w, k in gemms if k == "gemm")
    seconds = sum(w * gemm_time(M, N, K, hw, b, out) for M, N, K, b, out, w, k in gemms if k == "gemm")
    return flops / (seconds * hw.peak_flops)


def rows_section():
    print("3. The validation rows' GEMMs (one layer, one micro-batch, one GPU; gemm kernels only)")
    print(f"   {'row':28s} {'shapes (M x N x K)':44s} {'K (FLOP-wtd)':>12s} {'in table':>8s} "
          f"{'eff K0=0':>8s} {'eff now':>8s}")
    for source, name, model, hw, layout, *_ in published_runs():
        gpu = "a100-80gb" if hw.peak_flops == HARDWARE["a100-80gb"].peak_flops else "h100-sxm"
        s = layout.seq_len or model.seq_len
        fwd, bwd = layer_gemms(model, s, layout.micro_batch, layout.tp, layout.cp, layout.ep, layout.recompute,
                               hw.fused_attention, etp=layout.etp, sp=layout.sp)
        gemms = [g for g in fwd + bwd if g[6] == "gemm"]
        flops = [g[5] * 2 * g[0] * g[1] * g[2] * g[3] for g in gemms]
        k_mean = math.exp(sum(f * math.log(g[2]) for f, g in zip(flops, gemms)) / sum(flops))
        covered = sum(f for f, g in zip(flops, gemms) if max(g[:3]) <= 4096) / sum(flops)
        shapes = sorted({(int(g[0]), int(g[1]), int(g[2])) for g in fwd if g[6] == "gemm"})
        text = " ".join("x".join(map(str, x)) for x in shapes[:3]) + (" ..." if len(shapes) > 3 else "")
        before = efficiency(gemms, HARDWARE[gpu].with_(gemm_tile_overhead=0.0, matmul_efficiency=0.834))
        after = efficiency(gemms, clock_hw(gpu))
        print(f"   {source[:12] + ' ' + name:28.28s} {text:44.44s} {k_mean:12.0f} {covered:8.0%} "
              f"{before:8.3f} {after:8.3f}")
    print("   eff K0=0: the clock before this change (0.834 a tile, the H100 record's, on both GPUs)")


def main():
    table_section()
    print()
    mamf_section()
    print()
    k_trend_section()
    print()
    rows_section()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
