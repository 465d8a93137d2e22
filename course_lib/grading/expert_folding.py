"""Graders of chapter 8's folding part: where an EP x TP layout sends a token, the capacity
factor a drop budget allows, and the ranks holding the same experts. The expected answers come
from the library (the folded :class:`~course_lib.parallel.mesh.MeshShape`,
:func:`course_lib.moe.capacity`), computed before the learner's function runs with them
switched off.

    check_expert_destinations(expert_destinations)   # (sizes, n_experts, rank, experts) -> global ranks
    check_capacity_factor(smallest_capacity_factor)  # (counts, tokens, top_k, max_dropped) -> capacity factor
    check_expert_replicas(expert_replicas)           # (sizes, rank) -> the ranks holding rank's experts

Each prints one line (``expert_destinations: 6/6 cases passed`` or the first failing case
with a hint) and returns True/False.
"""
from __future__ import annotations

from course_lib.grading import Case, check, compare
from course_lib.grading.harness import check_answers
from course_lib.grading.guard import learner
from course_lib.moe import capacity
from course_lib.parallel.mesh import MeshShape

FOLDING = ("course_lib.parallel.mesh:MeshShape", "course_lib.parallel.mesh:Mesh", "course_lib.parallel.mesh:expert_fold",
           "course_lib.parallel.expert_parallel:*")
CAPACITY = ("course_lib.moe:capacity", "course_lib.moe:route", "course_lib.moe:MoE")


