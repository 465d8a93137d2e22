"""FlashAttention's time on this GPU over a grid of shapes: the data the clock's attention
model is fitted on and checked against (``course_lib.planner.attention_measured.H200_FLASH``).

    python scripts/device_attention.py --save FILE [--repeats 5] [--cudnn]

For each (heads x batch, sequence, head dim, causal): CUDA-event medians of the forward alone
(``aten._scaled_dot_product_flash_attention``, the kernel F.scaled_dot_product_attention runs
when it picks the flash backend) and of forward + backward, calls back to back (:func:`timed`), bf16, one sequence of
``heads x batch`` heads; where cuDNN's attention runs (``--cudnn``), the same for it; and the
aten op F.scaled_dot_product_attention dispatches to by default on this GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from course_lib.virtual.gpu_check import measured_seconds  # noqa: E402

aten = torch.ops.aten


def timed(fn, repeats):
    """Seconds of one call, calls back to back (``gpu_check.measured_seconds``: the host's
    dispatch of a call overlaps the GPU's previous one, as in a training step)."""
    return measured_seconds(lambda: None, lambda _: fn(), repeats, back_to_back=True)


def shapes(limit=1 << 33):
    for d in (128, 64):
        for causal in (True, False):
            for heads in (1, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128):
                for s in (512, 1024, 2048, 4096, 8192, 16384, 32768):
                    if heads * s * s > limit or (d == 64 and heads not in (8, 16, 32, 64)):
                        continue
                    if not causal and s > 8192:
                        continue
                    yield heads, s, d, causal


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cudnn", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for heads, s, d, causal in shapes():
        q, k, v = (torch.randn(1, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(1, heads, s, d, device="cuda", dtype=torch.bfloat16)
        fwd = lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[0]
        both = lambda: torch.autograd.grad(fwd(), (q, k, v), grad)
        row = dict(heads=heads, s=s, d=d, causal=causal, fwd=timed(fwd, args.repeats),
                   fwd_bwd=timed(both, args.repeats))
        if args.cudnn and causal:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            def cud():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            try:
                row["cudnn_fwd"] = timed(cud, args.repeats)
                row["cudnn_fwd_bwd"] = timed(lambda: torch.autograd.grad(cud(), (q, k, v), grad), args.repeats)
            except RuntimeError as e:
                row["cudnn_error"] = str(e)[:200]
        rows.append(row)
        print(row, flush=True)
        del q, k, v, grad
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            seen.append(str(func))
            return func(*a, **(kw or {}))
    q = torch.randn(1, 32, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with Ops():
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.sum().backward()
    record = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, rows=rows,
                  sdpa_default_ops=[o for o in seen if "attention" in o])
    print("F.scaled_dot_product_attention by default:", record["sdpa_default_ops"])
    with open(args.save, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
