"""course_lib/collectives/rounds.py: the messages, bytes and rounds (a Lamport clock) a
send/recv algorithm takes, counted in each rank; one launch checks a chain, a ring shift
posted with isend/irecv, and the refusal of a receive from any source."""
from __future__ import annotations

from course_lib.launch import launch


def _patterns():
    import torch
    import torch.distributed as dist

    from course_lib.collectives.rounds import MessageRounds

    r, N = dist.get_rank(), dist.get_world_size()
    x = torch.zeros(4)                                  # 16 bytes
    with MessageRounds() as chain:                      # 0 -> 1 -> 2: rank r has the data in round r
        if r > 0:
            dist.recv(x, r - 1)
        if r < N - 1:
            dist.send(x, r + 1)
    with MessageRounds() as shift:                      # everyone to its right neighbour at once: 1 round
        works = [dist.isend(x, (r + 1) % N), dist.irecv(torch.zeros(4), (r - 1) % N)]
        for work in works:
            work.wait()
    try:
        with MessageRounds():
            dist.recv(x)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return [(w.messages, w.bytes_sent, w.received, w.clock) for w in (chain, shift)], refused


def test_messages_bytes_and_rounds_of_a_chain_and_a_ring_shift():
    results = launch(_patterns, 3, timeout=60)
    assert [chain for (chain, _), _ in results] == [(1, 16, 0, 1), (1, 16, 1, 2), (0, 0, 1, 2)]
    assert all(shift == (1, 16, 1, 1) for (_, shift), _ in results)
    assert all("src=None" in refused for _, refused in results)
