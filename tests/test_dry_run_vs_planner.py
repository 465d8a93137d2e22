"""The planner's runtime="course" against the dry run (course_lib.lab.dry_run_sweep): on
layouts where the sweep's cause list says they should agree (no ZeRO-3, no CP, no interleaving,
not host-bound TP: see benchmarks/dry_run_vs_planner.py), step times within the sweep's BOUND
(10%)."""
import pytest

from course_lib.layout import Layout
from course_lib.lab.dry_run_sweep import BOUND, cause, planner_parts
from course_lib.planner import estimate
from course_lib.planner.presets import ModelSpec, gpt_spec
from course_lib.planner.runtime import first_step_state
from course_lib.virtual import dry_run

GPT = gpt_spec("GPT 12L h2048", 12, 2048, 16, V=51200, s=1024)
LLAMA = ModelSpec("Llama-style 12L h2048 GQA", 12, 2048, 16, 4, 5632, 32000, 1024)
MOE = GPT.with_(name="GPT 12L h2048 MoE 8x top-2", n_experts=8, top_k=2)


@pytest.mark.parametrize("spec,layout", [
    (LLAMA, Layout(dp=2, pp=2, micro_batch=1, microbatches=2, recompute="selective")),
    (MOE, Layout(dp=4, ep=4, micro_batch=1, microbatches=1)),
], ids=["llama-dp2-pp2-selective", "moe-dp4-ep4"])
def test_planner_agrees_with_the_dry_run(spec, layout):
    """The dry run with torch's foreach AdamW, the optimizer the planner's course runtime counts;
    its step is the program's first, which creates AdamW's state: the planner's steady step plus
    first_step_state (the slowest stage's)."""
    est = estimate(spec, "h100-sxm", layout, runtime="course")
    r = dry_run(spec, "h100-sxm", layout, progress=None, optimizer="foreach")
    n, p = spec.n_layers // layout.pp, layout.pp
    first = max(first_step_state(spec, est.hardware, layout, n, s == 0, s == p - 1) for s in range(p))
    assert abs((est.step_time + first) / r.step_time - 1) <= BOUND, (est.step_time + first, r.step_time)
    assert abs(est.memory["total"] / r.peak_memory - 1) <= BOUND, (est.memory["total"], r.peak_memory)


def test_the_cause_is_the_part_that_differs_most():
    planner = {"compute": 1.0, "exposed TP": 0.1, "pipeline bubble": 0.2}
    dry = {"compute": 1.05, "exposed TP": 0.1, "pipeline bubble": 0.5}
    assert cause(planner, dry) == "pipeline bubble -300.0 ms"
    est = estimate(GPT, "h100-sxm", Layout(tp=2, micro_batch=1, microbatches=1), runtime="course")
    assert abs(sum(planner_parts(est).values()) - est.step_time) <= 1e-9 * est.step_time
