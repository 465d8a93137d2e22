"""Chapter 9's runs (course_lib/lab/nd_runs.py): a layout trained in float64 equals one device
within course_lib.tolerance's AdamW bound, and a layout that does not (a wrong reference)
is reported as outside it; its virtual step time is the same on a second run and is the
first rank's start to the last rank's end of the program's own spans; memory per rank."""
import dataclasses

import torch

from course_lib.gpt import GPTConfig
from course_lib.lab.nd_runs import predict, run_layout, single_device
from course_lib.virtual import VirtualCluster

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=4, n_kv_heads=2)
BATCH, STEPS = 4, 2
H100 = VirtualCluster("h100-sxm", gpus_per_node=8, dtype=torch.bfloat16)


def test_layout_equals_one_device_and_its_virtual_step_repeats():
    ref = single_device(CFG, BATCH, STEPS, dtype=torch.float64)
    first = run_layout("DP x TP", dict(dp=2, tp=2), {}, CFG, BATCH, STEPS, ref, H100)
    assert first.matches(), (first.loss_check, first.param_check)
    assert first.param_check.bound < 1e-6                  # fp64 AdamW: a tight bound
    second = run_layout("DP x TP", dict(dp=2, tp=2), {}, CFG, BATCH, STEPS, ref, H100)
    assert second.step_time == first.step_time > 0         # virtual time: no wall-clock input
    assert second.spans == first.spans
    assert first.step_time >= max(s.end for s in first.spans) - min(s.start for s in first.spans)
    assert len(first.memory) == 4 and all(m["peak"] > 0 for m in first.memory)
    est, _ = predict(first, H100.hw)
    assert est.step_time > 0


def test_a_wrong_reference_is_outside_the_bound():
    ref = single_device(CFG, BATCH, STEPS, dtype=torch.float64)
    moved = dataclasses.replace(ref, state={n: w + 1e-3 for n, w in ref.state.items()})
    run = run_layout("TP", dict(tp=2), {}, CFG, BATCH, STEPS, moved, H100)
    assert run.loss_check.ok and not run.param_check.ok and not run.matches()
