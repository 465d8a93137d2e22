"""Context parallelism (course_lib/parallel/context_parallel.py) against one device.

Ring attention (its blocks written out, and as FlashAttention kernels) and Ulysses: outputs
and gradients (q, k, v) equal to full causal attention
on one device for several lengths, CP sizes 2, 3, 4, both layouts and grouped-query heads
(fp32, within one step's reordering bound, course_lib.tolerance); a tiny GPT trained 5 AdamW
steps in float64 with CP (Mesh(cp=2), ring and Ulysses; Mesh(dp=2, cp=2) with DDP over
("dp", "cp")) ends with the single-device weights (float64: fp32 AdamW cannot claim more than
~lr per step, see course_lib.tolerance); the
zigzag layout balances causal work; payload bytes equal the formulas; bad input is refused.
One launch per world size runs every case of that size.
"""
import pytest
import torch

from course_lib import fused, launch, reference, tolerance
from course_lib.attention import causal_attention
from course_lib.models import GPTConfig, TinyGPT
from course_lib.parallel import context_parallel as cp

CFG = GPTConfig(vocab_size=64, seq_len=24, n_layers=2, hidden=32, n_heads=4, n_kv_heads=2)
STEPS, BATCH, LR = 5, 4, 1e-2


def _qkv(seq, a, kv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, seq, 8, generator=g) for h in (a, kv, kv, a)]  # q, k, v, dy


def _attention_cases(n):
    """(method, seq, a, kv, layout) for CP size n: two lengths, MHA and GQA."""
    out = []
    for seq in (2 * n * 2, 2 * n * 5):
        for a, kv in ((4, 4), (6, 2) if n == 3 else (4, 2)):
            out += [(ring, seq, a, kv, layout) for ring in ("ring", "ring_flash")
                    for layout in ("zigzag", "contiguous")]
            if a % n == 0 and kv % n == 0:   # ulysses_flash: its core one FlashAttention kernel, in order
                out.append(("ulysses", seq, a, kv, "zigzag"))
                out += [("ulysses_flash", seq, a, kv, layout) for layout in ("zigzag", "contiguous")]
    return out


