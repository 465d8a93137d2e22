"""FlashAttention's measured time on a Hopper GPU: the data the fused attention kernel's tile x
wave model (:data:`course_lib.planner.gemm.ATTENTION_MODEL`) is fitted on and checked against.

``scripts/device_attention.py --cudnn`` on one NVIDIA H200 (SXM, 132 SMs, the H100's compute
and clocks), torch 2.11.0+cu130, driver 580.159.04, 2026-11-29: for each (heads, sequence, head
dim, causal), bf16, one sequence of ``heads`` heads, the median seconds of one call over calls
run back to back (CUDA events; the host dispatches the next call while the GPU runs this one,
as in a training step): the forward alone (``aten._scaled_dot_product_flash_attention``, the
kernel ``F.scaled_dot_product_attention`` runs with the flash backend: FlashAttention-2), the
forward and backward, and (causal rows) the same through cuDNN's attention, the backend
``F.scaled_dot_product_attention`` picks by default on this GPU and torch
(:data:`SDPA_DEFAULT`). Rows are (heads, s, d, causal, forward us, forward + backward us,
cuDNN forward us, cuDNN forward + backward us).

The host dispatches one call of the forward in about 50 us and one backward (autograd) in
about 200 us (the smallest shapes' times: 31.6-52 us forward, 220-280 us both), so a call
whose forward is under :data:`HOST_BOUND` measures the host, not the GPU: those rows are
kept, and left out of the fit and the check.
"""
from __future__ import annotations

import math

SOURCE = ("scripts/device_attention.py on one NVIDIA H200, torch 2.11.0+cu130, driver 580.159.04, "
          "2026-11-29 (course_lib.planner.attention_measured.H200_FLASH)")
SDPA_DEFAULT = ("aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_cudnn_attention_backward")
HOST_BOUND = 200e-6     # a forward under this: at most 4 x the host's dispatch of one call

