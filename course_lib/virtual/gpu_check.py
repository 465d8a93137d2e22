"""The virtual GPU clock against a real GPU: the workloads, their prices, and the recorded runs.

``scripts/device_check.py`` runs :func:`workloads` (those the kernel model is fitted on) and
:func:`unseen_workloads`, :func:`gemm_workloads` and :func:`attention_workloads` (those it is
checked on) on a CUDA machine (CUDA events, medians) and under the virtual clock, breaks a
transformer block down per aten op (:func:`breakdown`) and fits the kernel model
(:func:`fit_kernels`). :data:`H100` is what it measured on one H100 SXM, :data:`H200` on one
H200: each preset's kernel constants are :func:`fit_kernels` of its own GPU's record, and
chapter 0 prints both next to the virtual times computed on the spot (:func:`against_recorded`,
on PyTorch's ``meta`` device: prices need shapes only). :data:`H200_AFTER` is a second H200
machine's run of the unseen workloads; :data:`H200_FOREACH` torch's foreach kernels on a grid
(:func:`fit_foreach`, the H200's "foreach" share); :data:`H200_PROFILE` the unseen workloads'
kernels against their events (``scripts/device_profile.py``).
"""
from __future__ import annotations

import statistics

import torch

from course_lib import trace
from course_lib.gpt import Attention, Block, SwiGLU
from course_lib.models import GPTConfig

STREAM_ELEMENTS = 128 << 20    # bf16: 256 MiB a tensor
STREAM = "add 2 x 256 MiB (HBM streaming)"


def workloads(device):
    """{name: (setup() -> state, run(state))}: each run is one measured unit of work."""
    def gemm():
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        return a, a.clone()

    def block():
        cfg = GPTConfig(vocab_size=256, seq_len=2048, n_layers=1, hidden=2048, n_heads=16)
        with torch.device(device):
            mod = Block(cfg).to(torch.bfloat16)
            x = torch.randn(4, 2048, 2048, dtype=torch.bfloat16, requires_grad=True)
        return mod, x

    def tiny():
        return torch.zeros(1, device=device, dtype=torch.bfloat16)

    def stream():
        a = torch.randn(STREAM_ELEMENTS, device=device, dtype=torch.bfloat16)
        return a, torch.randn_like(a)

    def run_block(state):
        mod, x = state
        mod.zero_grad(set_to_none=True)  # else every repeat after the first also accumulates
        x.grad = None                    # the gradients (add_ kernels the one virtual run lacks)
        mod(x).sum().backward()

    def run_tiny(t):
        for _ in range(1000):
            t.add_(1)

    return {"GEMM 8192^3": (gemm, lambda s: s[0] @ s[1]),
            "block fwd+bwd (h 2048, s 2048, b 4)": (block, run_block),
            "1000 tiny kernels": (tiny, run_tiny),
            STREAM: (stream, lambda s: s[0] + s[1])}


def unseen_workloads(device):
    """Workloads and shapes the fit (:func:`fit_kernels`) never saw, held to +-20% on a GPU:
    another block (GPT-2 style: LayerNorm, GeLU, biases), the SwiGLU MLP alone, attention
    alone (the course's, unfused, with rotary embeddings), and an AdamW step (torch's CUDA
    path, foreach) over 48 bf16 tensors."""
    def module(make, cfg, shape):
        def setup():
            with torch.device(device):
                mod = make(cfg).to(torch.bfloat16)
                x = torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)
            return mod, x
        return setup

    def fwd_bwd(state):
        mod, x = state
        mod.zero_grad(set_to_none=True)
        x.grad = None
        mod(x).sum().backward()

    def adamw():
        with torch.device(device):
            params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in [2 << 20] * 48]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4)
        opt.step()                          # the state exists: a steady step
        return opt

    gpt2 = GPTConfig(vocab_size=256, seq_len=1024, n_layers=1, hidden=1024, n_heads=8, block="gpt2")
    llama = GPTConfig(vocab_size=256, seq_len=4096, n_layers=1, hidden=2048, n_heads=16)
    mlp = GPTConfig(vocab_size=256, seq_len=2048, n_layers=1, hidden=4096, n_heads=32, ffn_hidden=11008)
    return {"GPT-2 block fwd+bwd (h 1024, s 1024, b 8)": (module(Block, gpt2, (8, 1024, 1024)), fwd_bwd),
            "SwiGLU MLP fwd+bwd (h 4096, f 11008, 8192 tokens)": (module(SwiGLU, mlp, (4, 2048, 4096)), fwd_bwd),
            "attention fwd+bwd (h 2048, s 4096, b 2)": (module(Attention, llama, (2, 4096, 2048)), fwd_bwd),
            "AdamW step (foreach, 48 x 2M bf16)": (adamw, lambda opt: opt.step())}


