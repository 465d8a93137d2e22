"""course_lib/virtual, ``VirtualCluster(dtype=None)``: each tensor priced at its own dtype (its
bytes in kernels and on the wire, a GEMM at its dtype's rate), for a program that runs the GPU's
dtypes for real. The default (bf16) prices every floating tensor at 2 bytes: unchanged (the other
virtual-clock tests run it). Expected prices from the planner's Hardware and formulas here."""
import pytest
import torch

from course_lib import trace
from course_lib.collectives.comm import Comm
from course_lib.launch import launch
from course_lib.planner import HARDWARE
from course_lib.planner.gemm import gemm_time
from course_lib.virtual import VirtualCluster
from course_lib.virtual.compute import op_time, tensor_bytes

A100 = HARDWARE["a100-80gb"].with_(launch_overhead=0.0)   # kernels back to back: no issue interval
N = 1024
aten = torch.ops.aten


def _gemm(dtype_rate, n=N, itemsize=2, hw=A100):
    """One n x n x n GEMM at ``dtype_rate`` FLOP/s peak: the tile x wave model, or its bytes."""
    eff = hw.efficiencies()
    return max(gemm_time(n, n, n, hw.with_(peak_flops=dtype_rate, matmul_efficiency=eff["gemm"])),
               3 * n * n * itemsize / (hw.hbm_bandwidth * eff["elementwise"]), hw.kernel_floor)


def test_each_tensor_at_its_own_dtype_in_kernels():
    own, bf16 = VirtualCluster(A100, dtype=None), VirtualCluster(A100)
    a32 = torch.randn(N, N)
    a16, i64 = a32.bfloat16(), torch.zeros(N, dtype=torch.int64)
    assert tensor_bytes(own, [a32, a16, i64]) == N * N * (4 + 2) + N * 8
    assert tensor_bytes(bf16, [a32, a16, i64]) == N * N * (2 + 2) + N * 8      # the default: floats at 2
    fp32_rate = A100.peak_flops_for("float32")
    assert fp32_rate == 19.5e12 and A100.peak_flops == 312e12
    mm = aten.mm.default
    assert op_time(own, mm, (a16, a16), {}, a16 @ a16) == pytest.approx(_gemm(A100.peak_flops), rel=1e-12)
    assert op_time(own, mm, (a32, a32), {}, a32 @ a32) == pytest.approx(_gemm(fp32_rate, itemsize=4), rel=1e-12)
    assert op_time(bf16, mm, (a32, a32), {}, a32 @ a32) == op_time(bf16, mm, (a16, a16), {}, a16 @ a16)
    # a memory-bound kernel moves its own bytes: fp32 += bf16 (Megatron's main_grad.add_) reads
    # 4 + 2 and writes 4 bytes an element
    ew = A100.hbm_bandwidth * A100.efficiencies()["elementwise"]
    out = a32.clone().add_(a16)
    assert op_time(own, aten.add_.Tensor, (a32.clone(), a16), {}, out) == pytest.approx(N * N * 10 / ew, rel=1e-12)
    assert op_time(bf16, aten.add_.Tensor, (a32.clone(), a16), {}, out) == pytest.approx(N * N * 6 / ew, rel=1e-12)
    with pytest.raises(ValueError, match="dtype torch.float64 has no FLOP rate"):
        op_time(own, mm, (a32.double(), a32.double()), {}, (a32 @ a32).double())
    with pytest.raises(ValueError, match="torch.dtype .* or None"):
        VirtualCluster(A100, dtype="bf16")
    assert "each tensor at its own dtype" in own.describe() and "dtype=None" in repr(own)


def _rank():
    comm = Comm(None, dim="dp")
    x32, x16 = torch.ones(N * N), torch.ones(N * N, dtype=torch.bfloat16)
    a16 = torch.ones(N, N, dtype=torch.bfloat16)
    with trace.span("bf16 gemm", "compute"):
        a16 @ a16
    with trace.span("fp32 gemm", "compute"):
        a16.float() @ a16.float()
    comm.all_reduce(x32, name="fp32 all-reduce")
    comm.all_reduce(x16, name="bf16 all-reduce")
    return float(x32[0]), float(x16[0])


def test_a_launch_prices_gemms_and_collectives_at_their_dtype():
    """Two ranks on one node: the fp32 all-reduce moves twice the bf16 one's bytes, the fp32
    GEMM runs at fp32's rate; the results are the real ones."""
    res = launch(_rank, 2, clock=VirtualCluster(A100, dtype=None))
    assert [r for r in res] == [(2.0, 2.0)] * 2
    spans = {(s.rank, s.name): s for s in res.spans}
    assert spans[0, "bf16 gemm"].duration == pytest.approx(_gemm(A100.peak_flops), rel=1e-9)
    # two .float() of contiguous tensors: casts, one streaming pass each (kernel_cost.STREAMING_COPIES)
    casts = 2 * N * N * 6 / (A100.hbm_bandwidth * A100.efficiencies()["elementwise"])
    assert spans[0, "fp32 gemm"].duration >= _gemm(A100.peak_flops_for("float32"), itemsize=4)
    assert spans[0, "fp32 gemm"].duration == pytest.approx(_gemm(19.5e12, itemsize=4) + casts, rel=1e-9)
    from course_lib.virtual.links import nccl_collective
    for name, nbytes in (("fp32 all-reduce", 4 * N * N), ("bf16 all-reduce", 2 * N * N)):
        assert spans[0, name].duration == pytest.approx(nccl_collective(A100, "all_reduce", nbytes, 2, 1)[0],
                                                        rel=1e-9)