H200_FLASH = (
    (1, 512, 128, True, 31.6, 247.6, 75.5, 314.6),
    (1, 1024, 128, True, 49.6, 223.2, 85.4, 361.4),
    (1, 2048, 128, True, 51.8, 282.0, 91.0, 383.4),
    (1, 4096, 128, True, 50.6, 377.5, 92.7, 395.7),
    (1, 8192, 128, True, 118.4, 710.5, 107.1, 446.4),
    (1, 16384, 128, True, 465.3, 1608.2, 205.0, 845.4),
    (1, 32768, 128, True, 1260.2, 3508.5, 632.6, 1828.6),
    (4, 512, 128, True, 49.1, 275.1, 80.6, 306.0),
    (4, 1024, 128, True, 49.2, 265.9, 73.0, 406.4),
    (4, 2048, 128, True, 47.4, 273.1, 80.2, 259.1),
    (4, 4096, 128, True, 118.5, 438.7, 97.9, 267.5),
    (4, 8192, 128, True, 397.2, 1278.3, 176.3, 676.7),
    (4, 16384, 128, True, 1214.8, 3544.6, 547.9, 1760.8),
    (4, 32768, 128, True, 3806.7, 12532.7, 1805.5, 6514.0),
    (8, 512, 128, True, 50.4, 307.8, 81.7, 304.7),
    (8, 1024, 128, True, 49.2, 281.4, 78.8, 345.5),
    (8, 2048, 128, True, 64.0, 266.0, 80.1, 326.9),
    (8, 4096, 128, True, 201.7, 707.4, 94.8, 409.9),
    (8, 8192, 128, True, 611.2, 2050.5, 288.4, 1062.0),
    (8, 16384, 128, True, 1937.4, 6515.0, 974.2, 3377.2),
    (8, 32768, 128, True, 6856.3, 24359.3, 3588.5, 14321.2),
    (12, 512, 128, True, 41.1, 304.3, 77.8, 412.7),
    (12, 1024, 128, True, 48.7, 240.8, 77.2, 430.6),
    (12, 2048, 128, True, 104.0, 356.0, 85.5, 273.9),
    (12, 4096, 128, True, 266.1, 912.4, 122.8, 515.7),
    (12, 8192, 128, True, 787.8, 2806.8, 396.6, 1501.6),
    (12, 16384, 128, True, 2661.5, 9417.8, 1402.0, 5028.4),
    (16, 512, 128, True, 55.2, 362.1, 48.9, 355.0),
    (16, 1024, 128, True, 35.0, 195.3, 67.5, 412.5),
    (16, 2048, 128, True, 106.8, 411.5, 55.3, 256.9),
    (16, 4096, 128, True, 321.7, 1131.2, 150.1, 590.7),
    (16, 8192, 128, True, 982.4, 3614.0, 502.1, 1911.9),
    (16, 16384, 128, True, 3521.2, 12559.7, 1752.6, 6982.9),
    (24, 512, 128, True, 48.0, 250.0, 76.2, 272.1),
    (24, 1024, 128, True, 54.0, 242.3, 46.0, 323.2),
    (24, 2048, 128, True, 141.4, 527.1, 67.0, 288.4),
    (24, 4096, 128, True, 410.3, 1543.2, 203.2, 807.7),
    (24, 8192, 128, True, 1346.3, 5108.0, 694.0, 2678.3),
    (24, 16384, 128, True, 4998.7, 18519.8, 2558.3, 10859.7),
    (32, 512, 128, True, 30.6, 201.4, 61.1, 197.5),
    (32, 1024, 128, True, 56.5, 241.9, 58.7, 243.9),
    (32, 2048, 128, True, 167.8, 655.2, 83.2, 355.5),
    (32, 4096, 128, True, 510.1, 1940.5, 259.2, 1034.3),
    (32, 8192, 128, True, 1737.5, 6695.1, 902.1, 3528.2),
    (32, 16384, 128, True, 6609.4, 24244.1, 3383.1, 14607.1),
    (48, 512, 128, True, 36.6, 272.8, 46.0, 340.6),
    (48, 1024, 128, True, 77.9, 327.6, 78.7, 241.1),
    (48, 2048, 128, True, 225.9, 913.9, 116.1, 531.6),
    (48, 4096, 128, True, 717.8, 2802.3, 380.2, 1492.7),
    (48, 8192, 128, True, 2525.8, 9843.0, 1317.2, 5274.6),
    (64, 512, 128, True, 38.6, 370.1, 62.0, 209.5),
    (64, 1024, 128, True, 94.8, 408.0, 60.5, 244.9),
    (64, 2048, 128, True, 273.1, 1126.5, 143.4, 644.5),
    (64, 4096, 128, True, 927.4, 3683.6, 497.5, 1945.9),
    (64, 8192, 128, True, 3350.6, 12942.5, 1795.0, 7048.5),
    (96, 512, 128, True, 56.1, 280.3, 75.9, 368.9),
    (96, 1024, 128, True, 127.9, 572.5, 73.0, 326.3),
    (96, 2048, 128, True, 386.6, 1623.3, 208.7, 888.4),
    (96, 4096, 128, True, 1310.3, 5344.4, 714.1, 2831.9),
    (96, 8192, 128, True, 5016.5, 19141.8, 2632.4, 11371.7),
    (128, 512, 128, True, 69.5, 314.0, 72.6, 225.9),
    (128, 1024, 128, True, 156.4, 717.6, 85.2, 400.6),
    (128, 2048, 128, True, 494.7, 2091.0, 269.3, 1130.0),
    (128, 4096, 128, True, 1730.1, 7076.9, 957.6, 3796.4),
    (128, 8192, 128, True, 6773.9, 25205.3, 3551.1, 15087.2),
    (1, 512, 128, False, 49.2, 290.8, None, None),
    (1, 1024, 128, False, 45.1, 262.9, None, None),
    (1, 2048, 128, False, 44.9, 260.2, None, None),
    (1, 4096, 128, False, 45.9, 353.8, None, None),
    (1, 8192, 128, False, 122.3, 726.8, None, None),
    (4, 512, 128, False, 45.7, 286.9, None, None),
    (4, 1024, 128, False, 44.7, 283.5, None, None),
    (4, 2048, 128, False, 44.0, 221.4, None, None),
    (4, 4096, 128, False, 121.1, 453.3, None, None),
    (4, 8192, 128, False, 399.8, 1588.7, None, None),
    (8, 512, 128, False, 45.9, 279.1, None, None),
    (8, 1024, 128, False, 44.7, 208.5, None, None),
    (8, 2048, 128, False, 62.5, 305.2, None, None),
    (8, 4096, 128, False, 200.3, 822.7, None, None),
    (8, 8192, 128, False, 788.2, 3164.3, None, None),
    (12, 512, 128, False, 44.3, 283.2, None, None),
    (12, 1024, 128, False, 46.6, 278.8, None, None),
    (12, 2048, 128, False, 103.9, 449.4, None, None),
    (12, 4096, 128, False, 347.9, 1279.2, None, None),
    (12, 8192, 128, False, 1177.8, 4759.5, None, None),
    (16, 512, 128, False, 44.8, 221.9, None, None),
    (16, 1024, 128, False, 34.3, 258.9, None, None),
    (16, 2048, 128, False, 104.3, 461.3, None, None),
    (16, 4096, 128, False, 402.0, 1648.3, None, None),
    (16, 8192, 128, False, 1576.2, 6238.5, None, None),
    (24, 512, 128, False, 44.4, 283.0, None, None),
    (24, 1024, 128, False, 55.1, 279.1, None, None),
    (24, 2048, 128, False, 168.7, 684.8, None, None),
    (24, 4096, 128, False, 597.2, 2419.5, None, None),
    (24, 8192, 128, False, 2319.1, 9337.9, None, None),
    (32, 512, 128, False, 32.6, 276.6, None, None),
    (32, 1024, 128, False, 55.1, 282.9, None, None),
    (32, 2048, 128, False, 207.6, 884.3, None, None),
    (32, 4096, 128, False, 794.3, 3252.9, None, None),
    (32, 8192, 128, False, 3136.2, 12413.4, None, None),
    (48, 512, 128, False, 34.3, 274.6, None, None),
    (48, 1024, 128, False, 90.9, 396.2, None, None),
    (48, 2048, 128, False, 309.5, 1318.2, None, None),
    (48, 4096, 128, False, 1189.3, 4910.7, None, None),
    (48, 8192, 128, False, 4685.0, 18530.2, None, None),
    (64, 512, 128, False, 33.6, 251.4, None, None),
    (64, 1024, 128, False, 110.6, 538.4, None, None),
    (64, 2048, 128, False, 408.6, 1744.5, None, None),
    (64, 4096, 128, False, 1585.8, 6426.8, None, None),
    (64, 8192, 128, False, 6329.1, 24557.3, None, None),
    (96, 512, 128, False, 51.4, 293.4, None, None),
    (96, 1024, 128, False, 164.0, 762.9, None, None),
    (96, 2048, 128, False, 608.6, 2586.0, None, None),
    (96, 4096, 128, False, 2337.2, 9569.9, None, None),
    (96, 8192, 128, False, 9437.0, 36130.5, None, None),
    (128, 512, 128, False, 62.5, 324.0, None, None),
    (128, 1024, 128, False, 211.5, 998.7, None, None),
    (128, 2048, 128, False, 806.3, 3582.8, None, None),
    (128, 4096, 128, False, 3215.2, 12698.1, None, None),
    (128, 8192, 128, False, 12761.8, 48168.5, None, None),
    (8, 512, 64, True, 49.2, 286.1, 44.0, 294.8),
    (8, 1024, 64, True, 47.2, 258.0, 76.8, 332.4),
    (8, 2048, 64, True, 38.7, 245.3, 82.2, 185.0),
    (8, 4096, 64, True, 118.6, 425.9, 83.3, 303.0),
    (8, 8192, 64, True, 355.8, 1181.4, 200.7, 741.3),
    (8, 16384, 64, True, 1086.8, 3745.3, 698.0, 2274.6),
    (8, 32768, 64, True, 3887.6, 13743.6, 2389.0, 8975.8),
    (16, 512, 64, True, 30.2, 218.2, 49.1, 445.8),
    (16, 1024, 64, True, 38.9, 300.3, 88.2, 520.0),
    (16, 2048, 64, True, 62.4, 380.1, 89.4, 269.0),
    (16, 4096, 64, True, 183.8, 648.1, 107.3, 414.7),
    (16, 8192, 64, True, 578.2, 2076.0, 350.6, 1276.7),
    (16, 16384, 64, True, 1999.7, 7196.9, 1247.6, 4393.5),
    (32, 512, 64, True, 36.7, 260.7, 75.1, 362.4),
    (32, 1024, 64, True, 37.7, 207.2, 76.6, 402.3),
    (32, 2048, 64, True, 99.0, 385.5, 72.5, 430.3),
    (32, 4096, 64, True, 299.6, 1135.1, 193.6, 749.6),
    (32, 8192, 64, True, 1024.9, 3886.4, 667.0, 2364.7),
    (32, 16384, 64, True, 3808.7, 13970.9, 2447.4, 8698.8),
    (64, 512, 64, True, 39.3, 279.3, 84.5, 308.6),
    (64, 1024, 64, True, 56.7, 285.6, 95.6, 261.3),
    (64, 2048, 64, True, 160.3, 651.9, 104.5, 440.3),
    (64, 4096, 64, True, 536.4, 2113.4, 356.8, 1299.6),
    (64, 8192, 64, True, 1902.3, 7481.5, 1249.5, 4630.3),
    (8, 512, 64, False, 30.9, 198.6, None, None),
    (8, 1024, 64, False, 37.1, 235.6, None, None),
    (8, 2048, 64, False, 40.3, 186.5, None, None),
    (8, 4096, 64, False, 119.6, 461.9, None, None),
    (8, 8192, 64, False, 465.9, 1732.0, None, None),
    (16, 512, 64, False, 44.7, 276.4, None, None),
    (16, 1024, 64, False, 35.5, 294.9, None, None),
    (16, 2048, 64, False, 62.4, 268.9, None, None),
    (16, 4096, 64, False, 236.4, 904.7, None, None),
    (16, 8192, 64, False, 914.8, 3445.4, None, None),
    (32, 512, 64, False, 33.5, 217.4, None, None),
    (32, 1024, 64, False, 33.3, 209.9, None, None),
    (32, 2048, 64, False, 121.5, 501.7, None, None),
    (32, 4096, 64, False, 466.1, 1777.7, None, None),
    (32, 8192, 64, False, 1814.9, 6817.3, None, None),
    (64, 512, 64, False, 31.7, 262.4, None, None),
    (64, 1024, 64, False, 64.5, 285.7, None, None),
    (64, 2048, 64, False, 240.6, 964.6, None, None),
    (64, 4096, 64, False, 918.1, 3555.1, None, None),
    (64, 8192, 64, False, 3608.3, 13467.3, None, None),)


