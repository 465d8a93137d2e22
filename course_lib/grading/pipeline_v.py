"""Graders of chapter 6's V schedules (issue #37): the learner writes ZB-V and the V placement.

    check_v_placement(v_placement)   # (n_layers, p) -> {rank: [its layers]}: 2p stages in V order
    check_zb_v(zb_v)                 # (p, m) -> per-rank action lists: ZB-V's bubble, 1F1B's memory

A learner's schedule is checked by ``schedules.validate`` (a deadlock or a missing action becomes
a hint, never a hang), then against the library's ZB-V on the unit clock: any valid order whose
step is no longer and which holds no more activations passes, not only torch's. While the
learner's function runs, the library's V schedules and placement are switched off. Each prints
one line and returns True/False.
"""
from __future__ import annotations

from course_lib import schedules as S
from course_lib.grading import Mismatch
from course_lib.grading.harness import check_answers, table
from course_lib.parallel.pipeline.rules import partition_layers

SECONDS = 10
# off while a learner's function runs: what would write the answer for it
LIBRARY_V = ("course_lib.schedules:zero_bubble_v", "course_lib.schedules:dualpipe_v",
             "course_lib.schedules:make_schedule")
LIBRARY_PLACEMENT = ("course_lib.schedules:stage_rank", "course_lib.schedules:rank_stage_ids",
                     "course_lib.parallel.pipeline.stages:rank_stages",
                     "course_lib.parallel.pipeline.stages:split_stages")


def reference_v_placement(n_layers: int, p: int) -> dict:
    """{rank: its layers, in model order}: the 2p balanced stages, stage s on stage_rank(s, p, "v")."""
    stages = partition_layers(n_layers, 2 * p)
    return {r: [layer for s in S.rank_stage_ids(r, p, 2, "v") for layer in stages[s]] for r in range(p)}


def check_v_placement(fn) -> bool:
    """fn(n_layers, p) -> {rank: [layer indices]}: the model cut into 2p balanced stages of
    contiguous layers (the first ``n_layers % 2p`` one layer longer), rank r holding stages r and
    2p - 1 - r."""
    def read(got, n, p):
        if not isinstance(got, dict) or sorted(got) != list(range(p)):
            raise Mismatch(f"expected a dict {{rank: [layers]}} for ranks 0..{p - 1}, got {got!r}"[:200])
        return {r: sorted(int(x) for x in layers) for r, layers in got.items()}

    def differ(got, want, n, p):
        if got == want:
            return None
        loop = {r: [x for s in range(r, 2 * p, p) for x in partition_layers(n, 2 * p)[s]] for r in range(p)}
        if got == loop:
            return "this is the interleaved (loop) placement: rank r holds r and r + p; a V holds r and 2p - 1 - r"
        if 0 not in got[0] or n - 1 not in got[0]:
            return "in a V the first and the last layers both sit on rank 0"
        r = next(r for r in range(p) if got[r] != want[r])
        return f"rank {r}: got layers {got[r]}, expected {want[r]} (balanced stages: the first n % 2p one longer)"
    shapes = [(8, 2), (8, 4), (7, 2), (9, 4), (6, 3), (2, 1), (13, 5)]
    return check_answers("v_placement", fn, table(shapes, "n_layers={}, p={}"), reference_v_placement,
                         guard=LIBRARY_PLACEMENT, exercise="the V placement", seconds=SECONDS, read=read,
                         differ=differ)


def _step(schedule, p):
    spans = [s for s in S.simulate(schedule, p, 2, t_f=1.0, t_b=2.0, t_w=1.0) if s.kind == "compute"]
    return max(s.end for s in spans) - min(s.start for s in spans)


def check_zb_v(fn) -> bool:
    """fn(p, m) -> [[(op, stage, mb), ...] per rank]: a ZB-V schedule over 2p stages in V order,
    every backward split into B and W, whose step on the unit clock (a chunk's F 1, B 1, W 1) is
    no longer than ZB-V's and which holds no more micro-batches than ZB-V (1F1B's memory)."""
    def differ(answer, want, p, m):
        try:
            got = S.validate(answer, p, m, 2)
        except ValueError as e:
            return f"invalid schedule: {e}"
        if p > 1 and got.placement != "v":
            return "the stages are placed in a loop (stage s on rank s % p): ZB-V places them in a V"
        n_b, n_w = (sum(a.op == op for row in got for a in row) for op in "BW")
        if n_w != n_b:
            return f"{n_b - n_w} backwards are not split into B and W: ZB-V computes every weight gradient apart"
        held, limit = max(S.in_flight(row) for row in got), max(S.in_flight(row) for row in want)
        if held > limit:
            return f"a rank holds {held} chunk-micro-batches at once, ZB-V {limit}: warm up less, or run W sooner"
        step, best = _step(got, p), _step(want, p)
        if step > best + 1e-9:
            return f"valid, but the step takes {step:g} units on the unit clock, ZB-V's {best:g}: fill the bubbles"
    shapes = [(2, 4), (3, 6), (4, 8), (2, 3), (4, 9), (1, 2), (3, 2), (2, 1)]
    return check_answers("zb_v", fn, table(shapes, "p={}, m={}"), S.zero_bubble_v, guard=LIBRARY_V,
                         exercise="the ZB-V schedule", seconds=SECONDS, differ=differ)


__all__ = ["check_v_placement", "check_zb_v"]
