"""FP8 training, emulated on any CPU: Transformer Engine's hybrid recipe (e4m3 forward, e5m2
backward, one scale per tensor), and finer scales (per row, per block) for any tensor.

    model = swap_linear_to_fp8(TinyGPT(cfg), recipe="delayed", history_len=16)
    logits, loss = model(x, y)        # every nn.Linear now runs FP8LinearFunction
    loss.backward()                   # gradients of the outputs quantised to e5m2

torch's float8 dtypes store the values: a tensor is QUANTISED (multiplied by its scale,
saturated to the format's largest value, rounded to 8 bits), the matmul runs on the 8-bit
values widened to float32 (an FP8 tensor core multiplies 8-bit inputs and accumulates in
fp32 alike), and the product is divided by the two scales. What this emulates exactly: the
rounding of every input to 8 bits, with its range and its subnormals; what it does not:
the speed (the CPU computes in fp32).

The two formats (OCP FP8): e4m3 (4 exponent bits, 3 mantissa bits, no inf) reaches 448
with relative precision 2**-3, down to 2**-9; e5m2 (5 and 2) reaches 57344 with 2**-2,
down to 2**-16. Activations and weights need precision (e4m3); gradients need range (e5m2).
Neither has the range of a tensor's actual values, so each tensor gets a scale:

* current scaling: scale = max_fp8 / amax(this tensor), computed just before quantising
  (one extra read of the tensor; on a GPU the amax stays on the device, no host sync: only
  this emulation's ``float(amax)`` synchronises);
* delayed scaling (Transformer Engine's hybrid recipe, amax history 1024 by default):
  scale = max_fp8 / max(amax history), the amaxes of this tensor in the last H steps; this
  step's amax is recorded afterwards. A value larger than the history predicts saturates.

Finer scales (:func:`quantize_blocks`): one per row (torchao's rowwise recipe), per 1 x 128
tile or 128 x 128 block (DeepSeek-V3), per 32 elements with power-of-two scales (MXFP8).
"""
from __future__ import annotations

import math
from collections import deque

import torch
import torch.nn as nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("current", "delayed", "none")   # "none": scale 1, the failure case


def format_facts(dtype) -> dict:
    """Largest value, smallest normal and subnormal, relative precision of a float8 dtype."""
    info = torch.finfo(dtype)
    return {"max": info.max, "smallest_normal": info.tiny, "smallest_subnormal": info.tiny * info.eps,
            "relative_precision": info.eps}


def compute_scale(amax: float, dtype, margin: int = 0) -> float:
    """max_fp8 / amax / 2**margin: the tensor's largest magnitude lands on the format's largest
    value (``margin`` binades below it). amax 0 or not finite: scale 1 (nothing to learn from)."""
    if not math.isfinite(amax) or amax <= 0.0:
        return 1.0
    return torch.finfo(dtype).max / amax / 2.0 ** margin


def quantize(x, scale: float, dtype):
    """x * scale, saturated to +-max (no inf, no NaN from a large value), rounded to ``dtype``.
    (torch 2.13 on CPU saturates e4m3 by itself; earlier versions and other devices give NaN.)"""
    limit = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def dequantize(q, scale: float):
    return q.float() / scale


def rounding_error(x, scale: float, dtype):
    """The largest |x - dequantize(quantize(x))| allowed element-wise, without saturation:
    u |x| for a normal number (u = eps / 2: 2**-4 in e4m3, 2**-3 in e5m2), half the smallest
    subnormal / scale below the normal range."""
    facts = format_facts(dtype)
    return torch.maximum(x.abs().float() * facts["relative_precision"] / 2,
                         torch.full_like(x, facts["smallest_subnormal"] / 2 / scale, dtype=torch.float32))


def matmul_error_bound(a, b, sa: float, sb: float, dtype_a=E4M3, dtype_b=E4M3):
    """How far the FP8 product of a (m, k) and b (k, n) may be from a @ b: the inputs' rounding,
    |da| |b| + |a| |db| + |da| |db|, plus fp32's reordering of k terms (course_lib.tolerance)."""
    from course_lib.tolerance import reorder_bound

    da, db = rounding_error(a, sa, dtype_a), rounding_error(b, sb, dtype_b)
    magnitude = (a.abs().float() + da) @ (b.abs().float() + db)
    return da @ b.abs().float() + a.abs().float() @ db + da @ db + reorder_bound(torch.float32, a.shape[-1]) * magnitude


