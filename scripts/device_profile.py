"""Per-op GPU profiles of the workloads the virtual clock still prices fast, and a grid of
torch's foreach kernels: data for the kernel model, recorded for sessions without a GPU.

    python scripts/device_profile.py --save FILE

* ``breakdown``: for the GPT-2 block, the unfused attention and the AdamW step of
  ``gpu_check.unseen_workloads`` (and AdamW with ``fused=True``), each aten op's virtual
  seconds (the preset guessed from the device) next to torch.profiler's self device time;
* ``events``: the same workloads' CUDA-event time, one run alone and runs back to back;
* ``foreach``: torch's ``_foreach_*`` ops over n tensors of e elements (bf16 and fp32),
  seconds of one call, calls back to back (the GPU's time, not the host's).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from course_lib.virtual import VirtualCluster  # noqa: E402
from course_lib.virtual.gpu_check import (breakdown, foreach_calls, measured_seconds,  # noqa: E402
                                          unseen_workloads)



def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", required=True)
    args = ap.parse_args(argv)
    name = torch.cuda.get_device_name(0)
    preset = "h200" if "H200" in name else "h100-sxm"
    cluster = VirtualCluster(preset, gpus_per_node=8, dtype=torch.bfloat16)
    out = dict(device=name, torch=torch.__version__, preset=preset, breakdown={}, events={}, foreach=[])
    works = unseen_workloads("cuda")

    def fused_adamw():
        with torch.device("cuda"):
            params = [torch.nn.Parameter(torch.randn(2 << 20, dtype=torch.bfloat16)) for _ in range(48)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        opt.step()
        return opt
    works["AdamW step (fused, 48 x 2M bf16)"] = (fused_adamw, lambda opt: opt.step())
    for label, (setup, run) in works.items():
        if label.startswith("SwiGLU"):
            continue
        out["breakdown"][label] = breakdown(cluster, setup, run, show=False)
        out["events"][label] = dict(alone=measured_seconds(setup, run, 10),
                                    back_to_back=measured_seconds(setup, run, 10, back_to_back=True))
        print(label, out["events"][label], flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        for n, e in ((48, 2 << 20), (48, 1 << 16), (8, 16 << 20), (256, 1 << 18)):
            a, b, c = ([torch.rand(e, device="cuda", dtype=dtype) + 1 for _ in range(n)] for _ in range(3))
            for op, fn in foreach_calls().items():
                seconds = measured_seconds(lambda: None, lambda _: fn(a, b, c), 5, back_to_back=True)
                out["foreach"].append(dict(op=op, dtype=str(dtype), n=n, elements=e, seconds=seconds))
            print(dtype, n, e, flush=True)
            del a, b, c
    with open(args.save, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