# One layer of a published run, one tensor-parallel rank (tp 8): (hidden, tokens per micro-batch)
PUBLISHED_LAYERS = {"22B (Korthikanti Table 4: tp 8, 4 x 2048 tokens)": (6144, 4 * 2048),
                    "175B (Korthikanti Table 5: tp 8, 2048 tokens)": (12288, 2048)}


def layer_gemms(h: int, tokens: int, t: int = 8) -> list:
    """The 12 GEMMs of one GPT layer's forward and backward on one of ``t`` tensor-parallel ranks,
    as (M, K, N) of (M x K) @ (K x N): QKV (one GEMM, width 3h/t), the attention's output
    projection, the MLP's two (4h/t); backward each layer's dX = dY W^T and dW = X^T dY (the
    attention's batched products and everything memory-bound left out)."""
    layers = [(h, 3 * h // t), (h // t, h), (h, 4 * h // t), (4 * h // t, h)]      # (in, out) per rank
    out = []
    for k, n in layers:
        out.append((tokens, k, n))                  # forward: y = x W
    for k, n in layers:
        out += [(tokens, n, k), (k, tokens, n)]     # dX = dY W^T, dW = X^T dY
    return out


def gemm_workloads(device):
    """The GEMMs of one layer of the published runs (:data:`PUBLISHED_LAYERS`, :func:`layer_gemms`)
    run back to back, bf16, operands made once: the clock's tile x wave model at the shapes its
    published rows run, against a GPU's cuBLAS in a training-like sequence (a different operand
    each GEMM, nothing repeated while hot in L2). ``scripts/device_check.py`` holds them to the
    unseen workloads' +-20% and prints virtual / measured: the check of the clock's GEMM rate
    that chapter 10 asks of a GPU (its published rows all run fast)."""
    def make(h, tokens):
        def setup():
            with torch.device(device):
                return [(torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16))
                        for m, k, n in layer_gemms(h, tokens)]
        return setup

    def run(pairs):
        for a, b in pairs:
            a @ b
    return {f"layer GEMMs, {name}": (make(*shape), run) for name, shape in PUBLISHED_LAYERS.items()}


# FlashAttention at the published rows' shapes, one tensor-parallel rank (tp 8): (batch, query
# heads, sequence), head dim 128 (K/V one head per query head: grouped-query attention changes
# the bytes, not the FLOPs)
PUBLISHED_ATTENTION = {"175B (Korthikanti Table 5: 12 heads, s 2048)": (1, 12, 2048),
                       "22B (Korthikanti Table 4: 4 x 6 heads, s 2048)": (4, 6, 2048),
                       "Llama 3 405B (16 heads, s 8192)": (1, 16, 8192)}


def attention_workloads(device):
    """FlashAttention's causal forward and backward at :data:`PUBLISHED_ATTENTION`: the very
    op F.scaled_dot_product_attention runs when it picks the flash backend
    (``aten._scaled_dot_product_flash_attention``, FlashAttention-2 in torch's CUDA build), on
    the GPU and on the meta device alike. Checks the clock's "attention" fraction of peak, which
    the H100 record never measured (its source is a published SDPA benchmark)."""
    aten = torch.ops.aten

    def make(b, a, s):
        def setup():
            with torch.device(device):
                q, k, v = (torch.randn(b, a, s, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
                return q, k, v, torch.randn(b, a, s, 128, dtype=torch.bfloat16)
        return setup

    def run(state):
        q, k, v, grad = state
        out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        torch.autograd.grad(out, (q, k, v), grad)
    return {f"FlashAttention fwd+bwd, {name}": (make(*shape), run) for name, shape in PUBLISHED_ATTENTION.items()}


def virtual_seconds(cluster, setup, run):
    """One run under a fresh virtual clock (setup outside it)."""
    state = setup()
    clock = cluster.start(0, 1, trace.Recorder())
    with clock:
        run(state)
    return clock.t


def measured_seconds(setup, run, repeats, back_to_back: bool = False):
    """Seconds of one run on the GPU: CUDA events around it, the median of ``repeats`` after
    three warm-ups. ``back_to_back``: events around n runs (n such that they take about 3 ms),
    over n, so the host's dispatch of a run overlaps the GPU's previous one, as in a training
    step: the GPU's time for a workload the host dispatches slowly (one attention call)."""
    state = setup()
    for _ in range(3):
        run(state)
    torch.cuda.synchronize()

    def timed(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            run(state)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / n
    n = max(1, min(200, -(-3e-3 // timed(1)))) if back_to_back else 1
    return statistics.median(timed(int(n)) for _ in range(repeats))


def breakdown(cluster, setup, run, repeats=5, show=True):
    """Per aten op: virtual seconds (one run under :func:`course_lib.virtual.compute.op_time`)
    next to the GPU's (torch.profiler's self device time, the mean of ``repeats`` runs).
    A clone's kernel is its copy_'s in the profiler: read those two rows together."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    from course_lib.virtual.compute import op_time
    state = setup()
    virtual, count = Counter(), Counter()

    class PerOp(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seconds = op_time(cluster, func, args, kwargs or {}, out)
            if seconds:
                virtual[func.overloadpacket.__name__] += seconds
                count[func.overloadpacket.__name__] += 1
            return out

    with PerOp():
        run(state)
    for _ in range(3):
        run(state)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            run(state)
        torch.cuda.synchronize()
    measured = Counter()
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            seconds = getattr(e, "self_device_time_total", 0) / 1e6
            measured[e.key[len("aten::"):]] += seconds / repeats
    rows = sorted(set(virtual) | set(measured), key=lambda k: -max(virtual[k], measured[k]))
    rows = {k: (count[k], virtual[k], measured[k]) for k in rows if max(virtual[k], measured[k]) >= 1e-5}
    if show:
        print(f"  {'aten op':26s} {'kernels':>7s} {'virtual ms':>10s} {'measured ms':>11s}")
        for k, (n, v, m) in rows.items():
            print(f"  {k:26s} {n:7d} {v * 1e3:10.3f} {m * 1e3:11.3f}")
        print(f"  {'total':26s} {sum(count.values()):7d} {sum(virtual.values()) * 1e3:10.3f} "
              f"{sum(measured.values()) * 1e3:11.3f}")
    return rows


# scripts/device_check.py --repeats 30 --breakdown --save FILE on one NVIDIA H100 80GB HBM3
# (SXM), torch 2.11.0+cu130, driver 580.159.04, 2026-11-27: seconds, medians of 30 runs.
# "virtual": today's price (re-priced whenever the model changes; the measured figures stay);
# "virtual_then", "fitted" and the breakdown's virtual column: the model of that day (roofline
# at 70% of peak and 100% of HBM, 4 us a kernel), kept as it was recorded
H100 = dict(
    device='NVIDIA H100 80GB HBM3', torch='2.11.0+cu130', preset='h100-sxm', date="2026-11-27",
    rows=[
        dict(label='GEMM 8192^3', virtual=0.00138704, measured=0.00138704, virtual_then=0.0015922),
        dict(label='block fwd+bwd (h 2048, s 2048, b 4)', virtual=0.0110165, measured=0.0120574,
             virtual_then=0.00865431),
        dict(label='1000 tiny kernels', virtual=0.012322, measured=0.0123212, virtual_then=0.004),
        dict(label='add 2 x 256 MiB (HBM streaming)', virtual=0.000277651, measured=0.000277648,
             virtual_then=0.00024439),
    ],
    # what the clock charged these workloads before it was fitted on this record (4 us a
    # launch added to each kernel's roofline, GEMMs at 70% of peak, HBM at 100%): chapter 0
    priced_before_fit={'GEMM 8192^3': 0.0015922, 'block fwd+bwd (h 2048, s 2048, b 4)': 0.00865431,
                       '1000 tiny kernels': 0.004, 'add 2 x 256 MiB (HBM streaming)': 0.00024439},
    span_over_events=0.978338,
    fitted=dict(matmul_efficiency=0.803838,
                hbm_efficiency=0.878464,
                block_virtual=0.00882909),
    issue_interval=1.23212e-05,
    breakdown={  # aten op: (kernels, virtual s, measured s: torch.profiler's self device time)
        'mm': (21, 0.00366211, 0.00321867),
        'mul': (33, 0.0015561, 0.00264666),
        'bmm': (6, 0.00110575, 0.00132559),
        'add': (16, 0.000767661, 0.000984902),
        '_softmax': (1, 0.00032452, 0.000748904),
        'copy_': (0, 0, 0.00064119),
        '_softmax_backward_data': (1, 0.00048478, 0.000525565),
        'add_': (0, 0, 0.00029461),
        'cat': (4, 9.613e-05, 0.000279436),
        'clone': (8, 0.00019226, 0.0),
        'sum': (5, 7.00935e-05, 0.000120176),
        'pow': (6, 0.00010415, 4.98316e-05),
        'neg': (4, 5.6065e-05, 9.30708e-05),
        'silu_backward': (1, 8.42865e-05, 8.52498e-05),
        'div': (2, 2.80423e-05, 5.93858e-05),
        'silu': (1, 5.75243e-05, 5.7345e-05),
        'mean': (2, 2.80423e-05, 2.37378e-05),
        'masked_fill': (1, 1.02602e-05, 0.0),
    },
)


# scripts/device_check.py --repeats 30 --breakdown --save FILE on one NVIDIA H200 (SXM), torch
# 2.11.0+cu130, driver 580.159.04, 2026-11-29: the first GPU the kernel model was not fitted on.
# "virtual_then": the H200 preset of that day, the H100's kernel model with the H200's datasheet
# (4.8 TB/s HBM, the same peak): GEMM 0.95, block 0.85, GPT-2 block 0.73, unfused attention 0.78,
# AdamW 0.66, streaming 1.03, tiny kernels 1.88 (this host issues every 6.55 us, the H100's every
# 12.3). Its memory-bound classes (reduction 0.562, broadcast 0.225, copy 0.194 of 4.8 TB/s) are
# slower shares of HBM than the H100's (0.675, 0.290, 0.257 of 3.35): those kernels did not speed
# up with the HBM, so the H200 preset now has its own model, fit_kernels of this record. The three
# FlashAttention rows here are single calls, each timed alone: the host's dispatch of a call
# (about 250 us for forward and backward) is in them; planner.attention_measured times them back
# to back, the GPU's figure, which the attention model is fitted on.
H200 = dict(
    device='NVIDIA H200', torch='2.11.0+cu130', preset='h200', date="2026-11-29",
    rows=[
        dict(label='GEMM 8192^3', measured=0.0014529, virtual_then=0.00138704),
        dict(label='block fwd+bwd (h 2048, s 2048, b 4)', measured=0.0103753, virtual_then=0.00882593),
        dict(label='1000 tiny kernels', measured=0.0065547, virtual_then=0.012322),
        dict(label='add 2 x 256 MiB (HBM streaming)', measured=0.000191616, virtual_then=0.000197499),
        dict(label='GPT-2 block fwd+bwd (h 1024, s 1024, b 8)', measured=0.00303541, virtual_then=0.00220733),
        dict(label='SwiGLU MLP fwd+bwd (h 4096, f 11008, 8192 tokens)', measured=0.0102632, virtual_then=0.00889158),
        dict(label='attention fwd+bwd (h 2048, s 4096, b 2)', measured=0.0108096, virtual_then=0.0084256),
        dict(label='AdamW step (foreach, 48 x 2M bf16)', measured=0.00151317, virtual_then=0.00099683),
        dict(label='layer GEMMs, 22B (Korthikanti Table 4: tp 8, 4 x 2048 tokens)', measured=0.00389437, virtual_then=0.00361178),
        dict(label='layer GEMMs, 175B (Korthikanti Table 5: tp 8, 2048 tokens)', measured=0.00407584, virtual_then=0.00362457),
        dict(label='FlashAttention fwd+bwd, 175B (Korthikanti Table 5: 12 heads, s 2048)', measured=0.000452992, virtual_then=0.000164316),
        dict(label='FlashAttention fwd+bwd, 22B (Korthikanti Table 4: 4 x 6 heads, s 2048)', measured=0.000634144, virtual_then=0.000316312),
        dict(label='FlashAttention fwd+bwd, Llama 3 405B (16 heads, s 8192)', measured=0.00362384, virtual_then=0.0032549),
    ],
    span_over_events=0.947783,
    issue_interval=6.5547e-06,
    fitted=dict(launch_overhead=6.5547e-06, gemm=0.811256, elementwise=0.906576, reduction=0.561957, broadcast=0.224658, copy=0.194324),
    breakdown={  # aten op: (kernels, virtual s of that day, measured s: torch.profiler's self device time)
        'mm': (21, 0.0032712, 0.00325348),
        'mul': (33, 0.00163154, 0.00206906),
        'add': (16, 0.00110737, 0.00090491),
        'bmm': (6, 0.000965461, 0.000946492),
        '_softmax': (1, 0.000331402, 0.000736923),
        'copy_': (0, 0, 0.000577194),
        '_softmax_backward_data': (1, 0.000497103, 0.000367371),
        'clone': (8, 0.000435207, 0),
        'cat': (4, 0.000217603, 0.000284549),
        'add_': (0, 0, 0.00023141),
        'sum': (5, 5.17942e-05, 0.000101375),
        'neg': (4, 3.08632e-05, 8.81718e-05),
        'pow': (6, 6.57263e-05, 3.58912e-05),
        'silu_backward': (1, 6.18469e-05, 6.5683e-05),
        'div': (2, 4.82339e-05, 6.0864e-05),
        'silu': (1, 4.12313e-05, 4.5728e-05),
        'mean': (2, 2.07227e-05, 1.87454e-05),
    },
)

# The same script on a second H200 machine the same day, after the H200 preset had its own kernel
# model and fused attention its tile x wave model (planner.gemm.ATTENTION_MODEL): (workload,
# virtual s priced then, measured s), the FlashAttention rows timed back to back. Within 15% but
# the tiny kernels (this machine's host issued every 10.5 us, the first's 6.55: the host, not the
# GPU), the GPT-2 block (0.74: LayerNorm, GeLU and biases at head dim 64, never fitted) and
# AdamW's foreach step (0.64): the two unseen workloads the model still prices fast.
H200_AFTER = dict(
    device='NVIDIA H200', torch='2.11.0+cu130', preset='h200', date="2026-11-29",
    issue_interval=1.04842e-05,
    rows=[
        ('GEMM 8192^3', 0.00145289, 0.00143301),
        ('block fwd+bwd (h 2048, s 2048, b 4)', 0.00986243, 0.0102914),
        ('1000 tiny kernels', 0.0065567, 0.0104842),
        ('add 2 x 256 MiB (HBM streaming)', 0.000191615, 0.000198256),
        ('GPT-2 block fwd+bwd (h 1024, s 1024, b 8)', 0.00244437, 0.00331856),
        ('SwiGLU MLP fwd+bwd (h 4096, f 11008, 8192 tokens)', 0.00931828, 0.0102223),
        ('attention fwd+bwd (h 2048, s 4096, b 2)', 0.0096327, 0.0108502),
        ('AdamW step (foreach, 48 x 2M bf16)', 0.000984677, 0.00154643),
        ('layer GEMMs, 22B (Korthikanti Table 4: tp 8, 4 x 2048 tokens)', 0.00379352, 0.00402597),
        ('layer GEMMs, 175B (Korthikanti Table 5: tp 8, 2048 tokens)', 0.00380698, 0.00401733),
        ('FlashAttention fwd+bwd, 175B (Korthikanti Table 5: 12 heads, s 2048)', 0.000328868, 0.000382329),
        ('FlashAttention fwd+bwd, 22B (Korthikanti Table 4: 4 x 6 heads, s 2048)', 0.000520786, 0.000531107),
        ('FlashAttention fwd+bwd, Llama 3 405B (16 heads, s 8192)', 0.00360607, 0.00366166),
    ],
)

# scripts/device_profile.py on the first H200 machine, 2026-11-29: torch's _foreach_ kernels over n
# tensors of e elements, microseconds of one call, calls back to back (op, dtype, n, e, us). The
# 48 x 64K rows are the host's (a call's dispatch is longer than its kernels); the out-of-place
# sqrt and the norm fall back to a kernel per tensor at many small tensors.
H200_FOREACH = (
    ('_foreach_add_', 'bfloat16', 48, 2097152, 186.1),
    ('_foreach_mul_ scalar', 'bfloat16', 48, 2097152, 146.5),
    ('_foreach_lerp_', 'bfloat16', 48, 2097152, 182.6),
    ('_foreach_addcmul_', 'bfloat16', 48, 2097152, 223.1),
    ('_foreach_addcdiv_', 'bfloat16', 48, 2097152, 232.1),
    ('_foreach_sqrt', 'bfloat16', 48, 2097152, 280.7),
    ('_foreach_div_ list', 'bfloat16', 48, 2097152, 199.0),
    ('_foreach_norm', 'bfloat16', 48, 2097152, 249.2),
    ('_foreach_add_', 'bfloat16', 48, 65536, 32.1),
    ('_foreach_mul_ scalar', 'bfloat16', 48, 65536, 23.3),
    ('_foreach_lerp_', 'bfloat16', 48, 65536, 31.6),
    ('_foreach_addcmul_', 'bfloat16', 48, 65536, 41.0),
    ('_foreach_addcdiv_', 'bfloat16', 48, 65536, 40.8),
    ('_foreach_sqrt', 'bfloat16', 48, 65536, 251.5),
    ('_foreach_div_ list', 'bfloat16', 48, 65536, 50.1),
    ('_foreach_norm', 'bfloat16', 48, 65536, 213.8),
    ('_foreach_add_', 'bfloat16', 8, 16777216, 251.3),
    ('_foreach_mul_ scalar', 'bfloat16', 8, 16777216, 201.5),
    ('_foreach_lerp_', 'bfloat16', 8, 16777216, 248.5),
    ('_foreach_addcmul_', 'bfloat16', 8, 16777216, 304.0),
    ('_foreach_addcdiv_', 'bfloat16', 8, 16777216, 314.1),
    ('_foreach_sqrt', 'bfloat16', 8, 16777216, 218.1),
    ('_foreach_div_ list', 'bfloat16', 8, 16777216, 267.7),
    ('_foreach_norm', 'bfloat16', 8, 16777216, 133.1),
    ('_foreach_add_', 'bfloat16', 256, 262144, 134.1),
    ('_foreach_mul_ scalar', 'bfloat16', 256, 262144, 109.4),
    ('_foreach_lerp_', 'bfloat16', 256, 262144, 137.2),
    ('_foreach_addcmul_', 'bfloat16', 256, 262144, 195.7),
    ('_foreach_addcdiv_', 'bfloat16', 256, 262144, 208.8),
    ('_foreach_sqrt', 'bfloat16', 256, 262144, 1411.3),
    ('_foreach_div_ list', 'bfloat16', 256, 262144, 146.6),
    ('_foreach_norm', 'bfloat16', 256, 262144, 1127.9),
    ('_foreach_add_', 'float32', 48, 2097152, 321.5),
    ('_foreach_mul_ scalar', 'float32', 48, 2097152, 235.2),
    ('_foreach_lerp_', 'float32', 48, 2097152, 321.3),
    ('_foreach_addcmul_', 'float32', 48, 2097152, 416.0),
    ('_foreach_addcdiv_', 'float32', 48, 2097152, 419.4),
    ('_foreach_sqrt', 'float32', 48, 2097152, 297.7),
    ('_foreach_div_ list', 'float32', 48, 2097152, 319.6),
    ('_foreach_norm', 'float32', 48, 2097152, 150.2),
    ('_foreach_add_', 'float32', 48, 65536, 20.6),
    ('_foreach_mul_ scalar', 'float32', 48, 65536, 14.3),
    ('_foreach_lerp_', 'float32', 48, 65536, 19.9),
    ('_foreach_addcmul_', 'float32', 48, 65536, 25.8),
    ('_foreach_addcdiv_', 'float32', 48, 65536, 26.3),
    ('_foreach_sqrt', 'float32', 48, 65536, 140.3),
    ('_foreach_div_ list', 'float32', 48, 65536, 61.6),
    ('_foreach_norm', 'float32', 48, 65536, 127.3),
    ('_foreach_add_', 'float32', 8, 16777216, 424.7),
    ('_foreach_mul_ scalar', 'float32', 8, 16777216, 311.7),
    ('_foreach_lerp_', 'float32', 8, 16777216, 424.7),
    ('_foreach_addcmul_', 'float32', 8, 16777216, 543.1),
    ('_foreach_addcdiv_', 'float32', 8, 16777216, 550.1),
    ('_foreach_sqrt', 'float32', 8, 16777216, 320.8),
    ('_foreach_div_ list', 'float32', 8, 16777216, 431.2),
    ('_foreach_norm', 'float32', 8, 16777216, 172.6),
    ('_foreach_add_', 'float32', 256, 262144, 214.3),
    ('_foreach_mul_ scalar', 'float32', 256, 262144, 166.3),
    ('_foreach_lerp_', 'float32', 256, 262144, 214.4),
    ('_foreach_addcmul_', 'float32', 256, 262144, 293.8),
    ('_foreach_addcdiv_', 'float32', 256, 262144, 298.7),
    ('_foreach_sqrt', 'float32', 256, 262144, 759.8),
    ('_foreach_div_ list', 'float32', 256, 262144, 217.4),
    ('_foreach_norm', 'float32', 256, 262144, 625.5),
)
FOREACH_STREAMING = ("_foreach_add_", "_foreach_mul_ scalar", "_foreach_lerp_", "_foreach_addcmul_",
                     "_foreach_addcdiv_", "_foreach_div_ list")


def foreach_calls():
    """{label: call(a, b, c)} of :data:`H200_FOREACH`'s ops on three lists of tensors."""
    return {"_foreach_add_": lambda a, b, c: torch._foreach_add_(a, b),
            "_foreach_mul_ scalar": lambda a, b, c: torch._foreach_mul_(a, 0.5),
            "_foreach_lerp_": lambda a, b, c: torch._foreach_lerp_(a, b, 0.1),
            "_foreach_addcmul_": lambda a, b, c: torch._foreach_addcmul_(a, b, c, value=0.1),
            "_foreach_addcdiv_": lambda a, b, c: torch._foreach_addcdiv_(a, b, c, value=0.1),
            "_foreach_sqrt": lambda a, b, c: torch._foreach_sqrt(a),
            "_foreach_div_ list": lambda a, b, c: torch._foreach_div_(a, c),
            "_foreach_norm": lambda a, b, c: torch._foreach_norm(a)}


def fit_foreach(hw, rows=H200_FOREACH) -> tuple:
    """(efficiency, {dtype: efficiency}) of torch's in-place streaming _foreach_ kernels
    (:data:`FOREACH_STREAMING`) over lists of at least 48M elements: the geometric mean of each
    call's bytes (as the clock counts them, on the meta device) / its time / HBM bandwidth."""
    import math

    from torch.utils._python_dispatch import TorchDispatchMode

    from course_lib.planner.kernel_cost import op_cost
    calls, shares = foreach_calls(), {}

    class Bytes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            cost = op_cost(func, args, kwargs or {}, out, None)
            if cost is not None:
                self.nbytes = cost[1]
            return out
    for op, dtype, n, e, us in rows:
        if op not in FOREACH_STREAMING or n * e < 48 << 20:
            continue
        a, b, c = ([torch.empty(e, device="meta", dtype=getattr(torch, dtype)) for _ in range(n)] for _ in range(3))
        mode = Bytes()
        with mode:
            calls[op](a, b, c)
        shares.setdefault(dtype, []).append(mode.nbytes / (us * 1e-6) / hw.hbm_bandwidth)

    def mean(v):
        return math.exp(sum(math.log(x) for x in v) / len(v))
    return mean([x for v in shares.values() for x in v]), {k: mean(v) for k, v in shares.items()}

# scripts/device_profile.py on the first H200 machine: the unseen workloads' kernels summed from
# torch.profiler's self device time, next to CUDA events around one run alone and runs back to
# back (seconds). What the events hold beyond the kernels is gaps between them.
H200_PROFILE = {
    'GPT-2 block fwd+bwd (h 1024, s 1024, b 8)': dict(kernels=0.00254474, alone=0.0034143, back_to_back=0.00343021),
    'attention fwd+bwd (h 2048, s 4096, b 2)': dict(kernels=0.0105047, alone=0.0109729, back_to_back=0.0109574),
    'AdamW step (foreach, 48 x 2M bf16)': dict(kernels=0.00127645, alone=0.00179378, back_to_back=0.00161849),
    'AdamW step (fused, 48 x 2M bf16)': dict(kernels=0.000498153, alone=0.000844016, back_to_back=0.000592468),
}

def against_recorded(cluster, record=H100):
    """[(workload, virtual seconds priced now on ``cluster``, measured seconds recorded)] for
    every workload of ``record``: the workloads run on PyTorch's ``meta`` device."""
    here = workloads("meta")
    return [(r["label"], virtual_seconds(cluster, *here[r["label"]]), r["measured"])
            for r in record["rows"] if r["label"] in here]


def print_against_recorded(cluster, record=H100):
    """Prints :func:`against_recorded` as a table; returns its rows."""
    rows = against_recorded(cluster, record)
    print(f"{record['device']} ({record['date']}) against {cluster.hw.name} priced now")
    for label, virtual, measured in rows:
        print(f"  {label:38s} virtual {virtual * 1e3:8.3f} ms  measured {measured * 1e3:8.3f} ms"
              f"  virtual / measured {virtual / measured:5.2f}")
    return rows


# the profiler's rows that hold another row's kernels on CUDA: autograd accumulates in place
# (add_), a clone's kernel is its copy_
_SAME_KERNELS = {"add_": "add", "copy_": "clone"}
MEMORY_CLASSES = ("reduction", "broadcast", "copy")   # fitted on the block; elementwise on the streaming add


def class_bytes(setup, run) -> dict:
    """{aten op: {kernel class: bytes}} of one run on the meta device (bf16 bytes)."""
    from collections import defaultdict

    from torch.utils._python_dispatch import TorchDispatchMode

    from course_lib.planner.kernel_cost import op_cost
    by = defaultdict(lambda: defaultdict(float))

    class PerClass(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            cost = op_cost(func, args, kwargs or {}, out, 2)
            if cost is not None:
                by[func.overloadpacket.__name__][cost[2]] += cost[1]
            return out
    state = setup()
    with PerClass():
        run(state)
    return {k: dict(v) for k, v in by.items()}


def fit_kernels(hw, record=H100) -> dict:
    """The kernel model's constants fitted once to ``record`` (deterministic, on the meta device):

    * ``launch_overhead``: the host's issue interval, the tiny kernels' time / 1000;
    * ``elementwise``: the streaming add's bytes over (its time less one issue) / HBM;
    * ``gemm``: the fraction of peak per tile that puts the 8192^3 GEMM's tile x wave time at
      its measured time less one issue;
    * reduction, broadcast, copy: least squares over the block's per-op profile (the measured
      seconds of each aten op against its bytes by class, recomputed on the meta device; the
      GEMMs, priced by the two above, left out)."""
    from course_lib.planner.gemm import gemm_time
    work, by = workloads("meta"), {r["label"]: r["measured"] for r in record["rows"]}
    issue = record["issue_interval"]
    stream = sum(sum(c.values()) for c in class_bytes(*work[STREAM]).values())
    elementwise = stream / (hw.hbm_bandwidth * (by[STREAM] - issue))
    one = hw.with_(matmul_efficiency=1.0)
    gemm = gemm_time(8192, 8192, 8192, one) / (by["GEMM 8192^3"] - issue)
    measured = {}
    for op, (_, _, seconds) in record["breakdown"].items():
        measured[_SAME_KERNELS.get(op, op)] = measured.get(_SAME_KERNELS.get(op, op), 0.0) + seconds
    label = next(k for k in work if k.startswith("block"))
    rows = [(c, measured[op]) for op, c in class_bytes(*work[label]).items()
            if measured.get(op, 0) > 0 and not {"gemm", "attention"} & set(c)]
    # seconds = sum over classes of bytes / (HBM x efficiency): linear in 1 / efficiency
    a = torch.tensor([[c.get(k, 0.0) / hw.hbm_bandwidth for k in MEMORY_CLASSES] for c, _ in rows],
                     dtype=torch.float64)
    b = torch.tensor([m - c.get("elementwise", 0.0) / (hw.hbm_bandwidth * elementwise) for c, m in rows],
                     dtype=torch.float64)
    inverse = torch.linalg.lstsq(a, b, driver="gelsd").solution.tolist()
    return dict(launch_overhead=issue, gemm=gemm, elementwise=elementwise,
                **{k: 1.0 / x for k, x in zip(MEMORY_CLASSES, inverse)})