def underflow_fraction(x, scale: float, dtype) -> float:
    """The share of x's nonzero elements that become 0 in ``dtype`` at this scale."""
    nonzero = x != 0
    if not nonzero.any():
        return 0.0
    return float((quantize(x, scale, dtype).float() == 0)[nonzero].float().mean())


def quantize_blocks(x, block, dtype=E4M3, power_of_two=False):
    """x (rows, cols) quantised with one scale per ``block`` = (r, c) elements: (rows, cols) is
    per-tensor, (1, cols) rowwise (torchao), (1, 128) and (128, 128) DeepSeek-V3's activation
    tiles and weight blocks, (1, 32) with ``power_of_two`` MXFP8 (its scale an E8M0 exponent,
    1 byte; here the largest power of two that saturates nothing). Each block's amax lands
    at the format's max. Returns (codes (rows, cols), scales (rows / r, cols / c), fp32)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_blocks takes a 2-D tensor (rows, cols), got shape {tuple(x.shape)}")
    (rows, cols), (r, c) = x.shape, block
    if r < 1 or c < 1 or rows % r or cols % c:
        raise ValueError(f"block {tuple(block)} must divide the tensor's shape {(rows, cols)}")
    blocks = x.detach().float().reshape(rows // r, r, cols // c, c)     # (R, r, C, c)
    amax = blocks.abs().amax(dim=(1, 3))                                 # (R, C)
    limit = torch.finfo(dtype).max
    scale = torch.where((amax > 0) & amax.isfinite(), limit / amax, torch.ones_like(amax))
    if power_of_two:                   # 2**floor(log2(scale)), exactly: frexp's exponent
        scale = torch.ldexp(torch.ones_like(scale), torch.frexp(scale).exponent - 1)
    codes = (blocks * scale[:, None, :, None]).clamp(-limit, limit).to(dtype)
    return codes.reshape(rows, cols), scale


def dequantize_blocks(codes, scales, block):
    """The values ``quantize_blocks`` encoded: each block's codes divided by its scale."""
    (rows, cols), (r, c) = codes.shape, block
    blocks = codes.float().reshape(rows // r, r, cols // c, c) / scales[:, None, :, None]
    return blocks.reshape(rows, cols)


class TensorScaling:
    """The scale of one tensor role (a layer's input, weight or output gradient) over the
    steps: ``current``, ``delayed`` (amax history of ``history_len`` steps) or ``none``."""

    def __init__(self, dtype, recipe: str = "delayed", history_len: int = 16, margin: int = 0):
        check_recipe(recipe, history_len)
        self.dtype, self.recipe, self.margin = dtype, recipe, margin
        self.amax_history = deque(maxlen=history_len)    # the last H steps' amaxes
        self.last_scale = 1.0

    def scale_for(self, x) -> float:
        """The scale to quantise x with; records x's amax in the history (delayed)."""
        amax = float(x.detach().abs().max()) if x.numel() else 0.0
        if self.recipe == "none":
            scale = 1.0
        elif self.recipe == "current" or not self.amax_history:   # first step: nothing recorded yet
            scale = compute_scale(amax, self.dtype, self.margin)
        else:
            scale = compute_scale(max(self.amax_history), self.dtype, self.margin)
        if math.isfinite(amax):
            self.amax_history.append(amax)
        self.last_scale = scale
        return scale


class FP8Meta:
    """A layer's three scalings: input and weight in e4m3, output gradient in e5m2."""

    def __init__(self, recipe: str = "delayed", history_len: int = 16, margin: int = 0):
        self.input = TensorScaling(E4M3, recipe, history_len, margin)
        self.weight = TensorScaling(E4M3, recipe, history_len, margin)
        self.grad_output = TensorScaling(E5M2, recipe, history_len, margin)


class FP8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with x, W quantised to e4m3 and dy to e5m2 (8-bit values, fp32 matmul)."""

    @staticmethod
    def forward(ctx, x, weight, bias, meta: FP8Meta):      # x (..., in), weight (out, in)
        sx, sw = meta.input.scale_for(x), meta.weight.scale_for(weight)
        xq, wq = quantize(x, sx, E4M3), quantize(weight, sw, E4M3)   # 1 byte per element
        y = (xq.float() @ wq.float().t()) / (sx * sw)                 # (..., out), rescaled
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(xq, wq)       # FP8 copies are what backward keeps: 1 byte each
        ctx.scales, ctx.meta, ctx.has_bias, ctx.w_dtype = (sx, sw), meta, bias is not None, weight.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):                                  # dy (..., out)
        xq, wq = ctx.saved_tensors
        sx, sw = ctx.scales
        sg = ctx.meta.grad_output.scale_for(dy)
        gq = quantize(dy, sg, E5M2).float()                 # (..., out)
        dx = (gq @ wq.float()) / (sg * sw)                  # (..., in)
        dw = (gq.flatten(0, -2).t() @ xq.float().flatten(0, -2)) / (sg * sx)   # (out, in)
        db = dy.float().flatten(0, -2).sum(0) if ctx.has_bias else None   # unquantised, as TE
        return dx.to(dy.dtype), dw.to(ctx.w_dtype), db, None


class FP8Linear(nn.Module):
    """An nn.Linear whose matmuls run in FP8; shares the Linear's weight and bias."""

    def __init__(self, linear: nn.Linear, recipe: str = "delayed", history_len: int = 16, margin: int = 0):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.meta = FP8Meta(recipe, history_len, margin)

    def forward(self, x):
        return FP8LinearFunction.apply(x, self.weight, self.bias, self.meta)

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, recipe={self.meta.input.recipe}"


def check_recipe(recipe, history_len=16):
    if recipe not in RECIPES:
        raise ValueError(f"FP8 scaling recipe must be one of {RECIPES}, got {recipe!r}")
    if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
        raise ValueError(f"history_len (the amax history's length) must be a positive int, got {history_len!r}")


def swap_linear_to_fp8(model: nn.Module, recipe: str = "delayed", history_len: int = 16, margin: int = 0,
                       skip=()) -> nn.Module:
    """Replace every nn.Linear of ``model`` (in place; names in ``skip`` kept) by an FP8Linear
    sharing its parameters. Returns the model."""
    check_recipe(recipe, history_len)
    swaps = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in skip]
    for name, linear in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FP8Linear(linear, recipe, history_len, margin))
    return model


