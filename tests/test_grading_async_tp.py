"""course_lib/grading/async_tp.py (chapter 5): the decomposed all-gather matmul's grader fails the
classic mistakes (a plain all-gather then the matmul, chunks stored in arrival order, every
shard sent to every rank, the hop waited for before the matmul, the hops batched out of the
check's sight), a hard-coded answer and the
library's own implementation, and passes a right answer written differently (the course's
Comm, the output written in place)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.grading import async_tp as G
from grading_answers import passed, refused

NAME = "decomposed_all_gather_matmul"


def _ring(x_shard, weight, rows, wait_first=False, arrival_order=False):
    """The ring, with two classic mistakes available."""
    r, t = dist.get_rank(), dist.get_world_size()
    out, held = [None] * t, x_shard.contiguous()
    for i in range(t):
        c = (r - i) % t
        if i < t - 1:
            nxt = held.new_empty(rows[(c - 1) % t], held.shape[1])
            hop = [dist.isend(held, (r + 1) % t), dist.irecv(nxt, (r - 1) % t)]
            if wait_first:
                for work in hop:
                    work.wait()
        out[i if arrival_order else c] = held @ weight.T
        if i < t - 1:
            for work in hop if not wait_first else ():
                work.wait()
            held = nxt
    return torch.cat(out)


def _plain_all_gather(x_shard, weight, rows):                 # not decomposed
    parts = [x_shard.new_empty(n, x_shard.shape[1]) for n in rows]
    dist.all_gather(parts, x_shard.contiguous())
    return torch.cat(parts) @ weight.T


def _arrival_order(x_shard, weight, rows):                     # rows permuted
    return _ring(x_shard, weight, rows, arrival_order=True)


def _wait_before_matmul(x_shard, weight, rows):                # no overlap
    return _ring(x_shard, weight, rows, wait_first=True)


def _shard_to_everyone(x_shard, weight, rows):                 # not a ring: t - 1 peers
    r, t = dist.get_rank(), dist.get_world_size()
    got = [x_shard if q == r else x_shard.new_empty(rows[q], x_shard.shape[1]) for q in range(t)]
    works = [dist.isend(x_shard.contiguous(), q) for q in range(t) if q != r]
    works += [dist.irecv(got[q], q) for q in range(t) if q != r]
    mine = x_shard @ weight.T
    for work in works:
        work.wait()
    return torch.cat([mine if q == r else got[q] @ weight.T for q in range(t)])


def _batched(x_shard, weight, rows):                           # the waits out of sight
    r, t = dist.get_rank(), dist.get_world_size()
    out, held = [None] * t, x_shard.contiguous()
    for i in range(t):
        c = (r - i) % t
        out[c] = held @ weight.T
        if i < t - 1:
            nxt = held.new_empty(rows[(c - 1) % t], held.shape[1])
            ops = [dist.P2POp(dist.isend, held, (r + 1) % t), dist.P2POp(dist.irecv, nxt, (r - 1) % t)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            held = nxt
    return torch.cat(out)


def _hard_coded(x_shard, weight, rows):                        # the first case's shape
    return torch.zeros(6, 5, dtype=torch.float64)


def _library(x_shard, weight, rows):                           # the library's own ring
    from course_lib.collectives.comm import Comm
    from course_lib.parallel.async_tp import all_gather_matmul
    return all_gather_matmul(x_shard[None], Comm(), [weight], [None])[0][0]


@pytest.mark.parametrize("wrong, hints", [
    (_plain_all_gather, ["you called all_gather"]),
    (_arrival_order, ["rows of rank 0's chunk first"]),
    (_wait_before_matmul, ["no overlap at step 1"]),
    (_shard_to_everyone, ["a ring passes one chunk a step"]),
    (_batched, ["which batch_isend_irecv hides"]),
    (_hard_coded, ["Y = all_gather(X) W^T"]),
    (_library, ["write this yourself"]),
])
def test_decomposed_all_gather_matmul_refuses(wrong, hints, capsys):
    refused(capsys, NAME, G.check_decomposed_all_gather_matmul(wrong), *hints)


def test_decomposed_all_gather_matmul_accepts_the_course_comm_writing_in_place(capsys):
    def right(x_shard, weight, rows):
        from course_lib.collectives.comm import Comm
        comm = Comm()
        starts = [sum(rows[:q]) for q in range(comm.size)]
        y = x_shard.new_empty(sum(rows), weight.shape[0])
        held, src = x_shard, comm.rank
        for step in range(comm.size):
            last = step == comm.size - 1
            if not last:
                incoming = x_shard.new_empty(rows[comm.prev - step if comm.prev >= step
                                                  else comm.prev - step + comm.size], x_shard.shape[1])
                recv = comm.irecv(incoming, comm.prev)
                send = comm.isend(held.contiguous(), comm.next)
            y[starts[src]:starts[src] + rows[src]] = F.linear(held, weight)
            if not last:
                comm.wait(recv, send)
                held, src = incoming, (src - 1) % comm.size
        return y
    passed(capsys, G.check_decomposed_all_gather_matmul(right), f"{NAME}: 3/3 cases passed")


def test_decomposed_all_gather_matmul_accepts_the_ring(capsys):
    passed(capsys, G.check_decomposed_all_gather_matmul(_ring), f"{NAME}: 3/3 cases passed")


def _silences_the_grader(x_shard, weight, rows):        # a plain all-gather, the checks told to agree
    import sys

    module = sys.modules["course_lib.grading.async_tp"]
    module.compare = lambda *a, **k: None
    return _plain_all_gather(x_shard, weight, rows)


def test_decomposed_all_gather_matmul_refuses_an_answer_that_changes_the_grader(capsys):
    refused(capsys, NAME, G.check_decomposed_all_gather_matmul(_silences_the_grader), "changed the grader")
