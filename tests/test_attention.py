"""course_lib.attention's blockwise (FlashAttention-style) causal attention against the plain one:
the same outputs and gradients, and saved memory linear in the sequence length."""
import pytest
import torch

from course_lib import tolerance
from course_lib.attention import blockwise_causal_attention, causal_attention


def _run(fn, q, k, v, dy):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    y = fn(*leaves)
    (y * dy).sum().backward()
    return {"out": y.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


@pytest.mark.parametrize("a,kv,s,block", [(4, 4, 37, 8), (8, 2, 64, 16), (4, 2, 5, 64), (2, 1, 33, 1)])
def test_blockwise_equals_causal_attention(a, kv, s, block):
    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(2, h, s, 8, generator=g, dtype=torch.float64) for h in (a, kv, kv, a))
    want = _run(causal_attention, q, k, v, dy)
    got = _run(lambda *t: blockwise_causal_attention(*t, block=block), q, k, v, dy)
    tolerance.assert_matches(got, want, what="blockwise attention against plain causal attention")


def _saved_bytes(fn):
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_blockwise_saves_memory_linear_in_s():
    saved = {}
    for s in (128, 256):
        q, k, v = (torch.randn(1, 2, s, 16, requires_grad=True) for _ in range(3))
        saved[s] = _saved_bytes(lambda: blockwise_causal_attention(q, k, v, block=32))
        assert saved[s] == 4 * (4 * 2 * s * 16 + 2 * s)   # q, k, v, out (fp32) + the log-sum-exp per row
    plain = _saved_bytes(lambda: causal_attention(*(torch.randn(1, 2, 256, 16, requires_grad=True) for _ in range(3))))
    assert plain > 4 * 2 * 256 * 256                       # the (s, s) probabilities
    assert saved[256] == 2 * saved[128]


def test_blockwise_refuses_bad_input():
    q = torch.zeros(1, 3, 4, 8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        blockwise_causal_attention(q, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))
    with pytest.raises(ValueError, match="positive"):
        blockwise_causal_attention(q, q, q, block=0)