def cudnn(rows=H200_FLASH) -> list:
    """The causal rows' cuDNN columns as rows of their own (heads, s, d, causal, forward us,
    forward + backward us): the kernel ``F.scaled_dot_product_attention`` runs by default here."""
    return [(r[0], r[1], r[2], r[3], r[6], r[7]) for r in rows if r[6] is not None]


def gpu_bound(rows=H200_FLASH) -> list:
    """The rows whose forward takes at least :data:`HOST_BOUND` (the GPU, not the host, sets it)."""
    return [r for r in rows if r[4] * 1e-6 >= HOST_BOUND]


def measured(row, backward: bool) -> float:
    """Seconds of the row's forward, or of its backward (forward + backward less forward)."""
    return ((row[5] - row[4]) if backward else row[4]) * 1e-6


def model_ratios(hw, backward: bool, rows=None) -> list:
    """[(row, modelled / measured seconds)] of ``hw``'s attention kernel model over ``rows``
    (default: :func:`gpu_bound`)."""
    from course_lib.planner.gemm import attention_kernel_time
    rows = gpu_bound() if rows is None else rows
    return [(r, attention_kernel_time(hw, r[0], r[1], r[1], r[2], r[3], backward) / measured(r, backward))
            for r in rows]


def log_rms(ratios) -> float:
    return math.sqrt(sum(math.log(x) ** 2 for x in ratios) / len(ratios))


