"""Chapter 8's folding graders (course_lib/grading/expert_folding.py): the solution and a
differently written right answer pass; classic mistakes, a hard-coded answer and a call to the
library's own code fail with a hint."""
import math

from course_lib.grading import expert_folding as G
from grading_answers import fails_with, graded, refused


# ----------------------------------------------------------------------------- 1. destinations
def _fold_index(sizes, coords, fold):
    i = 0
    for d in fold:
        i = i * sizes.get(d, 1) + coords[d]
    return i


def _coords(sizes, rank):
    out = {}
    for d in ("tp", "cp", "pp", "dp"):
        rank, out[d] = divmod(rank, sizes.get(d, 1))
    return out


def destinations(sizes, n_experts, rank, experts, order=("dp", "cp", "tp"), fold_first=("dp", "cp", "tp")):
    """By coordinates: the fold = the shortest run of dp, cp, tp that ep * etp divides,
    numbered in rank order; my EP group = the fold indexes with my etp and edp."""
    ep, etp = sizes.get("ep", 1), sizes.get("etp", 1)
    size, fold = 1, ()
    for d in fold_first:
        size, fold = size * sizes.get(d, 1), fold + (d,)
        if size % (ep * etp) == 0:
            break
    fold = tuple(d for d in order if d in fold)
    me = _coords(sizes, rank)
    f = _fold_index(sizes, me, fold)
    etp_i, rest = f % etp, f // etp
    edp_i = rest // ep
    out = []
    for e in experts:
        target = (edp_i * ep + e // (n_experts // ep)) * etp + etp_i
        c = dict(me)
        for d in reversed(fold):
            target, c[d] = divmod(target, sizes.get(d, 1))
        t, cp, pp = sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("pp", 1)
        out.append(((c["dp"] * pp + c["pp"]) * cp + c["cp"]) * t + c["tp"])
    return out


def by_search(sizes, n_experts, rank, experts):
    """Written differently: enumerate every rank, keep those whose expert coordinates match."""
    ep, etp = sizes.get("ep", 1), sizes.get("etp", 1)
    world = math.prod(sizes.get(d, 1) for d in ("dp", "pp", "cp", "tp"))

    def key(r):
        c = _coords(sizes, r)
        size, fold = 1, []
        for d in ("dp", "cp", "tp"):
            size *= sizes.get(d, 1)
            fold.append(d)
            if size % (ep * etp) == 0:
                break
        f = _fold_index(sizes, c, fold)
        outside = tuple(c[d] for d in ("pp", "dp", "cp", "tp") if d not in fold)
        return outside + (f % etp, f // (etp * ep)), (f // etp) % ep
    mine = key(rank)[0]
    holder = {key(r)[1]: r for r in range(world) if key(r)[0] == mine}
    return [holder[e * ep // n_experts] for e in experts]


def group_places(sizes, n_experts, rank, experts):                 # forgets the global rank
    return [e // (n_experts // sizes.get("ep", 1)) for e in experts]


def megatron_tp_first(sizes, n_experts, rank, experts):           # folds TP first always
    return destinations(sizes, n_experts, rank, experts, fold_first=("tp", "cp", "dp"))


def dp_fastest(sizes, n_experts, rank, experts):                  # numbers the fold dp fastest
    return destinations(sizes, n_experts, rank, experts, order=("tp", "cp", "dp"))


def hard_coded(sizes, n_experts, rank, experts):                  # tp2 x ep2 only
    return [e // 2 for e in experts]


def library(sizes, n_experts, rank, experts):
    from course_lib.parallel.mesh import MeshShape
    group = next(g for g in MeshShape(**sizes).rank_sets("ep") if rank in g)
    return [group[e * len(group) // n_experts] for e in experts]


def test_expert_destinations(capsys):
    assert graded(capsys, G.check_expert_destinations, destinations)[0]
    assert graded(capsys, G.check_expert_destinations, by_search)[0]
    fails_with(capsys, G.check_expert_destinations, group_places, hint="GLOBAL ranks")
    fails_with(capsys, G.check_expert_destinations, megatron_tp_first, hint="DP first")   # case 2
    fails_with(capsys, G.check_expert_destinations, dp_fastest, hint="rank order")
    fails_with(capsys, G.check_expert_destinations, hard_coded, hint=("GLOBAL", "expected"))
    fails_with(capsys, G.check_expert_destinations, library, hint="write this yourself")


# ----------------------------------------------------------------------------- 2. capacity factor
def smallest_cf(counts, tokens, top_k, max_dropped):
    E = len(counts)
    cap = 1
    while sum(max(0, n - cap) for n in counts) > max_dropped:
        cap += 1
    return cap * E / (tokens * top_k)


def by_bisection(counts, tokens, top_k, max_dropped):
    """Written differently: the smallest capacity by bisection, then just above the capacity below it."""
    lo, hi = 1, max(max(counts), 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(max(0, n - mid) for n in counts) <= max_dropped:
            hi = mid
        else:
            lo = mid + 1
    return (lo - 0.5) * len(counts) / (tokens * top_k)


def returns_capacity(counts, tokens, top_k, max_dropped):
    cap = 1
    while sum(max(0, n - cap) for n in counts) > max_dropped:
        cap += 1
    return cap


def ignores_budget(counts, tokens, top_k, max_dropped):           # never drops anything
    return max(counts) * len(counts) / (tokens * top_k)


def always_switch(counts, tokens, top_k, max_dropped):            # hard-coded: Switch's 1.25
    return 1.25


def library_capacity(counts, tokens, top_k, max_dropped):
    from course_lib.moe import capacity
    cf = 0.05
    while sum(max(0, n - capacity(tokens, len(counts), top_k, cf)) for n in counts) > max_dropped:
        cf += 0.05
    return cf


def test_capacity_factor(capsys):
    assert graded(capsys, G.check_capacity_factor, smallest_cf)[0]
    assert graded(capsys, G.check_capacity_factor, by_bisection)[0]
    fails_with(capsys, G.check_capacity_factor, returns_capacity, hint="capacity FACTOR")
    fails_with(capsys, G.check_capacity_factor, ignores_budget, hint="smaller factor")
    fails_with(capsys, G.check_capacity_factor, always_switch, hint=("dropped", "smaller factor"))
    fails_with(capsys, G.check_capacity_factor, library_capacity, hint="write this yourself")


# ----------------------------------------------------------------------------- 3. expert replicas
def _fold(sizes, first=("dp", "cp", "tp")):
    """(the fold's dims in rank order, its size): the shortest run of ``first`` ep * etp divides."""
    size, fold = 1, []
    for d in first:
        size, fold = size * sizes.get(d, 1), fold + [d]
        if size % (sizes.get("ep", 1) * sizes.get("etp", 1)) == 0:
            break
    return [d for d in ("dp", "cp", "tp") if d in fold], size


def _slot(sizes, r):
    """(pp, ep index, etp index) of rank r: which experts (and slices) it holds."""
    ep, etp = sizes.get("ep", 1), sizes.get("etp", 1)
    c = _coords(sizes, r)
    f = _fold_index(sizes, c, _fold(sizes)[0])
    return c["pp"], (f // etp) % ep, f % etp


def _world(sizes):
    return math.prod(sizes.get(d, 1) for d in ("dp", "pp", "cp", "tp"))


def replicas(sizes, rank):
    """Every rank of the stage holding the same experts: the same EP and ETP index."""
    return [r for r in range(_world(sizes)) if _slot(sizes, r) == _slot(sizes, rank)]


def replicas_by_edp(sizes, rank):
    """Written differently: walk edp along the fold, then every coordinate the fold leaves out."""
    ep, etp = sizes.get("ep", 1), sizes.get("etp", 1)
    fold, size = _fold(sizes)
    me = _coords(sizes, rank)
    f = _fold_index(sizes, me, fold)
    out = []
    for edp in range(size // (ep * etp)):
        target = (edp * ep + (f // etp) % ep) * etp + f % etp
        c = dict(me)
        for d in reversed(fold):
            target, c[d] = divmod(target, sizes.get(d, 1))
        for cp in range(sizes.get("cp", 1)) if "cp" not in fold else (c["cp"],):
            for tp in range(sizes.get("tp", 1)) if "tp" not in fold else (c["tp"],):
                out.append(((c["dp"] * sizes.get("pp", 1) + c["pp"]) * sizes.get("cp", 1) + cp)
                           * sizes.get("tp", 1) + tp)
    return out


def dense_group(sizes, rank):                                      # the dense weights' dp x cp
    c = _coords(sizes, rank)
    return [r for r in range(_world(sizes)) if [_coords(sizes, r)[d] for d in ("pp", "tp")] == [c["pp"], c["tp"]]]


def ep_group(sizes, rank):                                         # the ranks holding the OTHER experts
    """Same stage, edp index and coordinates outside the fold, same etp index: rank's EP group."""
    fold, _ = _fold(sizes)
    per = sizes.get("ep", 1) * sizes.get("etp", 1)
    me = _coords(sizes, rank)

    def same(r):
        c = _coords(sizes, r)
        return (_fold_index(sizes, c, fold) // per == _fold_index(sizes, me, fold) // per
                and _slot(sizes, r)[2] == _slot(sizes, rank)[2]
                and all(c[d] == me[d] for d in ("pp", "dp", "cp", "tp") if d not in fold))
    return [r for r in range(_world(sizes)) if same(r)]


def edp_only(sizes, rank):                                         # forgets the dims outside the fold
    c, fold = _coords(sizes, rank), _fold(sizes)[0]
    return [r for r in replicas(sizes, rank)
            if all(_coords(sizes, r)[d] == c[d] for d in ("cp", "tp") if d not in fold)]


def every_stage(sizes, rank):                                      # forgets the pipeline stage
    _, ep_i, etp_i = _slot(sizes, rank)
    return [r for r in range(_world(sizes)) if _slot(sizes, r)[1:] == (ep_i, etp_i)]


def hard_coded_pairs(sizes, rank):                                 # dp4 x ep2 only
    return [rank % 2, rank % 2 + 2]


def library_replicas(sizes, rank):
    from course_lib.parallel.mesh import MeshShape
    shape = MeshShape(**sizes)
    return next(g for g in shape.rank_sets(shape.expert_replicas()) if rank in g)


def test_expert_replicas(capsys):
    assert graded(capsys, G.check_expert_replicas, replicas)[0]
    assert graded(capsys, G.check_expert_replicas, replicas_by_edp)[0]
    fails_with(capsys, G.check_expert_replicas, dense_group, hint="dense weights")
    fails_with(capsys, G.check_expert_replicas, ep_group, hint="OTHER experts")
    fails_with(capsys, G.check_expert_replicas, edp_only, hint="leaves out")
    fails_with(capsys, G.check_expert_replicas, every_stage, hint="same pipeline stage")
    fails_with(capsys, G.check_expert_replicas, hard_coded_pairs, hint="expected")
    fails_with(capsys, G.check_expert_replicas, library_replicas, hint="write this yourself")


def tampers_with_the_mesh(sizes, rank):                            # rebinds the grader's MeshShape
    import sys

    grader = sys.modules["course_lib.grading.expert_folding"]
    real = grader.MeshShape

    class Agrees(real):
        def rank_sets(self, dims):
            return [[r] for r in range(self.world_size)]
    grader.MeshShape = Agrees
    return [rank]


def test_an_answer_that_rebinds_the_graders_mesh_fails_and_the_grader_is_restored(capsys):
    real = G.MeshShape
    refused(capsys, "expert_replicas", G.check_expert_replicas(tampers_with_the_mesh), "changed the grader")
    assert G.MeshShape is real
    assert graded(capsys, G.check_expert_replicas, replicas)[0]
