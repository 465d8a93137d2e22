"""Graders of chapter 9b (memory and precision): activation recomputation and mixed precision.

    check_activation_bytes(activation_bytes)     # bytes one Llama block keeps, per policy and layout
    check_selective_recompute(attention_core_recompute)   # the attention core, recomputed in backward
    check_wire_bytes(wire_bytes)                 # bytes a rank sends per step: DDP / FSDP, fp32 / bf16
    check_model_state_bytes(model_state_bytes)   # where the master weights live: bytes per rank

Each prints one line and returns True/False. While the learner's function runs, the planner's
formulas, course_lib.recompute, torch.utils.checkpoint and this module's references are off.
"""
from __future__ import annotations

import torch

from course_lib.grading import Case, check, compare, learner
from course_lib.grading.harness import check_answers, number
from course_lib.memory import storage_bytes
from course_lib.planner.communication import dp_bytes_per_step
from course_lib.planner.formulas import zero_memory_bytes
from course_lib.precision.mixed import check_precision

REFERENCES = ("course_lib.grading.memory_precision:_reference_activation_bytes",
              "course_lib.grading.memory_precision:_reference_wire_bytes",
              "course_lib.grading.memory_precision:_reference_model_state_bytes")
FORMULAS = ("course_lib.planner.formulas:*", "course_lib.planner.activations:*", "course_lib.planner.communication:*",
            "course_lib.planner.estimate:*", "course_lib.planner.costs:*")
RECOMPUTE = ("course_lib.recompute:*", "torch.utils.checkpoint:checkpoint", "torch.utils.checkpoint:checkpoint_sequential")
PRECISION = ("course_lib.precision.mixed:*",)
__all__ = ["check_activation_bytes", "check_selective_recompute", "check_wire_bytes", "check_model_state_bytes"]


# ----------------------------------------------------------------------------- activation bytes
ACTIVATION_CASES = [  # s, b, h, a, kv, f, t, sp, policy (bf16 values)
    dict(s=16, b=2, h=32, a=4, kv=2, f=96, t=1, sp=False, policy="none"),
    dict(s=16, b=2, h=32, a=4, kv=2, f=96, t=1, sp=False, policy="selective"),
    dict(s=16, b=2, h=32, a=4, kv=2, f=96, t=1, sp=False, policy="full"),
    dict(s=2048, b=1, h=4096, a=32, kv=8, f=14336, t=8, sp=True, policy="selective"),
    dict(s=2048, b=1, h=4096, a=32, kv=8, f=14336, t=8, sp=False, policy="selective"),
    dict(s=4096, b=2, h=8192, a=64, kv=8, f=28672, t=8, sp=True, policy="full"),
    dict(s=16, b=2, h=32, a=4, kv=2, f=96, t=4, sp=True, policy="none"),          # t > kv: a K/V copy per rank
    dict(s=8192, b=1, h=5120, a=40, kv=8, f=13824, t=4, sp=False, policy="none"),
]


def _check_bytes(name, fn, reference, cases, exercise, off=(FORMULAS, PRECISION, REFERENCES)) -> bool:
    """Grade fn(**case) -> a byte count against ``reference(**case)`` (exact in float64), with
    the library's formulas (``off``) switched off while fn runs."""
    return check_answers(name, fn, [Case(dict(args=c), label=", ".join(f"{k}={v}" for k, v in c.items()))
                                    for c in cases], reference, guard=off, exercise=exercise, read=number,
                         differ=lambda got, want, **_: compare(float(got), float(want), dtype=torch.float64)
                         and f"got {got:,.0f} bytes, expected {want:,.0f}")


def _reference_activation_bytes(s, b, h, a, kv, f, t, sp, policy):
    from course_lib.planner.activations import llama_activation_bytes_per_layer
    return llama_activation_bytes_per_layer(s, b, h, a, kv, f, t=t, sp=sp, recompute=policy)


def check_activation_bytes(fn) -> bool:
    """fn(s, b, h, a, kv, f, t, sp, policy) -> bytes one course (Llama) block keeps for backward
    on one TP rank, bf16 values; checked exactly (integer arithmetic in float64) over 8 layouts."""
    return _check_bytes("activation_bytes", fn, _reference_activation_bytes, ACTIVATION_CASES,
                        "the activation bytes of a block", (FORMULAS, REFERENCES))


# ----------------------------------------------------------------------------- selective recomputation
SELECTIVE_CASES = [(2, 4, 2, 16, 8), (1, 4, 4, 12, 4), (3, 6, 2, 8, 6)]   # b, a, kv, s, d


def _plain_core(q, k, v):
    from course_lib.attention import causal_attention
    return causal_attention(q, k, v)


