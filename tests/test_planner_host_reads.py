"""The host's value reads in the planner's ``runtime="course"`` issue chain (planner/kernels.py
marks them, planner/issue.py waits there), on a mixture of experts without EP.

Where the program reads a value on the host (the router's counts, a ring block's positions), the
virtual clock makes the host wait for the stream; the small kernels after it (an MoE layer's
masks, indexes and per-expert GEMMs: 96 of its 129 forward kernels run shorter than the host's
issue interval on H100) are then paced by the host again. The planner summed issue and device
time over the whole pass, so the wait never showed: GPT 1.3B MoE's forward was 13.8% short of the
dry run's, on every recompute policy, and full recomputation ran it twice (the sweep's two MoE
rows at -13.5% and -13.7%). Now the traced order runs through the chain, reads marked; the
forward is the dry run's to 0.1% (the same kernels, priced by the same model, in the same order:
so 1%). With EP the traced order is one device's (all E experts): left to the summed model."""
import pytest

from course_lib.lab.dry_run_sweep import pass_times
from course_lib.layout import Layout
from course_lib.planner import estimate
from course_lib.planner.presets import get_model
from course_lib.virtual import dry_run


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_an_moes_passes_are_the_dry_runs(recompute):
    spec = get_model("gpt-1.3b-moe-8x").with_(n_layers=2)
    layout = Layout(micro_batch=1, microbatches=1, seq_len=2048, recompute=recompute)
    est = estimate(spec, "h100-sxm", layout, runtime="course")
    r = dry_run(spec, "h100-sxm", layout, progress=None, optimizer="foreach")
    (fwd, bwd), = pass_times(r.spans).values()
    st = est.stages[0]
    assert abs(st.fwd_time / fwd - 1) <= 0.01 and abs(st.bwd_time / bwd - 1) <= 0.01, (st.fwd_time, fwd, st.bwd_time, bwd)
