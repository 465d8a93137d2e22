"""course_lib/grading/collective_algorithms.py (chapter 2), the ring family and the fit:
each grader fails the classic mistakes of its algorithm, an answer hard-coded to the
lecture's case and a library shortcut, with a hint naming the mistake and never a hang, and
passes a right answer written differently from the solution (the broadcasts and trees:
test_grading_collective_algorithms.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from course_lib.grading import collective_algorithms as G
from grading_answers import exchange, passed, rank_world, refused


# ----------------------------------------------------------------------------- ring all-reduce
def _ring_whole_buffer(tensor):                        # right sums, the whole buffer goes round
    r, N = rank_world()
    total, cur, buf = tensor.clone(), tensor.clone(), torch.empty_like(tensor)
    for _ in range(N - 1):
        exchange(cur, (r + 1) % N, buf, (r - 1) % N)
        total += buf
        cur = buf.clone()
    tensor.copy_(total)


def _ring_blocking(tensor):                            # blocking send first: a cycle of waits
    r, N = rank_world()
    dist.send(tensor, (r + 1) % N)
    dist.recv(tensor.clone(), (r - 1) % N)


def _ring_chunk(tensor):                               # .chunk(): fewer than N chunks when numel < N
    r, N = rank_world()
    chunks = list(tensor.view(-1).chunk(N))
    for s in range(N - 1):
        got = torch.empty_like(chunks[(r - s - 1) % N])
        exchange(chunks[(r - s) % N], (r + 1) % N, got, (r - s - 1) % N)
        chunks[(r - s - 1) % N] += got
    for s in range(N - 1):
        exchange(chunks[(r - s + 1) % N], (r + 1) % N, chunks[(r - s) % N], (r - 1) % N)


def _ring_gloo(tensor):
    dist.all_reduce(tensor)


@pytest.mark.parametrize("wrong, hints", [
    (_ring_whole_buffer, ["not the whole buffer"]),
    (_ring_blocking, ["deadlock", "post isend and irecv first"]),
    (_ring_chunk, ["case 2/", "numel=1", "list index out of range"]),
    (_ring_gloo, ["write this yourself: the exercise is the ring"]),
], ids=["whole-buffer", "blocking", "chunk", "gloo"])
def test_ring_all_reduce_refuses(wrong, hints, capsys):
    refused(capsys, "ring_all_reduce", G.check_ring_all_reduce(wrong, timeout=4), *hints)


# ----------------------------------------------------------------------------- reduce-scatter, all-gather
def _rs_via_all_reduce_ring(output, input):            # a whole ring all-reduce, then a slice
    r, N = rank_world()
    full = input.clone()
    _ring_whole_buffer(full)
    output.copy_(full.view(N, -1)[r])


def _rs_wrong_piece(output, input):                    # ends with piece r+1 (the all-reduce's indexing)
    r, N = rank_world()
    chunks = list(input.clone().view(N, -1))
    buf = torch.empty_like(chunks[0])
    for s in range(N - 1):
        exchange(chunks[(r - s) % N], (r + 1) % N, buf, (r - 1) % N)
        chunks[(r - s - 1) % N] += buf
    output.copy_(chunks[(r + 1) % N])


def _rs_two_ranks(output, input):                      # hard-coded to 2 ranks: swap the other half
    r = dist.get_rank()
    halves = input.view(2, -1)
    got = torch.empty_like(halves[0])
    exchange(halves[1 - r].contiguous(), 1 - r, got, 1 - r)
    output.copy_(halves[r] + got)


def _rs_torch(output, input):
    from course_lib import compat

    compat.reduce_scatter_tensor(output, input)


@pytest.mark.parametrize("wrong, hints", [
    (_rs_via_all_reduce_ring, ["a ring reduce-scatter sends (N-1)/N x n"]),
    (_rs_wrong_piece, ["piece 0 of the sum"]),
    (_rs_torch, ["write this yourself", "reduce-scatter"]),
    (_rs_two_ranks, ["case 2/", "world_size=3"]),
], ids=["all-reduce-then-slice", "wrong-piece", "library", "two-ranks"])
def test_ring_reduce_scatter_refuses(wrong, hints, capsys):
    refused(capsys, "ring_reduce_scatter", G.check_ring_reduce_scatter(wrong, timeout=5), *hints)


def _ag_rotated(output, input):                        # every rank's own input first
    r, N = rank_world()
    chunks = list(output.view(N, -1))
    chunks[0].copy_(input)
    for s in range(N - 1):
        exchange(chunks[s], (r + 1) % N, chunks[s + 1], (r - 1) % N)


def _ag_whole(output, input):                          # everyone sends its whole output each step
    r, N = rank_world()
    output.view(N, -1)[r].copy_(input)
    buf = torch.empty_like(output)
    for _ in range(N - 1):
        exchange(output.clone(), (r + 1) % N, buf, (r - 1) % N)
        mask = buf != -7
        output[mask] = buf[mask]


def _ag_two_ranks(output, input):                      # hard-coded to 2 ranks: swap with the other one
    r = dist.get_rank()
    rows = output.view(2, -1)
    rows[r].copy_(input)
    exchange(input, 1 - r, rows[1 - r], 1 - r)


def _ag_torch(output, input):
    out = [torch.empty_like(input) for _ in range(dist.get_world_size())]
    dist.all_gather(out, input)
    output.copy_(torch.cat(out))


@pytest.mark.parametrize("wrong, hints", [
    (_ag_rotated, ["rank order"]),
    (_ag_whole, ["not the whole buffer"]),
    (_ag_torch, ["write this yourself", "all_gather"]),
    (_ag_two_ranks, ["case 2/", "world_size=3"]),
], ids=["rotated", "whole-buffer", "library", "two-ranks"])
def test_ring_all_gather_refuses(wrong, hints, capsys):
    refused(capsys, "ring_all_gather", G.check_ring_all_gather(wrong, timeout=5), *hints)


def test_ring_halves_accept_a_different_right_answer(capsys):
    def rs(output, input):                             # rank r finishes chunk r: it starts by sending r-1
        r, N = rank_world()
        acc = input.clone().view(N, -1)
        buf = torch.empty_like(acc[0])
        for s in range(N - 1):
            exchange(acc[(r - 1 - s) % N].clone(), (r + 1) % N, buf, (r - 1) % N)
            acc[(r - 2 - s) % N] += buf
        output.copy_(acc[r])

    def ag(output, input):
        r, N = rank_world()
        rows = output.view(N, -1)
        rows[r].copy_(input)
        for s in range(N - 1):
            exchange(rows[(r - s) % N].clone(), (r + 1) % N, rows[(r - s - 1) % N], (r - 1) % N)
    assert G.check_ring_reduce_scatter(rs) and G.check_ring_all_gather(ag)
    assert capsys.readouterr().out.split("\n")[:2] == ["ring_reduce_scatter: 4/4 cases passed",
                                                       "ring_all_gather: 4/4 cases passed"]


# ----------------------------------------------------------------------------- the composition
def _composed_unpadded(tensor):                        # fine when N divides the size only
    N = dist.get_world_size()
    piece = torch.empty(tensor.numel() // N, dtype=tensor.dtype)
    from course_lib import compat  # noqa: F401 - not used: the learner's own halves would be
    chunks = tensor.view(-1)[:piece.numel() * N]
    _rs_wrong_piece(piece, chunks)


def _composed_gloo(tensor):
    dist.all_reduce(tensor)


def _composed_whole(tensor):                           # skips the halves: whole-buffer ring
    _ring_whole_buffer(tensor)


@pytest.mark.parametrize("wrong, hints", [
    (_composed_unpadded, ["case 1/"]),
    (_composed_gloo, ["write this yourself: the exercise is all-reduce from your two halves"]),
    (_composed_whole, ["not the whole buffer"]),
], ids=["unpadded", "gloo", "whole-buffer"])
def test_all_reduce_composed_refuses(wrong, hints, capsys):
    refused(capsys, "all_reduce_composed", G.check_all_reduce_composed(wrong, timeout=5), *hints)


# ----------------------------------------------------------------------------- alpha-beta fit
def _fit_absolute(ms):                                 # plain least squares: the big points decide
    rows = [[2 * (N - 1), 2 * (N - 1) / N * n] for n, N, _ in ms]
    return tuple(np.linalg.lstsq(np.array(rows), np.array([t for *_, t in ms]), rcond=None)[0])


def _fit_two_points(ms):                               # the lecture's two-point estimate
    (n1, N1, t1), (n2, N2, t2) = min(ms), max(ms)
    beta = (t2 - t1) / (2 * (N2 - 1) / N2 * n2 - 2 * (N1 - 1) / N1 * n1)
    return (t1 - 2 * (N1 - 1) / N1 * n1 * beta) / (2 * (N1 - 1)), beta


def _fit_library(ms):
    from course_lib import costmodel

    fit = costmodel.fit_alpha_beta([("ring_all_reduce", n, N, t) for n, N, t in ms], relative=True)
    return fit.alpha, fit.beta


@pytest.mark.parametrize("wrong, hints", [
    (_fit_absolute, ["case 3/", "noise=10%", "alpha"]),
    (_fit_two_points, ["noise"]),
    (_fit_library, ["write this yourself", "costmodel"]),
], ids=["absolute-errors", "two-points", "library"])
def test_fit_alpha_beta_refuses(wrong, hints, capsys):
    refused(capsys, "fit_alpha_beta", G.check_fit_alpha_beta(wrong), *hints)


def test_fit_alpha_beta_accepts_the_normal_equations(capsys):
    def normal(ms):
        A = np.array([[2 * (N - 1) / t, 2 * (N - 1) / N * n / t] for n, N, t in ms])
        return tuple(np.linalg.solve(A.T @ A, A.T @ np.ones(len(ms))))
    passed(capsys, G.check_fit_alpha_beta(normal), "fit_alpha_beta: 6/6 cases passed")


def test_ring_all_reduce_and_composition_accept_other_right_answers(capsys):
    def ring_by_views(tensor):                       # post the receive into a scratch buffer, add after
        r, N = rank_world()
        parts = tensor.view(-1).tensor_split(N)
        scratch = torch.empty(parts[0].numel(), dtype=tensor.dtype)
        for s in range(N - 1):
            out, into = parts[(r - s) % N], parts[(r - s - 1) % N]
            req = dist.irecv(scratch[:into.numel()], (r - 1) % N)
            dist.isend(out, (r + 1) % N).wait()
            req.wait()
            into.add_(scratch[:into.numel()])
        for s in range(N - 1):
            exchange(parts[(r - s + 1) % N], (r + 1) % N, parts[(r - s) % N], (r - 1) % N)

    def composed(tensor):                            # pad to N pieces of ceil(n / N), ring halves of the test above
        r, N = rank_world()
        per = -(-tensor.numel() // N)
        buf = torch.zeros(per * N, dtype=tensor.dtype)
        buf[:tensor.numel()] = tensor.view(-1)
        rows, tmp = buf.view(N, per), torch.empty(per, dtype=tensor.dtype)
        for s in range(N - 1):                       # reduce-scatter: rank r ends with row r
            exchange(rows[(r - 1 - s) % N].clone(), (r + 1) % N, tmp, (r - 1) % N)
            rows[(r - 2 - s) % N] += tmp
        for s in range(N - 1):                       # all-gather
            exchange(rows[(r - s) % N].clone(), (r + 1) % N, rows[(r - s - 1) % N], (r - 1) % N)
        tensor.view(-1).copy_(buf[:tensor.numel()])
    assert G.check_ring_all_reduce(ring_by_views) and G.check_all_reduce_composed(composed)
    assert capsys.readouterr().out.split("\n")[:2] == ["ring_all_reduce: 8/8 cases passed",
                                                       "all_reduce_composed: 8/8 cases passed"]


def test_a_ring_that_posts_the_all_gathers_receives_up_front_on_its_own_tag_passes(capsys):
    """Issue 34: the watcher sent every round stamp on one tag, so receives posted early on
    the learner's own tag took the reduce-scatter's stamps and a right ring was failed as a
    deadlock. Stamps now travel on a tag keyed by the learner's."""
    def early_receives(tensor):
        r, N = rank_world()
        parts = tensor.view(-1).tensor_split(N)
        # all-gather step s receives piece (r - s) % N from the left, on tag 1: posted first
        inbox = [torch.empty_like(parts[(r - s) % N]) for s in range(N - 1)]
        pending = [dist.irecv(inbox[s], (r - 1) % N, tag=1) for s in range(N - 1)]
        for s in range(N - 1):                       # reduce-scatter on tag 0: rank r ends with piece r + 1
            got = torch.empty_like(parts[(r - s - 1) % N])
            exchange(parts[(r - s) % N], (r + 1) % N, got, (r - 1) % N)
            parts[(r - s - 1) % N].add_(got)
        sent = []
        for s in range(N - 1):                       # all-gather: forward what arrived in the step before
            if s:
                pending[s - 1].wait()
                parts[(r - s + 1) % N].copy_(inbox[s - 1])
            sent.append(dist.isend(parts[(r - s + 1) % N].clone(), (r + 1) % N, tag=1))
        if N > 1:
            pending[-1].wait()
            parts[(r - N + 2) % N].copy_(inbox[-1])
        for work in sent:
            work.wait()
    passed(capsys, G.check_ring_all_reduce(early_receives, timeout=6), "ring_all_reduce: 8/8 cases passed")