# ----------------------------------------------------------------------------- 1. EP x TP dispatch
def check_expert_destinations(expert_destinations) -> bool:
    """``expert_destinations(sizes, n_experts, rank, experts)``: on the folded mesh ``sizes``
    (dp, pp, cp, tp, ep, etp), the GLOBAL rank that receives each of ``rank``'s assignments to
    ``experts`` (expert ids) in the all-to-all dispatch: the member of ``rank``'s EP group
    holding that expert (E / ep consecutive experts per EP rank)."""
    cases = [Case(dict(sizes=dict(tp=2, ep=2), E=4), label="tp2 x ep2: EP over the TP ranks"),
             Case(dict(sizes=dict(dp=4, tp=2, ep=2), E=4), label="dp4 x tp2, ep2: EP inside DP"),
             Case(dict(sizes=dict(dp=2, tp=2, ep=4), E=8), label="dp2 x tp2, ep4: EP over DP and TP"),
             Case(dict(sizes=dict(dp=2, tp=2, ep=2, etp=2), E=4), label="dp2 x tp2, ep2 x etp2"),
             Case(dict(sizes=dict(dp=3, cp=2, ep=3), E=6), label="dp3 x cp2, ep3 (odd)"),
             Case(dict(sizes=dict(pp=2, cp=2, tp=2, ep=4), E=8), label="pp2 x cp2 x tp2, ep4: stage 1's ranks")]
    guarded = learner(expert_destinations, *FOLDING, exercise="the EP x TP dispatch")

    def run(case):
        p = case.params
        shape = MeshShape(**p["sizes"])
        local = p["E"] // shape.ep
        experts = list(range(p["E"])) + [p["E"] - 1, 0]
        places = [e // local for e in experts]
        groups = [next(g for g in shape.rank_sets("ep") if rank in g) for rank in range(shape.world_size)]
        answers = []
        for rank in range(shape.world_size):
            got = guarded(dict(p["sizes"]), p["E"], rank, list(experts))
            try:
                answers.append([int(r) for r in got])
            except (TypeError, ValueError):
                return f"return a list of global ranks, got {got!r}"
        if all(got == places for got in answers) and any(g != list(range(shape.ep)) for g in groups):
            return "those are places in the EP group; return GLOBAL ranks (e.g. of the group [rank, ...])"
        for rank, (got, group) in enumerate(zip(answers, groups)):
            msg = compare(got, [group[e // local] for e in experts],
                          what=f"rank {rank}'s destinations of experts {experts} (EP group {group})")
            if msg:
                return msg + "; the fold takes DP first, then CP, then TP, numbered in rank order (TP fastest)"
        return None

    return check("expert_destinations", cases, run)


# ----------------------------------------------------------------------------- 2. capacity factor
def _fewest_places(counts, max_dropped):
    """The smallest capacity (>= 1) that drops at most ``max_dropped`` of ``counts``' assignments."""
    c = 1
    while sum(max(0, n - c) for n in counts) > max_dropped:
        c += 1
    return c


def check_capacity_factor(smallest_capacity_factor) -> bool:
    """``smallest_capacity_factor(counts, tokens, top_k, max_dropped)``: ``counts[e]`` the
    assignments one routing group of ``tokens`` tokens sends to expert e (before dropping). Return
    the smallest capacity factor whose capacity ``ceil(cf * tokens * top_k / E)`` drops at most
    ``max_dropped`` assignments (any cf giving that capacity passes)."""
    rows = [([8, 8, 8, 8], 16, 2, 0, "balanced, nothing dropped"),
            ([14, 6, 6, 6], 16, 2, 0, "one hot expert, nothing dropped"),
            ([14, 6, 6, 6], 16, 2, 4, "one hot expert, 4 drops allowed"),
            ([5, 3, 0, 4, 9, 1, 2, 0], 12, 2, 3, "8 experts, 3 drops allowed"),
            ([7, 0, 0], 7, 1, 6, "top-1, almost everything may drop"),
            ([10, 10, 10, 2, 10, 6], 16, 3, 1, "top-3, 6 experts")]

    def differ(got, want, counts, T, k, budget):
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not got > 0:
            return f"return a capacity factor > 0 (a number), got {got!r}"
        places = capacity(T, len(counts), k, float(got))
        dropped = sum(max(0, n - places) for n in counts)
        if got == want and places != want:
            return f"{got} is a capacity (places per expert); return the capacity FACTOR that gives it"
        if dropped > budget:
            return (f"capacity factor {got} gives {places} places per expert: {dropped} assignments dropped, "
                    f"more than the {budget} allowed (counts {counts})")
        if places != want:
            lowest = capacity(T, len(counts), k, 1e-9)
            return (f"capacity factor {got} gives {places} places per expert, but {want} already keep the drops "
                    f"within {budget}: a smaller factor suffices (capacity at least {lowest})")
    return check_answers("smallest_capacity_factor", smallest_capacity_factor,
                         [Case(dict(args=row[:4]), label=row[4]) for row in rows],
                         lambda counts, T, k, budget: _fewest_places(counts, budget), guard=CAPACITY,
                         exercise="choosing the capacity factor", differ=differ)


# ----------------------------------------------------------------------------- 3. expert replicas
def check_expert_replicas(expert_replicas) -> bool:
    """``expert_replicas(sizes, rank)``: on the folded mesh ``sizes`` (dp, pp, cp, tp, ep, etp),
    the sorted GLOBAL ranks holding the same experts (the same etp slices) as ``rank``, itself
    included: the group ZeRO-3 shards each block's experts over and DDP sums their gradient
    over ("edp" and the stage dims the fold leaves out)."""
    cases = [Case(dict(sizes=dict(dp=4, ep=2)), label="dp4, ep2: EP inside DP"),
             Case(dict(sizes=dict(dp=2, cp=2, tp=2, ep=2)), label="dp2 x cp2 x tp2, ep2: cp and tp outside the fold"),
             Case(dict(sizes=dict(dp=4, tp=2, ep=2, etp=2)), label="dp4 x tp2, ep2 x etp2"),
             Case(dict(sizes=dict(dp=2, tp=2, ep=4)), label="dp2 x tp2, ep4: one rank holds each expert"),
             Case(dict(sizes=dict(dp=3, pp=2, tp=2, ep=2)), label="dp3 x pp2 x tp2, ep2 (odd, two stages)"),
             Case(dict(sizes=dict(dp=4, cp=2, ep=4)), label="dp4 x cp2, ep4")]
    guarded = learner(expert_replicas, *FOLDING, exercise="the ranks holding the same experts")

    def run(case):
        sizes = case.params["sizes"]
        shape = MeshShape(**sizes)
        want = {r: sorted(next(g for g in shape.rank_sets(shape.expert_replicas()) if r in g))
                for r in range(shape.world_size)}
        same = {d: {r: sorted(next(g for g in shape.rank_sets(d) if r in g)) for r in range(shape.world_size)}
                for d in (("dp", "cp"), ("ep",), ("edp",))}
        for rank in range(shape.world_size):
            got = guarded(dict(sizes), rank)
            try:
                got = sorted(int(r) for r in got)
            except (TypeError, ValueError):
                return f"return a list of global ranks, got {got!r}"
            if got == want[rank]:
                continue
            where = f"rank {rank} on {shape.describe()}: got {got}, expected {want[rank]}"
            if got == same[("dp", "cp")][rank]:
                return where + "; those hold the dense weights: an expert lives only on the ranks of its EP slot"
            if got == same[("ep",)][rank]:
                return where + "; that is the EP group, the ranks holding the OTHER experts of the block"
            if set(got) < set(want[rank]) and got == same[("edp",)][rank]:
                return where + ("; the stage's dims the fold leaves out (cp, tp) hold the same experts too "
                                "(each rank routes its own tokens)")
            if any(shape.coords(r)["pp"] != shape.coords(rank)["pp"] for r in got if 0 <= r < shape.world_size):
                return where + "; only ranks of the same pipeline stage hold its blocks"
            return where
        return None

    return check("expert_replicas", cases, run)


__all__ = ["check_expert_destinations", "check_capacity_factor", "check_expert_replicas"]
