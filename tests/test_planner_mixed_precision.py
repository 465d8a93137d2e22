"""The planner's runtime="course" under a mixed precision against the dry run.

Under "bf16" the dry run prices each tensor at its own dtype: the bf16 model, and the fp32 the
program computes in (its norms' statistics, the rotary tables' products, the loss over the
vocabulary, the ring's merges). The planner traced every float at 2 bytes, as under "full", and
was fast by 17.6% (TP2 + SP x PP2 x DP2), 9.5% (ZeRO-3) and 8.1% (CP2, 16k tokens) on Llama 3 8B's
4 layers at 4096 tokens, H100; it now traces the bf16 model at its own dtypes
(``trace_step(itemsize=None)``): -1.0%, -4.0% and 0.0%. Small shapes here, a second each:
before, -12.9% and -15.5% (both past the sweep's bound); now -5.4% and +1.5%."""
import pytest

from course_lib.lab.dry_run_sweep import BOUND
from course_lib.layout import Layout
from course_lib.planner import estimate
from course_lib.planner.presets import get_model
from course_lib.virtual import dry_run

SMALL = get_model("llama3-8b").with_(n_layers=4, hidden=512, n_heads=8, n_kv_heads=2, ffn=1536, vocab=32000,
                                     name="Llama-style 4L h512")


@pytest.mark.parametrize("layout", [
    Layout(dp=2, tp=2, sp=True, pp=2, micro_batch=1, global_batch=8, seq_len=2048),
    Layout(cp=2, micro_batch=1, global_batch=1, seq_len=16384),
], ids=["dp2-tp2-sp-pp2", "cp2"])
def test_the_course_runtime_prices_a_mixed_precision_as_the_dry_run(layout):
    times = {}
    for precision in ("full", "bf16"):
        lay = layout.with_(precision=precision)
        est = estimate(SMALL, "h100-sxm", lay, runtime="course")
        r = dry_run(SMALL, "h100-sxm", lay, progress=None, optimizer="foreach")
        assert abs(est.step_time / r.step_time - 1) <= BOUND, (precision, est.step_time, r.step_time)
        times[precision] = est.step_time, r.step_time
    # the fp32 work is seen on both sides: "bf16" costs more than "full"
    (plan_full, dry_full), (plan_bf16, dry_bf16) = times["full"], times["bf16"]
    assert plan_bf16 > plan_full and dry_bf16 > dry_full
