"""Performance questions (course_lib/grading/ddp_overlap.py, pipeline_plan.py), graded on virtual time: the
solution and a differently written right answer pass; classic mistakes, answers hard-coded to
one case or to the lecture's number, and library shortcuts each fail with a hint."""
from __future__ import annotations

import math

import pytest

from course_lib.grading import ddp_overlap as G
from course_lib.grading import pipeline_plan as PP
from course_lib.grading import placement as P
from grading_answers import fails_with, graded


# ----------------------------------------------------------------------------- 1. DDP buckets
# graded on hidden cases against the fastest step of a sweep run on the clock at grading time
# (issue 33 item 9): the sweep runs once per case in this process (cached), each answer once.
def bucket_cap_replay(grads, backward_s, world_size, cluster):
    """The solution's idea: replay DDP's buckets on the gradients' ready times, each all-reduce
    priced by the clock's NCCL model one after another, a few host ops per bucket; the cap whose
    step ends first."""
    from course_lib.virtual.links import collective_time

    def step_end(cap_mb):
        buckets, numel, fp32, ready = [], 0, 0, 0.0
        for _, n, t in grads:
            if fp32 and fp32 + 4 * n > cap_mb * 2**20:
                buckets.append((numel, ready))
                numel = fp32 = 0
            numel, fp32, ready = numel + n, fp32 + 4 * n, t
        buckets.append((numel, ready))
        free = 0.0
        for n, t in buckets:
            free = max(t, free) + collective_time(cluster, "all_reduce", n * cluster.dtype.itemsize,
                                                  range(world_size))
        return max(free, backward_s) + 4 * cluster.launch_overhead * len(buckets)

    return min((2 ** (k / 4) for k in range(-24, 32)), key=step_end)


def bucket_cap_at_boundaries(grads, backward_s, world_size, cluster):
    """Written differently: a bucket always ends at a gradient, so the caps worth trying are the
    sizes of the first i gradients; price each layout with the clock's NCCL model on a running
    stream clock (one host issue per bucket for its launch, wait, divide and flags)."""
    from course_lib.virtual.links import collective_time

    def price(numel):
        return collective_time(cluster, "all_reduce", numel * cluster.dtype.itemsize, range(world_size))

    def finish_time(cap_bytes):
        stream, open_numel, open_bytes = 0.0, 0, 0
        count = 0
        for i, (_, n, t) in enumerate(grads):
            if open_bytes and open_bytes + 4 * n > cap_bytes:      # DDP closes the bucket before this one
                stream, count = max(stream, grads[i - 1][2]) + price(open_numel), count + 1
                open_numel = open_bytes = 0
            open_numel, open_bytes = open_numel + n, open_bytes + 4 * n
        stream, count = max(stream, grads[-1][2]) + price(open_numel), count + 1
        return max(stream, backward_s) + 4 * cluster.launch_overhead * count

    prefix, sizes = 0, []
    for _, n, _ in grads:
        prefix += 4 * n
        sizes.append(prefix)
    return min(sizes, key=finish_time) / 2**20


def issue_constant(grads, backward_s, world_size, cluster):
    return 0.1 if cluster.gpus_per_node > 1 else 1.0     # no cost model: passed the old grader


def lecture_tiny(grads, backward_s, world_size, cluster):
    return 0.0625                                       # the old grader's "hidden" winner: slower


def runs_ddp_itself(grads, backward_s, world_size, cluster):
    from course_lib.gpt import GPTConfig, TinyGPT
    from course_lib.parallel.data_parallel import DDP

    DDP(TinyGPT(GPTConfig(n_layers=1, hidden=32, n_heads=2), seed=0), bucket_cap_mb=1)
    return 1.0


def test_bucket_cap_right_answers_pass(capsys):
    for answer in (bucket_cap_replay, bucket_cap_at_boundaries):
        ok, line = graded(capsys, G.check_bucket_cap, answer)
        assert ok and line == "bucket_cap: 3/3 cases passed", line


