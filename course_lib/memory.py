"""What each rank holds, by category, measured.

Bytes are counted on **storages**, each once: a tied weight, a gradient that is a view of
a communication bucket, or an optimizer slice that is a view of a parameter are not
counted twice.

    held = model_state_bytes(model, optimizer)      # {'parameters', 'gradients', 'optimizer_state'}
    report = measure(step, model, optimizer)        # run step() once under a MemoryTracker
    report.peak, report.temporaries                 # high-water mark; communication buffers

:class:`MemoryTracker` is a ``TorchDispatchMode``: it sees every tensor a torch op creates
(on any device, CPU included), follows its storage until it is freed, and marks the
storages handed to a collective (``c10d`` ops): all-gather outputs, bucket and gradient
buffers. On CUDA, ``torch.cuda.max_memory_allocated`` is reported next to it as a check.

A storage is freed when its last reference goes, and that reference is not always the
program's: gloo's worker threads hold a collective's tensors until they have finished with
the work, a few microseconds after ``wait()`` has returned. When the program drops a buffer
in that window, the free happens on the transport's thread a little later, so a peak can move
by the size of such a buffer from one run to the next (a few KiB in chapter 9's tiny runs).
Frees from other threads are queued and applied by the tracker's own thread at its next
event (never a race on the counters).
"""
from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CATEGORIES = ("parameters", "gradients", "optimizer_state")


def _storage(t):
    t = getattr(t, "_local_tensor", t)  # a DTensor (torch's fully_shard) holds a local shard
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return None
    return t.untyped_storage()


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and aliases count once)."""
    seen = {}
    for t in tensors:
        st = _storage(t)
        if st is not None:
            seen[(st.device, st.data_ptr())] = st.nbytes()
        elif isinstance(t, torch.Tensor) and t.is_meta:   # (the dry run) no address: the storage itself
            st = t.untyped_storage()
            seen[("meta", st._cdata)] = st.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer):
    """Every tensor in an optimizer's per-parameter state (moments, step counters...)."""
    if optimizer is None:
        return []
    return [t for state in optimizer.state.values() for t in tree_leaves(state) if isinstance(t, torch.Tensor)]


def _model_state_tensors(module, optimizer):
    params = list(module.parameters())
    if optimizer is not None:  # ZeRO's slices are views of the parameters: counted once
        params += [p for g in optimizer.param_groups for p in g["params"]]
        params += [p for g in getattr(getattr(optimizer, "local", None), "param_groups", []) for p in g["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    return {"parameters": params, "gradients": grads, "optimizer_state": optimizer_tensors(optimizer)}


def model_state_bytes(module, optimizer=None) -> dict:
    """Bytes of parameters, gradients and optimizer state this rank holds (the ZeRO paper's
    "model states"); each storage is counted once, in the first category that has it."""
    out, seen = {}, set()
    for category, tensors in _model_state_tensors(module, optimizer).items():
        total = 0
        for t in tensors:
            st = _storage(t)
            if st is None or (st.device, st.data_ptr()) in seen:
                continue
            seen.add((st.device, st.data_ptr()))
            total += st.nbytes()
        out[category] = total
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out


class MemoryTracker(TorchDispatchMode):
    """Follow the storages created while active: live bytes, their peak, and which were
    communication buffers. ``track(tensors)`` adds storages that existed before."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.events = []     # (storage serial, +bytes when created / -bytes when freed)
        self.comm = set()    # serials of storages handed to a collective
        self._alive = {}     # id(storage) -> (serial, bytes), for the live ones
        self._finalizers = []
        self._owner = threading.get_ident()
        self._foreign = collections.deque()   # storages freed on another thread, not yet applied

    def track(self, tensors):
        for t in tensors:
            self._see(t)

    def serial(self, t):
        """The tracker's name for ``t``'s storage (None if it never saw it)."""
        self._apply_foreign()
        st = _storage(t)
        return None if st is None else self._alive.get(id(st), (None,))[0]

    def _see(self, t):
        self._apply_foreign()
        st = _storage(t)
        if st is None or id(st) in self._alive or st.nbytes() == 0:
            return
        serial, n = len(self.events), st.nbytes()
        self._alive[id(st)] = (serial, n)
        self.events.append((serial, n))
        self.live += n
        self.peak = max(self.peak, self.live)
        self._finalizers.append(weakref.finalize(st, self._freed, id(st)))

    def _freed(self, key):
        if threading.get_ident() != self._owner:  # a transport thread dropped the last reference
            self._foreign.append(key)               # deque.append is atomic
            return
        self._apply_foreign()
        self._drop(key)

    def _apply_foreign(self):
        while self._foreign:
            self._drop(self._foreign.popleft())

    def _drop(self, key):
        serial, n = self._alive.pop(key, (None, 0))
        if serial is not None:
            self.events.append((serial, -n))
            self.live -= n

    def __exit__(self, *exc):
        self._apply_foreign()
        for f in self._finalizers:  # storages that outlive the measurement: stop following them
            f.detach()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._apply_foreign()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t)
        if func.namespace == "c10d":  # all-gather outputs, reduce-scatter inputs, buckets
            for t in tree_leaves((args, kwargs)):
                st = _storage(t) if isinstance(t, torch.Tensor) else None
                if st is not None:
                    self._see(t)
                    if id(st) in self._alive:
                        self.comm.add(self._alive[id(st)][0])
        return out

    def peak_of(self, serials) -> int:
        """High-water mark of the live bytes of the storages ``serials`` (replaying the events)."""
        live = peak = 0
        for key, n in self.events:
            if key in serials:
                live += n
                peak = max(peak, live)
        return peak


@dataclass
class MemoryReport:
    """One rank's bytes after a step (model states) and during it (temporaries, peak)."""

    parameters: int
    gradients: int
    optimizer_state: int
    temporaries: int   # peak of communication buffers that do not outlive the step
    peak: int          # high-water mark of everything the tracker followed (activations too)
    cuda_peak: int | None = None

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def measure(step, module, optimizer=None) -> MemoryReport:
    """Run ``step()`` once under a :class:`MemoryTracker` and report this rank's bytes.

    The model states are counted after the step (gradients still held: measure before
    ``zero_grad``); the peak starts from the storages alive before it.
    """
    cuda = any(p.is_cuda for p in module.parameters())
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tracker = MemoryTracker()
    before = _model_state_tensors(module, optimizer)
    tracker.track([*before["parameters"], *before["gradients"], *before["optimizer_state"],
                   *module.buffers()])
    with tracker:
        step()
        held = model_state_bytes(module, optimizer)
        after = _model_state_tensors(module, optimizer)
        persistent = {tracker.serial(t) for ts in after.values() for t in ts}
    temporaries = tracker.peak_of(tracker.comm - persistent)
    return MemoryReport(held["parameters"], held["gradients"], held["optimizer_state"], temporaries,
                        tracker.peak, torch.cuda.max_memory_allocated() if cuda else None)


__all__ = ["storage_bytes", "optimizer_tensors", "model_state_bytes", "MemoryTracker", "MemoryReport",
           "measure", "CATEGORIES"]