def all_gather_fp8(shard, comm_group=None, counter=None):
    """FSDP's parameter all-gather in FP8: one all-reduce (MAX) of the amax gives every rank
    the same per-tensor scale; each rank quantises its shard (n, ...) to e4m3 and the 1-byte
    codes are all-gathered. Returns (the gathered e4m3 tensor (size * n, ...), the scale).
    Runs course_lib's ring collectives; ``counter`` (a TrafficCounter) counts their bytes."""
    from course_lib import collectives as C

    amax = shard.detach().abs().max().float().reshape(1)            # (1,)
    C.all_reduce(amax, op=C.ReduceOp.MAX, group=comm_group, counter=counter)
    scale = compute_scale(float(amax), E4M3)
    codes = quantize(shard, scale, E4M3).view(torch.uint8)           # (n, ...) 1 byte each
    size = torch.distributed.get_world_size(comm_group)
    out = codes.new_empty((size * shard.shape[0], *shard.shape[1:]))  # on the shard's device
    C.all_gather_into_tensor(out, codes, group=comm_group, counter=counter)
    return out.view(E4M3), scale


__all__ = ["E4M3", "E5M2", "RECIPES", "format_facts", "compute_scale", "quantize", "dequantize",
           "rounding_error", "matmul_error_bound", "underflow_fraction", "quantize_blocks",
           "dequantize_blocks", "TensorScaling", "FP8Meta", "FP8LinearFunction", "FP8Linear",
           "swap_linear_to_fp8", "all_gather_fp8", "check_recipe"]
