"""The copy class of course_lib.planner.kernel_cost: a contiguous copy streams, a strided one is
the fitted "copy" class, and a copy's destination is written, not read."""
import torch

from course_lib.planner.kernel_cost import COPY, ELEMENTWISE, KernelModel, op_cost
from course_lib.planner.presets import HARDWARE
from course_lib.virtual import gpu_check

aten = torch.ops.aten


def _cost(func, *args):
    out = func(*args)
    return op_cost(func, args, {}, out, None)      # each tensor at its own dtype


def test_a_contiguous_cast_streams_and_reads_only_its_source():
    src, dst = torch.empty(1024, 512, device="meta"), torch.empty(1024, 512, dtype=torch.bfloat16, device="meta")
    flops, nbytes, cls, _ = _cost(aten.copy_.default, dst, src)
    assert (flops, nbytes, cls) == (0, 1024 * 512 * (4 + 2), ELEMENTWISE)   # fp32 read, bf16 written
    flops, nbytes, cls, _ = _cost(aten._to_copy.default, dst)                 # .to(): no dtype, a clone
    assert (nbytes, cls) == (2 * 1024 * 512 * 2, ELEMENTWISE)
    _, nbytes, cls, _ = _cost(aten.fill_.Scalar, dst, 0.0)                    # a fill writes only
    assert (nbytes, cls) == (1024 * 512 * 2, ELEMENTWISE)
    a100 = KernelModel(HARDWARE["a100-80gb"])
    eff = HARDWARE["a100-80gb"].efficiencies()
    assert a100.roofline(0, 6e9, ELEMENTWISE) == 6e9 / (HARDWARE["a100-80gb"].hbm_bandwidth * eff["elementwise"])


def test_a_strided_copy_keeps_the_fitted_copy_class():
    x = torch.empty(4, 16, 2048, 128, device="meta")
    _, nbytes, cls, _ = _cost(aten.clone.default, x.transpose(1, 2))          # a transpose: strided read
    assert (nbytes, cls) == (2 * x.numel() * 4, COPY)
    dst = torch.empty(4, 2048, 16, 128, device="meta")
    _, nbytes, cls, _ = _cost(aten.copy_.default, dst, x.transpose(1, 2))     # into a contiguous destination
    assert (nbytes, cls) == (2 * x.numel() * 4, COPY)                          # read the source, write dst
    a, b = torch.empty(8, 64, device="meta"), torch.empty(8, 64, device="meta").t()
    assert _cost(aten.cat.default, [a, a])[2] == ELEMENTWISE
    assert _cost(aten.cat.default, [b, b])[2] == COPY


def test_the_records_copies_are_strided_so_the_fit_is_unchanged():
    # every copy of the recorded H100 block (what the "copy" fraction was fitted on) is strided
    work = gpu_check.workloads("meta")
    label = next(k for k in work if k.startswith("block"))
    classes = gpu_check.class_bytes(*work[label])
    for op in ("clone", "cat"):
        assert set(classes[op]) == {"copy"}, (op, classes[op])
    fit = gpu_check.fit_kernels(HARDWARE["h100-sxm"])
    assert round(fit["copy"], 3) == dict(HARDWARE["h100-sxm"].kernel_efficiency)["copy"]
