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


def test_capacity_keep_serves_first_choices_first_then_by_weight_or_token():
    expert = torch.tensor([[1, 0], [0, 2], [2, 1], [0, 1]])               # (T=4, k=2)
    weight = torch.tensor([[0.45, 0.44], [0.40, 0.35], [0.50, 0.30], [0.60, 0.20]])
    from course_lib.moe import capacity_keep
    # in token order: expert 0 takes token 1's first choice (capacity 1), token 3's is dropped,
    # and token 0's second choice (expert 0 again) too; expert 1 takes token 0, then is full
    assert capacity_keep(expert, 3, 1).tolist() == [[True, False], [True, False], [True, False], [False, False]]
    # Batch Prioritized Routing: token 3 (0.60) goes before token 1 (0.40) for expert 0
    assert capacity_keep(expert, 3, 1, weight).tolist() == [[True, False], [False, False], [True, False],
                                                             [True, False]]
    tied = capacity_keep(torch.zeros(3, 1, dtype=torch.int64), 1, 2, torch.full((3, 1), 0.5))
    assert tied.flatten().tolist() == [True, True, False]                # ties: the earlier token
    assert capacity_keep(torch.zeros(0, 2, dtype=torch.int64), 3, 2, torch.zeros(0, 2)).shape == (0, 2)
    logits = torch.randn(20, 5, generator=torch.Generator().manual_seed(1))
    expert, _, keep, _, _ = route(logits, 2, 1.0)                       # capacity ceil(20 * 2 / 5) = 8
    assert torch.equal(keep, capacity_keep(expert, 5, 8)) and not keep.all()


def test_load_balancing_loss_is_routes_aux_and_keeps_float64():
    from course_lib.moe import load_balancing_loss

    logits = torch.full((8, 4), -4.0, dtype=torch.float64)
    logits[torch.arange(8), torch.arange(8) % 4] = 4.0                   # token t -> expert t mod 4
    _, _, _, counts, aux = route(logits.float(), 1, 1.0)
    assert torch.equal(aux, load_balancing_loss(logits.float().softmax(-1), counts, 1))   # route's, in fp32
    loss = load_balancing_loss(logits.softmax(-1), counts, 1)
    assert loss.dtype == torch.float64 and abs(loss.item() - 1.0) < 1e-12                # balanced: 1
    f = counts.double() / 8                                              # f_e computed in float64
    assert loss.item() == (4 * (f * logits.softmax(-1).mean(0)).sum()).item()
    collapsed = torch.zeros(8, 4)
    collapsed[:, 0] = 20.0                                               # everyone -> expert 0: about E
    assert 3.99 < route(collapsed, 1, 1.0)[4].item() <= 4.0
