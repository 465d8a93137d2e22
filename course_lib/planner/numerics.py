"""The numerics of a layout's precision (``Layout.precision``, the names of
:mod:`course_lib.precision.mixed`) as the planner prices them: bytes per gradient element where
the micro-batches' gradients are summed and where the data-parallel collectives carry them, and
bytes per parameter of the optimizer step.

* ``"full"``: the planner's convention of a bf16 program (every floating tensor 2 bytes; ZeRO's
  K = 12 in memory; the optimizer step's 28 bytes a parameter of :data:`OPTIMIZER_BYTES_FULL`);
* ``"bf16"``: a bf16 model and fp32 masters; gradients summed over the micro-batches and reduced
  in bf16, widened to the masters' fp32 after the sum (Megatron-LM 2021-22 under --fp16:
  ``main_grad`` in the parameters' dtype, then ``main_grad.float()``);
* ``"bf16-reduce-fp32"``: summed in bf16 by autograd, widened, reduced in fp32;
* ``"bf16-accumulate-fp32"``: each micro-batch's gradient added into an fp32 buffer (the first
  one cast into it), reduced in fp32 (Megatron-LM's main_grad under
  accumulate_allreduce_grads_in_fp32, DeepSpeed's BF16_Optimizer, Llama 3).
Under the three mixed precisions the step reads and writes the fp32 master, momentum and
variance (24 bytes), reads the fp32 gradient (4) and copies the master into the bf16 model
(read 4, write 2): 34 bytes, 40 where the gradient is widened first (read 2, write 4). The same
program the dry run runs (``course_lib.virtual.dry_run`` under a precision); the planner may not
import it, so its bytes are stated here and a test checks them against the dtypes of
``course_lib.precision.mixed.check_precision``.
"""
from __future__ import annotations

from dataclasses import dataclass

from course_lib.planner.kernel_cost import ELEMENTWISE, KernelModel
from course_lib.planner.kernels import Kernels

OPTIMIZER_BYTES_FULL = 28     # fp32 master, momentum, variance read and written; bf16 gradient read, weight written
FP32, BF16 = 4, 2


@dataclass(frozen=True)
class Numerics:
    """Bytes per element: ``accumulate``, of the micro-batches' gradient sum; ``reduce``, of a
    gradient on the DP wire; ``masters``: fp32 masters apart from the bf16 model; ``widen``: the
    gradients cast to the masters' fp32 after the schedule; ``per_microbatch``: the sum added as
    each backward produces it, in its own buffer (the first micro-batch's a cast)."""
    accumulate: int
    reduce: int
    masters: bool
    widen: bool
    per_microbatch: bool

    @property
    def optimizer_bytes(self) -> int:
        """HBM bytes per parameter of the optimizer step (see the module's docstring)."""
        if not self.masters:
            return OPTIMIZER_BYTES_FULL
        return 3 * 2 * FP32 + FP32 + (FP32 + BF16) + ((BF16 + FP32) if self.widen else 0)

    def accumulation_bytes(self, microbatches: int) -> int:
        """HBM bytes per parameter of summing ``microbatches`` backwards' gradients: each add
        after the first reads the sum and the new gradient and writes the sum; a sum kept in its
        own buffer costs the first micro-batch's cast too. The "full" convention: bf16 adds."""
        later = (microbatches - 1) * (2 * self.accumulate + BF16)
        return later + ((BF16 + self.accumulate) if self.per_microbatch else 0)


NUMERICS = {
    "full": Numerics(BF16, BF16, masters=False, widen=False, per_microbatch=False),
    "bf16": Numerics(BF16, BF16, masters=True, widen=True, per_microbatch=False),
    "bf16-reduce-fp32": Numerics(BF16, FP32, masters=True, widen=True, per_microbatch=False),
    "bf16-accumulate-fp32": Numerics(FP32, FP32, masters=True, widen=False, per_microbatch=True),
}


def numerics(precision: str) -> Numerics:
    """The :class:`Numerics` of ``precision``; a ValueError for one the planner does not price
    ("fp32": fp32 compute, whose GEMMs the planner does not rate)."""
    if precision not in NUMERICS:
        raise ValueError(f"the planner prices precision in {tuple(NUMERICS)}, got {precision!r}")
    return NUMERICS[precision]


def gradient_sums(hw, elements: float, tensors: int, num, m: int) -> Kernels:
    """The kernels of one step's gradient sums over ``m`` micro-batches (:mod:`.numerics`):
    autograd's adds into a bf16 ``.grad`` (m - 1 per tensor); or, summed in their own buffer
    (``num.per_microbatch``: the course's ``MainGrads``), the first backward's cast into it
    (``.to``: read 2, write 4) and m - 1 adds of a bf16 gradient into it (read 4 + 2, write 4)."""
    model = KernelModel(hw, "float32")
    if not num.per_microbatch:           # (as runtime.accumulation: read two, write one, at bf16)
        seconds = model.roofline(elements, 6 * elements, ELEMENTWISE)
        return Kernels(tensors, elements, 6 * elements, seconds, max(seconds, tensors * hw.kernel_floor)).times(m - 1)
    cast, add = (2 + num.accumulate) * elements, (2 * num.accumulate + 2) * elements
    out = Kernels(0, 0, 0, 0.0, 0.0)
    for nbytes, n in ((cast, 1), (add, m - 1)):
        # (the cast of contiguous tensors streams: the clock's elementwise rate, kernel_cost.STREAMING_COPIES)
        seconds = model.roofline(0 if nbytes == cast else elements, nbytes, ELEMENTWISE)
        out = out + Kernels(tensors, 0 if nbytes == cast else elements, nbytes, seconds,
                            max(seconds, tensors * hw.kernel_floor)).times(n)
    return out


def master_copies(hw, elements: float, tensors: int, num) -> Kernels:
    """The kernels of the fp32 masters around a step (``course_lib.precision.mixed.MasterWeights``),
    one per tensor each: the masters copied into the bf16 model (``copy_``: the fp32 source read,
    the bf16 destination written, 4 + 2 bytes), and the gradients widened to fp32 (``.to``:
    2 + 4) unless they were summed in fp32; contiguous casts, priced as the clock prices them
    (kernel_cost.STREAMING_COPIES: one streaming pass, the elementwise rate)."""
    model = KernelModel(hw, "float32")
    out = Kernels(0, 0, 0, 0.0, 0.0)
    for nbytes in (6 * elements, 6 * elements if num.widen else 0):
        if nbytes:
            seconds = model.roofline(0, nbytes, ELEMENTWISE)
            out = out + Kernels(tensors, 0, nbytes, seconds, max(seconds, tensors * hw.kernel_floor))
    return out


__all__ = ["Numerics", "NUMERICS", "numerics", "OPTIMIZER_BYTES_FULL", "gradient_sums", "master_copies"]
