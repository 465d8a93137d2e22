"""course_lib/grading/collectives.py (chapter 1): each grader fails the classic mistakes, an
answer hard-coded to the lecture's case and a library shortcut, each with a hint naming the
mistake and within seconds (deadlocks are stopped), and passes a different right answer."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib import compat
from course_lib.grading import collectives as G
from grading_answers import passed, refused


# ----------------------------------------------------------------------------- ring shift
def _shift_send_first(tensor):          # the first try: every rank sends first
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(tensor)
    dist.send(tensor, (rank + 1) % world)
    dist.recv(got, (rank - 1) % world)
    return got


def _shift_wrong_way(tensor):           # receives from the right neighbour
    rank, world = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(tensor)
    reqs = [dist.isend(tensor, (rank - 1) % world), dist.irecv(got, (rank + 1) % world)]
    for r in reqs:
        r.wait()
    return got


def _shift_two_ranks(tensor):           # hard-coded to 2 ranks: swap with the other one
    rank = dist.get_rank()
    got = torch.empty_like(tensor)
    if rank == 0:
        dist.send(tensor, 1)
        dist.recv(got, 1)
    else:
        dist.recv(got, 0)
        dist.send(tensor, 0)
    return got


def _shift_all_gather(tensor):          # a collective does it
    rank, world = dist.get_rank(), dist.get_world_size()
    out = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(out, tensor)
    return out[(rank - 1) % world]


@pytest.mark.parametrize("wrong, hints", [
    (_shift_send_first, ["deadlock", "waits in send to rank"]),
    (_shift_wrong_way, ["rank 0 received"]),
    (_shift_two_ranks, ["case 2/", "world_size=3"]),
    (_shift_all_gather, ["write this yourself", "all_gather"]),
], ids=["send-first", "wrong-way", "two-ranks", "all-gather"])
def test_ring_shift_refuses(wrong, hints, capsys):
    refused(capsys, "ring_shift", G.check_ring_shift(wrong, timeout=4), *hints)


def test_ring_shift_accepts_the_odd_last_rank_receiving_first(capsys):
    def last_receives_first(tensor):
        rank, world = dist.get_rank(), dist.get_world_size()
        got = torch.empty_like(tensor)
        if rank == 0:                       # rank 0 receives first: the chain starts at rank N-1
            dist.recv(got, world - 1)
            dist.send(tensor, 1 % world)
        else:
            dist.send(tensor, (rank + 1) % world)
            dist.recv(got, rank - 1)
        return got
    passed(capsys, G.check_ring_shift(last_receives_first), "ring_shift: 4/4 cases passed")


# ----------------------------------------------------------------------------- global mean
def _mean_of_means(rows):               # the first try
    m = rows.mean(0)
    dist.all_reduce(m)
    return m / dist.get_world_size()


def _mean_of_nonempty_means(rows):      # skips NaN, still weighs ranks alike
    m = rows.mean(0) if len(rows) else torch.zeros(rows.shape[1], dtype=rows.dtype)
    k = torch.tensor([float(len(rows) > 0)], dtype=rows.dtype)
    dist.all_reduce(m)
    dist.all_reduce(k)
    return m / k


def _mean_lecture_sizes(rows):          # hard-coded to equal slices: count = rows * world
    s = rows.sum(0)
    dist.all_reduce(s)
    return s / (len(rows) * dist.get_world_size())


def _mean_gather_rows(rows):            # moves every row to every rank
    world = dist.get_world_size()
    n = torch.tensor([len(rows)])
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, n)
    most = int(max(counts))
    padded = torch.zeros(most, rows.shape[1], dtype=rows.dtype)
    padded[:len(rows)] = rows
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:int(c)] for o, c in zip(out, counts)]).mean(0)


def _mean_course_avg(rows):             # the course's all-reduce does the sum
    from course_lib import collectives as C

    s = torch.cat([rows.sum(0), torch.tensor([float(len(rows))], dtype=rows.dtype)])
    C.all_reduce(s)
    return s[:-1] / s[-1]


@pytest.mark.parametrize("wrong, hints", [
    (_mean_of_means, ["case 2/", "19 on this rank"]),
    (_mean_of_nonempty_means, ["case 2/", "37 rows"]),
    (_mean_lecture_sizes, ["case 2/"]),
    (_mean_gather_rows, ["never the rows themselves"]),
    (_mean_course_avg, ["write this yourself", "course_lib.collectives"]),
], ids=["mean-of-means", "nonempty-means", "equal-slices", "gather-rows", "course-collective"])
def test_global_mean_refuses(wrong, hints, capsys):
    refused(capsys, "global_mean", G.check_global_mean(wrong), *hints)


def test_global_mean_accepts_two_all_reduces(capsys):
    def two(rows):
        s, n = rows.double().sum(0), torch.tensor(float(len(rows)), dtype=torch.float64)
        dist.all_reduce(s)
        dist.all_reduce(n)
        return (s / n).to(rows.dtype)
    passed(capsys, G.check_global_mean(two), "global_mean: 6/6 cases passed")


# ----------------------------------------------------------------------------- all-reduce from halves
def _halves_all_reduce(tensor):         # the shortcut
    dist.all_reduce(tensor)


def _halves_no_padding(tensor):         # right only when the world size divides the size
    world = dist.get_world_size()
    flat = tensor.reshape(-1)
    piece = flat.new_empty(flat.numel() // world)
    compat.reduce_scatter_tensor(piece, flat)
    compat.all_gather_into_tensor(flat, piece)


def _halves_not_in_place(tensor):       # the sum lands in a copy
    world = dist.get_world_size()
    flat = torch.cat([tensor.reshape(-1), tensor.new_zeros((-tensor.numel()) % world)])
    piece = flat.new_empty(flat.numel() // world)
    compat.reduce_scatter_tensor(piece, flat)
    compat.all_gather_into_tensor(flat, piece)
    return flat[:tensor.numel()].view_as(tensor)


def _halves_two_gathers(tensor):        # all-gather every input, sum locally: N times the bytes
    world = dist.get_world_size()
    out = tensor.new_empty(world * tensor.numel())
    compat.all_gather_into_tensor(out, tensor.reshape(-1).contiguous())
    tensor.copy_(out.view(world, -1).sum(0).view_as(tensor))


@pytest.mark.parametrize("wrong, hints", [
    (_halves_all_reduce, ["write this yourself", "all_reduce"]),
    (_halves_no_padding, ["case 2/", "worldSize == inputShape"]),
    (_halves_not_in_place, ["case 1/", "in place"]),
    (_halves_two_gathers, ["expected exactly one reduce-scatter and one all-gather"]),
], ids=["all-reduce", "no-padding", "not-in-place", "gather-all"])
def test_all_reduce_from_halves_refuses(wrong, hints, capsys):
    refused(capsys, "all_reduce_from_halves", G.check_all_reduce_from_halves(wrong), *hints)


def test_all_reduce_from_halves_accepts_padding_by_ceil(capsys):
    def ceil_pad(tensor):
        world = dist.get_world_size()
        per = -(-tensor.numel() // world)
        buf = tensor.new_zeros(per * world)
        buf[:tensor.numel()] = tensor.reshape(-1)
        mine = tensor.new_empty(per)
        compat.reduce_scatter_tensor(mine, buf)
        compat.all_gather_into_tensor(buf, mine)
        tensor.copy_(buf[:tensor.numel()].reshape(tensor.shape))
    passed(capsys, G.check_all_reduce_from_halves(ceil_pad), "all_reduce_from_halves: 6/6 cases passed")


# ----------------------------------------------------------------------------- bus bandwidth
def _bus_algbw(collective, n, N, t):            # algorithm bandwidth, no correction
    return n / t


def _bus_all_reduce_everywhere(collective, n, N, t):   # 2(N-1)/N for every collective
    return n / t * 2 * (N - 1) / N


def _bus_lecture(collective, n, N, t):          # the chapter's all-reduce example only
    return n / t * 2 * 7 / 8


def _bus_library(collective, n, N, t):
    from course_lib.costmodel import busbw

    return busbw(collective, n, t, N)


@pytest.mark.parametrize("wrong, hints", [
    (_bus_algbw, ["case 1/", "algbw"]),
    (_bus_all_reduce_everywhere, ["all_gather", "which fraction of n"]),
    (_bus_lecture, ["case 2/", "N = 2"]),
    (_bus_library, ["write this yourself", "busbw"]),
], ids=["algbw", "all-reduce-factor", "hard-coded", "library"])
def test_bus_bandwidth_refuses(wrong, hints, capsys):
    refused(capsys, "bus_bandwidth", G.check_bus_bandwidth(wrong), *hints)


def test_bus_bandwidth_accepts_bytes_moved_over_time(capsys):
    def moved(collective, n, N, t):
        per_rank = {"all_reduce": 2 * n * (N - 1) / N, "broadcast": n}.get(collective, n * (N - 1) / N)
        return per_rank / t
    passed(capsys, G.check_bus_bandwidth(moved), "bus_bandwidth: 7/7 cases passed")
