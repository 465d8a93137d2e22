"""course_lib/grading/pipeline_v.py: each grader passes right answers written differently and
fails classic mistakes, a hard-coded answer and a call to the library's own implementation."""
from course_lib import schedules as S
from course_lib.grading.pipeline_v import check_v_placement, check_zb_v


# ---------------------------------------------------------------- the V placement

def placement_right(n_layers, p):
    """Written differently: sizes by divmod, the V by walking down then back up."""
    base, extra = divmod(n_layers, 2 * p)
    bounds, start = [], 0
    for s in range(2 * p):
        size = base + (s < extra)
        bounds.append(list(range(start, start + size)))
        start += size
    order = list(range(p)) + list(reversed(range(p)))       # stage s -> rank order[s]
    out = {r: [] for r in range(p)}
    for s, r in enumerate(order):
        out[r] += bounds[s]
    return out


def placement_loop(n_layers, p):                             # the interleaved placement
    base, extra = divmod(n_layers, 2 * p)
    sizes = [base + (s < extra) for s in range(2 * p)]
    starts = [sum(sizes[:s]) for s in range(2 * p)]
    return {r: [x for s in (r, r + p) for x in range(starts[s], starts[s] + sizes[s])] for r in range(p)}


def placement_unbalanced(n_layers, p):                       # the remainder all on the last stage
    base = n_layers // (2 * p)
    sizes = [base] * (2 * p - 1) + [n_layers - base * (2 * p - 1)]
    starts = [sum(sizes[:s]) for s in range(2 * p)]
    order = list(range(p)) + list(reversed(range(p)))
    out = {r: [] for r in range(p)}
    for s, r in enumerate(order):
        out[r] += list(range(starts[s], starts[s] + sizes[s]))
    return out


def placement_hard_coded(n_layers, p):
    return {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}                 # right for (8, 2) only


def placement_library(n_layers, p):
    from course_lib.parallel.pipeline.rules import partition_layers
    stages = partition_layers(n_layers, 2 * p)
    return {r: [x for s in S.rank_stage_ids(r, p, 2, "v") for x in stages[s]] for r in range(p)}


def test_v_placement_grader(capsys):
    assert check_v_placement(placement_right)
    for wrong, hint in ((placement_loop, "interleaved (loop) placement"),
                        (placement_unbalanced, "balanced stages"),
                        (placement_hard_coded, "FAILED case 2/7"),
                        (placement_library, "write this yourself")):
        capsys.readouterr()
        assert not check_v_placement(wrong), wrong.__name__
        out = capsys.readouterr().out
        assert hint in out, (wrong.__name__, out)


# ---------------------------------------------------------------- ZB-V

def zb_v_right(p, m):
    """Written differently: one phase table per rank, the extra micro-batches filtered at the end."""
    n = max(m, 2 * p - 1)
    out = []
    for r in range(p):
        a, b = r, 2 * p - 1 - r
        nxt = {}
        row = []

        def do(op, s):
            k = nxt.get((op, s), 0)
            nxt[(op, s)] = k + 1
            row.append((op, s, k))
        phases = [[("F", a)]] * (2 * (p - r) - 1) + [[("F", b), ("F", a)]] * r + \
            [[("F", b), ("B", b), ("W", b)]] * (p - r)
        for phase in phases:
            for op, s in phase:
                do(op, s)
        while nxt.get(("F", b), 0) < nxt[("F", a)] or nxt[("F", a)] < n:
            if nxt[("F", a)] < n:
                do("F", a)
            for op, s in (("B", a), ("W", a), ("F", b), ("B", b), ("W", b)):
                do(op, s)
        for phase in [[("B", a), ("B", b)]] * r + [[("B", a), ("W", a)]] * (p - r):
            for op, s in phase:
                do(op, s)
        for s in (b, a):
            while nxt.get(("W", s), 0) < nxt[("B", s)]:
                do("W", s)
        out.append([x for x in row if x[2] < m])
    return out


def zb_v_w_at_the_end(p, m):            # valid and split, but every W waits: more activations held
    out = []
    for row in zb_v_right(p, m):
        out.append([a for a in row if a[0] != "W"] + [a for a in row if a[0] == "W"])
    return out


def zb_v_unsplit(p, m):                 # the V order with full backwards (no W)
    return [[a for a in row if a[0] != "W"] for row in zb_v_right(p, m)]


def zb_v_loop(p, m):                    # interleaved placement: the second chunk is stage p + r
    return [[(op, st if st < p else p + r, mb) for op, st, mb in row] for r, row in enumerate(zb_v_right(p, m))]


def zb_v_hard_coded(p, m):
    return [[("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 3, 0), ("B", 3, 0), ("W", 3, 0)]]


def zb_v_library(p, m):
    return S.zero_bubble_v(p, m)


def zb_v_slow(p, m):                    # valid, V, split, little memory: one micro-batch at a time
    rows = [[] for _ in range(p)]
    for mb in range(m):
        for st in range(2 * p):
            rows[st if st < p else 2 * p - 1 - st].append(("F", st, mb))
        for st in reversed(range(2 * p)):
            rows[st if st < p else 2 * p - 1 - st] += [("B", st, mb), ("W", st, mb)]
    return rows


def test_zb_v_grader(capsys):
    assert zb_v_right(3, 5) == [list(map(tuple, row)) for row in S.zero_bubble_v(3, 5)]
    assert check_zb_v(zb_v_right)
    for wrong, hint in ((zb_v_w_at_the_end, "chunk-micro-batches at once"),
                        (zb_v_unsplit, "not split into B and W"),
                        (zb_v_loop, "invalid schedule|placed in a loop"),
                        (zb_v_hard_coded, "invalid schedule"),
                        (zb_v_library, "write this yourself"),
                        (zb_v_slow, "fill the bubbles")):
        capsys.readouterr()
        assert not check_zb_v(wrong), wrong.__name__
        out = capsys.readouterr().out
        assert any(h in out for h in hint.split("|")), (wrong.__name__, out)
