"""FP8 training, emulated (course_lib/precision/fp8.py).

The formats' facts from torch's float8 dtypes; the quantiser saturates; current and delayed
scales; FP8Linear within the error bound derived from e4m3/e5m2's rounding (forward and
backward), equal to torch._scaled_mm; a TinyGPT with every Linear swapped trains, and
without scaling its gradients underflow in e5m2; one launch: FP8 all-gather of FSDP shards
equals quantising on one device, at a quarter of fp32's bytes; finer scales (rowwise, 1 x 128,
128 x 128, MXFP8's 32 with power-of-two scales): each block's amax at the format's max, nothing
of a small row flushed, refused when the block does not divide the tensor.
"""
import pytest
import torch

from course_lib import launch, tolerance
from course_lib.precision.fp8 import (E4M3, E5M2, FP8Linear, TensorScaling, compute_scale, dequantize,
                                      dequantize_blocks, format_facts, matmul_error_bound, quantize,
                                      quantize_blocks, swap_linear_to_fp8, underflow_fraction)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices (tests/conftest.py)


def test_format_facts_from_the_bits():
    e4, e5 = format_facts(E4M3), format_facts(E5M2)
    assert (e4["max"], e4["smallest_subnormal"], e4["relative_precision"]) == (448.0, 2.0 ** -9, 2.0 ** -3)
    assert (e5["max"], e5["smallest_subnormal"], e5["relative_precision"]) == (57344.0, 2.0 ** -16, 2.0 ** -2)
    for facts, dtype in ((e4, E4M3), (e5, E5M2)):
        sub = facts["smallest_subnormal"]
        assert torch.tensor([sub]).to(dtype).float().item() == sub        # representable
        assert torch.tensor([sub / 2]).to(dtype).float().item() == 0.0    # a tie rounds to even: 0
        one_up = 1 + facts["relative_precision"]
        assert torch.tensor([one_up]).to(dtype).float().item() == one_up  # the next number after 1


def test_quantize_saturates_and_scales():
    x = torch.tensor([1000.0, -1e6, 3.0, 1e-4])
    assert quantize(x, 1.0, E4M3).float().tolist() == [448.0, -448.0, 3.0, 0.0]
    assert quantize(torch.tensor([1e6]), 1.0, E5M2).float().item() == 57344.0     # no inf
    s = compute_scale(float(x[2:].abs().max()), E4M3)                            # amax 3 -> 448
    assert quantize(x[2:], s, E4M3).float()[0].item() == 448.0
    assert dequantize(quantize(x[2:], s, E4M3), s)[1].item() != 0.0              # 1e-4 survives scaled
    assert compute_scale(0.0, E4M3) == 1.0 and compute_scale(float("inf"), E4M3) == 1.0


def test_delayed_scale_comes_from_the_history():
    delayed, current = TensorScaling(E4M3, "delayed", history_len=3), TensorScaling(E4M3, "current")
    amaxes = [1.0, 4.0, 2.0, 2.0, 0.5, 0.5]
    got = [(delayed.scale_for(torch.tensor([a])), current.scale_for(torch.tensor([a]))) for a in amaxes]
    # step 0: no history yet (current); then max of the last 3 steps' amaxes, this step's not included
    want_delayed = [448 / 1.0, 448 / 1.0, 448 / 4.0, 448 / 4.0, 448 / 4.0, 448 / 2.0]
    assert [d for d, _ in got] == want_delayed
    assert [c for _, c in got] == [448 / a for a in amaxes]
    with pytest.raises(ValueError, match="recipe"):
        TensorScaling(E4M3, "jit")
    with pytest.raises(ValueError, match="history_len"):
        TensorScaling(E4M3, "delayed", history_len=0)


def test_fp8_linear_within_the_derived_bound():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    fp8 = FP8Linear(linear, recipe="current")
    x = torch.randn(3, 16, 64, requires_grad=True)
    dy = torch.randn(3, 16, 32) * 1e-3
    y, y_ref = fp8(x), linear(x)
    meta = fp8.meta
    sx, sw = meta.input.last_scale, meta.weight.last_scale
    w = linear.weight.detach()
    assert ((y - y_ref).abs() <= matmul_error_bound(x.detach(), w.t(), sx, sw)).all()
    assert not torch.equal(y, y_ref)                       # it did round
    # torch's own FP8 matmul on the same 8-bit inputs: the same sums (fp32 reordering only)
    xq, wq = quantize(x, sx, E4M3).flatten(0, 1), quantize(w, sw, E4M3)
    scaled = torch._scaled_mm(xq, wq.t(), scale_a=torch.tensor(1 / sx), scale_b=torch.tensor(1 / sw),
                              out_dtype=torch.float32)
    tolerance.assert_matches(scaled + linear.bias, y.detach().flatten(0, 1), dtype=torch.float32, terms=64)
    (gx,) = torch.autograd.grad(y, x, dy)
    (gx_ref,) = torch.autograd.grad(y_ref, x, dy)
    sg = meta.grad_output.last_scale
    assert ((gx - gx_ref).abs() <= matmul_error_bound(dy, w, sg, sw, E5M2, E4M3)).all()


GLOBAL_TOKENS = 2 ** 19   # a 0.5M-token global batch (GPT-3 small's): each rank's loss is its sum / this


