"""Save from any layout, load into any other: the files, the metadata, the atomic publish.

    save(path, net, opt, step=k, data_state={"batches_seen": k}, scheduler=sched)  # every rank
    state = load(path, other_net, other_opt, scheduler=sched)   # another layout, or one device

A checkpoint is a directory: ``rank00003.bin`` holds the boxes rank 3 wrote, back to back as
raw bytes; ``metadata.json`` records every tensor's global shape and dtype and, for each
saved box, its offsets and lengths, the file, the byte range and a CRC-32; ``extra.pt``
holds the step, the data order, the learning-rate schedule, the optimizer's hyperparameters
and the RNG states (rank 0's: the course's ranks draw the same streams).

Publish: every rank writes into ``path.partial``; the ranks' CRCs are gathered on rank 0
(every rank has finished); rank 0 writes ``extra.pt`` and ``metadata.json`` last and renames
the directory to ``path`` in one ``os.rename``. A rank killed mid-save leaves a
``.partial`` directory without metadata, which ``load`` refuses; ``path`` never exists half.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import zlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from course_lib.checkpoint.layout import model_holdings, optimizer_holdings, part_view, state_parts
from course_lib.checkpoint.plan import assign_writers

FORMAT, VERSION = "course_lib.checkpoint", 1
METADATA, EXTRA = "metadata.json", "extra.pt"


class Item(NamedTuple):
    key: str          # "model.<name>" or "optim.state.<name>.<state key>"
    shape: tuple      # global shape
    dtype: str        # "float64"
    offsets: tuple    # the box this rank holds
    lengths: tuple
    view: object      # its local values, shaped like the box


def _world(group=None):
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _all_gather(obj, group=None):
    if _world(group)[1] == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def local_items(model, optimizer=None) -> list[Item]:
    """Everything this rank holds, box by box: parameters, then optimizer state."""
    holdings = model_holdings(model)
    items = [Item(f"model.{h.name}", h.shape, _dtype_name(h.tensor.dtype), p.offsets, p.lengths,
                  part_view(h.tensor, p)) for h in holdings.values() for p in h.parts]
    keyed, state = optimizer_holdings(optimizer, holdings)
    for key_tensor, h in keyed:
        for k, v in state.get(key_tensor, {}).items():
            if not torch.is_tensor(v):
                raise ValueError(f"checkpoint: optimizer state {k!r} of {h.name!r} is not a tensor ({v!r})")
            shape, parts = state_parts(h, v)
            items += [Item(f"optim.state.{h.name}.{k}", shape, _dtype_name(v.dtype), p.offsets, p.lengths,
                           part_view(v, p)) for p in parts]
    return items


def rng_state() -> dict:
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if "numpy" in sys.modules:
        out["numpy"] = sys.modules["numpy"].random.get_state()
    return out


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy
        numpy.random.set_state(state["numpy"])


class SaveJob(NamedTuple):
    path: str
    tmp: str
    rank: int
    per_rank: list     # every rank's [(key, shape, dtype, offsets, lengths)]
    writes: list       # every rank's indexes into its items: what it writes
    mine: list         # [Item] this rank writes
    extra: dict        # rank 0: step, data order, schedule, hyperparameters, RNG


def prepare(path, model, optimizer=None, *, step=0, data_state=None, rng=True, scheduler=None, copy=False):
    """The blocking part of a save (every rank, collective on the default group): list the
    boxes, plan who writes what, snapshot them (``copy``: to host memory, so training may go
    on while they are written), make ``path.partial``."""
    path = os.path.abspath(os.fspath(path))
    rank, _ = _world()
    if os.path.exists(path):
        raise ValueError(f"checkpoint: {path} exists already: save each checkpoint under a new name")
    items = local_items(model, optimizer)
    per_rank = _all_gather([tuple(i[:5]) for i in items])
    writes = assign_writers(per_rank)
    mine = [items[j] for j in writes[rank]]
    if copy:
        mine = [i._replace(view=i.view.detach().to("cpu", copy=True)) for i in mine]
    extra = {}
    if rank == 0:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in getattr(optimizer, "param_groups", [])]
        extra = {"step": step, "data_state": data_state, "param_groups": groups,
                 "scheduler": scheduler.state_dict() if scheduler is not None else None,
                 "rng": rng_state() if rng else None}
        shutil.rmtree(path + ".partial", ignore_errors=True)       # a save killed earlier
        os.makedirs(path + ".partial")
    if _world()[1] > 1:
        dist.barrier()                                              # the directory exists
    return SaveJob(path, path + ".partial", rank, per_rank, writes, mine, extra)


def _fsync_write(file, chunks):
    with open(file, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def _raw(view) -> memoryview:
    return memoryview(view.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def write_and_publish(job: SaveJob, group=None) -> int:
    """Write this rank's boxes, then (rank 0, after every rank is done) the metadata, and
    publish by one rename. Returns the bytes this rank wrote. ``group``: the gloo group of
    the gather and barrier (a background save uses its own)."""
    name, records, offset, chunks = f"rank{job.rank:05d}.bin", [], 0, []
    for item in job.mine:
        raw = _raw(item.view)
        records.append((offset, raw.nbytes, zlib.crc32(raw)))
        chunks.append(raw)
        offset += raw.nbytes
    _fsync_write(os.path.join(job.tmp, name), chunks)
    every = _all_gather(records, group)                     # also: every rank has written
    if job.rank == 0:
        tensors = {}
        for r, (writes, recs) in enumerate(zip(job.writes, every)):
            for j, (start, nbytes, crc) in zip(writes, recs):
                key, shape, dtype, offsets, lengths = job.per_rank[r][j]
                entry = tensors.setdefault(key, {"shape": list(shape), "dtype": dtype, "shards": []})
                entry["shards"].append({"rank": r, "file": f"rank{r:05d}.bin", "offsets": list(offsets),
                                        "lengths": list(lengths), "byte_offset": start, "nbytes": nbytes,
                                        "crc32": crc})
        torch.save(job.extra, os.path.join(job.tmp, EXTRA))
        with open(os.path.join(job.tmp, EXTRA), "rb") as f:
            extra_crc = zlib.crc32(f.read())
        meta = {"format": FORMAT, "version": VERSION, "world_size": len(every), "step": job.extra["step"],
                "extra": {"file": EXTRA, "crc32": extra_crc}, "tensors": tensors}
        _fsync_write(os.path.join(job.tmp, METADATA), [json.dumps(meta, indent=1).encode()])
        os.rename(job.tmp, job.path)                         # the publish: atomic on POSIX
        fd = os.open(os.path.dirname(job.path), os.O_RDONLY)
        os.fsync(fd)                                         # the rename itself reaches the disk
        os.close(fd)
    if _world(group)[1] > 1:
        dist.barrier(group=group)                            # nobody returns before it is published
    return offset


def save(path, model, optimizer=None, *, step=0, data_state=None, rng=True, scheduler=None) -> int:
    """Save ``model`` (any course layout) and ``optimizer`` to directory ``path``; call on
    every rank. Each rank writes only the boxes it holds, a replicated box once (the lowest
    rank holding it). Returns the bytes this rank wrote."""
    job = prepare(path, model, optimizer, step=step, data_state=data_state, rng=rng, scheduler=scheduler)
    return write_and_publish(job)
