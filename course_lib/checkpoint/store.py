"""Save from any layout, load into any other: the files, the metadata, the atomic publish.

    save(path, net, opt, step=k, data_state={"batches_seen": k}, scheduler=sched)  # every rank
    state = load(path, other_net, other_opt, scheduler=sched)   # another layout, or one device

A checkpoint is a directory: ``rank00003.bin`` holds the boxes rank 3 wrote, back to back as
raw bytes; ``metadata.json`` records every tensor's global shape and dtype and, for each
saved box, its offsets and lengths, the file, the byte range and a CRC-32; ``extra.pt``
holds the step, the data order, the learning-rate schedule, the optimizer's hyperparameters
and every rank's RNG states (a TP run may draw other streams on each rank). It holds plain
values only (tensors, numbers, strings, lists, tuples, dicts), so that ``load`` reads it with
``torch.load(weights_only=True)``: loading a checkpoint never runs code from it.

Publish: every rank writes and fsyncs its file in ``path.partial``; the ranks' CRCs are
gathered on rank 0 (every rank has finished); rank 0 writes ``extra.pt`` and
``metadata.json`` last, fsyncs the ``.partial`` directory itself (its entries: the files'
names), renames it to ``path`` in one ``os.rename`` and fsyncs the parent (the rename). The
rename is atomic on a local POSIX file system; an object store (S3, GCS) has no atomic
rename, and there a marker written last commits a checkpoint (DCP writes ``.metadata``
last; here ``metadata.json`` plays that part too). A rank killed mid-save leaves a
``.partial`` directory without metadata, which ``load`` refuses; ``path`` never exists half.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import sys
import zlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from course_lib.checkpoint.layout import model_holdings, optimizer_holdings, part_view, state_parts
from course_lib.checkpoint.plan import assign_writers

FORMAT, VERSION = "course_lib.checkpoint", 2   # 2: every rank's RNG state, extra.pt weights-only
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
    """This process's RNG states as plain values: torch's CPU generator (and the current
    GPU's, once CUDA is in use), Python's and numpy's (its key as a list of ints)."""
    out = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    if "numpy" in sys.modules:
        name, key, pos, has_gauss, gauss = sys.modules["numpy"].random.get_state()
        out["numpy"] = (name, key.tolist(), pos, has_gauss, gauss)
    return out


def set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy
        name, key, pos, has_gauss, gauss = state["numpy"]
        numpy.random.set_state((name, numpy.array(key, dtype=numpy.uint32), pos, has_gauss, gauss))


def _refused(error) -> str:
    """What ``torch.load(weights_only=True)`` refused, in its own words (``Unsupported global:
    GLOBAL mymodule.MyClass ...``), without its advice to load unsafely."""
    text = str(error)
    start = text.find("Unsupported global")
    return text[start:].split(" was not an allowed global")[0] if start >= 0 else text.splitlines()[0]


def extra_bytes(extra: dict) -> bytes:
    """``extra.pt``'s bytes; a ValueError if it holds anything ``torch.load(weights_only=True)``
    refuses (an object of a class of one's own in ``data_state``, a scheduler's lambda)."""
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except pickle.UnpicklingError as e:
        reason = _refused(e)
        raise ValueError(f"checkpoint: the step, data_state and scheduler state must be plain values "
                         f"(tensors, numbers, strings, lists, tuples, dicts) so that load reads them "
                         f"with torch.load(weights_only=True): {reason}") from None
    return buffer.getvalue()


class SaveJob(NamedTuple):
    path: str
    tmp: str
    rank: int
    per_rank: list     # every rank's [(key, shape, dtype, offsets, lengths)]
    writes: list       # every rank's indexes into its items: what it writes
    mine: list         # [Item] this rank writes
    step: int
    extra: bytes       # rank 0: extra.pt (step, data order, schedule, hyperparameters, RNGs)


def prepare(path, model, optimizer=None, *, step=0, data_state=None, rng=True, scheduler=None, copy=False):
    """The blocking part of a save (every rank, collective on the default group): list the
    boxes, plan who writes what, snapshot them (``copy``: to host memory, so training may go
    on while they are written), make ``path.partial``."""
    path = os.path.abspath(os.fspath(path))
    rank, _ = _world()
    if os.path.exists(path):
        raise ValueError(f"checkpoint: {path} exists already: save each checkpoint under a new name")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in getattr(optimizer, "param_groups", [])]
    extra = {"step": step, "data_state": data_state, "param_groups": groups,
             "scheduler": scheduler.state_dict() if scheduler is not None else None}
    extra_bytes(extra)                       # every rank: plain values, or the same error everywhere
    items = local_items(model, optimizer)
    gathered = _all_gather(([tuple(i[:5]) for i in items], rng_state() if rng else None))
    per_rank = [boxes for boxes, _ in gathered]
    writes = assign_writers(per_rank)
    mine = [items[j] for j in writes[rank]]
    if copy:
        mine = [i._replace(view=i.view.detach().to("cpu", copy=True)) for i in mine]
    data = b""
    if rank == 0:
        extra["rng"] = [state for _, state in gathered] if rng else None   # one per rank, in rank order
        data = extra_bytes(extra)
        shutil.rmtree(path + ".partial", ignore_errors=True)       # a save killed earlier
        os.makedirs(path + ".partial")
    if _world()[1] > 1:
        dist.barrier()                                              # the directory exists
    return SaveJob(path, path + ".partial", rank, per_rank, writes, mine, step, data)


def _fsync_write(file, chunks):
    with open(file, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path):
    """Make a directory's entries (the names of the files in it, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        _fsync_write(os.path.join(job.tmp, EXTRA), [job.extra])
        meta = {"format": FORMAT, "version": VERSION, "world_size": len(every), "step": job.step,
                "extra": {"file": EXTRA, "crc32": zlib.crc32(job.extra)}, "tensors": tensors}
        _fsync_write(os.path.join(job.tmp, METADATA), [json.dumps(meta, indent=1).encode()])
        _fsync_dir(job.tmp)                                  # every file's name in .partial is on disk
        os.rename(job.tmp, job.path)                         # the publish: atomic on local POSIX
        _fsync_dir(os.path.dirname(job.path))                # the rename itself reaches the disk
    if _world(group)[1] > 1:
        dist.barrier(group=group)                            # nobody returns before it is published
    return offset


def save(path, model, optimizer=None, *, step=0, data_state=None, rng=True, scheduler=None) -> int:
    """Save ``model`` (any course layout) and ``optimizer`` to directory ``path``; call on
    every rank. Each rank writes only the boxes it holds, a replicated box once (the lowest
    rank holding it). Returns the bytes this rank wrote."""
    job = prepare(path, model, optimizer, step=step, data_state=data_state, rng=rng, scheduler=scheduler)
    return write_and_publish(job)