def test_bucket_cap_wrong_answers_fail_with_a_hint(capsys):
    line = fails_with(capsys, G.check_bucket_cap, issue_constant, hint="slower than")
    assert "the fastest of a sweep" in line and "every bucket pays fixed costs" in line, line
    fails_with(capsys, G.check_bucket_cap, lecture_tiny, hint="every bucket pays fixed costs")
    fails_with(capsys, G.check_bucket_cap, runs_ddp_itself, hint="write this yourself")


def test_bucket_cap_fails_the_slowest_size_of_the_sweep_whatever_the_prices(capsys):
    """Read from the sweep the clock gives today: the hidden cases must discriminate (some bucket
    size more than the margin slower than the fastest), and that size fails, named."""
    from course_lib.virtual import VirtualCluster

    label, cfg, batch, hw, gpn, world = max(G.HIDDEN_CASES, key=lambda row: _spread(row, VirtualCluster))
    sweep = G._sweep(tuple(sorted(cfg.items())), batch, hw, gpn, world, VirtualCluster(hw, gpus_per_node=gpn).describe())
    slowest = max(sweep, key=sweep.get)
    assert sweep[slowest] > min(sweep.values()) * (1 + G.MARGIN), f"no hidden case discriminates: {sweep}"
    line = fails_with(capsys, G.check_bucket_cap, lambda *a: slowest, hint="slower than",
                      cases=[(label, cfg, batch, hw, gpn, world)])
    assert f"{slowest:g} MiB" in line, line


def _spread(row, VirtualCluster):
    label, cfg, batch, hw, gpn, world = row
    sweep = G._sweep(tuple(sorted(cfg.items())), batch, hw, gpn, world, VirtualCluster(hw, gpus_per_node=gpn).describe())
    return max(sweep.values()) / min(sweep.values())


