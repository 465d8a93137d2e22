"""Mixed precision (course_lib/precision/mixed.py) through DDP, FSDP, TP + SP, PP and CP.

* the plumbing (16-bit model, master weights, gradients moved and reduced in the reduce
  dtype) is exact: with fp32 compute under float64 masters every layout equals one device
  running the same recipe, within fp32's derived bounds (course_lib.tolerance);
* bf16: the first step's gradients against a float64 run. A parallel run rounds what one
  device rounds, plus each partial result before it is summed (a TP partial sum, a gradient
  reduced in bf16): with two ranks per sum, one more rounding, and the error stays within
  twice one device's own bf16 error (a heuristic, asserted at these sizes: a bf16 sum's error
  grows with the number of summands, ``sum_rounded``); reducing in fp32 removes that kind;
* bytes on the wire: every activation, parameter and gradient collective carries half the
  bytes in bf16 (gradients stay fp32 with "bf16-reduce-fp32"); the loss's fp32/fp64 sums do not;
* the master weights: fp32 on the optimizer's side (all of them with DDP, 1/N with FSDP);
* an unknown precision is a ValueError naming it, before any rank starts.
"""
import pytest
import torch

from course_lib import tolerance
from course_lib.gpt import GPTConfig
from course_lib.lab.nd_runs import LR
from course_lib.parallel.compose import check_layout
from course_lib.precision.mixed import check_precision, relative_error, sum_rounded
from course_lib.lab.precision_runs import one_device, precision_runs

CFG = GPTConfig(vocab_size=96, seq_len=16, n_layers=4, hidden=32, n_heads=4, n_kv_heads=2)
CASES = {"dp2-tp2-sp": (dict(dp=2, tp=2), {}),
         "pp2-cp2": (dict(pp=2, cp=2), dict(microbatches=2)),
         "fsdp2-tp2": (dict(dp=2, tp=2), dict(data="fsdp"))}
BATCH = 4


def test_fp32_compute_under_fp64_masters_equals_one_device():
    steps = 2
    want = one_device(CFG, BATCH, steps, "fp32", torch.float64)
    runs = precision_runs(CFG, CASES, BATCH, steps, precisions=("fp32",), dtype=torch.float64)
    for case, by in runs.items():
        got = by["fp32"]
        assert got.held["master"][1] == ["torch.float64"], case
        assert got.held["model"][1] == (["torch.float64"] if "fsdp" in case else ["torch.float32"]), case
        tolerance.assert_matches(got.grads, want.grads, dtype=torch.float32, what=f"{case} first gradients")
        tolerance.assert_matches(got.losses[:1], want.losses[:1], dtype=torch.float32, what=f"{case} loss")
        tolerance.assert_matches(got.state, want.state, dtype=torch.float32, optimizer="adamw", steps=steps,
                                 lr=LR, what=f"{case} parameters")


@pytest.fixture(scope="module")
def bf16_runs():
    return precision_runs(CFG, CASES, BATCH, 1)


def test_bf16_gradients_against_fp64_within_one_device_error_doubled(bf16_runs):
    truth = one_device(CFG, BATCH, 1, "full", torch.float64)
    own = relative_error(one_device(CFG, BATCH, 1, "bf16").grads, truth.grads)
    assert 2 ** -12 < own < 2 ** -6        # bf16's u = 2^-8: the error is bf16's, not fp32's or a bug's
    for case, by in bf16_runs.items():
        tolerance.assert_matches(by["full"].grads, truth.grads, dtype=torch.float32, what=case)
        for precision in ("bf16", "bf16-reduce-fp32"):
            err = relative_error(by[precision].grads, truth.grads)
            assert err <= 2 * own, f"{case} {precision}: {err:.3g} > 2 x {own:.3g}"


def _gradient_call(dim, op, name):
    """A collective that sums gradients: DDP's buckets, FSDP's reduce-scatters and extra sums."""
    return name.startswith("all-reduce b") or " over " in name or (dim == "dp+cp" and op == "reduce_scatter_tensor")


def test_bytes_on_the_wire_halved(bf16_runs):
    for case, by in bf16_runs.items():
        full = by["full"].calls
        assert set(full) == set(by["bf16"].calls) == set(by["bf16-reduce-fp32"].calls), case
        for precision in ("bf16", "bf16-reduce-fp32"):
            for dim, calls in by[precision].calls.items():
                assert [(op, name) for op, name, _ in calls] == [(op, name) for op, name, _ in full[dim]]
                for (op, name, got), (_, _, was) in zip(calls, full[dim]):
                    # FSDP's extra sums (an SP norm's gradient over tp) run on the fp32 shard, after the
                    # reduce-scatter: master dtype in every precision
                    kept = "loss" in name or " over " in name or \
                        (precision == "bf16-reduce-fp32" and _gradient_call(dim, op, name))
                    assert got == (was if kept else was // 2) and was % 2 == 0, (case, precision, dim, name)
        def total(calls):  # everything the precision moves: all but the loss's and FSDP's fp32 extra sums
            return sum(p for cs in calls.values() for _, name, p in cs if "loss" not in name and " over " not in name)
        assert 2 * total(by["bf16"].calls) == total(full), case


def test_master_weights_live_with_the_optimizer(bf16_runs):
    for case, by in bf16_runs.items():
        master, model = by["bf16"].held["master"], by["bf16"].held["model"]
        assert master[1] == ["torch.float32"], case
        if "fsdp" in case:       # the shards are the masters; the 16-bit copy exists only gathered
            assert model == master
        else:                    # a full fp32 copy next to the bf16 model: 4 + 2 bytes per parameter
            assert model[1] == ["torch.bfloat16"] and master[0] == 2 * model[0], case


@pytest.mark.parametrize("name", ["fp8", "bfloat16", "", None])
def test_unknown_precision_refused_before_any_rank_starts(name):
    with pytest.raises(ValueError, match="unknown precision"):
        check_layout(CFG, dp=2, precision=name)
    with pytest.raises(ValueError, match=f"unknown precision {name!r}"):
        check_precision(name)


@pytest.mark.parametrize("name", ["fp16", "half"])
def test_fp16_refused_for_want_of_a_loss_scaler(name):
    """fp16 is not an unknown name: it is refused because the option runs no loss scaler."""
    for call in (lambda: check_layout(CFG, dp=2, precision=name), lambda: check_precision(name)):
        with pytest.raises(ValueError, match="needs a loss scaler.*use 'bf16'"):
            call()


def test_sum_rounded_rounds_every_partial_sum():
    terms = [torch.tensor([1.0]), torch.tensor([2.0 ** -9]), torch.tensor([2.0 ** -9])]
    # bf16 (8 bits): 1 + 2^-9 rounds back to 1 at each hop; fp32 keeps both
    assert sum_rounded(terms, torch.bfloat16).item() == 1.0
    assert sum_rounded(terms, torch.float32).item() == 1.0 + 2.0 ** -8
    assert sum_rounded(terms, torch.bfloat16).dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(4096, generator=gen).bfloat16() for _ in range(256)]

    def error(n, dtype):
        exact = torch.stack(grads[:n]).double().sum(0)
        return float((sum_rounded(grads[:n], dtype).double() - exact).norm() / exact.norm())

    assert error(2, torch.bfloat16) < 2 ** -8                    # one rounding: at most u
    assert error(256, torch.bfloat16) > 4 * error(2, torch.bfloat16)   # grows with n (~sqrt(n))
    assert error(256, torch.float32) < 2 ** -20
    with pytest.raises(ValueError, match="at least one term"):
        sum_rounded([], torch.float32)
