"""course_lib.moe: top-k weights as Switch uses them (default) or renormalised (GShard, Mixtral)."""
import pytest
import torch

from course_lib.moe import MoE, route


def test_topk_weights_renormalised_only_when_asked():
    logits = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    _, plain, *_ = route(logits, 2, 2.0)
    expert, norm, *_ = route(logits, 2, 2.0, normalize=True)
    probs = logits.softmax(-1)
    assert torch.equal(plain, probs.gather(1, expert))                   # Switch: the probabilities as they are
    assert (plain.sum(1) < 1).all()
    assert torch.allclose(norm.sum(1), torch.ones(12))                   # GShard / Mixtral: they sum to 1
    assert torch.allclose(norm, torch.softmax(logits.gather(1, expert), -1))   # = softmax over the top-k logits


@pytest.mark.parametrize("top_k", [1, 2])
def test_renormalised_moe_scales_each_token_by_its_weight_sum(top_k):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    plain = MoE(8, 16, 4, top_k, capacity_factor=4.0, seed=0)           # C = T: nothing dropped
    norm = MoE(8, 16, 4, top_k, capacity_factor=4.0, seed=0, normalize_topk=True)
    weights = route(plain.router(x), top_k, 4.0)[1].detach()
    assert torch.allclose(norm(x)[0], plain(x)[0] / weights.sum(1, keepdim=True), atol=1e-6)
    assert torch.equal(norm(x)[1], plain(x)[1])                          # the aux loss does not change
    assert not plain.normalize_topk                                      # default: unchanged behaviour
