"""course_lib/grading/zeropp.py (chapter 4): hpZ's groups. The solution and a right answer written
differently pass; groups across nodes (strided), the whole world, a primary partition per node,
the kept shards taken by rank instead of local index, a hard-coded 8-rank answer and a call to
the library's own function fail with a hint."""
from __future__ import annotations

from course_lib.grading import zeropp as G
from grading_answers import fails_with, graded


def solution(world_size, gpus_per_node):
    N, g = world_size, gpus_per_node
    primary = [list(range(N))]
    secondary = [list(range(n * g, (n + 1) * g)) for n in range(N // g)]
    per = N // g
    holds = [list(range(r % g * per, (r % g + 1) * per)) for r in range(N)]
    return primary, secondary, holds


def by_coordinates(world_size, gpus_per_node):
    """Written differently: group ranks by node = rank // G; keep the shards whose owner falls in
    chunk `local` when the N shards are cut into G chunks; groups and lists in reverse order."""
    nodes = {}
    for r in reversed(range(world_size)):
        nodes.setdefault(r // gpus_per_node, []).append(r)
    holds = [[o for o in range(world_size)[::-1] if o * gpus_per_node // world_size == r % gpus_per_node]
             for r in range(world_size)]
    return (tuple(range(world_size)[::-1]),), list(nodes.values()), holds


def strided(world_size, gpus_per_node):               # groups across nodes: same local index
    p, _, h = solution(world_size, gpus_per_node)
    return p, [list(range(i, world_size, gpus_per_node)) for i in range(gpus_per_node)], h


def whole_world(world_size, gpus_per_node):           # the backward all-gather over everyone
    p, _, h = solution(world_size, gpus_per_node)
    return p, [list(range(world_size))], h


def primary_per_node(world_size, gpus_per_node):      # HSDP's shard groups, not ZeRO-3's
    _, s, h = solution(world_size, gpus_per_node)
    return s, s, h


def holds_by_node(world_size, gpus_per_node):         # keeps its node's shards, not chunk `local`
    p, s, _ = solution(world_size, gpus_per_node)
    return p, s, [s[r // gpus_per_node] for r in range(world_size)]


def hard_coded(world_size, gpus_per_node):            # the 8-rank, 2-node answer only
    return ([[0, 1, 2, 3, 4, 5, 6, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]],
            [[0, 1], [2, 3], [4, 5], [6, 7]] * 2)


def library(world_size, gpus_per_node):
    from course_lib.parallel.zeropp import hpz_groups
    return hpz_groups(world_size, gpus_per_node)


def test_hpz_groups(capsys):
    assert graded(capsys, G.check_hpz_groups, solution) == (True, "hpz_groups: 7/7 cases passed")
    assert graded(capsys, G.check_hpz_groups, by_coordinates)[0]
    fails_with(capsys, G.check_hpz_groups, strided, hint="same local index")
    fails_with(capsys, G.check_hpz_groups, whole_world, hint="whole world")
    fails_with(capsys, G.check_hpz_groups, primary_per_node, hint="ZeRO-3's")
    fails_with(capsys, G.check_hpz_groups, holds_by_node, hint="chunk")
    fails_with(capsys, G.check_hpz_groups, hard_coded, hint="case 2/7")
    fails_with(capsys, G.check_hpz_groups, library, hint="write this yourself")


def rebinds_the_reference(world_size, gpus_per_node):
    """A wrong answer (strided groups) that first makes the grader's reference agree with it."""
    import sys

    sys.modules["course_lib.grading.zeropp"].hpz_groups = strided
    return strided(world_size, gpus_per_node)


def test_hpz_groups_refuses_an_answer_that_changes_the_grader(capsys):
    fails_with(capsys, G.check_hpz_groups, rebinds_the_reference, hint="changed the grader")
    from course_lib.parallel.zeropp import hpz_groups
    assert G.hpz_groups is hpz_groups                     # the grader is whole again afterwards
