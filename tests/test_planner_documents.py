"""The planner's count of packed documents' attention work per CP rank (planner/documents.py,
arithmetic series, no tensors) equals the pairs the ranks' own split holds
(parallel.cp_layouts.work_per_rank, which builds the positions); and planner.estimate
prices the slowest rank's share under a fused kernel, so the document-aware split is faster."""
import dataclasses

import pytest

from course_lib.parallel.cp_layouts import work_per_rank as ranks_work
from course_lib.planner import Layout, estimate
from course_lib.planner.documents import attention_scale, work_per_rank
from course_lib.planner.presets import get_hardware
from course_lib.virtual.dry_run import document_ids


@pytest.mark.parametrize("s,cp,docs", [(4096, 4, (2560, 1536)), (96, 3, (48, 24, 24)), (120, 5, (40, 80)),
                                       (64, 2, (64,)), (60, 3, (6, 18, 36))])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "documents"])
def test_counted_pairs_equal_the_ranks_split(s, cp, docs, layout):
    assert work_per_rank(s, cp, layout, docs) == ranks_work(s, cp, layout, doc_ids=document_ids(docs))


def test_estimate_prices_the_slowest_ranks_attention():
    base = Layout(dp=2, tp=8, sp=True, cp=4, micro_batch=1, global_batch=16, seq_len=32768)
    docs = (16384, 8192, 4096, 4096)
    step = {lay: estimate("llama3-70b", "h100-sxm", base.with_(documents=docs, cp_layout=lay)).step_time
            for lay in ("zigzag", "contiguous", "documents")}
    scale = {lay: attention_scale(32768, 4, lay, docs) for lay in step}
    assert scale["documents"] < scale["zigzag"] < scale["contiguous"]
    assert step["documents"] < step["zigzag"] < step["contiguous"]
    assert estimate("llama3-70b", "h100-sxm", base).step_time > step["documents"]   # fewer pairs than one document
    unfused = dataclasses.replace(get_hardware("h100-sxm"), fused_attention=False)  # the masked scores run anyway
    assert estimate("llama3-70b", unfused, base.with_(documents=docs)).step_time == \
        estimate("llama3-70b", unfused, base).step_time