# ----------------------------------------------------------------------------- 2. pipeline m, v
def m_v_closed_form(p, layers, act_bytes, weight_bytes, budget_bytes, max_m):
    """Written differently: for each v the least m with v m >= 9 (p - 1) (a multiple of p when
    interleaved), kept if rank 0's p + (p - 1)/v micro-batches (p for 1F1B) fit."""
    best = None
    for v in (d for d in range(1, layers // p + 1) if (layers // p) % d == 0):
        m = math.ceil(9 * (p - 1) / v)
        if v > 1:
            m = math.ceil(m / p) * p
        held = min(p, m) if v == 1 else min(p + (p - 1) / v, m)
        if m <= max_m and weight_bytes + held * act_bytes <= budget_bytes and (best is None or m < best[0]):
            best = (m, v)
    return best


def m_v_search(p, layers, act_bytes, weight_bytes, budget_bytes, max_m, held=None, bubble=None, multiple=True):
    for m in range(1, max_m + 1):
        for v in range(1, layers // p + 1):
            if layers % (p * v) or (multiple and v > 1 and m % p):
                continue
            b = bubble(p, m, v) if bubble else (p - 1) / (v * m + p - 1)
            h = held(p, m, v) if held else (min(p, m) if v == 1 else min(2 * (p - 1) + (v - 1) * p + 1, m * v) / v)
            if b <= 0.1 + 1e-12 and weight_bytes + h * act_bytes <= budget_bytes:
                return m, v
    return None


def narayanan_bubble(*a):             # idle over ideal compute time, (p-1)/m: too many micro-batches
    return m_v_search(*a, bubble=lambda p, m, v: (p - 1) / (v * m))


def interleaving_is_free(*a):         # every schedule holds p micro-batches: over budget
    return m_v_search(*a, held=lambda p, m, v: min(p, m))


def gpipe_memory(*a):                 # all m forwards first: m micro-batches held
    return m_v_search(*a, held=lambda p, m, v: m / 1)


def any_m(*a):                        # interleaving with m not a multiple of p
    return m_v_search(*a, multiple=False)


def hard_coded(*a):
    return 16, 2


def library_bubble(p, layers, act_bytes, weight_bytes, budget_bytes, max_m):
    from course_lib import schedules as S

    S.bubble_fraction(p, 8, "interleaved", 2)
    return 8, 2


def test_pipeline_plan_right_answers_pass(capsys):
    for answer in (m_v_search, m_v_closed_form):
        ok, line = graded(capsys, PP.check_pipeline_plan, answer)
        assert ok and line == "pipeline_plan: 7/7 cases passed", line


@pytest.mark.parametrize("answer, hint", [
    (narayanan_bubble, "micro-batches are enough"),
    (interleaving_is_free, "interleaving warms up with"),
    (gpipe_memory, "returned None, but"),
    (any_m, "needs m to be a multiple of p"),
    (hard_coded, "micro-batches are enough"),
    (library_bubble, "write this yourself"),
])
def test_pipeline_plan_wrong_answers_fail_with_a_hint(capsys, answer, hint):
    fails_with(capsys, PP.check_pipeline_plan, answer, hint=hint)


# ----------------------------------------------------------------------------- 3. placement
def _coords(rank, sizes, order):
    c = {}
    for d in reversed(order):
        rank, c[d] = divmod(rank, sizes[d])
    return c


def place_by_split_groups(sizes, order, gpus_per_node):
    """Written differently: try every assignment of ranks to nodes, keep the one that splits the
    fewest TP groups across nodes, then the fewest PP groups (DP crosses the network last)."""
    import itertools

    world = math.prod(sizes[d] for d in order)
    coords = [_coords(r, sizes, order) for r in range(world)]

    def split(nodes, dim):              # groups along dim whose ranks sit on more than one node
        groups = {}
        for r, c in enumerate(coords):
            groups.setdefault(tuple(v for d, v in c.items() if d != dim), set()).add(nodes[r])
        return sum(len(g) > 1 for g in groups.values())

    fits = [n for n in itertools.product(range(world // gpus_per_node), repeat=world)
            if all(n.count(k) == gpus_per_node for k in set(n))]
    return list(min(fits, key=lambda n: (split(n, "tp") if "tp" in sizes else 0,
                                         split(n, "pp") if "pp" in sizes else 0)))


def block_placement(sizes, order, gpus_per_node):      # the launcher's order as it comes
    return [r // gpus_per_node for r in range(math.prod(sizes.values()))]


def cyclic_placement(sizes, order, gpus_per_node):     # SLURM's --distribution=cyclic
    world = math.prod(sizes.values())
    return [r % (world // gpus_per_node) for r in range(world)]


def dp_inside_the_node(sizes, order, gpus_per_node):   # "keep the gradient all-reduce off the network"
    world = math.prod(sizes.values())
    other = [d for d in order if d != "dp"]
    return [_coords(r, sizes, order).get(other[0], 0) if "dp" in sizes else r // gpus_per_node
            for r in range(world)]


def order_read_backwards(sizes, order, gpus_per_node):  # the first dim taken as the innermost
    return place_by_split_groups(sizes, tuple(reversed(order)), gpus_per_node)


def planner_shortcut(sizes, order, gpus_per_node):
    from course_lib import planner

    planner.estimate(None, None, None)
    return [0, 0, 1, 1]


def place_tp_innermost(sizes, order, gpus_per_node):
    """The solution's idea: renumber every rank with TP innermost, then DP outermost; fill nodes in that order."""
    world = math.prod(sizes[d] for d in order)
    out = []
    for r in range(world):
        c, slot = _coords(r, sizes, order), 0
        for d in (d for d in ("dp", "pp", "cp", "tp") if d in order):
            slot = slot * sizes[d] + c[d]
        out.append(slot // gpus_per_node)
    return out


def test_placement_right_answers_pass(capsys):
    for answer in (place_tp_innermost, place_by_split_groups):
        ok, line = graded(capsys, P.check_placement, answer)
        assert ok and line == "placement: 3/3 cases passed", line


@pytest.mark.parametrize("answer, case", [(block_placement, 2), (cyclic_placement, 1), (dp_inside_the_node, 1),
                                          (order_read_backwards, 1), (planner_shortcut, 1)])
def test_placement_wrong_answers_fail_with_a_hint(capsys, answer, case):
    hint = "write this yourself" if answer is planner_shortcut else "keep it on one node's NVLink"
    line = fails_with(capsys, P.check_placement, answer, hint=hint)
    assert f"case {case}/3" in line, line
