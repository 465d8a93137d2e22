"""Chapter 9's performance question, graded on the virtual GPU clock: place a mesh on nodes.

    check_placement(place)    # place(sizes, order, gpus_per_node) -> node of each rank

Two virtual nodes of 2 H100s (NVLink inside, the network across), their steps replayed as
CUDA graphs (no host time per op: eager PyTorch's would hide these tiny models' collectives
behind the host, and no placement would matter). The grader runs one
``parallelize_nd`` training step for every way to pair the 4 ranks into the nodes (the
clock's node map switched between steps of one launch) and accepts a placement within 1% of
the fastest, on three models, meshes and rank orders: TP, which all-reduces in every layer,
belongs inside a node. While the learner's function runs, the planner, the virtual runs and
``launch`` are switched off.
"""
from __future__ import annotations

import functools

from course_lib.gpt import GPTConfig
from course_lib.grading import Case, check, learner
from course_lib.parallel.mesh import MeshShape
from course_lib.planner.presets import HARDWARE
from course_lib.lab.virtual_runs import placement_step_times

__all__ = ["check_placement"]

# what would answer for the learner: the planner's layout search and pricing, running steps
PLACEMENT_LIBRARY = ("course_lib.planner:*", "course_lib.planner.search:*", "course_lib.planner.layout:*",
                     "course_lib.planner.estimate:*", "course_lib.launch:launch",
                     "course_lib.lab.virtual_runs:*", "course_lib.grading.placement:_*",
                     "course_lib.grading.placement:_step_times")   # (a cache: not a function)


def _canonical(nodes):
    """The node numbering by first appearance: two placements that only rename nodes are equal."""
    names = {}
    return [names.setdefault(n, len(names)) for n in nodes]


# 2 virtual nodes of 2 H100s: 4 ranks. Their steps replayed as CUDA graphs (no host issue per
# op): eager PyTorch's host, 12 us an op, would hide a tiny model's collectives behind it
PLACEMENT_HW = HARDWARE["h100-sxm"].with_(launch_overhead=0.0)
PLACEMENT_GPN = 2
PAIRINGS = [[0, 0, 1, 1], [0, 1, 0, 1], [0, 1, 1, 0]]  # every way to put 4 ranks on 2 nodes of 2
PLACEMENT_CASES = [  # (label, TinyGPT config, mesh sizes, parallelize_nd options, the learner's rank order)
    ("4 blocks of width 64, dp=2 x tp=2, ranks numbered dp-major",
     dict(vocab_size=128, seq_len=16, n_layers=4, hidden=64, n_heads=4), dict(dp=2, tp=2), {}, ("dp", "tp")),
    ("2 blocks of width 128, dp=2 x tp=2, ranks numbered tp-major",
     dict(vocab_size=128, seq_len=16, n_layers=2, hidden=128, n_heads=4), dict(dp=2, tp=2), {}, ("tp", "dp")),
    ("4 blocks of width 64, pp=2 x tp=2 (2 micro-batches), ranks numbered tp-major",
     dict(vocab_size=128, seq_len=16, n_layers=4, hidden=64, n_heads=4), dict(pp=2, tp=2),
     dict(microbatches=2), ("tp", "pp")),
]


@functools.lru_cache(maxsize=None)
def _step_times(case: int) -> tuple:
    """The virtual step time of every pairing for PLACEMENT_CASES[case]: one launch, once per
    process (the virtual clock gives the same times on every run)."""
    _, cfg, sizes, kw, _ = PLACEMENT_CASES[case]
    return tuple(placement_step_times(GPTConfig(**cfg), sizes, kw, 8, PAIRINGS, PLACEMENT_HW, PLACEMENT_GPN))


def _coords(rank, sizes, order):
    """Coordinates of ``rank`` numbered with ``order`` (outermost first, last innermost)."""
    out = {}
    for d in reversed(order):
        rank, out[d] = divmod(rank, sizes[d])
    return out


def check_placement(place):
    """place(sizes, order, gpus_per_node) -> node_of_rank: the node of each rank (ranks numbered
    with ``order``, outermost dim first), gpus_per_node ranks per node. Graded on 2 virtual nodes
    of 2 H100s: one training step per way to pair the ranks into nodes, the learner's must be
    within 1% of the fastest, on three models / meshes / rank orders."""
    cases = [Case(dict(i=i, sizes=s, order=o), world_size=4, label=label)
             for i, (label, _, s, _, o) in enumerate(PLACEMENT_CASES)]
    answer = learner(place, PLACEMENT_LIBRARY, exercise="placing the mesh on the nodes", seconds=10)

    def run(case):
        k = case.params
        sizes, order, world = k["sizes"], k["order"], case.world_size
        mesh = MeshShape(**sizes)               # the learner's rank r -> the course mesh's rank
        course_rank = [mesh.rank_of(**_coords(r, sizes, order)) for r in range(world)]
        got = answer(dict(sizes), tuple(order), PLACEMENT_GPN)
        if not (isinstance(got, (list, tuple)) and len(got) == world
                and all(isinstance(n, int) and not isinstance(n, bool) for n in got)):
            return f"expected a list of {world} node numbers (one per rank), got {got!r}"
        if sorted(got.count(n) for n in set(got)) != [PLACEMENT_GPN] * (world // PLACEMENT_GPN):
            return f"{list(got)}: each of the {world // PLACEMENT_GPN} nodes holds exactly {PLACEMENT_GPN} ranks"
        nodes = [0] * world                     # the course mesh's rank -> node
        for r, n in enumerate(got):
            nodes[course_rank[r]] = n
        mine = PAIRINGS.index(_canonical(nodes))
        steps = _step_times(k["i"])
        best = min(range(len(steps)), key=steps.__getitem__)
        if steps[mine] > steps[best] * 1.01:
            groups = lambda p: sorted(sorted(r for r in range(world) if p[r] == n) for n in set(p))
            return (f"nodes {list(got)} (mesh ranks {groups(nodes)} together): step {steps[mine] * 1e6:.0f} us, "
                    f"but {groups(PAIRINGS[best])} take {steps[best] * 1e6:.0f} us: a TP group all-reduces in "
                    f"every layer, so keep it on one node's NVLink; DP's one gradient all-reduce per step can "
                    f"cross the network")
        return None

    return check("placement", cases, run)
