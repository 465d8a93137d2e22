"""course_lib/grading/collective_algorithms.py (chapter 2): each grader fails the classic
mistakes of its algorithm, an answer hard-coded to the lecture's case and a library shortcut,
with a hint naming the mistake and never a hang, and passes a right answer written
differently from the solution. This file: the broadcasts and the trees; the ring family
and the fit: test_grading_ring.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib.grading import collective_algorithms as G
from grading_answers import passed, rank_world, refused


# ----------------------------------------------------------------------------- pipelined chain broadcast
def _chain_not_pipelined(tensor, src, segments):     # waits for every segment before forwarding
    r, N = rank_world()
    v = (r - src) % N
    pieces = tensor.view(-1).tensor_split(segments)
    if v > 0:
        for p in pieces:
            dist.recv(p, (r - 1) % N)
    if v < N - 1:
        for p in pieces:
            dist.send(p, (r + 1) % N)


def _chain_root_sends_all(tensor, src, segments):    # a star, not a chain
    r, N = rank_world()
    if r == src:
        for q in range(N):
            if q != src:
                for p in tensor.view(-1).tensor_split(segments):
                    dist.send(p, q)
    else:
        for p in tensor.view(-1).tensor_split(segments):
            dist.recv(p, src)


def _chain_from_zero(tensor, src, segments):         # hard-coded to the lecture's root 0
    r, N = rank_world()
    for p in tensor.view(-1).tensor_split(segments):
        if r > 0:
            dist.recv(p, r - 1)
        if r < N - 1:
            dist.send(p, r + 1)


def _chain_broadcast(tensor, src, segments):
    dist.broadcast(tensor, src)


@pytest.mark.parametrize("wrong, hints", [
    (_chain_not_pipelined, ["not pipelined"]),
    (_chain_root_sends_all, ["sent", "messages", "to the next rank"]),
    (_chain_from_zero, ["case 2/", "src=1"]),
    (_chain_broadcast, ["write this yourself", "broadcast"]),
], ids=["not-pipelined", "star", "root-0", "dist.broadcast"])
def test_pipelined_broadcast_refuses(wrong, hints, capsys):
    refused(capsys, "pipelined_broadcast", G.check_pipelined_broadcast(wrong, timeout=5), *hints)


def test_pipelined_broadcast_accepts_irecv_ahead(capsys):
    def posted_receives(tensor, src, segments):
        r, N = rank_world()
        v = (r - src) % N
        pieces = tensor.view(-1).tensor_split(segments)
        recvs = [dist.irecv(p, (r - 1) % N) for p in pieces] if v > 0 else []
        sends = []
        for k, p in enumerate(pieces):
            if recvs:
                recvs[k].wait()
            if v < N - 1:
                sends.append(dist.isend(p, (r + 1) % N))
        for s in sends:
            s.wait()
    passed(capsys, G.check_pipelined_broadcast(posted_receives), "pipelined_broadcast: 6/6 cases passed")


# ----------------------------------------------------------------------------- binomial tree broadcast
def _tree_chain(tensor, src):                          # a chain: N-1 rounds
    r, N = rank_world()
    v = (r - src) % N
    if v > 0:
        dist.recv(tensor, (r - 1) % N)
    if v < N - 1:
        dist.send(tensor, (r + 1) % N)


def _tree_star(tensor, src):                           # the root sends to everyone in turn
    r, N = rank_world()
    if r == src:
        for q in range(N):
            if q != src:
                dist.send(tensor, q)
    else:
        dist.recv(tensor, src)


def _tree_root_zero(tensor, src):                      # the tree of root 0, whatever src
    r, N = rank_world()
    step = 1
    while step < N:
        if r < step and r + step < N:
            dist.send(tensor, r + step)
        elif step <= r < 2 * step:
            dist.recv(tensor, r - step)
        step *= 2


def _tree_course(tensor, src):
    from course_lib import collectives as C

    C.broadcast(tensor, src, algorithm="tree")


@pytest.mark.parametrize("wrong, hints", [
    (_tree_chain, ["case 4/", "more than ceil(log2 N) = 2 rounds"]),
    (_tree_star, ["case 4/", "ceil(log2 N)"]),
    (_tree_root_zero, ["case 2/", "src=1"]),
    (_tree_course, ["write this yourself", "course_lib.collectives"]),
], ids=["chain", "star", "root-0", "course"])
def test_tree_broadcast_refuses(wrong, hints, capsys):
    refused(capsys, "tree_broadcast", G.check_tree_broadcast(wrong, timeout=5), *hints)


def test_tree_broadcast_accepts_the_far_half_first(capsys):
    def halving(tensor, src):
        """Recursive halving: the root sends to the middle of its range, both halves recurse."""
        r, N = rank_world()
        v = (r - src) % N
        lo, hi = 0, N                                  # my current range of positions [lo, hi)
        while hi - lo > 1:
            mid = (lo + hi + 1) // 2
            if v == lo:
                dist.send(tensor, (mid + src) % N)
            elif v == mid:
                dist.recv(tensor, (lo + src) % N)
            if v < mid:
                hi = mid
            else:
                lo = mid
    passed(capsys, G.check_tree_broadcast(halving), "tree_broadcast: 6/6 cases passed")


# ----------------------------------------------------------------------------- binomial tree reduce
def _reduce_naive(tensor, dst):                        # everyone sends to the root
    r, N = rank_world()
    if r == dst:
        buf = torch.empty_like(tensor)
        for q in range(N):
            if q != dst:
                dist.recv(buf, q)
                tensor += buf
    else:
        dist.send(tensor, dst)


def _reduce_chain(tensor, dst):                        # partial sums along a chain
    r, N = rank_world()
    v = (r - dst) % N
    if v < N - 1:
        buf = torch.empty_like(tensor)
        dist.recv(buf, (r + 1) % N)
        tensor += buf
    if v > 0:
        dist.send(tensor, (r - 1) % N)


def _reduce_forgets_own(tensor, dst):                  # the root keeps the children's sum only
    r, N = rank_world()
    v = (r - dst) % N
    buf, acc = torch.empty_like(tensor), tensor.clone() if v else torch.zeros_like(tensor)
    step = 1
    while step < N:
        if v % (2 * step):
            dist.send(acc, (v - step + dst) % N)
            break
        if v + step < N:
            dist.recv(buf, (v + step + dst) % N)
            acc += buf
        step *= 2
    tensor.copy_(acc)


def _reduce_to_zero(tensor, dst):                     # the lecture's tree onto rank 0, whatever dst
    r, N = rank_world()
    buf, step = torch.empty_like(tensor), 1
    while step < N:
        if r % (2 * step):
            dist.send(tensor, r - step)
            return
        if r + step < N:
            dist.recv(buf, r + step)
            tensor += buf
        step *= 2


def _reduce_dist(tensor, dst):
    dist.reduce(tensor, dst)


@pytest.mark.parametrize("wrong, hints", [
    (_reduce_naive, ["case 4/", "naive reduce"]),
    (_reduce_chain, ["case 4/", "rounds"]),
    (_reduce_forgets_own, ["case 1/", "the sum over ranks"]),
    (_reduce_dist, ["write this yourself", "reduce"]),
    (_reduce_to_zero, ["case 2/", "dst=1"]),
], ids=["naive", "chain", "root-forgets-itself", "dist.reduce", "root-0"])
def test_tree_reduce_refuses(wrong, hints, capsys):
    refused(capsys, "tree_reduce", G.check_tree_reduce(wrong, timeout=5), *hints)


def test_tree_reduce_accepts_pairs_by_low_bit(capsys):
    def by_bits(tensor, dst):
        r, N = rank_world()
        v = (r - dst) % N
        buf, bit = torch.empty_like(tensor), 0
        while (1 << bit) < N:
            partner = v ^ (1 << bit)
            if v & (1 << bit):
                dist.send(tensor, (partner + dst) % N)
                return
            if partner < N:
                dist.recv(buf, (partner + dst) % N)
                tensor.add_(buf)
            bit += 1
    passed(capsys, G.check_tree_reduce(by_bits), "tree_reduce: 6/6 cases passed")
