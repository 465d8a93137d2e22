"""course_lib/tolerance.py: the bounds hold for correct runs and fail wrong ones."""
import pytest
import torch

from course_lib import tolerance


def test_reordered_sums_stay_within_the_one_step_bound():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(64, 4096, generator=g, dtype=dtype)
        forward = x.sum(1)
        backward = x.flip(1).sum(1)                       # the same terms, the other way round
        blocked = x.view(64, 64, 64).sum(2).sum(1)        # as a blocked kernel adds them
        tolerance.assert_matches(backward, forward)
        tolerance.assert_matches(blocked, forward)


def test_a_missing_or_doubled_reduction_fails():
    g = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    for wrong in (g / 2, 2 * g, g[:, torch.randperm(32)]):
        assert not tolerance.compare(wrong, g)
    assert "OUTSIDE" in str(tolerance.compare({"w": g / 2}, {"w": g}))


def test_adam_ratio_bound_holds():
    """|m_hat| / sqrt(v_hat) never exceeds the Cauchy-Schwarz bound, for any gradient sequence."""
    assert tolerance.adam_ratio_bound(1) == pytest.approx(1.0)
    gen = torch.Generator().manual_seed(2)
    for _ in range(50):
        gs = torch.randn(30, generator=gen, dtype=torch.float64) * torch.rand(30, generator=gen, dtype=torch.float64) ** 4
        m = v = 0.0
        for t, gt in enumerate(gs.tolist(), 1):
            m, v = 0.9 * m + 0.1 * gt, 0.999 * v + 0.001 * gt * gt
            ratio = abs(m / (1 - 0.9 ** t)) / (v / (1 - 0.999 ** t)) ** 0.5
            assert ratio <= tolerance.adam_ratio_bound(t) * (1 + 1e-12)


def _adamw_after_ulp_noise(dtype, steps=5, lr=1e-2):
    """Two AdamW runs whose gradients differ by one reordering's rounding (a few ulps of the
    gradient's scale), as two CPUs' kernels do; some elements' gradients are near zero."""
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(1000, generator=gen, dtype=dtype)
    grads = [torch.randn(1000, generator=gen, dtype=dtype) * torch.rand(1000, generator=gen, dtype=dtype) ** 8
             for _ in range(steps)]
    runs = []
    for noisy in (False, True):
        p = p0.clone().requires_grad_()
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=0.1)
        for g in grads:
            ulp = tolerance.unit_roundoff(dtype) * g.abs().max()
            p.grad = g + (torch.randn(g.shape, generator=gen, dtype=dtype) * ulp if noisy else 0)
            opt.step()
        runs.append(p.detach())
    return runs


def test_fp32_adamw_turns_ulps_into_a_fraction_of_lr_within_the_bound():
    a, b = _adamw_after_ulp_noise(torch.float32)
    moved = float((a - b).abs().max())
    assert moved > 1e-5      # far more than fp32's rounding of the parameters (~1e-7): the issue's effect
    tolerance.assert_matches(a, b, optimizer="adamw", steps=5, lr=1e-2)


def test_fp64_adamw_bound_is_tight_enough_to_catch_a_wrong_update():
    a, b = _adamw_after_ulp_noise(torch.float64)
    result = tolerance.assert_matches(a, b, optimizer="adamw", steps=5, lr=1e-2)
    assert result.bound < 1e-5                       # fp64: ~1e-6 lr k, far below one update (lr)
    assert not tolerance.compare(a + 1e-2 * torch.sign(torch.randn(a.shape, dtype=a.dtype)), b,
                                 optimizer="adamw", steps=5, lr=1e-2)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="optimizer"):
        tolerance.parameter_bound(torch.float32, optimizer="lion")
    with pytest.raises(ValueError, match="unit roundoff"):
        tolerance.unit_roundoff(torch.int64)
    assert "missing" in tolerance.compare({"a": torch.ones(1)}, {"a": torch.ones(1), "b": torch.ones(1)}).why
    assert not tolerance.compare(torch.ones(2), torch.ones(3))
    assert not tolerance.compare(torch.tensor([float("nan")]), torch.tensor([1.0]))
