"""Grader of chapter 4's ZeRO++ question: hpZ's all-gather groups.

    check_hpz_groups(hpz_groups)   # (world_size, gpus_per_node) -> (primary, secondary, holds)

N ranks on nodes of G (rank = node * G + local). The expected answer is the library's
(:func:`course_lib.parallel.zeropp.hpz_groups`, what ``FSDP(zeropp=("hpz",))`` builds), computed
before the learner's function runs with it (and HSDP's block cutting) switched off. Groups
compare as sets of ranks (any order); ``holds[r]`` as the sorted ranks whose primary shards r
keeps. Prints one line: ``hpz_groups: 7/7 cases passed`` or the first failing case with a hint.
"""
from __future__ import annotations

from course_lib.grading import Case, check
from course_lib.grading.guard import learner
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
    cases = [Case(dict(N=8, G=4), label="2 nodes of 4"),
             Case(dict(N=8, G=2), label="4 nodes of 2"),
             Case(dict(N=6, G=2), label="3 nodes of 2 (odd node count)"),
             Case(dict(N=9, G=3), label="3 nodes of 3 (odd sizes)"),
             Case(dict(N=4, G=4), label="1 node of 4"),
             Case(dict(N=16, G=8), label="2 nodes of 8 (H100 nodes)"),
             Case(dict(N=5, G=1), label="5 nodes of 1 GPU")]
    guarded = learner(hpz_groups_fn, *LIBRARY, exercise="hpZ's all-gather groups")

    def run(case):
        N, G = case.params["N"], case.params["G"]
        want_p, want_s, want_h = hpz_groups(N, G)          # the reference, before the learner runs
        got = guarded(N, G)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            return f"return three things (primary, secondary, holds), got {got!r}"
        for name, g, w in (("primary", got[0], want_p), ("secondary", got[1], want_s)):
            g, w = _as_groups(g, name), _as_groups(w, name)
            if isinstance(g, str):
                return g
            if g != w:
                hint = _hint(name, g, w, N, G)
                return f"{name} groups {[list(x) for x in g]}, expected {len(w)} group(s)" + (f"; {hint}" if hint
                                                                                               else "")
        holds = got[2]
        try:
            holds = [sorted(int(r) for r in h) for h in holds]
        except (TypeError, ValueError):
            return f"holds: return one list of ranks per rank, got {got[2]!r}"
        if len(holds) != N:
            return f"holds: one list per rank ({N}), got {len(holds)}"
        for r, (h, w) in enumerate(zip(holds, want_h)):
            if h != w:
                return (f"holds[{r}] = {h}, expected {len(w)} ranks: rank {r} (local index {r % G}) keeps chunk "
                        f"{r % G} of {G} of the gathered unit, whose N shards sit in rank order")
        return None

    return check("hpz_groups", cases, run)


__all__ = ["check_hpz_groups"]