def _attention_on_ranks(cases):
    import torch.distributed as dist

    from course_lib.collectives.comm import Comm, TrafficCounter
    from course_lib.parallel.mesh import Mesh

    mesh = Mesh(cp=dist.get_world_size())
    comm = Comm(mesh.group("cp"), TrafficCounter(), dim="cp")  # counts point-to-point payload
    out = []
    for method, seq, a, kv, layout in cases:
        q, k, v, dy = _qkv(seq, a, kv)
        pos = cp.shard_positions(seq, comm.size, comm.rank, layout)
        local = [t.index_select(2, pos).requires_grad_() for t in (q, k, v)]
        comm.counter.reset()
        if method.startswith("ring"):     # ring_flash: its blocks as FlashAttention kernels
            y = cp.ring_attention(*local, pos, comm, seq, layout, flash=method == "ring_flash")
        elif method == "ulysses_flash":
            y = cp.ulysses_attention(*local, pos, mesh.comm("cp"), lambda q, k, v: fused.flash_attention(q, k, v),
                                     seq_len=seq, layout=layout, in_order=True)
        else:
            y = cp.ulysses_attention(*local, pos, mesh.comm("cp"))
        forward_bytes = comm.counter.bytes_sent
        (y * dy.index_select(2, pos)).sum().backward()
        out.append((y.detach(), [t.grad for t in local], pos, forward_bytes, comm.counter.bytes_sent))
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_and_ulysses_equal_full_attention(n):
    cases = _attention_cases(n)
    ranks = launch(_attention_on_ranks, n, cases)
    for i, (method, seq, a, kv, layout) in enumerate(cases):
        q, k, v, dy = _qkv(seq, a, kv)
        ts = [t.clone().requires_grad_() for t in (q, k, v)]
        y = causal_attention(*ts)
        (y * dy).sum().backward()
        for r, res in enumerate(ranks):
            got_y, grads, pos, fwd_bytes, all_bytes = res[i]
            where = f"{method} {layout} seq={seq} heads={a}/{kv} rank {r}"
            tolerance.assert_matches(got_y, y.detach().index_select(2, pos), what=where)
            tolerance.assert_matches({n: g for n, g in zip("qkv", grads)},
                                     {n: t.grad.index_select(2, pos) for n, t in zip("qkv", ts)}, what=where)
            if method.startswith("ring"):  # N-1 hops of this rank's K and V, forward; backward adds N of dK, dV
                kv_bytes = 2 * 2 * kv * (seq // n) * 8 * 4
                assert fwd_bytes == (n - 1) * kv_bytes, where
                assert all_bytes - fwd_bytes == (n - 1) * kv_bytes + n * kv_bytes, where


def test_zigzag_layout_and_balance():
    assert cp.zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp.zigzag_positions(12, 3, 1).tolist() == [2, 3, 8, 9]
    every = torch.cat([cp.zigzag_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    for n in (2, 3, 4):
        seq = 16 * n

        def work(layout):
            pos = [cp.shard_positions(seq, n, r, layout) for r in range(n)]
            return [sum(cp.attention_flops(pos[r], pos[j], 1, 1) for j in range(n)) for r in range(n)]

        zig, cont = work("zigzag"), work("contiguous")
        assert len(set(zig)) == 1                         # equal work on every rank
        assert cont == sorted(cont) and cont[-1] > cont[0]  # the last rank sees the most keys
        assert sum(zig) == sum(cont)                      # the same total, computed blockwise


def test_merge_partial_is_softmax_over_the_union():
    q, k, v, _ = _qkv(6, 2, 2)
    pos = torch.arange(6)
    o1, l1 = cp.block_attention(q, k[:, :, :3], v[:, :, :3], pos, pos[:3])
    o2, l2 = cp.block_attention(q, k[:, :, 3:], v[:, :, 3:], pos, pos[3:])   # rows 0-2 see nothing: -inf
    assert torch.isinf(l2[:, :, :3]).all()
    out, _ = cp.merge_partial(o1, l1, o2, l2)
    tolerance.assert_matches(out, causal_attention(q, k, v))


def _train_cp(mesh_shape, method, layout, batches):
    import torch.distributed as dist

    from course_lib.parallel.data_parallel import DDP
    from course_lib.parallel.mesh import Mesh

    mesh = Mesh(**mesh_shape)
    # the ring's blocks as FlashAttention kernels; Ulysses' core one such kernel on the sequence in order
    flash = method in ("ring_flash", "ulysses_flash")
    model = TinyGPT(CFG, seed=0).double()
    if method == "ulysses_flash":
        fused.install_flash(model)
    model = cp.context_parallel(model, mesh.comm("cp"), method.removesuffix("_flash"), layout)
    for block in model.blocks:
        block.attn.flash_blocks = flash
    ddp = DDP(model, mesh=mesh, dims=("dp", "cp"), divisor=1)   # loss already / global tokens
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    c = mesh.coord
    pos = cp.shard_positions(CFG.seq_len, mesh.sizes["cp"], c["cp"], layout)
    losses, first_grads = [], None
    for x, y in batches:
        n_tokens = int((y != -100).sum())                          # the GLOBAL batch's tokens
        x, y = x.chunk(mesh.sizes["dp"])[c["dp"]], y.chunk(mesh.sizes["dp"])[c["dp"]]
        loss = ddp(x[:, pos], y[:, pos], positions=pos, n_tokens=n_tokens)[1]
        loss.backward()
        ddp.finish_gradient_synchronization()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert dist.get_world_size() == mesh.world_size
    return model.state_dict(), losses, first_grads


def _first_step_grads(batch):
    model = TinyGPT(CFG, seed=0).double()
    x, y = batch
    model(x, y, n_tokens=int((y != -100).sum()))[1].backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mesh_shape,method,layout", [
    (dict(cp=2), "ring", "zigzag"), (dict(cp=2), "ulysses", "contiguous"), (dict(dp=2, cp=2), "ring", "zigzag"),
    (dict(cp=3), "ring_flash", "zigzag"), (dict(cp=2), "ulysses_flash", "zigzag")])
def test_training_with_cp_equals_one_device(mesh_shape, method, layout):
    batches = reference.gpt_batches(CFG, batch=BATCH, steps=STEPS)
    model = TinyGPT(CFG, seed=0).double()            # float64: exactness is the claim
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    ref_state, ref_losses = reference.train_gpt(model, batches, opt)
    ref_grads = _first_step_grads(batches[0])
    world = mesh_shape.get("dp", 1) * mesh_shape["cp"]
    ranks = launch(_train_cp, world, mesh_shape, method, layout, batches)
    for state, _, grads in ranks:   # AdamW hides a scaled gradient: step 1's gradients tightly
        tolerance.assert_matches(grads, ref_grads, what="first step's gradients")
        tolerance.assert_matches(state, ref_state, optimizer="adamw", steps=STEPS, lr=LR)
    summed = [sum(r[1][s] for r in ranks) for s in range(STEPS)]   # shard losses add up to the global one
    tolerance.assert_matches(summed, ref_losses, optimizer="adamw", steps=STEPS, lr=LR, what="losses")


def _bad_inputs():
    import torch.distributed as dist

    from course_lib.parallel.mesh import Mesh

    comm = Mesh(cp=dist.get_world_size()).comm("cp")
    q = torch.zeros(1, 3, 4, 8)
    attn = cp.context_parallel(TinyGPT(CFG, seed=0), comm).blocks[0].attn
    errors = []
    for call in (lambda: cp.ulysses_attention(q, q, q, torch.arange(4), comm),          # 3 heads, CP 2
                 lambda: cp.ring_attention(q, q, q, torch.arange(4), comm, 8, "zigzag"),  # wrong shard
                 lambda: attn(torch.zeros(1, 6, CFG.hidden))):                            # no positions
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="divisible by 2\\*CP=4"):
        cp.zigzag_positions(10, 2, 0)
    with pytest.raises(ValueError, match="layout"):
        cp.shard_positions(8, 2, 0, "striped")
    ulysses, ring, positions = launch(_bad_inputs, 2)[0]
    assert "divisible by cp=2" in ulysses, ulysses
    assert "zigzag shard" in ring
    assert "needs the positions of this rank's tokens" in positions