def fit_attention(hw, rows=None, k0s=range(0, 513, 32), d0s=range(0, 33, 8)) -> dict:
    """The attention model's constants fitted to ``rows`` (default :func:`gpu_bound`) on
    ``hw``'s SMs and peak, deterministic: for each D_0 in ``d0s`` and K_0 in ``k0s``, per
    direction, the efficiency that makes the geometric mean of modelled / measured 1; the
    (D_0, K_0 forward, K_0 backward) of least summed log-rms error. Returns the Hardware fields
    (``kernel_efficiency`` "attention", ``attention_backward_efficiency``,
    ``attention_tile_overhead``, ``attention_head_overhead``) and each direction's log-rms."""
    rows = gpu_bound() if rows is None else rows
    best = None
    for d0 in d0s:
        fit = []
        for backward in (False, True):
            options = []
            for k0 in k0s:
                one = hw.with_(kernel_efficiency=(("attention", 1.0),), attention_backward_efficiency=0.0,
                               attention_tile_overhead=(float(k0), float(k0)), attention_head_overhead=float(d0))
                ratios = [x for _, x in model_ratios(one, backward, rows)]
                eff = math.exp(sum(math.log(x) for x in ratios) / len(ratios))   # the geometric mean
                options.append((log_rms([x / eff for x in ratios]), k0, eff))
            fit.append(min(options))
        score = fit[0][0] + fit[1][0]
        if best is None or score < best[0]:
            best = (score, d0, fit)
    _, d0, ((rms_f, k0_f, eff_f), (rms_b, k0_b, eff_b)) = best
    return dict(attention=eff_f, attention_backward_efficiency=eff_b,
                attention_tile_overhead=(float(k0_f), float(k0_b)), attention_head_overhead=float(d0),
                log_rms=(rms_f, rms_b))
