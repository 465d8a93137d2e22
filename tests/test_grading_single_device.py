"""course_lib/grading/single_device.py: each chapter-0 grader fails the classic mistakes,
an answer hard-coded to the lecture's case and a library shortcut, each with a hint that
names the mistake, and passes a right answer written differently from the solution."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.grading import single_device as G
from grading_answers import passed, refused


# ----------------------------------------------------------------------------- state_bytes
def _bytes_no_dedup(model, opt):        # a tied weight counted twice
    params = [p for _, p in model.named_parameters(remove_duplicate=False)]
    return {"params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            "optimizer": sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())}


def _bytes_fp32(model, opt):            # hard-coded to the lecture's fp32 model: 4 bytes everywhere
    params = list(model.parameters())
    return {"params": 4 * sum(p.numel() for p in params),
            "grads": 4 * sum(p.numel() for p in params if p.grad is not None),
            "optimizer": 4 * sum(t.numel() for s in opt.state.values() for t in s.values())}


def _bytes_grads_of_all(model, opt):    # every parameter counted as having a gradient
    from course_lib.memory import storage_bytes as sb  # noqa: F401 - imported, not used: allowed
    params = list(model.parameters())
    n = sum(p.untyped_storage().nbytes() for p in params)
    return {"params": n, "grads": n,
            "optimizer": sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values())}


def _bytes_library(model, opt):         # the library's own count
    from course_lib.memory import model_state_bytes

    held = model_state_bytes(model, opt)
    return {"params": held["parameters"], "grads": held["gradients"], "optimizer": held["optimizer_state"]}


@pytest.mark.parametrize("wrong, hints", [
    (_bytes_no_dedup, ["params: got", "counted twice"]),
    (_bytes_fp32, ["bf16"]),
    (_bytes_grads_of_all, ["grads: got", "p.grad is None"]),
    (_bytes_library, ["write this yourself", "memory.model_state_bytes"]),
], ids=["tied-twice", "fp32-only", "grads-of-frozen", "library"])
def test_state_bytes_refuses(wrong, hints, capsys):
    refused(capsys, "state_bytes", G.check_state_bytes(wrong), *hints)


def test_state_bytes_accepts_a_different_right_answer(capsys):
    def by_data_ptr(model, opt):
        def once(ts):
            seen = {}
            for t in ts:
                seen.setdefault((t.untyped_storage().data_ptr(), t.device), t.untyped_storage().nbytes())
            return sum(seen.values())
        params = list(dict.fromkeys(model.parameters()))
        return {"params": once(params), "grads": once([p.grad for p in params if p.grad is not None]),
                "optimizer": once([v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)])}
    passed(capsys, G.check_state_bytes(by_data_ptr), "state_bytes: 4/4 cases passed")


# ----------------------------------------------------------------------------- max_micro_batch
def _state_and_acts(cfg, bs):
    from course_lib import models
    from course_lib.memory import model_state_bytes

    model = models.TinyGPT(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1))
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    opt.step()

    def acts(b):
        idx = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1))
        return sum(r.nbytes for r in models.saved_activations(model, idx[:, :-1], idx[:, 1:])[1])
    return model_state_bytes(model, opt)["total"], acts


def _fit_extrapolated(cfg, budget):     # activations(b) = b * activations(1): off by one at the boundary
    state, acts = _state_and_acts(cfg, None)
    return max(0, int((budget - state) // acts(1)))


def _fit_no_optimizer_state(cfg, budget):  # the state before the first step: AdamW holds nothing yet
    from course_lib import models

    model = models.TinyGPT(cfg, seed=0)
    state = sum(p.numel() * 4 for p in model.parameters()) * 2
    _, acts = _state_and_acts(cfg, None)
    b = 0
    while state + acts(b + 1) <= budget:
        b += 1
    return b


def _fit_lecture_case(cfg, budget):     # the chapter's printed answer for its model
    return 3


@pytest.mark.parametrize("wrong, hints", [
    (_fit_extrapolated, ["expected b="]),
    (_fit_no_optimizer_state, ["got b=5, expected b=3"]),
    (_fit_lecture_case, ["got b=3"]),
], ids=["extrapolated", "no-adamw-state", "hard-coded"])
def test_max_micro_batch_refuses(wrong, hints, capsys):
    refused(capsys, "max_micro_batch", G.check_max_micro_batch(wrong, timeout=30), *hints)


def test_max_micro_batch_refuses_the_graders_reference(capsys):
    def cheat(cfg, budget):
        from course_lib.grading.single_device import _training_bytes
        return _training_bytes(vars(cfg), range(1, 3))
    refused(capsys, "max_micro_batch", G.check_max_micro_batch(cheat, timeout=30), "write this yourself")


# ----------------------------------------------------------------------------- average_gradients
def _avg_sum_only(model):               # all-reduce without dividing: N times the gradient
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def _avg_skip_none(model):              # the chapter's loop: skips None on each rank by itself
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def _avg_two_ranks(model):              # hard-coded to the lecture's 2 ranks, every grad present
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= 2


def _avg_library(model):
    from course_lib.parallel.data_parallel import average_gradients

    average_gradients(model, None)


@pytest.mark.parametrize("wrong, hints", [
    (_avg_sum_only, ["case 1/", "grad"]),
    (_avg_skip_none, ["case 3/", "rank 0's rows"]),
    (_avg_library, ["write this yourself", "averaging gradients"]),
    (_avg_two_ranks, ["case 2/", "world_size=3"]),
], ids=["no-division", "skips-None", "library", "two-ranks"])
def test_average_gradients_refuses(wrong, hints, capsys):
    refused(capsys, "average_gradients", G.check_average_gradients(wrong, timeout=10), *hints)


def test_average_gradients_accepts_one_flat_buffer(capsys):
    def flat(model):
        params = [p for p in model.parameters() if p.requires_grad]
        used = torch.tensor([float(p.grad is not None) for p in params])
        dist.all_reduce(used)
        live = [p for p, u in zip(params, used.tolist()) if u]
        for p in live:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        buf = torch.cat([p.grad.reshape(-1) for p in live]) / dist.get_world_size()
        dist.all_reduce(buf)
        for p, g in zip(live, buf.split([p.numel() for p in live])):
            p.grad.copy_(g.view_as(p))
    passed(capsys, G.check_average_gradients(flat), "average_gradients: 6/6 cases passed")


# ----------------------------------------------------------------------------- accumulation
def _acc_plain(model, loss_fn, x, y, k):           # the first try: k means summed
    for xs, ys in zip(x.tensor_split(k), y.tensor_split(k)):
        loss_fn(model(xs), ys).backward()


def _acc_divide_by_k(model, loss_fn, x, y, k):     # right only for equal micro-batches
    for xs, ys in zip(x.tensor_split(k), y.tensor_split(k)):
        (loss_fn(model(xs), ys) / k).backward()


def _acc_last_only(model, loss_fn, x, y, k):       # zero_grad inside the loop
    for xs, ys in zip(x.tensor_split(k), y.tensor_split(k)):
        model.zero_grad()
        (loss_fn(model(xs), ys) * len(xs) / len(x)).backward()


def _acc_whole_batch(model, loss_fn, x, y, k):     # the shortcut: one forward of everything
    loss_fn(model(x), y).backward()


@pytest.mark.parametrize("wrong, hints", [
    (_acc_plain, ["case 1/", "3x the full batch"]),
    (_acc_divide_by_k, ["case 2/", "[3, 3, 2, 2]"]),
    (_acc_last_only, ["case 1/", "grad"]),
    (_acc_whole_batch, ["a forward on 12 rows", "one micro-batch's activations"]),
], ids=["sum-of-means", "divide-by-k", "zero-grad-inside", "whole-batch"])
def test_accumulation_refuses(wrong, hints, capsys):
    refused(capsys, "accumulation", G.check_accumulation(wrong), *hints)


def test_accumulation_accepts_summed_losses_divided_once(capsys):
    def by_sum(model, loss_fn, x, y, k):
        for xs, ys in zip(x.tensor_split(k), y.tensor_split(k)):
            (loss_fn(model(xs), ys, reduction="sum") / y.numel()).backward()
    passed(capsys, G.check_accumulation(lambda m, lf, x, y, k: by_sum(m, F.mse_loss, x, y, k)), "accumulation: 6/6 cases passed")


def test_max_micro_batch_accepts_a_bisection(capsys):
    def bisect(cfg, budget):
        state, acts = _state_and_acts(cfg, None)
        if state > budget:
            return 0
        lo, hi = 0, 1
        while state + acts(hi) <= budget:        # grow until it does not fit
            lo, hi = hi, 2 * hi
        while hi - lo > 1:                       # the largest b that fits lies in [lo, hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if state + acts(mid) <= budget else (lo, mid)
        return lo
    passed(capsys, G.check_max_micro_batch(bisect), "max_micro_batch: 6/6 cases passed")
