"""FSDP's all-gathers: a unit's shards gathered into full parameters before it runs (the next
unit's all-gather started meanwhile: prefetch), freed after it, and gathered again in backward
when autograd needs a parameter it saved (``saved_tensors_hooks`` keep a token instead)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from course_lib import trace
from course_lib.parallel.zeropp import quantized_all_gather


class _FreedParam(NamedTuple):
    """What autograd keeps instead of a saved view of freed, gathered parameters."""
    unit: int
    offset: int
    size: tuple
    stride: tuple


class FSDPGathering:
    """Prefetch, gather and free a unit's parameters; the tokens autograd keeps for them.

    A part of :class:`~course_lib.parallel.fsdp.FSDP`: its methods read the state FSDP's ``__init__`` builds."""

    def _prefetch(self, u, phase, order):
        """The explicit list set for u in this phase, else (prefetch=True) the next in ``order``."""
        explicit = self._explicit[phase].get(u.index)
        if explicit is None:
            if self.prefetch:
                self._prefetch_after(u, order)
            return
        for j in explicit:
            nxt = self.units[j]
            if nxt.full is None and nxt.gather is None and not (nxt.reduced or nxt is u):
                self._start_gather(nxt)

    def _prefetch_after(self, u, order):
        k = order.index(u.index) + 1 if u.index in order else len(order)
        for j in order[k:]:
            nxt = self.units[j]
            if nxt.full is None and nxt.gather is None and not (nxt.reduced or nxt is u):
                self._start_gather(nxt)
                return

    # ------------------------------------------------------------------ gather / free
    def _start_gather(self, u):
        """Launch one all-gather of all of u's shards (in u's group): (S,) per rank -> (N * S,); after a
        reshard to k ranks, of the (N * S / k,) parts inside this rank's block of k."""
        comm, send = (u.comm, u.flat_shard.to(self.compute_dtype)) if u.post is None \
            else (self.reshard_group, u.post)  # a copy only when casting
        gathered = send.new_empty(u.world * u.numel)
        if "qwz" in self.zeropp and u.post is None:   # qwZ: int8 blocks from the primary shards
            work = quantized_all_gather(comm, gathered, send, name=f"all-gather {u.name}")
        else:
            work = comm.all_gather_into_tensor(gathered, send, async_op=True, name=f"all-gather {u.name}")
        u.gather, u.post = (work, send, gathered), None
        self._note_memory()

    def _unshard(self, u):
        """Wait for u's all-gather (start it if nobody did) and copy it out to full parameters."""
        if u.full is not None:
            return
        if u.gather is None:
            self._start_gather(u)
        work, _, gathered = u.gather
        work.wait()
        u.gather, u.full = None, u.copy_out(gathered)  # rank after rank -> parameter after parameter
        self._where[_key(u.full)] = u.index
        self._note_memory()

    def _reshard(self, u):
        if u.gather is not None:  # a prefetch nobody used
            u.gather[0].wait()
            u.gather = None
        if u.full is not None:
            self._where.pop(_key(u.full), None)
            u.full = None  # the last reference: the gathered parameters are freed
        u.post = None

    def _saved_tensor_hooks(self):
        """FSDP's (pack, unpack), composed with the pair this forward runs inside, if any (a count
        of the activations saved for backward: the pipeline runner's, the dry run's). torch calls
        only the innermost pair, so FSDP hands that pair every saved tensor that is not a view of
        gathered parameters, and its packed form back to its unpack: the enclosing pair sees
        exactly what it sees around the module without FSDP, parameters excepted. (torch has no
        public getter of the enclosing pair; its AOT autograd reads it the same way.)"""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if outer is None:
            return self._pack, self._unpack
        outer_pack, outer_unpack = outer

        def pack(t):
            token = self._pack(t)
            return token if isinstance(token, _FreedParam) else outer_pack(t)

        def unpack(saved):
            return self._unpack(saved) if isinstance(saved, _FreedParam) else outer_unpack(saved)

        return pack, unpack

    def _pack(self, t):
        """Autograd saves a tensor: a view of gathered parameters becomes a token."""
        unit = self._where.get(_key(t)) if t.numel() else None
        if unit is None:
            return t
        return _FreedParam(unit, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def _unpack(self, saved):
        if not isinstance(saved, _FreedParam):
            return saved
        u = self.units[saved.unit]
        if not u.backward_started:
            u.backward_started, u.t_backward = True, trace.now()
            self._unshard(u)  # backward runs the units in reverse order of their forward end
            self._prefetch(u, "backward", self._post_order[::-1])
        self._unshard(u)
        return u.full.as_strided(saved.size, saved.stride, saved.offset)


def _key(t):
    """The storage ``t`` views. On the meta device every storage's data_ptr is 0 (the dry
    run): there, the storage's own identity."""
    storage = t.untyped_storage()
    return (t.device, storage._cdata if t.is_meta else storage.data_ptr())


__all__ = ["FSDPGathering"]
