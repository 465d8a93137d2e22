"""course_lib.reference: the data, the loop and the two loss rules every comparison uses."""
import pytest
import torch

from course_lib import reference, tolerance
from course_lib.models import MLP, GPTConfig, TinyGPT

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=4, n_kv_heads=2)


def same_state(a, b):
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_mlp_data_is_seeded_and_reshuffled_every_step():
    X, Y, perms = reference.mlp_data(seed=0, batch=12, steps=4, sizes=(6, 10, 5))
    assert X.shape == (12, 6) and Y.shape == (12, 5) and len(perms) == 4
    assert all(sorted(p.tolist()) == list(range(12)) for p in perms)
    assert not torch.equal(perms[0], perms[1])
    X2, _, perms2 = reference.mlp_data(seed=0, batch=12, steps=4, sizes=(6, 10, 5))
    assert torch.equal(X, X2) and all(torch.equal(a, b) for a, b in zip(perms, perms2))
    batches = reference.mlp_batches(seed=0, batch=12, steps=4, sizes=(6, 10, 5))
    assert torch.equal(batches[2][0], X[perms[2]]) and torch.equal(batches[2][1], Y[perms[2]])


def test_train_accumulates_micro_batches_to_the_full_batch_step():
    batches = reference.mlp_batches(batch=24, steps=3)
    runs = {}
    for micro in (1, 2, 3):     # float64: AdamW after steps (course_lib.tolerance)
        model = MLP(seed=0, sizes=(16, 32, 16, 32)).double()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        runs[micro] = reference.train(model, [(x.double(), y.double()) for x, y in batches], opt, micro=micro)
    state, losses = runs[1]
    assert len(losses) == 3 and losses[-1] < losses[0]
    for micro in (2, 3):
        tolerance.assert_matches(runs[micro][0], state, optimizer="adamw", steps=3, lr=1e-2)
        tolerance.assert_matches(runs[micro][1][:1], losses[:1], what="the step loss is the full mean")


def test_an_update_function_works_like_an_optimizer():
    batches = reference.mlp_batches(batch=12, steps=3, sizes=(6, 10, 5))
    by_hand, torch_sgd = MLP((6, 10, 5), seed=0), MLP((6, 10, 5), seed=0)
    state, _ = reference.train(by_hand, batches, lambda params: reference.sgd_step(params, 0.1))
    expected, _ = reference.train(torch_sgd, batches, torch.optim.SGD(torch_sgd.parameters(), lr=0.1))
    tolerance.assert_matches(state, expected, optimizer="sgd", steps=3, lr=0.1)
    assert all(p.grad is None for p in by_hand.parameters())  # cleared after every step


def test_gpt_batches_are_shifted_text_windows_in_the_vocabulary():
    batches = reference.gpt_batches(CFG, batch=4, steps=3, seed=1)
    assert len(batches) == 3
    x, y = batches[0]
    assert x.shape == y.shape == (4, CFG.seq_len) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert 0 <= int(x.min()) and int(x.max()) < CFG.vocab_size
    again = reference.gpt_batches(CFG, batch=4, steps=3, seed=1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again))


def test_train_gpt_divides_by_the_global_token_count():
    """Micro-batches with different numbers of ignored targets: the global count makes the
    accumulated gradient the full batch's; dividing each micro-batch's mean by micro would not."""
    batches = [(x, y.clone()) for x, y in reference.gpt_batches(CFG, batch=4, steps=2)]  # y: a view of x's window
    for _, y in batches:
        y[0, :12] = -100   # the first micro-batch of two counts fewer tokens
    runs = {}
    for micro in (1, 2):
        model = TinyGPT(CFG, seed=0)
        runs[micro] = reference.train_gpt(model, batches, torch.optim.SGD(model.parameters(), lr=0.5), micro=micro)
    tolerance.assert_matches(runs[2][0], runs[1][0], optimizer="sgd", steps=2, lr=0.5)
    x, y = batches[0]
    tolerance.assert_matches(runs[1][1][:1], [TinyGPT(CFG, seed=0)(x, y)[1].item()], what="loss")
    tolerance.assert_matches(runs[2][1][:1], runs[1][1][:1], what="loss")

    model = TinyGPT(CFG, seed=0)  # the per-micro-batch mean is a different objective
    per_micro_mean, _ = reference.train(model, batches, torch.optim.SGD(model.parameters(), lr=0.5),
                                        loss=lambda m, x, y: m(x, y)[1], micro=2)
    assert not tolerance.compare(per_micro_mean["lm_head.weight"], runs[1][0]["lm_head.weight"],
                                 optimizer="sgd", steps=2, lr=0.5)


def test_bad_micro_raises():
    model = MLP((6, 10, 5), seed=0)
    batches = reference.mlp_batches(batch=12, steps=1, sizes=(6, 10, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="micro"):
        reference.train(model, batches, opt, micro=0)
    with pytest.raises(ValueError, match="equal micro-batches"):
        reference.train(model, batches, opt, micro=5)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        reference.mlp_data(batch=0)
