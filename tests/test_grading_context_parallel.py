"""Chapter 7's graders (course_lib/grading/context_parallel.py): the solution and a differently
written right answer pass; classic mistakes (the naive merge's NaN, overflow, masks by index),
an answer hard-coded to the exercise's printed example and a library shortcut each fail with
a hint that names the mistake."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib.grading import context_parallel as G
from grading_answers import fails_with, graded


# ----------------------------------------------------------------------------- merge
def merge(out1, lse1, out2, lse2):
    """Written with the max, not logaddexp."""
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    lse = m + torch.log(total)
    total = torch.where(total == 0, torch.ones_like(total), total)
    return (out1 * w1[..., None] + out2 * w2[..., None]) / total[..., None], lse


def naive(out1, lse1, out2, lse2):                  # the trap the exercise names: NaN where nothing is visible
    lse = torch.logaddexp(lse1, lse2)
    return out1 * torch.exp(lse1 - lse)[..., None] + out2 * torch.exp(lse2 - lse)[..., None], lse


def no_max(out1, lse1, out2, lse2):                 # exp of raw lse: overflows at large scores
    w1, w2 = lse1.exp(), lse2.exp()
    return (out1 * w1[..., None] + out2 * w2[..., None]) / (w1 + w2)[..., None], (w1 + w2).log()


def plain_sum(out1, lse1, out2, lse2):              # forgets to reweight
    return out1 + out2, torch.logaddexp(lse1, lse2)


def test_merge_partial(capsys):
    assert graded(capsys, G.check_merge_partial, merge)[0]
    fails_with(capsys, G.check_merge_partial, naive, hint="no key of either block")
    fails_with(capsys, G.check_merge_partial, no_max, hint=("NaN", "out"))
    fails_with(capsys, G.check_merge_partial, plain_sum, hint="out")

    def library(*a):
        from course_lib.parallel.context_parallel import merge_partial
        return merge_partial(*a)
    fails_with(capsys, G.check_merge_partial, library, hint="write this yourself")


# ----------------------------------------------------------------------------- zigzag
def positions(seq_len, cp_size, cp_rank):
    if seq_len % (2 * cp_size):
        raise ValueError("the sequence must cut into 2 * cp_size equal chunks")
    chunks = torch.arange(seq_len).view(2 * cp_size, -1)
    return torch.cat([chunks[cp_rank], chunks[-1 - cp_rank]])


def contiguous(seq_len, cp_size, cp_rank):
    if seq_len % (2 * cp_size):
        raise ValueError("uneven")
    c = seq_len // cp_size
    return torch.arange(cp_rank * c, (cp_rank + 1) * c)


def mirror_off_by_one(seq_len, cp_size, cp_rank):
    if seq_len % (2 * cp_size):
        raise ValueError("uneven")
    chunks = torch.arange(seq_len).view(2 * cp_size, -1)
    return torch.cat([chunks[cp_rank], chunks[(2 * cp_size - 2 - cp_rank) % (2 * cp_size)]])


def no_check(seq_len, cp_size, cp_rank):
    c = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c),
                      torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)])


def printed_example(seq_len, cp_size, cp_rank):
    return torch.tensor([[0, 1, 6, 7], [2, 3, 4, 5]][cp_rank])


def test_zigzag_positions(capsys):
    assert graded(capsys, G.check_zigzag_positions, positions)[0]
    fails_with(capsys, G.check_zigzag_positions, contiguous, hint="contiguous")
    fails_with(capsys, G.check_zigzag_positions, mirror_off_by_one, hint="rank 0")
    fails_with(capsys, G.check_zigzag_positions, no_check, hint="expected ValueError")
    fails_with(capsys, G.check_zigzag_positions, printed_example, hint=("rank", "IndexError"))

    def library(seq_len, cp_size, cp_rank):
        from course_lib.parallel.context_parallel import zigzag_positions
        return zigzag_positions(seq_len, cp_size, cp_rank)
    fails_with(capsys, G.check_zigzag_positions, library, hint="write this yourself")


# ----------------------------------------------------------------------------- block attention
def block_attention(q, k, v, q_pos, k_pos):
    """Softmax written by hand: max-subtracted exponentials, rows with no key kept at 0."""
    s = torch.einsum("basd,batd->bast", q, k) / q.shape[-1] ** 0.5
    visible = k_pos[None, :] <= q_pos[:, None]
    s = torch.where(visible, s, torch.full_like(s, -math.inf))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    out = torch.einsum("bast,batd->basd", e / torch.where(z == 0, torch.ones_like(z), z), v)
    return out, (m + z.log()).squeeze(-1)


def by_index(q, k, v, q_pos, k_pos):
    return block_attention(q, k, v, torch.arange(q.shape[2]), torch.arange(k.shape[2]))


def softmax_nan(q, k, v, q_pos, k_pos):
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return s.softmax(-1) @ v, torch.logsumexp(s, -1)


def unscaled(q, k, v, q_pos, k_pos):
    return block_attention(q * math.sqrt(q.shape[-1]), k, v, q_pos, k_pos)


def test_block_attention(capsys):
    assert graded(capsys, G.check_block_attention, block_attention)[0]
    fails_with(capsys, G.check_block_attention, by_index, hint="by index")
    fails_with(capsys, G.check_block_attention, softmax_nan, hint="NaN in out")
    fails_with(capsys, G.check_block_attention, unscaled, hint="1/sqrt(d)")

    def library(q, k, v, q_pos, k_pos):
        from course_lib.parallel.context_parallel import block_attention
        return block_attention(q, k, v, q_pos, k_pos)
    fails_with(capsys, G.check_block_attention, library, hint="write this yourself")


# ----------------------------------------------------------------------------- ring attention
def ring_attention(q, k, v, positions, **bug):
    """K and V sent as two messages; the sender's positions recomputed, not sent."""
    r, n = dist.get_rank(), dist.get_world_size()
    out, lse = block_attention(q, k, v, positions, positions)
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
        o2, l2 = block_attention(q, k, v, positions, k_pos)
        out, lse = merge(out, lse, o2, l2)
        if bug.get("extra_send"):
            w = dist.isend(k, (r + 1) % n)
            dist.recv(torch.empty_like(k), (r - 1) % n)
            w.wait()
    return out


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
    return block_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), positions, torch.cat(ps))[0]


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
