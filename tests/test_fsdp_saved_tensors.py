"""FSDP's saved_tensors_hooks compose with the pair its forward runs inside (issue #36).

FSDP turns a saved view of gathered parameters into a token, with its own
``saved_tensors_hooks``; torch calls only the innermost pair, so a count of the activations
saved for backward around it (the pipeline runner's, hence the dry run's and a real launch's
``activations``) used to see none of the blocks' tensors. FSDP now hands every other saved
tensor to the enclosing pack hook and its packed form back to the enclosing unpack hook.

Checked: around a real FSDP the enclosing pair sees exactly the bytes it sees around the plain
model, parameters left out, and its unpack is what backward gets (a pack that wraps the
tensor: backward would fail without it); the gradients and the gathered-parameter peak are the
same with and without the enclosing pair (parameters are still resharded after forward, not
kept twice). On the dry run: FSDP, HSDP, ZeRO++ and FSDP under PP save the same activation
bytes per stage as DDP on the same layout, to the byte; tests/test_dry_run_sharded.py checks
the first three layouts' dry runs against real launches (``activations`` equal): both sides
count the blocks' tensors now, and both missed them before.
"""
import pytest
import torch

from course_lib import launch
from course_lib.layout import Layout
from course_lib.memory import storage_bytes
from course_lib.models import GPTConfig, TinyGPT
from course_lib.parallel.fsdp import FSDP
from course_lib.virtual import dry_run
from test_dry_run_sharded import HW, LAYOUTS as SHARDED, SPEC

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=3, hidden=32, n_heads=4, n_kv_heads=2)


class Wrapped:
    """What the enclosing pack hook returns: not a tensor (an offload's handle would not be)."""

    def __init__(self, t):
        self.t = t


def _step(net, params, x, outer):
    """One forward and backward of ``net``; with ``outer``, inside a pair that records what it
    is handed and wraps it. (bytes saved, packs, unpacks: parameters' storages left out; and
    whether each block's gathered parameters were freed after forward)."""
    constant = {p.untyped_storage().data_ptr() for p in params}
    seen, unpacked = [], [0]

    def pack(t):
        if t.untyped_storage().data_ptr() not in constant:
            seen.append(t)
        return Wrapped(t)

    def unpack(w):
        unpacked[0] += w.t.untyped_storage().data_ptr() not in constant
        return w.t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack) if outer else None
    if hooks:
        with hooks:
            loss = net(x[:, :-1], x[:, 1:])[1]
    else:
        loss = net(x[:, :-1], x[:, 1:])[1]
    resharded = [u.full is None for u in getattr(net, "units", []) if not u.is_root]
    loss.backward()
    return storage_bytes(seen), len(seen), unpacked[0], resharded


def rank_checks():
    x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1),
                      generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    plain = TinyGPT(CFG, seed=0)
    out = {"plain": _step(plain, [*plain.parameters(), *plain.buffers()], x, True)}
    for outer in (False, True):
        net = FSDP(TinyGPT(CFG, seed=0))
        out[outer] = _step(net, [*net.parameters(), *net.buffers()], x, outer)
        net.finish_gradient_synchronization()
        out[outer] += ({n: p.grad.clone() for n, p in net.named_parameters()}, dict(net.peak))
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(rank_checks, 2, threads=1, timeout=120)


def test_the_enclosing_pair_sees_the_plain_models_activations(ranks):
    for r in ranks:
        plain_bytes, plain_packs, plain_unpacks, _ = r["plain"]
        got_bytes, got_packs, got_unpacks, resharded = r[True][:4]
        assert plain_bytes > 0 and got_bytes == plain_bytes          # to the byte, no parameter
        assert got_packs == plain_packs                             # the same tensors, one by one
        assert got_unpacks == plain_unpacks > 0                     # backward went through it
        assert resharded and all(resharded)                         # blocks freed after forward


def test_fsdp_is_unchanged_by_the_enclosing_pair(ranks):
    for r in ranks:
        without, with_ = r[False], r[True]
        assert with_[4].keys() == without[4].keys()
        for name, g in without[4].items():
            assert torch.equal(with_[4][name], g), name   # the same ops in the same order: bitwise
        assert with_[5] == without[5]                   # gathered parameters held at once: the same


ZERO3 = {**{name: L for name, L in SHARDED.items() if L.zero == 3},   # each also run for real there
         "fsdp dp2 x pp2, selective": Layout(dp=2, pp=2, zero=3, recompute="selective", micro_batch=1,
                                             global_batch=8)}


@pytest.mark.parametrize("name", list(ZERO3))
def test_dry_run_activations_under_zero3_equal_ddp(name):
    L = ZERO3[name]
    ddp = L.with_(zero=0, shard_size=None, zeropp=(), gpus_per_node=None)
    want = [m["activations"] for m in dry_run(SPEC, HW, ddp, progress=None).memory_by_stage]
    got = [m["activations"] for m in dry_run(SPEC, HW, L, progress=None).memory_by_stage]
    assert min(want) > 0 and got == want
