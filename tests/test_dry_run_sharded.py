"""The dry run beyond dp x tp x pp: the V schedules (each rank's two chunks in V order),
sharded data parallelism (FSDP, HSDP, ZeRO++ with hpZ's reshard block), packed documents
under CP (``Layout.documents``: the step's ``doc_ids``) and async TP (its ring hops go to a
folded tp peer: the message received from the peer behind left when this rank's own message
to the peer ahead did): the same virtual step time, kernels and memory as a real launch of
the same layout on the clock. FSDP keys a saved tensor by the storage it views, and on the
meta device every storage's data_ptr is 0: the dry run once mistook every saved tensor for a
parameter (a bool mask came back a float32 view). HSDP's and a reshard block's groups come
from the mesh (``comm_of_sets``), and so do ZeRO++'s node groups, which the dry run's mesh
builds without process groups."""
import dataclasses

import pytest

from course_lib.launch import launch
from course_lib.layout import Layout
from course_lib.parallel.mesh import MeshShape
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run
from memory_parity import assert_same_memory

SPEC = dataclasses.replace(gpt_spec("GPT test", 4, 64, 4, V=256, s=32), tied=False)   # FSDP: untied over stages
HW = "a100-80gb"
LAYOUTS = {
    "fsdp dp2 x tp2": Layout(dp=2, tp=2, sp=True, zero=3, micro_batch=1, global_batch=4),
    "hsdp 2 x 2": Layout(dp=4, zero=3, shard_size=2, micro_batch=1, global_batch=8),
    "async tp2 x dp2": Layout(dp=2, tp=2, sp=True, async_tp=True, micro_batch=1, global_batch=2),
    "cp2 packed documents": Layout(cp=2, documents=(20, 12), cp_layout="documents", micro_batch=1,
                                   global_batch=2),
    "zb-v pp2": Layout(pp=2, schedule="zb-v", micro_batch=1, global_batch=4),
    "dualpipe-v pp2 x tp2": Layout(pp=2, tp=2, sp=True, schedule="dualpipe-v", micro_batch=1, global_batch=4),
    "zero++ 2 nodes of 2": Layout(dp=4, zero=3, zeropp=("hpz", "qwz", "qgz"), gpus_per_node=2, micro_batch=1,
                                  global_batch=4),
}


def _real_rank(cfg, layouts):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    return [train_step(cfg, L, Mesh.from_layout(L)) for L in layouts]


@pytest.fixture(scope="module")
def real():
    """Each layout in a 4-rank launch (one clock per launch: a launch per layout)."""
    from course_lib.virtual.dry_run import model_config
    out = {}
    for name, L in LAYOUTS.items():
        out[name] = [r[0] for r in launch(_real_rank, L.n_gpus, model_config(SPEC, L), [L],
                                          clock=VirtualCluster(HW))]
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_dry_run_equals_a_real_launch(real, name):
    L = LAYOUTS[name]
    ranks = real[name]
    r = dry_run(SPEC, HW, L, progress=None)
    step = max(x["t"] for x in ranks)
    assert r.step_time == step, (r.step_time, step)      # the same prices in the same order: to the bit
    stage_ranks = [MeshShape(**L.sizes).rank_of(pp=s, cp=c) for s in range(L.pp) for c in range(L.cp)]
    assert r.kernels == sum(ranks[k]["kernels"] for k in stage_ranks)
    for i, k in enumerate(stage_ranks):     # (the running ranks, in running_ranks' order)
        assert_same_memory(r.memory_by_stage[i], ranks[k], k)
    if L.zero == 3:
        assert [s for s in r.spans if "all-gather" in s.name]      # FSDP's collectives were priced
    if L.async_tp:      # the ring's hops to the folded tp peer: sent and received, priced
        assert [s for s in r.spans if s.name.startswith("recv from")] and r.ranks_run == 1


@pytest.mark.parametrize("documents,layout,message", [
    ((20, 10), "zigzag", "summing to the sequence length 32"),
    ((20, 12.0), "zigzag", "positive ints"),
    ((18, 14), "documents", "not all multiples"),
])
def test_bad_document_packings_are_refused_before_anything_runs(documents, layout, message):
    with pytest.raises(ValueError, match=message):
        dry_run(SPEC, HW, Layout(cp=2, documents=documents, cp_layout=layout, micro_batch=1, global_batch=2))
