"""Checkpoints that outlive their layout (chapter 12): save from any N-D layout, load into
any other, torch.distributed.checkpoint's idea written out.

    save(path, net, opt, step=k, data_state=..., scheduler=sched)    # every rank of layout L1
    state = load(path, net2, opt2, scheduler=sched2)                 # every rank of layout L2

layout: which global box each local tensor holds; plan: who writes what, who reads what;
store: files, metadata, atomic publish; load: checks, then reads; async_save: the write
overlapped with the next steps.
"""
from course_lib.checkpoint.async_save import AsyncSaver
from course_lib.checkpoint.layout import (Holding, Part, flat_range_boxes, model_holdings,
                                          optimizer_holdings)
from course_lib.checkpoint.load import bytes_per_rank, load, read_metadata
from course_lib.checkpoint.plan import assign_writers, overlap, read_plan
from course_lib.checkpoint.store import FORMAT, VERSION, local_items, save

__all__ = ["save", "load", "AsyncSaver", "read_metadata", "bytes_per_rank", "local_items", "model_holdings",
           "optimizer_holdings", "flat_range_boxes", "overlap", "read_plan", "assign_writers", "Part",
           "Holding", "FORMAT", "VERSION"]
