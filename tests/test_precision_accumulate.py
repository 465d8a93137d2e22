"""Gradients accumulated in the reduce dtype (course_lib/precision/mixed.py ``MainGrads``,
``"bf16-accumulate-fp32"``) and ZeRO-1/2 with master weights (course_lib/parallel/zero_nd.py: the
owned slices are the masters):

* MainGrads adds each backward's gradient into its buffer as autograd produces it: in float64
  over fp32 gradients, the buffer is the float64 sum of the separate backwards, exactly;
* ZeRO-1 and ZeRO-2 under fp32 compute and float64 masters equal one device running the same
  recipe over 2 AdamW steps, within fp32's derived bounds (course_lib.tolerance), at dp 3 (an
  odd group; ZeRO-2 over 2 micro-batches: each gradient accumulated);
* a tied embedding over pp 2: its two stages' fp32 sums added (DDP's masters, ZeRO's buffers);
* "bf16-accumulate-fp32" with DDP and with ZeRO-2: the first step's gradients within twice one
  device's own bf16 error of a float64 run; on one device (one micro-batch) it is
  "bf16-reduce-fp32", bit for bit.
"""
import dataclasses

import pytest
import torch

from course_lib import tolerance
from course_lib.gpt import GPTConfig
from course_lib.lab.precision_runs import one_device, precision_runs
from course_lib.lab.nd_runs import LR
from course_lib.precision.mixed import MainGrads, MasterWeights, accumulates, relative_error

CFG = GPTConfig(vocab_size=96, seq_len=16, n_layers=4, hidden=32, n_heads=4, n_kv_heads=2, block="llama")
BATCH = 6


def test_main_grads_add_each_backward_in_their_dtype():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    xs = [torch.randn(3, 8) for _ in range(3)]
    separate = []
    for x in xs:
        lin.zero_grad(set_to_none=True)
        lin(x).square().sum().backward()
        separate.append([p.grad.clone() for p in lin.parameters()])
    lin.zero_grad(set_to_none=True)
    main = MainGrads(list(lin.parameters()), torch.float64)
    for x in xs:
        lin(x).square().sum().backward()
        assert all(p.grad is None for p in lin.parameters())      # freed once added
    for i, p in enumerate(lin.parameters()):
        want = separate[0][i].double() + separate[1][i] + separate[2][i]
        got = main.pop(p)
        assert got.dtype == torch.float64 and torch.equal(got, want)
    main.remove()
    # MasterWeights(accumulate=True): the sum lands in the master's .grad, in the masters' dtype
    model = torch.nn.Linear(8, 4).double()
    mw = MasterWeights(model.parameters(), torch.float32, torch.float64, accumulate=True)
    for x in xs:
        model(x).square().sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad.dtype == torch.float64 for m in mw.parameters())
    assert accumulates("bf16-accumulate-fp32") and not accumulates("bf16-reduce-fp32")
    with pytest.raises(ValueError, match="unknown precision"):
        accumulates("bf16-fp32")


# 3 ranks (an odd ZeRO group), 6 sequences: 2 micro-batches per rank under ZeRO-2 (each gradient
# summed over two backwards), 2 sequences per rank in one micro-batch under ZeRO-1
ZERO = {"zero2-dp3-m2": (dict(dp=3), dict(zero=2, microbatches=2)),
        "zero1-dp3": (dict(dp=3), dict(zero=1))}


def test_zero_with_master_weights_equals_one_device():
    steps = 2
    want = one_device(CFG, BATCH, steps, "fp32", torch.float64)
    runs = precision_runs(CFG, ZERO, BATCH, steps, precisions=("fp32",), dtype=torch.float64, world_size=3)
    for case, by in runs.items():
        got = by["fp32"]
        assert got.held["master"][1] == ["torch.float64"] and got.held["model"][1] == ["torch.float32"], case
        tolerance.assert_matches(got.grads, want.grads, dtype=torch.float32, what=f"{case} first gradients")
        tolerance.assert_matches(got.losses, want.losses, dtype=torch.float32, what=f"{case} losses")
        tolerance.assert_matches(got.state, want.state, dtype=torch.float32, optimizer="adamw", steps=steps,
                                 lr=LR, what=f"{case} parameters")


def test_bf16_accumulated_in_fp32_within_one_device_error_doubled():
    truth = one_device(CFG, BATCH, 1, "full", torch.float64)
    mine = one_device(CFG, BATCH, 1, "bf16-accumulate-fp32")
    same = one_device(CFG, BATCH, 1, "bf16-reduce-fp32")
    assert all(torch.equal(mine.grads[k], same.grads[k]) for k in same.grads)     # one micro-batch: no sum
    own = relative_error(same.grads, truth.grads)
    assert 2 ** -12 < own < 2 ** -6
    cases = {"ddp-dp3-m2": (dict(dp=3), dict(microbatches=2)), **ZERO}
    runs = precision_runs(CFG, cases, BATCH, 1, precisions=("bf16-accumulate-fp32",), world_size=3)
    for case, by in runs.items():
        run = by["bf16-accumulate-fp32"]
        assert run.held["model"][1] == ["torch.bfloat16"] and run.held["master"][1] == ["torch.float32"], case
        err = relative_error(run.grads, truth.grads)
        assert err <= 2 * own, f"{case}: {err:.3g} > 2 x {own:.3g}"


def test_a_tied_embedding_over_the_pipeline_sums_the_fp32_buffers():
    """pp 2 with the embedding tied to the head: the two stages' gradients are summed where they
    are kept (the masters' .grad with DDP, ZeRO's fp32 buffers); without it 0.57 relative error."""
    cfg = dataclasses.replace(CFG, tie_embeddings=True)
    truth = one_device(cfg, 4, 1, "full", torch.float64)
    own = relative_error(one_device(cfg, 4, 1, "bf16-reduce-fp32").grads, truth.grads)
    cases = {"tied-ddp-dp2-pp2": (dict(dp=2, pp=2), dict(microbatches=2)),
             "tied-zero2-dp2-pp2": (dict(dp=2, pp=2), dict(zero=2, microbatches=2))}
    for case, by in precision_runs(cfg, cases, 4, 1, precisions=("bf16-accumulate-fp32",)).items():
        err = relative_error(by["bf16-accumulate-fp32"].grads, truth.grads)
        assert err <= 2 * own, f"{case}: {err:.3g} > 2 x {own:.3g}"
