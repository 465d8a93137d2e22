"""Load a checkpoint into any layout: each rank reads only the saved boxes that overlap the
boxes it holds (:func:`~course_lib.checkpoint.plan.read_plan`), each of them whole (its CRC-32
covers the whole box) and once, and copies the overlap (DCP also reads whole chunks).

Everything is checked before a byte is copied, on every rank together: the format and its
version, every tensor the model and optimizer need present with the same global shape and
dtype, no saved tensor left over, every file there and long enough. Then each shard's CRC-32
is checked as it is read. A problem is a ValueError naming the file and the tensor.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import zlib

import torch

from course_lib.checkpoint.layout import Part, model_holdings, optimizer_holdings, part_view
from course_lib.checkpoint.plan import local_index, read_plan
from course_lib.checkpoint.store import (EXTRA, FORMAT, METADATA, VERSION, _all_gather, _dtype_name, _refused,
                                         _world, set_rng_state)
from course_lib.parallel.zero import ShardedOptimizer


def read_metadata(path) -> dict:
    """The checkpoint's metadata.json; ValueError if there is none (an unfinished save) or it
    is another format or version."""
    file = os.path.join(os.fspath(path), METADATA)
    if not os.path.isfile(file):
        raise ValueError(f"checkpoint: no {file}: not a complete checkpoint (a save that did not finish "
                         f"leaves only a .partial directory without metadata)")
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint: {file} is not readable JSON metadata ({e})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"checkpoint: {file} is format {meta.get('format')!r} version {meta.get('version')!r}; "
                         f"this code reads {FORMAT!r} version {VERSION}")
    return meta


def bytes_per_rank(path) -> dict:
    """{rank: bytes it wrote}, from the metadata."""
    out = {}
    for entry in read_metadata(path)["tensors"].values():
        for s in entry["shards"]:
            out[s["rank"]] = out.get(s["rank"], 0) + s["nbytes"]
    return dict(sorted(out.items()))


def _needs(meta, model, optimizer, problems):
    """[(key, parts, target tensor)] this rank fills, {optimizer key tensor: fresh state}, and
    every key it asked for (found or not)."""
    tensors, needs, fresh, asked = meta["tensors"], [], {}, []

    def check(key, shape, dtype):
        asked.append(key)
        if key not in tensors:
            problems.append(f"the checkpoint has no tensor {key!r}")
            return False
        rec = tensors[key]
        if tuple(rec["shape"]) != tuple(shape) or rec["dtype"] != _dtype_name(dtype):
            problems.append(f"tensor {key!r} is {rec['dtype']} {tuple(rec['shape'])} in the checkpoint, "
                            f"{_dtype_name(dtype)} {tuple(shape)} here")
            return False
        return True

    holdings = model_holdings(model)
    for h in holdings.values():
        if check(f"model.{h.name}", h.shape, h.tensor.dtype):
            needs.append((f"model.{h.name}", h.parts, h.tensor))
    keyed, _ = optimizer_holdings(optimizer, holdings)
    for key_tensor, h in keyed:
        prefix, state = f"optim.state.{h.name}.", {}
        for key in (k for k in tensors if k.startswith(prefix) and "." not in k[len(prefix):]):
            rec = tensors[key]
            scalar = rec["shape"] == []
            value = torch.zeros((), dtype=getattr(torch, rec["dtype"])) if scalar else \
                torch.zeros(key_tensor.shape, dtype=getattr(torch, rec["dtype"]), device=key_tensor.device)
            if check(key, () if scalar else h.shape, value.dtype):
                needs.append((key, [Part((), (), 0)] if scalar else h.parts, value))
                state[key[len(prefix):]] = value
        fresh[key_tensor] = state
    return needs, fresh, asked


def _file_problems(path, meta, needs):
    """Every shard file this rank will read: there, and as long as the metadata says."""
    problems, seen = [], {}
    for key, parts, _ in needs:
        shards = meta["tensors"][key]["shards"]
        for part in parts:
            for i, _ in read_plan(part.offsets, part.lengths, [(s["offsets"], s["lengths"]) for s in shards]):
                s = shards[i]
                file = os.path.join(path, s["file"])
                if file not in seen:
                    seen[file] = os.path.getsize(file) if os.path.isfile(file) else None
                if seen[file] is None:
                    problems.append(f"{file} is missing (it holds tensor {key!r})")
                    seen[file] = -1                         # said once per file
                elif 0 <= seen[file] < s["byte_offset"] + s["nbytes"]:
                    problems.append(f"{file} is truncated: {seen[file]} bytes, but tensor {key!r} ends at byte "
                                    f"{s['byte_offset'] + s['nbytes']}")
    return problems


def _read_shard(path, key, shard, dtype):
    file = os.path.join(path, shard["file"])
    with open(file, "rb") as f:
        f.seek(shard["byte_offset"])
        raw = f.read(shard["nbytes"])
    if len(raw) != shard["nbytes"] or zlib.crc32(raw) != shard["crc32"]:
        raise ValueError(f"checkpoint: {file} is corrupt: the bytes of tensor {key!r} at {shard['byte_offset']} "
                         f"do not match their CRC-32")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(shard["lengths"])


def load(path, model, optimizer=None, *, scheduler=None, rng=True) -> dict:
    """Load checkpoint ``path`` into ``model`` (any layout: call on every rank of it, or on one
    process for a single-device model) and ``optimizer``; restore the schedule and (``rng``)
    the RNG states (each rank its own on the saved world size, else rank 0's). Returns
    {"step", "data_state"} as saved."""
    path = os.path.abspath(os.fspath(path))
    meta, problems = read_metadata(path), []
    needs, fresh, asked = _needs(meta, model, optimizer, problems)
    problems += _file_problems(path, meta, needs)
    everyone = _all_gather((asked, problems))                 # the check is the same on every rank
    wanted = {key for keys, _ in everyone for key in keys}
    model_only = optimizer is None                            # an export: the optimizer state stays behind
    left = sorted(k for k in meta["tensors"] if k not in wanted and not (model_only and k.startswith("optim.")))
    problems = [p for _, ps in everyone for p in ps] + [f"tensor {k!r} of the checkpoint is not in the model or its "
                                                        f"optimizer" for k in left]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(f"checkpoint {path} does not fit this model: " + "; ".join(dict.fromkeys(problems[:5])) + more)
    extra_file = os.path.join(path, EXTRA)
    with open(extra_file, "rb") as f:
        raw = f.read()
    if zlib.crc32(raw) != meta["extra"]["crc32"]:
        raise ValueError(f"checkpoint: {extra_file} is corrupt (CRC-32)")
    try:
        extra = torch.load(io.BytesIO(raw), weights_only=True)   # plain values only: no code runs
    except pickle.UnpicklingError as e:
        raise ValueError(f"checkpoint: {extra_file} holds more than plain values, refused by "
                         f"torch.load(weights_only=True): {_refused(e)}") from None
    with torch.no_grad():
        for key, parts, target in needs:
            rec = meta["tensors"][key]
            dtype, shards, cache = getattr(torch, rec["dtype"]), rec["shards"], {}
            for part in parts:
                dst = part_view(target, part)
                for i, box in read_plan(part.offsets, part.lengths, [(s["offsets"], s["lengths"]) for s in shards]):
                    if i not in cache:
                        cache[i] = _read_shard(path, key, shards[i], dtype)
                    dst[local_index(box, part.offsets)] = cache[i][local_index(box, shards[i]["offsets"])]
    if optimizer is not None:
        _restore_optimizer(optimizer, fresh, extra["param_groups"], path)
    if scheduler is not None and extra["scheduler"] is not None:
        scheduler.load_state_dict(extra["scheduler"])
    if rng and extra["rng"] is not None:
        set_rng_state(_own_rng(extra["rng"]))
    return {"step": extra["step"], "data_state": extra["data_state"]}


def _own_rng(states: list) -> dict:
    """This rank's saved RNG states when the world size is the saved one (a TP run's ranks
    may draw different streams); on another world size no rank has a saved counterpart, and
    every rank takes rank 0's: streams that differ per rank (a TP rank's dropout seed) must
    then be derived again from the seed and the new layout's coordinates."""
    rank, world = _world()
    return states[rank] if world == len(states) else states[0]


def _restore_optimizer(optimizer, fresh, groups, path):
    state = optimizer.local.state if isinstance(optimizer, ShardedOptimizer) else optimizer.state
    for key_tensor, values in fresh.items():
        if values:
            state[key_tensor] = values
        else:
            state.pop(key_tensor, None)            # saved before its first update
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"checkpoint {path}: {len(groups)} optimizer parameter groups saved, "
                         f"{len(optimizer.param_groups)} here")
    inner = optimizer.local.param_groups if isinstance(optimizer, ShardedOptimizer) else [{}] * len(groups)
    for g, i, saved in zip(optimizer.param_groups, inner, groups):
        g.update(saved)                            # lr (the schedule's), betas, weight decay...
        i.update(saved)


__all__ = ["load", "read_metadata", "bytes_per_rank"]
