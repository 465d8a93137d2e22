"""The dry run's memory against the formulas, at small shapes (course_lib/lab/dry_run_memory.py):
model states equal ZeRO's bytes exactly in the course's precision (DDP's buckets' flags
beside), one layer's activations equal the Korthikanti terms the course keeps, and the first
stage holds the in-flight micro-batches the interleaving formula says."""
import pytest
import torch

from course_lib.lab import dry_run_memory as M
from course_lib.layout import Layout
from course_lib.planner import formulas as F
from course_lib.planner.activations import activation_bytes_per_layer
from course_lib.planner.presets import HARDWARE, gpt_spec

# the course's attention written out (the preset states fused attention, FlashAttention: the
# terms below are the written-out program's, Korthikanti's terms with the softmax kept)
HW = HARDWARE["a100-80gb"].with_(fused_attention=False)
# every weight's first dim divisible by 4: FSDP's shards carry no padding at dp 2 and 4
TINY = gpt_spec("tiny GPT", 2, 64, 4, V=128, s=32)


@pytest.mark.parametrize("dp,zero", [(1, 0), (2, 0), (2, 1), (4, 1), (2, 2), (4, 2), (2, 3), (4, 3)])
def test_model_states_equal_zero_formula(dp, zero):
    # bf16 mixed precision (the dry run's default): 2 + 2 bytes and K = 12, sharded as ZeRO-1/2/3
    # say; DDP (ZeRO-0 at dp > 1) holds its gradients in its buckets after the step (each .grad a
    # view of its bucket), with one flag per parameter tensor ("had a gradient"), 2 bytes each
    from course_lib.gpt import TinyGPT
    from course_lib.virtual.dry_run import model_config
    P = F.param_count(TINY)
    with torch.device("meta"):
        tensors = len(list(TinyGPT(model_config(TINY, Layout()), seed=0).parameters()))
    flags = 2 * tensors if dp > 1 and zero == 0 else 0
    assert M.model_state_bytes(TINY, HW, dp, zero) == F.zero_memory_bytes(P, zero, dp)["total"] + flags


def test_fp32_cluster_counts_a_master_copy():
    # fp32 AdamW keeps 4 + 4 + 8 bytes; the dry run adds its fp32 master (4): 20, as the lab says
    P = F.param_count(TINY)
    got = M.model_state_bytes(TINY, HW, 1, 0, dtype=torch.float32)
    assert got == F.zero_memory_bytes(P, 0, 1, 4, 4, 8)["total"] + 4 * P
    assert M.precision_rows(TINY, HW)[1]["dry_per_param"] == 20.0


@pytest.mark.parametrize("sp,recompute", [(False, "none"), (False, "selective"), (False, "full"),
                                          (True, "none"), (True, "selective"), (True, "full")])
def test_layer_activations_equal_course_terms(sp, recompute):
    s, t = 32, 2
    layout = Layout(tp=t, sp=sp, recompute=recompute, global_batch=1)
    got = M.layer_activations(TINY, HW, layout, fusions=())
    terms = M.course_terms(s, 1, 64, 4, t, sp, recompute)
    assert got == round(terms["course"])
    # and the course's terms are the paper's less its dropout, plus LayerNorm's statistics
    paper = activation_bytes_per_layer(s, 1, 64, 4, t, sp, recompute)
    assert terms["course"] == pytest.approx(paper - terms["dropout"] + terms["norm_stats"], abs=1e-6)
    assert (terms["dropout"] > 0) == (recompute != "full")


def test_first_stage_holds_the_interleaving_formula():
    # doubling the layers per chunk adds L x one layer x (1 + (p-1)/(p v)) to the first stage's
    # peak (the embedding's share cancels): 11 chunk forwards of one layer each at p 4, v 2
    p, v, m = 4, 2, 8
    layer = M.layer_activations(TINY, HW, Layout(global_batch=1), fusions=())
    peaks = {}
    for L in (p * v, 2 * p * v):
        for schedule, chunks in (("1f1b", 1), ("interleaved", v)):
            layout = Layout(pp=p, schedule=schedule, v=chunks, global_batch=m)
            r = M.dry_run(M.with_layers(TINY, L), HW, layout, progress=None)
            peaks[L, schedule] = r.memory_by_stage[0]["activations"]
    L = p * v
    assert peaks[2 * L, "1f1b"] - peaks[L, "1f1b"] == L * layer
    assert peaks[2 * L, "interleaved"] - peaks[L, "interleaved"] == L * layer * (1 + (p - 1) / (p * v))
    assert F.in_flight_microbatches(p, m, "interleaved", v) * 2 == 11


def test_course_terms_refuse_an_unknown_policy():
    with pytest.raises(ValueError, match="recompute"):
        M.course_terms(32, 1, 64, 4, recompute="some")