def _train(recipe, steps):
    from course_lib.data import batches, byte_tokens, synthetic_text
    from course_lib.gpt import GPTConfig, TinyGPT

    model = swap_linear_to_fp8(TinyGPT(GPTConfig(n_layers=1, hidden=32, n_heads=2, seq_len=16), seed=0), recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, zero_grads = [], []
    for x, y in batches(byte_tokens(synthetic_text(4000)), 4, 16, seed=0, n_batches=steps):
        # this rank's share of the global batch's mean loss (data parallel): d loss / d logit <= 2**-19
        _, loss = model(x, y, n_tokens=GLOBAL_TOKENS)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item() * GLOBAL_TOKENS / x.numel())
        zero_grads.append(all(bool((p.grad == 0).all()) for p in model.parameters()))
    return model, losses, zero_grads


def test_swapped_tinygpt_trains_and_underflows_unscaled():
    model, losses, zero = _train("delayed", 30)
    n_linear = sum(isinstance(m, FP8Linear) for m in model.modules())
    assert n_linear == 8 and not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert losses[-1] < losses[0] - 1.0 and not any(zero)
    _, unscaled, zero = _train("none", 5)
    assert all(zero)                              # every gradient of every parameter is 0: dy flushed in e5m2
    assert unscaled[-1] > losses[4] + 0.5         # nothing learns (the scaled run did by step 5)
    g = torch.full((100,), 1e-6)
    assert underflow_fraction(g, 1.0, E5M2) == 1.0 and underflow_fraction(g, compute_scale(1e-6, E5M2), E5M2) == 0.0


def _gather(rows):
    import torch.distributed as dist

    from course_lib import collectives as C
    from course_lib.collectives.comm import TrafficCounter
    from course_lib.precision.fp8 import all_gather_fp8

    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.randn(world * rows, 8, generator=torch.Generator().manual_seed(0))
    shard = full[rank * rows:(rank + 1) * rows]       # FSDP's dim-0 shard
    fp8_counter, counters = TrafficCounter(), {}
    gathered, scale = all_gather_fp8(shard, counter=fp8_counter)
    for dtype in (torch.bfloat16, torch.float32):
        counters[str(dtype)] = TrafficCounter()
        out = torch.empty(full.shape, dtype=dtype)
        C.all_gather_into_tensor(out, shard.to(dtype), counter=counters[str(dtype)])
    return {"fp8": fp8_counter.bytes_sent, **{k: c.bytes_sent for k, c in counters.items()},
            "gathered": gathered.view(torch.uint8), "scale": scale, "full": full}


def test_fp8_all_gather_equals_one_device_and_counts_bytes():
    world, rows = 3, 4
    results = launch(_gather, world, rows, timeout=60)
    full = results[0]["full"]
    scale = compute_scale(float(full.abs().max()), E4M3)
    want = quantize(full, scale, E4M3).view(torch.uint8)
    shard_elems = rows * 8
    for r in results:
        assert r["scale"] == scale and torch.equal(r["gathered"], want)
        # a ring all-gather sends (N - 1) shards; the scale's all-reduce a few 4-byte pieces
        assert r["torch.float32"] == 4 * (world - 1) * shard_elems and r["torch.bfloat16"] == 2 * (world - 1) * shard_elems
        assert (world - 1) * shard_elems < r["fp8"] <= (world - 1) * shard_elems + 2 * (world - 1) * 4


def test_block_scales_put_each_blocks_amax_at_the_max():
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(4, 64, generator=gen) * 2 - 1) * 2.0 ** torch.tensor([[0.0], [-6.0], [-12.0], [-18.0]])
    for block in ((4, 64), (1, 64), (1, 32), (2, 32)):
        codes, scales = quantize_blocks(x, block)
        assert codes.dtype == E4M3 and codes.shape == x.shape
        assert scales.shape == (4 // block[0], 64 // block[1])
        blocks_amax = codes.float().abs().reshape(scales.shape[0], block[0], scales.shape[1], block[1]).amax((1, 3))
        assert torch.equal(blocks_amax, torch.full_like(blocks_amax, 448.0)), block   # amax lands on 448
        back = dequantize_blocks(codes, scales, block)
        normal = x.abs() * scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1) >= 2.0 ** -6
        assert ((back - x).abs() <= 2.0 ** -4 * x.abs())[normal].all(), block   # e4m3's u, normal range
    # per tensor: the row 2**-18 below the largest flushes; rowwise keeps every element
    flushed = lambda block: float(((dequantize_blocks(*quantize_blocks(x, block), block) == 0) & (x != 0)).float().mean())
    assert flushed((4, 64)) > 0.1 and flushed((1, 64)) == 0.0
    # per tensor with the whole tensor as its block = the per-tensor quantiser
    codes, scales = quantize_blocks(x, (4, 64))
    assert torch.equal(codes.view(torch.uint8), quantize(x, float(scales), E4M3).view(torch.uint8))


def test_mx_scales_are_powers_of_two_that_saturate_nothing():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=gen) * 3.0
    codes, scales = quantize_blocks(x, (1, 32), power_of_two=True)
    mantissa, _ = torch.frexp(scales)
    assert (mantissa == 0.5).all()                                  # exactly 2**k: an E8M0 exponent
    amax = codes.float().abs().reshape(8, 1, 2, 32).amax((1, 3))
    assert ((amax >= 224.0) & (amax <= 448.0)).all()     # the top binade (rounded), never clamped
    assert torch.equal(quantize_blocks(torch.zeros(2, 32), (1, 32))[1], torch.ones(2, 1))   # amax 0: scale 1


@pytest.mark.parametrize("x,block,message", [
    (torch.ones(4, 6), (1, 4), "must divide the tensor's shape"),
    (torch.ones(4, 6), (0, 2), "must divide"),
    (torch.ones(4), (1, 4), "2-D tensor"),
])
def test_quantize_blocks_refuses_blocks_that_do_not_tile(x, block, message):
    with pytest.raises(ValueError, match=message):
        quantize_blocks(x, block)
