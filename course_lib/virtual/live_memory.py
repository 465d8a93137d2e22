"""What a rank's program holds between two moments the dry run counts: every tensor it allocates.

The dry run counts memory at moments (:class:`~course_lib.virtual.dry_run.MemoryProbe`: the
model states as they are, plus what autograd saved for backward), after each forward and
each backward. Between two moments the program also holds tensors that are neither: the
logits' gradient the loss's backward makes, FSDP's gathered parameters, the layer a full
recompute runs again, a gradient on its way into ``.grad``, a bucket being reduced, the
optimizer's temporaries. A GPU holds them all at once, so they belong in its peak.

:class:`LiveBytes` follows every storage the compute stream's ops create (an op's return
that aliases none of its inputs: ``func._schema``; views and in-place results are the
storage they came from), at the virtual GPU's bytes per element (the stream's
``sizes``), until Python frees it (a weak reference's callback, as torch's
``torch.distributed._tools.mem_tracker`` follows storages). ``top`` is the most it held
since the last :meth:`~LiveBytes.mark`. The probe turns that into a peak: a moment's count
plus the most the program added after the previous moment (``MemoryProbe.__call__``).
Not followed: an op's own workspace, and what the program allocated before the step
(parameters, masters, moments: the probe counts them).
"""
from __future__ import annotations

import contextlib
import threading
import weakref

import torch

_FRESH: dict = {}       # OpOverload -> indices of the returns that are new storages


def fresh_returns(func) -> tuple:
    """The positions of ``func``'s returns that alias none of its inputs (tensors or lists of them)."""
    got = _FRESH.get(func)
    if got is None:
        schema = getattr(func, "_schema", None)
        # (c10d's in-place collectives return the tensors they were handed, unannotated: a
        # bucket all-reduced is not a new one)
        got = () if schema is None or getattr(func, "namespace", "") == "c10d" else tuple(
            i for i, r in enumerate(schema.returns)
            if r.alias_info is None and "Tensor" in str(r.type))
        _FRESH[func] = got
    return got


class LiveBytes:
    """Bytes of the storages a rank's ops created and Python still holds (``now``), and the most
    since the last :meth:`mark` (``top``). Frees may come from another thread (a dry run's ranks
    are threads and hand tensors on): the counts change under a lock."""

    def __init__(self, sizes):
        self.sizes = sizes                  # dtype -> bytes per element on the virtual GPU
        self.now = self.top = self.marked = 0
        self.late = 0                       # bytes another thread let go of (see _free)
        self._thread = threading.get_ident()
        self._refs = {}                     # id(storage) -> its weak reference
        self._lock = threading.Lock()

    def mark(self) -> int:
        """Start a new interval: ``top`` from ``now``; returns ``now``."""
        with self._lock:
            self.top = self.marked = self.now
            return self.now

    def rise(self) -> int:
        """The most held since the last :meth:`mark` above what was held then."""
        return self.top - self.marked

    def note(self, func, out) -> None:
        """Follow the new storages among ``func``'s results ``out``."""
        fresh = fresh_returns(func)
        if not fresh:
            return
        outs = out if isinstance(out, (tuple, list)) and len(func._schema.returns) > 1 else (out,)
        for i in fresh:
            if i >= len(outs):
                continue
            item = outs[i]
            for t in (item if isinstance(item, (tuple, list)) else (item,)):
                if isinstance(t, torch.Tensor):
                    self.follow(t)

    def follow(self, t: torch.Tensor) -> None:
        """Follow ``t``'s storage (once): a tensor the program holds that no followed op made
        (one made while the clock was muted, handed to the program as an op's result)."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):     # (a tensor without storage)
            return
        key = id(st)
        if key in self._refs:
            return
        n = st.nbytes() // t.element_size() * self.sizes[t.dtype] if t.element_size() else 0
        if not n:
            return
        self._refs[key] = weakref.ref(st, lambda _r, key=key, n=n: self._free(key, n))
        with self._lock:
            self.now += n
            if self.now > self.top:
                self.top = self.now

    def _free(self, key: int, n: int) -> None:
        with self._lock:
            self.now -= n
            if threading.get_ident() != self._thread:
                # a backend's thread held it last (gloo's work releases a collective's tensors
                # when it finishes, on its own thread): when it went depends on that thread's
                # timing, so a real launch's peak is certain only to within these bytes
                self.late += n
        self._refs.pop(key, None)


@contextlib.contextmanager
def unfollowed(stream):
    """Tensors made inside are the tool's, not the program's (a replay's meta templates): not followed."""
    live = getattr(stream, "live", None)
    if live is not None:
        stream.live = None
    try:
        yield
    finally:
        if live is not None:
            stream.live = live
