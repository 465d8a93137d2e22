"""Chapter 7's graders (course_lib/grading/context_parallel.py): a differently written right
answer passes; classic mistakes (the naive merge's NaN, no rescaling, masks by index), an
answer hard-coded to a printed case and a shortcut through the library (the lecture's own
lse-form code) each fail with a hint that names the mistake."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib.grading import context_parallel as G
from grading_answers import fails_with, graded


# ----------------------------------------------------------------------------- merge (running form)
def merge(acc1, m1, l1, acc2, m2, l2):
    """Written through the log-sum-exp form: lse = m + log l, merged, then back."""
    lse1, lse2 = m1 + torch.log(l1), m2 + torch.log(l2)       # -inf where a side saw nothing
    m = torch.maximum(m1, m2)
    finite = torch.isfinite(m)
    w1 = torch.where(finite, torch.exp(torch.where(finite, lse1 - torch.where(finite, m, 0), -math.inf)), 0)
    w2 = torch.where(finite, torch.exp(torch.where(finite, lse2 - torch.where(finite, m, 0), -math.inf)), 0)
    scale1 = torch.where(l1 > 0, w1 / torch.where(l1 > 0, l1, 1), 0)     # rescale factor of side 1
    scale2 = torch.where(l2 > 0, w2 / torch.where(l2 > 0, l2, 1), 0)
    return acc1 * scale1[..., None] + acc2 * scale2[..., None], m, w1 + w2


def naive(acc1, m1, l1, acc2, m2, l2):          # the trap: NaN where neither block has a visible key
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return acc1 * a1[..., None] + acc2 * a2[..., None], m, l1 * a1 + l2 * a2


def no_rescale(acc1, m1, l1, acc2, m2, l2):     # adds the sums without bringing them to one max
    return acc1 + acc2, torch.maximum(m1, m2), l1 + l2


def normalised(acc1, m1, l1, acc2, m2, l2):     # returns the output, not the running form
    acc, m, l = merge_ok(acc1, m1, l1, acc2, m2, l2)
    return acc / torch.where(l > 0, l, 1)[..., None], m, torch.ones_like(l)


def merge_ok(acc1, m1, l1, acc2, m2, l2):
    m = torch.maximum(m1, m2)
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    a1, a2 = torch.exp(m1 - safe), torch.exp(m2 - safe)
    return acc1 * a1[..., None] + acc2 * a2[..., None], m, l1 * a1 + l2 * a2


def test_merge_running(capsys):
    assert graded(capsys, G.check_merge_running, merge)[0]
    fails_with(capsys, G.check_merge_running, naive, hint="no key of either block")
    fails_with(capsys, G.check_merge_running, no_rescale, hint=("l:", "acc:"))
    fails_with(capsys, G.check_merge_running, normalised, hint="keep the running form")

    def lecture(acc1, m1, l1, acc2, m2, l2):     # the lecture's lse merge, shown in chapter 7
        from course_lib.parallel.context_parallel import merge_partial
        return merge_partial(acc1, m1, acc2, m2)
    fails_with(capsys, G.check_merge_running, lecture, hint="write this yourself")


# ----------------------------------------------------------------------------- zigzag unshard
def unshard(parts):
    n = len(parts)
    if len({p.shape[1] for p in parts}) != 1 or parts[0].shape[1] % 2:
        raise ValueError("uneven parts")
    c = parts[0].shape[1] // 2
    order = [r for r in range(n)] + [r for r in reversed(range(n))]       # chunk j comes from rank order[j]
    half = [0] * (2 * n)
    for j, r in enumerate(order):
        half[j] = parts[r][:, :c] if j < n else parts[r][:, c:]
    return torch.cat(half, 1)


def concatenated(parts):
    if len({p.shape[1] for p in parts}) != 1 or parts[0].shape[1] % 2:
        raise ValueError("uneven parts")
    return torch.cat(parts, 1)


def mirror_off_by_one(parts):
    n = len(parts)
    if len({p.shape[1] for p in parts}) != 1 or parts[0].shape[1] % 2:
        raise ValueError("uneven parts")
    chunks = [None] * (2 * n)
    for r, part in enumerate(parts):
        a, b = part.chunk(2, dim=1)
        chunks[r] = a
        chunks[(2 * n - 2 - r) % (2 * n) if r else 2 * n - 1] = b
    return torch.cat([c if c is not None else a * 0 for c in chunks], 1)


def no_check(parts):
    n = len(parts)
    chunks = [None] * (2 * n)
    for r, part in enumerate(parts):
        chunks[r], chunks[2 * n - 1 - r] = part.chunk(2, dim=1)
    return torch.cat(chunks, 1)


def test_zigzag_unshard(capsys):
    assert graded(capsys, G.check_zigzag_unshard, unshard)[0]
    fails_with(capsys, G.check_zigzag_unshard, concatenated, hint="concatenated")
    fails_with(capsys, G.check_zigzag_unshard, mirror_off_by_one, hint="sequence")
    fails_with(capsys, G.check_zigzag_unshard, no_check, hint="expected ValueError")
    fails_with(capsys, G.check_zigzag_unshard, lambda parts: torch.arange(8)[None], hint="sequence")

    def library(parts):
        from course_lib.parallel.context_parallel import zigzag_positions
        n, s = len(parts), 2 * sum(p.shape[1] for p in parts) // 2
        order = torch.cat([zigzag_positions(s, n, r) for r in range(n)])
        return torch.cat(parts, 1)[:, torch.argsort(order)]
    fails_with(capsys, G.check_zigzag_unshard, library, hint="write this yourself")


# ----------------------------------------------------------------------------- block attention
def block_attention(q, k, v, q_pos, k_pos):
    """einsum, where(), and the row max by hand."""
    s = torch.einsum("basd,batd->bast", q, k) / q.shape[-1] ** 0.5
    visible = k_pos[None, :] <= q_pos[:, None]
    s = torch.where(visible, s, torch.full_like(s, -math.inf))
    m = s.max(-1).values
    e = torch.where(visible, torch.exp(s - torch.where(torch.isinf(m), 0, m)[..., None]), 0)
    return torch.einsum("bast,batd->basd", e, v), m, e.sum(-1)


def by_index(q, k, v, q_pos, k_pos):
    return block_attention(q, k, v, torch.arange(q.shape[2]), torch.arange(k.shape[2]))


def nan_rows(q, k, v, q_pos, k_pos):
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    m = s.amax(-1)
    e = torch.exp(s - m[..., None])
    return e @ v, m, e.sum(-1)


def unscaled(q, k, v, q_pos, k_pos):
    return block_attention(q * math.sqrt(q.shape[-1]), k, v, q_pos, k_pos)


def test_block_attention(capsys):
    assert graded(capsys, G.check_block_attention, block_attention)[0]
    fails_with(capsys, G.check_block_attention, by_index, hint="by index")
    fails_with(capsys, G.check_block_attention, nan_rows, hint="NaN")
    fails_with(capsys, G.check_block_attention, unscaled, hint="1/sqrt(d)")

    def lecture(q, k, v, q_pos, k_pos):
        from course_lib.parallel.context_parallel import block_attention
        out, lse = block_attention(q, k, v, q_pos, k_pos)
        return out, lse, torch.ones_like(lse)
    fails_with(capsys, G.check_block_attention, lecture, hint="write this yourself")


# ----------------------------------------------------------------------------- ring attention
def ring_attention(q, k, v, positions, **bug):
    """K and V sent as two messages; the sender's positions recomputed, not sent."""
    r, n = dist.get_rank(), dist.get_world_size()
    acc, m, l = block_attention(q, k, v, positions, positions)
    seq = positions.numel() * n
    for step in range(1, n):
        k2, v2 = torch.empty_like(k), torch.empty_like(v)
        peer_to = (r - 1) % n if bug.get("backwards") else (r + 1) % n
        peer_from = (r + 1) % n if bug.get("backwards") else (r - 1) % n
        reqs = [dist.isend(k, peer_to), dist.isend(v, peer_to)]
        dist.recv(k2, peer_from)
        dist.recv(v2, peer_from)
        for w in reqs:
            w.wait()
        k, v = k2, v2
        src = (r - step) % n if not bug.get("backwards") else (r + step) % n
        k_pos = positions if bug.get("own_positions") else _zigzag(seq, n, src)
        acc, m, l = merge_ok(acc, m, l, *block_attention(q, k, v, positions, k_pos))
        if bug.get("extra_send"):
            w = dist.isend(k, (r + 1) % n)
            dist.recv(torch.empty_like(k), (r - 1) % n)
            w.wait()
    return acc / l[..., None]


def _zigzag(seq, n, r):
    c = seq // (2 * n)
    return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c)])


def all_gathered(q, k, v, positions):
    n = dist.get_world_size()
    ks, vs, ps = [torch.empty_like(k) for _ in range(n)], [torch.empty_like(v) for _ in range(n)], \
        [torch.empty_like(positions) for _ in range(n)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    dist.all_gather(ps, positions)
    acc, m, l = block_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), positions, torch.cat(ps))
    return acc / l[..., None]


def test_ring_attention(capsys):
    assert graded(capsys, G.check_ring_attention, ring_attention)[0]
    fails_with(capsys, G.check_ring_attention, lambda *a: ring_attention(*a, own_positions=True), hint="positions")
    fails_with(capsys, G.check_ring_attention, lambda *a: ring_attention(*a, backwards=True), hint="next rank")
    fails_with(capsys, G.check_ring_attention, lambda *a: ring_attention(*a, extra_send=True), hint="cp-1")
    fails_with(capsys, G.check_ring_attention, all_gathered, hint="write this yourself")

    def library(q, k, v, positions):
        from course_lib.parallel import ring_attention as lib
        return lib(q, k, v, positions, None)
    fails_with(capsys, G.check_ring_attention, library, hint="write this yourself")
