"""course_lib/virtual/contention: a collective's kernel holds SMs; a GEMM beside it gets the rest.

Expected times are written here from the tile x wave model's definition (planner/gemm.py's
module doc) and NCCL's rules (src/enqueue.cc, src/graph), not read from the clock's code."""
import math

import pytest
import torch

from course_lib import trace
from course_lib.collectives.comm import Comm
from course_lib.launch import launch
from course_lib.planner import HARDWARE
from course_lib.virtual import VirtualCluster
from course_lib.virtual.contention import Tiles, ctas, fluid_end, gemm_tiles, tiles_end

H100, A100 = HARDWARE["h100-sxm"], HARDWARE["a100-80gb"]
MiB = 1 << 20


def _tau(hw, K):
    """Seconds of one 128 x 128 output tile of a bf16 GEMM with inner size K on ``hw``: its FLOPs,
    K + K_0 steps, at the SM's share of the per-tile rate."""
    rate = hw.peak_flops * dict(hw.kernel_efficiency)["gemm"] / hw.sm_count
    return 2 * 128 * 128 * (K + hw.gemm_tile_overhead) / rate


def test_nccl_channels_and_the_ctas_a_collective_holds():
    """24 channels on a DGX A100 and H100 node; NCCL drops one while bytes < channels x 512 threads x
    64 bytes (Simple), so a collective holds one CTA per 32 KiB up to 24; across nodes, two per
    NIC of a node in the group; a Hardware that states no channels holds none."""
    assert H100.nccl_channels == A100.nccl_channels == 24
    assert "connect.cc" in dict(A100.sources)["nccl_channels"]
    assert [ctas(H100, n, 8, 1, 8) for n in (1024, 64 << 10, 96 << 10, 512 << 10, MiB, 100 * MiB)] == \
        [1, 2, 3, 16, 24, 24]
    assert ctas(H100, 100 * MiB, 16, 2, 8) == 16 and ctas(H100, 100 * MiB, 32, 32, 1) == 2
    assert ctas(H100, MiB, 8, 1, 8, "ring/LL") == 24 and ctas(H100, 256 << 10, 8, 1, 8, "ring/LL") == 8
    assert ctas(H100, 100 * MiB, 1, 1, 1) == 0
    assert ctas(H100.with_(nccl_channels=0), 100 * MiB, 8, 1, 8) == 0


def test_tiles_and_waves():
    """No collective: ceil(tiles / SMs) waves. A collective for the whole GEMM: the waves of the
    SMs it leaves (one wave of 132 tiles beside 24 CTAs: two, the forum's tail effect). One that
    ends mid-GEMM: its SMs take tiles from then on, each SM as soon as it is free."""
    assert tiles_end(0.0, 132, 1.0, [], 132) == 1.0
    assert tiles_end(0.0, 133, 1.0, [], 132) == 2.0
    assert tiles_end(0.0, 132, 1.0, [[0.0, 5.0, 24]], 132) == 2.0
    assert tiles_end(0.0, 108, 1.0, [[0.0, 5.0, 24]], 132) == 1.0
    # 432 tiles on 108 SMs, 24 held until 1.5: 84 at 0, 84 at 1, 24 at 1.5, 84 at 2, 24 at 2.5,
    # 84 at 3, 24 at 3.5, the last 24 at 4: done at 5 (4 waves without it)
    assert tiles_end(0.0, 432, 1.0, [[0.0, 1.5, 24]], 108) == 5.0
    # a collective that starts mid-GEMM takes SMs as their tiles end, not before
    assert tiles_end(0.0, 264, 1.0, [[0.5, 9.0, 24]], 132) == 3.0
    # fused attention: its work at the free SMs' share (27 of 108 held: 3/4 of the rate)
    assert fluid_end(0.0, 1.0, [[0.0, 9.0, 27]], 108) == pytest.approx(4 / 3)
    assert fluid_end(0.0, 1.0, [[0.5, 9.0, 27]], 108) == pytest.approx(0.5 + 0.5 * 4 / 3)
    assert fluid_end(2.0, 1.0, [[0.0, 1.0, 27]], 108) == 3.0


def test_only_a_gemm_on_its_tile_model_is_marked():
    """A GEMM whose time is its tile model's waves carries its tiles and a tile's seconds; one on
    its HBM roofline (a GEMM of K = 16, its output's bytes the bound) or a hardware without SMs keeps a plain float."""
    from course_lib.planner.kernel_cost import KernelModel
    model = KernelModel(H100)
    K = 1024
    sec = model.seconds(2.0 * 1536 * 1280 * K, 0, "gemm", (1536, 1280, K, 1))
    marked = gemm_tiles(1536, 1280, K, 1, model.gemm_hw, sec)
    assert type(marked) is Tiles and marked.tiles == 12 * 10 and marked.tau == pytest.approx(_tau(H100, K), rel=1e-12)
    assert float(marked) == pytest.approx(_tau(H100, K), rel=1e-12)          # one wave
    flat = model.seconds(2.0 * 8192 * 8192 * 16, 0, "gemm", (8192, 8192, 16, 1))
    assert flat > math.ceil(64 * 64 / 132) * _tau(H100, 16)
    assert type(gemm_tiles(8192, 8192, 16, 1, model.gemm_hw, flat)) is float
    assert type(gemm_tiles(1536, 1280, K, 1, model.gemm_hw.with_(sm_count=0), sec)) is float


def _gemm_beside(nbytes, async_op, M=1536, N=1280, K=1024):
    """Rank's compute-stream seconds of one (M x K) @ (K x N) GEMM issued right after an
    all-reduce of ``nbytes`` (async: the GEMM runs beside it; blocking: after it)."""
    comm = Comm(None)
    x, a, b = torch.zeros(nbytes // 2), torch.randn(M, K), torch.randn(K, N)
    comm.barrier()
    h = comm.all_reduce(x, async_op=async_op)
    t0 = trace.now()
    a @ b
    t1 = trace.now()
    if async_op:
        h.wait()
    return t1 - t0


@pytest.mark.parametrize("channels", [24, 0])
def test_a_gemm_beside_an_async_collective_loses_its_sms(channels):
    """Two H100s of one node. 120 tiles: one wave on 132 SMs. Beside a 32 MiB all-reduce (24 CTAs,
    ~0.1 ms, longer than the GEMM) 108 SMs are free: two waves. Beside a 64 KiB one (2 CTAs) still
    one; after a blocking one, one. A Hardware with no channels: always one."""
    hw = H100.with_(nccl_channels=channels)
    tau = _tau(H100, 1024)

    def run(nbytes, async_op):
        return launch(_gemm_beside, 2, nbytes, async_op, clock=VirtualCluster(hw, gpus_per_node=8))[0]
    big, small, blocking = run(32 * MiB, True), run(64 << 10, True), run(32 * MiB, False)
    assert blocking == pytest.approx(tau, rel=1e-9)           # one wave, the host ahead of the stream
    # after an async issue the GEMM also waits for the host to issue it: the same wait both times
    assert small > blocking
    assert big - small == pytest.approx((1 if channels else 0) * tau, rel=1e-9, abs=1e-15)
