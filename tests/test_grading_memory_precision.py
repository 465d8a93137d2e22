"""course_lib/grading/memory_precision.py (chapter 9b): each grader fails the classic mistakes,
an answer hard-coded to the lecture's case and a library shortcut (switched off by the guard),
and passes a right answer written differently from the solution."""
from __future__ import annotations

import pytest
import torch

from course_lib.grading import memory_precision as G
from grading_answers import passed, refused


# ----------------------------------------------------------------------------- activation bytes
def _acts(korthikanti=False, rstd=True, kv_full=False, kv_split=False, full_sp=True, selective_drops_qkv=False):
    def activation_bytes(s, b, h, a, kv, f, t, sp, policy):
        div = t if sp else 1
        if policy == "full":
            return 2 * s * b * h / (div if full_sp else 1)
        if korthikanti:                                   # the GPT-3 block's constants
            return s * b * h * (34 / t + (0 if policy == "selective" else 5 * a * s / (h * t)))
        d = h // a
        kv_heads = a if kv_full else (kv / t if kv_split else max(kv // t, 1))
        out = 2 * (2 * s * b * h + (s * b if rstd else 0)) * 2 / div + 2 * s * b * h * 2 / div
        out += 2 * s * b * h * 2 / t + 2 * s * b * kv_heads * d * 2 + 4 * s * b * f * 2 / t
        if selective_drops_qkv and policy == "selective":
            out -= 2 * s * b * h * 2 / t + 2 * s * b * kv_heads * d * 2
        return out + (0 if policy == "selective" else a * s * s * b * 2 / t)
    return activation_bytes


def _acts_hard_coded(s, b, h, a, kv, f, t, sp, policy):
    return {"none": 47232, "selective": 43136, "full": 2048}[policy]      # the lecture's tiny model


def _acts_library(s, b, h, a, kv, f, t, sp, policy):
    from course_lib.planner.activations import llama_activation_bytes_per_layer
    return llama_activation_bytes_per_layer(s, b, h, a, kv, f, t=t, sp=sp, recompute=policy)


@pytest.mark.parametrize("wrong, hints", [
    (_acts(korthikanti=True), ["case 1/", "expected 47,232"]),
    (_acts(rstd=False), ["case 1/"]),
    (_acts(kv_full=True), ["case 1/", "kv=2"]),
    (_acts(kv_split=True), ["case 7/", "t=4"]),
    (_acts(full_sp=False), ["case 6/", "policy=full"]),
    (_acts(selective_drops_qkv=True), ["case 2/", "policy=selective"]),
    (_acts_hard_coded, ["case 4/"]),
    (_acts_library, ["write this yourself", "activation bytes"]),
], ids=["korthikanti-constants", "no-rstd", "kv-as-many-as-queries", "kv-split-below-one-head",
        "full-not-split-by-sp", "selective-drops-qkv", "hard-coded", "library"])
def test_activation_bytes_refuses(wrong, hints, capsys):
    refused(capsys, "activation_bytes", G.check_activation_bytes(wrong), *hints)


def test_activation_bytes_accepts_a_census_written_differently(capsys):
    def census(s, b, h, a, kv, f, t, sp, policy):
        tokens = s * b // (t if sp else 1)                # the rows a rank holds outside the TP regions
        if policy == "full":
            return 2 * tokens * h
        kv_ch = (kv // t if kv >= t else 1) * (h // a)
        tensors = [tokens * h] * 4 + [tokens] * 2 + [tokens * h] * 2          # norms: x, x*rstd, rstd
        tensors += [s * b * h // t, s * b * kv_ch, s * b * kv_ch, s * b * h // t] + [s * b * f // t] * 4
        if policy == "none":
            tensors.append(a // t * s * s * b)
        return 2 * sum(tensors)
    passed(capsys, G.check_activation_bytes(census), "activation_bytes: 8/8 cases passed")


# ----------------------------------------------------------------------------- selective recomputation
class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, core, keep_output, recompute):
        ctx.core, ctx.recompute = core, recompute
        out = core(q, k, v)
        ctx.save_for_backward(q, k, v, *((out,) if keep_output else ()))
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors[:3])
        if not ctx.recompute:                              # no recomputation: a made-up gradient
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None
        with torch.enable_grad():
            out = ctx.core(q, k, v)
        return (*torch.autograd.grad(out, (q, k, v), g), None, None, None)


def _keeps_output(core, q, k, v):
    return _Recompute.apply(q, k, v, core, True, True)


def _never_recomputes(core, q, k, v):
    return _Recompute.apply(q, k, v, core, False, False)


def _plain(core, q, k, v):                                 # keeps the probabilities
    return core(q, k, v)


def _no_grad(core, q, k, v):                               # keeps nothing, and loses the gradient
    with torch.no_grad():
        return core(q, k, v)


def _torch_checkpoint(core, q, k, v):
    from torch.utils.checkpoint import checkpoint
    return checkpoint(core, q, k, v, use_reentrant=False)


def _library(core, q, k, v):
    from course_lib.recompute import recompute
    return recompute(core, (q, k, v))


@pytest.mark.parametrize("wrong, hints", [
    (_plain, ["the (a, s, s) probabilities must not be saved"]),
    (_keeps_output, ["keeps exactly q, k and v"]),
    (_never_recomputes, ["did not run again in backward"]),
    (_no_grad, ["does not require grad"]),
    (_torch_checkpoint, ["write this yourself", "selective recomputation"]),
    (_library, ["write this yourself"]),
], ids=["plain-core", "keeps-output", "never-recomputes", "no-grad", "torch-checkpoint", "library"])
def test_selective_recompute_refuses(wrong, hints, capsys):
    refused(capsys, "selective_recompute", G.check_selective_recompute(wrong), *hints)


def test_selective_recompute_accepts_saved_tensor_hooks(capsys):
    """Right, written differently: forward without grad, backward through a hook-free recompute."""
    class Again(torch.autograd.Function):
        @staticmethod
        def forward(ctx, core, *qkv):
            ctx.core = core
            ctx.save_for_backward(*qkv)
            return core(*qkv)

        @staticmethod
        def backward(ctx, g):
            qkv = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
            with torch.enable_grad():
                y = ctx.core(*qkv)
            y.backward(g)
            return (None, *(t.grad for t in qkv))

    passed(capsys, G.check_selective_recompute(lambda core, q, k, v: Again.apply(core, q, k, v)),
           "selective_recompute: 3/3 cases passed")


# ----------------------------------------------------------------------------- bytes on the wire
_BYTES = {"full": (4, 4), "bf16": (2, 2), "bf16-reduce-fp32": (2, 4)}


def _wire(ddp_factor=2, gathers=2, ring=True, reduce_like_params=False):
    def wire_bytes(n_params, world, data, precision):
        p, g = _BYTES[precision]
        g = p if reduce_like_params else g
        share = (world - 1) / world if ring else 1
        return ddp_factor * share * n_params * g if data == "ddp" else share * n_params * (gathers * p + g)
    return wire_bytes


@pytest.mark.parametrize("wrong, hints", [
    (_wire(ddp_factor=1), ["case 1/", "data=ddp"]),
    (_wire(gathers=1), ["case 4/", "data=fsdp"]),
    (_wire(ring=False), ["case 1/"]),
    (_wire(reduce_like_params=True), ["case 3/", "bf16-reduce-fp32"]),
    (lambda n_params, world, data, precision: 4 * n_params, ["case 2/", "precision=bf16"]),
    (lambda n_params, world, data, precision: __import__("course_lib.planner.communication", fromlist=["x"])
     .collective_bytes_per_rank("all_reduce", 4 * n_params, world), ["write this yourself"]),
], ids=["ddp-one-pass", "fsdp-no-regather", "no-ring-share", "fp32-reduce-halved", "hard-coded", "library"])
def test_wire_bytes_refuses(wrong, hints, capsys):
    refused(capsys, "wire_bytes", G.check_wire_bytes(wrong), *hints)


def test_wire_bytes_accepts_per_collective_sums(capsys):
    def per_collective(n_params, world, data, precision):
        elem = {"full": 4, "bf16": 2, "bf16-reduce-fp32": 2}[precision]
        grad = 2 if precision == "bf16" else 4
        steps = world - 1                                   # ring steps, each one chunk of 1/world
        if data == "ddp":                                   # reduce-scatter then all-gather
            return 2 * steps * n_params * grad / world
        return steps * n_params * elem / world * 2 + steps * n_params * grad / world
    passed(capsys, G.check_wire_bytes(per_collective), "wire_bytes: 18/18 cases passed")


# ----------------------------------------------------------------------------- master weights
def _states(fsdp_keeps_bf16=False, ddp_counts_bf16_grads=False, masters_everywhere=False, no_masters=False):
    def model_state_bytes(n_params, world, data, precision):
        mixed = precision != "full"
        if data == "fsdp":
            return n_params * (16 + (2 if mixed and fsdp_keeps_bf16 else 0)) / world + \
                (4 * n_params if mixed and masters_everywhere else 0)
        if no_masters:
            return n_params * (2 + 2 + 8 if mixed else 16)
        return n_params * (16 if not mixed else 18 + (2 if ddp_counts_bf16_grads else 0))
    return model_state_bytes


@pytest.mark.parametrize("wrong, hints", [
    (_states(fsdp_keeps_bf16=True), ["case 5/", "data=fsdp", "precision=bf16"]),
    (_states(ddp_counts_bf16_grads=True), ["case 2/", "data=ddp"]),
    (_states(masters_everywhere=True), ["case 5/"]),
    (_states(no_masters=True), ["case 2/"]),
    (lambda n_params, world, data, precision: 16 * n_params, ["case 2/", "precision=bf16"]),
    (lambda n_params, world, data, precision: __import__("course_lib.planner.formulas", fromlist=["x"])
     .zero_memory_bytes(n_params, 3 if data == "fsdp" else 0, world)["total"], ["write this yourself"]),
], ids=["fsdp-keeps-bf16-copy", "ddp-keeps-bf16-grads", "fsdp-full-masters", "no-masters", "hard-coded",
        "library"])
def test_model_state_bytes_refuses(wrong, hints, capsys):
    refused(capsys, "model_state_bytes", G.check_model_state_bytes(wrong), *hints)


def test_model_state_bytes_accepts_by_category(capsys):
    def by_category(n_params, world, data, precision):
        held = n_params / world if data == "fsdp" else n_params
        weights = 4 * held
        compute_copy = 2 * n_params if data == "ddp" and precision != "full" else 0
        return weights + 4 * held + 4 * held + 4 * held + compute_copy     # master, grad, m, v (+ bf16)
    passed(capsys, G.check_model_state_bytes(by_category), "model_state_bytes: 18/18 cases passed")