def _bf16_ring(seq):
    import torch.distributed as dist

    from course_lib.parallel.mesh import Mesh

    comm = Mesh(cp=dist.get_world_size()).comm("cp")
    q, k, v, dy = _qkv(seq, 4, 2, seed=3)
    pos = cp.shard_positions(seq, comm.size, comm.rank, "zigzag")
    out = []
    for flash in (False, True):
        local = [t.index_select(2, pos).bfloat16().requires_grad_() for t in (q, k, v)]
        y = cp.ring_attention(*local, pos, comm, seq, "zigzag", flash=flash)
        (y.float() * dy.index_select(2, pos)).sum().backward()
        out.append((pos, y.detach(), [t.grad for t in local]))
    return out


def test_bf16_ring_attention_is_as_accurate_as_one_device_bf16():
    """16-bit blocks merge and accumulate in fp32: the error against fp32 attention is no
    larger than one device's bf16 attention (merging N partial results in bf16 doubled it),
    the blocks written out or as FlashAttention kernels (each block's output and gradients
    rounded to bf16 by the kernel, then merged and summed in fp32)."""
    seq, n = 64, 4
    q, k, v, dy = _qkv(seq, 4, 2, seed=3)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    y64 = causal_attention(*exact)
    (y64 * dy.double()).sum().backward()
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    y16 = causal_attention(*low)
    (y16.float() * dy).sum().backward()

    def rel(got, want):                     # relative error in norm: rounding to bf16 is ~2^-9 of it
        got, want = got.detach().double(), want.detach()
        return float((got - want).norm() / want.norm())

    one_device = [rel(y16, y64)] + [rel(t.grad, e.grad) for t, e in zip(low, exact)]
    for runs in launch(_bf16_ring, n, seq):
        for flash, (pos, y, grads) in zip((False, True), runs):
            ring = [rel(y, y64.index_select(2, pos))] + [rel(g, e.grad.index_select(2, pos))
                                                         for g, e in zip(grads, exact)]
            for name, mine, single in zip(("out", "dq", "dk", "dv"), ring, one_device):
                assert mine <= 1.25 * single, (name, flash, mine, single)


def test_running_block_attention_is_the_log_sum_exp_form_kept_running():
    """acc / l = out and m + log l = lse of block_attention; a query that sees no key: m = -inf, l = acc = 0."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    q_pos, k_pos = torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])
    acc, m, l = cp.running_block_attention(q, k, v, q_pos, k_pos)
    out, lse = cp.block_attention(q, k, v, q_pos, k_pos)
    seen = l > 0
    assert seen.tolist() == [[[False, False, True, True]] * 2]
    assert torch.isinf(m[~seen]).all() and (acc[~seen] == 0).all()
    assert tolerance.compare(acc[seen] / l[seen][..., None], out[seen], dtype=torch.float64, terms=8).ok
    assert tolerance.compare(m[seen] + l[seen].log(), lse[seen], dtype=torch.float64, terms=8).ok
