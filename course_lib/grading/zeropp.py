"""Grader of chapter 4's ZeRO++ question: hpZ's all-gather groups.

    check_hpz_groups(hpz_groups)   # (world_size, gpus_per_node) -> (primary, secondary, holds)

N ranks on nodes of G (rank = node * G + local). The expected answer is the library's
(:func:`course_lib.parallel.zeropp.hpz_groups`, what ``FSDP(zeropp=("hpz",))`` builds), computed
before the learner's function runs with it (and HSDP's block cutting) switched off. Groups
compare as sets of ranks (any order); ``holds[r]`` as the sorted ranks whose primary shards r
keeps. Prints one line: ``hpz_groups: 7/7 cases passed`` or the first failing case with a hint.
"""
from __future__ import annotations

from course_lib.grading import Case
from course_lib.grading.harness import check_answers
from course_lib.parallel.zeropp import hpz_groups

LIBRARY = ("course_lib.parallel.zeropp:*", "course_lib.parallel.hsdp:block_sets",
           "course_lib.parallel.hsdp:hsdp_comms", "course_lib.parallel.hsdp:reshard_comm")


def _as_groups(groups, what):
    """A list of rank lists -> sorted tuple of sorted tuples; a hint string when it is not one."""
    try:
        return tuple(sorted(tuple(sorted(int(r) for r in g)) for g in groups))
    except (TypeError, ValueError):
        return f"{what}: return a list of groups, each a list of ranks, got {groups!r}"


def _hint(name, got, want, N, G):
    """Name the classic mistake behind a wrong set of groups."""
    strided = tuple(tuple(range(local, N, G)) for local in range(G))
    if name == "secondary" and got == strided and got != want:
        return ("those are the ranks with the same local index in every node (they cross the network: "
                "HSDP's replicas, qgZ's second all-to-all); hpZ's secondary partition is one NODE, "
                "G consecutive ranks node * G .. node * G + G - 1")
    if name == "secondary" and got == (tuple(range(N)),) and got != want:
        return ("one group of the whole world: the backward all-gather would cross nodes again; hpZ keeps "
                "it inside each node (G consecutive ranks)")
    if name == "primary":
        return "the primary partition is ZeRO-3's: every rank of the FSDP group holds 1/N, one group of N"
    return None


def check_hpz_groups(hpz_groups_fn) -> bool:
    """``hpz_groups(world_size, gpus_per_node)``: N ranks on nodes of G (rank = node * G + local).
    Return (primary, secondary, holds): the groups of the primary partition (the forward
    all-gather), those of hpZ's secondary partition (the backward all-gather), and holds[r],
    the ranks whose primary shards rank r keeps after forward (chunk ``local`` of G of the
    gathered unit)."""
    def differ(got, want, N, G):
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            return f"return three things (primary, secondary, holds), got {got!r}"
        for name, g, w in (("primary", got[0], want[0]), ("secondary", got[1], want[1])):
            g, w = _as_groups(g, name), _as_groups(w, name)
            if isinstance(g, str):
                return g
            if g != w:
                hint = _hint(name, g, w, N, G)
                return f"{name} groups {[list(x) for x in g]}, expected {len(w)} group(s)" + (f"; {hint}" if hint
                                                                                               else "")
        try:
            holds = [sorted(int(r) for r in h) for h in got[2]]
        except (TypeError, ValueError):
            return f"holds: return one list of ranks per rank, got {got[2]!r}"
        if len(holds) != N:
            return f"holds: one list per rank ({N}), got {len(holds)}"
        for r, (h, w) in enumerate(zip(holds, want[2])):
            if h != w:
                return (f"holds[{r}] = {h}, expected {len(w)} ranks: rank {r} (local index {r % G}) keeps chunk "
                        f"{r % G} of {G} of the gathered unit, whose N shards sit in rank order")
    rows = [(8, 4, "2 nodes of 4"), (8, 2, "4 nodes of 2"), (6, 2, "3 nodes of 2 (odd node count)"),
            (9, 3, "3 nodes of 3 (odd sizes)"), (4, 4, "1 node of 4"), (16, 8, "2 nodes of 8 (H100 nodes)"),
            (5, 1, "5 nodes of 1 GPU")]
    return check_answers("hpz_groups", hpz_groups_fn, [Case(dict(args=(N, G)), label=label) for N, G, label in rows],
                         hpz_groups, guard=LIBRARY, exercise="hpZ's all-gather groups", differ=differ)


__all__ = ["check_hpz_groups"]