def check_selective_recompute(fn) -> bool:
    """fn(core, q, k, v) -> core(q, k, v), keeping for backward ONLY q, k and v: the attention
    core (scores, softmax, probs @ V) runs again in backward. Checked on grouped-query shapes
    (float64): the output and the gradients of q, k, v against the plain core (one-step bound),
    the storages autograd keeps (exactly q's, k's and v's), and the core run twice."""
    answer = learner(fn, RECOMPUTE, REFERENCES, exercise="selective recomputation", seconds=10)

    def run(case):
        b, a, kv, s, d = case.params["shape"]
        gen = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(b, n, s, d, generator=gen, dtype=torch.float64, requires_grad=True)
                   for n in (a, kv, kv))
        g = torch.randn(b, a, s, d, generator=gen, dtype=torch.float64)
        want = _plain_core(q, k, v)
        want_grads = torch.autograd.grad(want, (q, k, v), g)
        calls, saved = [0], []

        def core(q_, k_, v_):
            calls[0] += 1
            return _plain_core(q_, k_, v_)

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            got = answer(core, q, k, v)
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return f"expected a {tuple(want.shape)} tensor, got {getattr(got, 'shape', type(got).__name__)}"
        bad = compare(got.detach(), want.detach(), what="output", dtype=torch.float64)
        if bad:
            return bad
        if not got.requires_grad:
            return "the output does not require grad: backward cannot reach q, k, v"
        kept, inputs = storage_bytes(saved), storage_bytes([q, k, v])
        if kept != inputs or {t.untyped_storage().data_ptr() for t in saved} != \
                {t.untyped_storage().data_ptr() for t in (q, k, v)}:
            more = "the (a, s, s) probabilities must not be saved" if kept > inputs else "backward needs them"
            return (f"autograd keeps {kept:,} bytes for backward; selective recomputation keeps exactly q, k "
                    f"and v ({inputs:,} bytes): {more}")
        before = calls[0]
        grads = torch.autograd.grad(got, (q, k, v), g, allow_unused=True)
        if calls[0] == before:
            return "the core did not run again in backward: nothing was recomputed"
        for name, x, y in zip("qkv", grads, want_grads):
            if x is None:
                return f"no gradient reached {name}"
            bad = compare(x, y, what=f"d{name}", dtype=torch.float64)
            if bad:
                return bad
        return None

    cases = [Case(params={"shape": c}, label="b, a, kv, s, d = " + ", ".join(map(str, c))) for c in SELECTIVE_CASES]
    return check("selective_recompute", cases, run)


# ----------------------------------------------------------------------------- bytes on the wire
WIRE_CASES = [dict(n_params=n, world=w, data=d, precision=p)
              for n, w in ((1_000_000, 2), (3_000, 3), (7_000_000_000, 8))
              for d in ("ddp", "fsdp") for p in ("full", "bf16", "bf16-reduce-fp32")]


def _reference_wire_bytes(n_params, world, data, precision):
    """DDP: one all-reduce of the gradients; FSDP (ZeRO-3): all-gather the parameters in forward
    and again in backward, reduce-scatter the gradients (the planner's formula)."""
    p_bytes, g_bytes = ((d or torch.float32).itemsize for d in check_precision(precision))   # compute, reduce
    return dp_bytes_per_step(n_params, world, 0 if data == "ddp" else 3, grad_bytes=g_bytes, param_bytes=p_bytes)


def check_wire_bytes(fn) -> bool:
    """fn(n_params, world, data, precision) -> bytes one rank sends in one step's gradient /
    parameter collectives (ring algorithms), data "ddp" or "fsdp", precision "full" (fp32),
    "bf16" or "bf16-reduce-fp32"; 18 cases."""
    return _check_bytes("wire_bytes", fn, _reference_wire_bytes, WIRE_CASES, "the bytes on the wire")



# ----------------------------------------------------------------------------- master weights
STATE_CASES = [dict(n_params=n, world=w, data=d, precision=p)
               for n, w in ((1_000_000, 2), (6_000, 3), (8_000_000_000, 8))
               for d in ("ddp", "fsdp") for p in ("full", "bf16", "bf16-reduce-fp32")]


def _reference_model_state_bytes(n_params, world, data, precision):
    """After AdamW's step, before zero_grad: DDP keeps fp32 weights, gradients, moments (16 B) or
    a bf16 model (2) next to fp32 masters, their gradients and moments (4 + 4 + 8) on every rank;
    FSDP's fp32 shards ARE the masters (16 B, 1/N of them): the bf16 copy lives only gathered."""
    p, g, o = (4, 4, 8) if data == "fsdp" or precision == "full" else (2, 4, 12)
    return zero_memory_bytes(n_params, 3 if data == "fsdp" else 0, world, p, g, o)["total"]


def check_model_state_bytes(fn) -> bool:
    """fn(n_params, world, data, precision) -> bytes of model states one rank holds after the
    optimizer step (the chapter's recipe: course_lib.precision.mixed); 18 cases."""
    return _check_bytes("model_state_bytes", fn, _reference_model_state_bytes, STATE_CASES,
                        "where the master weights live")
