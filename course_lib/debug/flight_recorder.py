"""The flight recorder: every rank's last N communication calls, readable after a hang.

Every call through :class:`course_lib.collectives.Comm` (every mesh dimension's collectives
and point-to-point messages) writes one :class:`Record` into a ring of N fixed-size slots,
*before* it runs: per-group sequence number (``#17`` = the 17th collective on that group;
a message's number counts the messages between the same two ranks, direction and tag),
op, group (mesh dimension and global ranks), shapes, dtypes, the innermost span, the call
site (the first frame outside the communication layer) and a state: issued, waiting (the
caller blocks on it), enqueued, completed.

Under NCCL the CPU call returns when the kernel is *enqueued* on the GPU, not when it has
run: a CPU-side "completed" would put the records many calls ahead of the kernel that is
stuck. So under ``launch(backend="nccl")`` a call on CUDA tensors is marked enqueued when the
CPU returns, a CUDA event is recorded behind it on the current stream (NCCL makes that
stream wait for the collective), and a watchdog thread marks it completed when the event
has fired -- what PyTorch's recorder does with its scheduled / started / completed states.

The ring is a file mapped in memory (like the launcher's status file): writing a record is
a copy, not a system call, and the launcher reads every rank's ring after a timeout or a
death **without the rank's help** -- a rank stuck inside gloo's C++ wait cannot run a
Python signal handler, and a killed rank cannot answer at all. This is the idea of
PyTorch's NCCL flight recorder (``TORCH_FR_BUFFER_SIZE``, formerly
``TORCH_NCCL_TRACE_BUFFER_SIZE``), which with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` dumps each
rank's ring to a file named by ``TORCH_FR_DUMP_TEMP_FILE`` (formerly
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``) and the rank, merged offline by ``torchfrtrace``
(``torch.distributed.flight_recorder.fr_trace``); here the merge
(:mod:`course_lib.debug.diagnosis`) runs in the launcher.

One recorder per rank process (``install``), like the process group itself; outside a
launch no recorder is installed and the hooks cost one attribute read.
"""
from __future__ import annotations

import mmap
import os
import struct
import sys
import threading
import time
import weakref
from dataclasses import dataclass

from course_lib import trace

SLOTS = 256                      # default N: the last 256 calls of each rank
SLOT_BYTES = 384                 # one record: the slot's head (below), then the text
_HEADER = struct.Struct("<8sQQ")  # magic, calls recorded so far, slots
_HEADER_BYTES, _COUNT = _HEADER.size, struct.Struct("<Q")   # (the count alone, at byte 8)
_SLOT = struct.Struct("<cHQQ")    # a slot's head: state, text length, index, sequence number
_TEXT_BYTES = SLOT_BYTES - _SLOT.size
_MAGIC = b"CLFLIGHT"
STATES = {b"i": "issued", b"w": "waiting", b"q": "enqueued", b"c": "completed"}
_WAITING, _COMPLETED = b"w"[0], b"c"[0]
WATCH_S = 0.05                   # how often the watchdog polls the CUDA events of enqueued calls
_SEP = "\x1f"
_MEMO_MAX = 4096                 # remembered texts (call sites, a call's fields) before starting afresh
# frames of the communication layer itself are not a call site
_HERE = os.path.dirname(os.path.abspath(__file__))
_LAYER = (_HERE, os.path.join(os.path.dirname(_HERE), "collectives"))
SHORT = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "all_to_all_single": "all_to_all"}


_DTYPES = {}


def _dtype(dtype) -> str:
    _DTYPES[dtype] = str(dtype).removeprefix("torch.")
    return _DTYPES[dtype]


def check_slots(slots):
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"flight_recorder must be None (off) or a number of calls to keep >= 1, got {slots!r}")
    return slots


@dataclass(frozen=True)
class Record:
    """One call as a rank recorded it. ``ranks``: the group's global ranks; ``peer``: the
    other end's global rank (point-to-point) or None."""
    rank: int
    index: int          # this rank's n-th call (1-based), any group
    seq: int            # the n-th call on this group (collectives) / between these two ranks (p2p)
    op: str
    dim: str
    ranks: tuple
    shapes: tuple       # one tuple per tensor argument
    dtypes: tuple
    peer: int | None
    tag: int
    extra: str          # reduce op, broadcast root
    span: str
    site: str
    state: str

    @property
    def group(self) -> str:
        return f"{self.dim or 'group'} {list(self.ranks)}"

    @property
    def p2p(self) -> bool:
        return self.op in ("send", "recv")

    @property
    def name(self) -> str:
        """``all_gather #17 on dp [0, 1, 2, 3]``, ``send #2 to rank 1``."""
        if self.p2p:
            return f"{self.op} #{self.seq} {'to' if self.op == 'send' else 'from'} rank {self.peer}"
        return f"{SHORT.get(self.op, self.op)} #{self.seq} on {self.group}"

    def fingerprint(self) -> tuple:
        """What every member of a collective must agree on (all-to-all: sizes along dim 0 may differ)."""
        return (self.op, comparable_shapes(self.op, self.shapes), self.dtypes, self.extra)


def comparable_shapes(op, shapes):
    """The part of the shapes that must be equal on every member: all of it, except the split
    dimension of an all-to-all (uneven splits are legal there)."""
    if op == "all_to_all_single":
        return tuple(s[1:] for s in shapes)
    return shapes


def shape_text(shapes) -> str:
    return ", ".join(str(tuple(s)) if len(s) != 1 else f"({s[0]},)" for s in shapes) or "()"


_SITES: dict = {}   # id(code object) -> (that code object, line, its call-site text)


def call_site(depth: int = 2) -> str:
    """``function (file:line)`` of the first frame outside the communication layer, looking
    from ``depth`` frames up (2: the caller's caller).

    A ring asks for every message, so this stays cheap: ``sys._getframe(depth)`` skips the
    frames below without making Python objects of them (Python >= 3.11 makes a frame object
    only when asked for one), and the text of the last site seen in each function is kept
    (by the code object's id, the object itself kept with it so that the id stays its own:
    hashing a code object hashes all its constants, nested functions included)."""
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(_LAYER):
        f = f.f_back
    if f is None:
        return ""
    code, line = f.f_code, f.f_lineno
    known = _SITES.get(id(code))
    if known is not None and known[0] is code and known[1] == line:
        return known[2]
    if len(_SITES) > _MEMO_MAX:
        _SITES.clear()
    site = f"{code.co_name} ({os.path.basename(code.co_filename)}:{line})"
    _SITES[id(code)] = (code, line, site)
    return site


class Entry:
    """A recorded call: its slot, updated in place as the call waits and completes.
    ``gpu``: the CUDA device whose event completes it (NCCL on CUDA tensors), or None: it
    completes when the CPU call returns."""
    __slots__ = ("_fr", "index", "_offset", "gpu")

    def __init__(self, fr, index, offset, gpu=None):
        self._fr, self.index, self._offset, self.gpu = fr, index, offset, gpu

    def _set(self, state: bytes):
        fr = self._fr
        if fr._mm is not None and fr.index - self.index < fr.slots:  # not overwritten by a later call
            fr._mm[self._offset] = state[0]

    def waiting(self):
        self._set(b"w")

    def complete(self):
        if self.gpu is not None:
            self._fr.enqueued(self)   # the CPU is done; the GPU may not be
        else:
            self._set(b"c")


def _cuda_event(device: int):
    """A CUDA event recorded now on ``device``'s current stream: it fires when every kernel
    enqueued on that stream before it, the collective's wait included, has run. (A handle's
    completion callback may run on another thread, whose current device is not the rank's.)"""
    import torch
    with torch.cuda.device(device):
        event = torch.cuda.Event()
        event.record()
    return event


class FlightRecorder:
    """This rank's ring of the last ``slots`` calls, in the file ``path`` (or anonymous memory).
    ``cuda_events``: calls on CUDA tensors complete when their CUDA event fires (NCCL)."""

    def __init__(self, path: str | None, rank: int, slots: int = SLOTS, cuda_events: bool = False):
        self.rank, self.slots, self.path = rank, check_slots(slots), path
        self.cuda_events, self._pending, self._watchdog = cuda_events, [], None
        size = _HEADER.size + slots * SLOT_BYTES
        if path is None:
            self._mm = mmap.mmap(-1, size)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        self.index, self._seq, self._groups, self._lock = 0, {}, {}, threading.Lock()
        self._texts = {}   # a call's fields -> (its sequence counter, encoded text): see record()
        self._posters = {}   # (op, dim, ranks, peer, tag, cpu_only) -> make(...): see p2p_poster()
        self._mm[:_HEADER.size] = _HEADER.pack(_MAGIC, 0, slots)

    def record(self, op, dim, ranks, tensors, peer=None, tag=0, extra="", span="", site="",
               state=b"i", gpu=None) -> Entry:
        fields = (op, dim, ranks, tuple([t.shape for t in tensors]), tuple([t.dtype for t in tensors]),
                  peer, tag, extra, span, site)
        return Entry(self, *self._write(fields, state), gpu)

    def _write(self, fields, state):
        """Write one record: ``fields`` as record() takes them, shapes and dtypes as tuples.
        Returns (its index, its slot's offset)."""
        # The text holds the fields that a ring's messages share (op, group, shapes, ..., call
        # site): encoded once and remembered, so a message costs one look-up and two copies into
        # the ring (numbers packed, not formatted), not a dozen str() calls.
        count, text = self._texts.get(fields) or self._remember(fields)
        return self._put(count, text, state)

    def _put(self, count, text, state):
        """Copy an encoded record into the next slot: (its index, its slot's offset)."""
        with self._lock:
            index = self.index = self.index + 1
            seq = count[0] = count[0] + 1
            offset = _HEADER_BYTES + ((index - 1) % self.slots) * SLOT_BYTES
            mm = self._mm   # the text, then the head (its index makes the slot valid), then the count
            mm[offset + _SLOT.size:offset + _SLOT.size + len(text)] = text
            _SLOT.pack_into(mm, offset, state, len(text), index, seq)
            _COUNT.pack_into(mm, 8, index)
            return index, offset

    def _remember(self, fields):
        """A call's fields -> ([calls so far with its sequence key], its encoded text). A
        sequence number counts per group (collectives) or per direction, pair of ranks and tag
        (messages): calls that differ in shape or call site share one counter."""
        op, dim, ranks, shapes, dtypes, peer, tag, extra, span, site = fields
        key = (dim, ranks, op, peer, tag) if peer is not None else (dim, ranks)
        count = self._seq.get(key) or self._seq.setdefault(key, [0])
        group = self._groups.get(ranks) or self._groups.setdefault(ranks, ",".join(map(str, ranks)))
        tail = _SEP.join((op, dim, group, ";".join(["x".join(map(str, s)) for s in shapes]),
                          ";".join([_DTYPES.get(d) or _dtype(d) for d in dtypes]), "" if peer is None else str(peer),
                          str(tag), extra, span, site)).encode("utf-8", "replace")[:_TEXT_BYTES]
        if len(self._texts) > _MEMO_MAX:
            self._texts.clear()
        self._texts[fields] = known = (count, tail)
        return known

    def poster_maker(self, op, dim, ranks, peer, tag, cpu_only):
        """The maker of :func:`p2p_poster`'s posts for one kind of message, kept."""
        if len(self._posters) > _MEMO_MAX:
            self._posters.clear()
        make = self._posters[op, dim, ranks, peer, tag, cpu_only] = _poster_maker(
            self, op, dim, ranks, peer, tag, cpu_only)
        return make

    def enqueued(self, entry: Entry):
        """The CPU call returned: mark it enqueued until its CUDA event fires."""
        event = _cuda_event(entry.gpu)
        entry._set(b"q")
        with self._lock:
            self._pending.append((entry, event))
            if self._watchdog is None:   # it queries the events on this rank's GPU
                self._watchdog = threading.Thread(target=self._watch, args=(entry.gpu,), daemon=True,
                                                  name=f"flight-recorder-{self.rank}")
                self._watchdog.start()

    def poll(self) -> int:
        """Mark completed the enqueued calls whose event has fired; returns how many still run."""
        with self._lock:
            pending, self._pending = self._pending, []
        running = []
        for entry, event in pending:
            if event.query():
                entry._set(b"c")
            else:
                running.append((entry, event))
        with self._lock:
            self._pending[:0] = running   # (in call order, before any added meanwhile)
            return len(self._pending)

    def _watch(self, device):
        import torch
        if torch.cuda.is_available():
            torch.cuda.set_device(device)
        try:
            while self._mm is not None:
                self.poll()
                time.sleep(WATCH_S)
        except ValueError:   # the ring was closed under it: the rank is done
            pass

    def records(self) -> list:
        return parse(bytes(self._mm), self.rank)

    def close(self):
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def parse(data: bytes, rank: int) -> list:
    """The records in a ring's bytes, oldest first (a slot being written is skipped)."""
    if len(data) < _HEADER.size:
        return []
    magic, count, slots = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        return []
    out = []
    for index in range(max(1, count - slots + 1), count + 1):
        offset = _HEADER.size + ((index - 1) % slots) * SLOT_BYTES
        if len(data) < offset + SLOT_BYTES:
            break
        code, length, i, seq = _SLOT.unpack_from(data, offset)
        state = STATES.get(code)
        fields = data[offset + _SLOT.size:offset + _SLOT.size + length].decode("utf-8", "replace").split(_SEP)
        if state is None or len(fields) != 10 or i != index:
            continue
        op, dim, ranks, shapes, dtypes, peer, tag, extra, span, site = fields
        out.append(Record(rank, i, seq, op, dim, tuple(int(r) for r in ranks.split(",") if r),
                          tuple(tuple(int(n) for n in s.split("x") if n) for s in shapes.split(";")) if shapes else (),
                          tuple(dtypes.split(";")) if dtypes else (), int(peer) if peer else None, int(tag),
                          extra, span, site, state))
    return out


def read(path: str, rank: int) -> list:
    """A rank's records from its ring file ([] if it never made one)."""
    try:
        with open(path, "rb") as f:
            return parse(f.read(), rank)
    except OSError:
        return []


# ----------------------------------------------------------------------------- this process's recorder

_recorder: FlightRecorder | None = None
_desync = False


def install(recorder: FlightRecorder | None, desync: bool = False):
    """Make ``recorder`` this process's flight recorder (the launcher does, in each rank)."""
    global _recorder, _desync
    _recorder, _desync = recorder, desync
    return recorder


def recorder() -> FlightRecorder | None:
    return _recorder


def _span() -> str:
    open_spans = trace.recorder()._open   # the innermost open span (what the status file shows)
    return open_spans[-1] if open_spans else ""


_REDUCE_OPS = {}


def _extra(op, kwargs, comm) -> str:
    """The reduce op's name (SUM, AVG, ...) or the broadcast root."""
    if "op" in kwargs:
        red = kwargs["op"]
        try:
            return _REDUCE_OPS[red]
        except (KeyError, TypeError):
            name = getattr(red, "name", None) or str(red)
            try:
                _REDUCE_OPS[red] = name
            except TypeError:
                pass
            return name
    if "src" in kwargs:
        return f"src {kwargs['src']}"
    return ""


def collective(comm, op, args, kwargs, async_op):
    """Hook of ``Comm._call``: record the call (and run the desync check); None when off."""
    if _recorder is None and not _desync:
        return None
    tensors = [a for a in args if hasattr(a, "shape")]
    extra, site = _extra(op, kwargs, comm), call_site()
    entry = None
    if _recorder is not None:
        entry = _recorder.record(op, comm.dim, tuple(comm.ranks), tensors, extra=extra, span=_span(),
                                 site=site, state=b"i" if async_op else b"w", gpu=_on_gpu(tensors))
    if _desync and comm.size > 1:
        from course_lib.debug import desync
        desync.check(comm, op, tensors, extra, site, entry)
    return entry


def _on_gpu(tensors):
    """The CUDA device whose event completes this call (NCCL launch, CUDA tensors), or None:
    it completes when the CPU call returns."""
    if _recorder.cuda_events:
        for t in tensors:
            if getattr(t, "is_cuda", False):
                return t.device.index
    return None


def completed(entry, result):
    """After ``Comm._call``: a blocking call is done; an async one completes with its handle."""
    if entry is None:
        return result
    if result is None:
        entry.complete()
        return None
    result._entry = entry
    if result.is_completed():
        entry.complete()
    return result


def p2p(comm, op, tensor, peer, tag, work, shape=None, dtype=None):
    """Hook of ``Comm._message`` (every isend / irecv): the work handle, tracked (waiting /
    completed); ``shape``, ``dtype``: the tensor's, when the caller has read them already.

    It runs for every message (a ring posts 2(N-1) a call, between copies of megabytes that
    leave every cache cold), so it does little: the call site is looked for from the caller
    of ``Comm.isend`` (or irecv, post_send, post_recv) up, 4 frames above call_site (the
    Comm's own frames skipped without being made), and a Comm that an algorithm of
    course_lib.collectives built for one call (``comm.one_call``) keeps the site of its first
    message, its caller's, for all the others."""
    rec = _recorder
    if rec is None:
        return work
    site = getattr(comm, "_site", None)
    if site is None:
        site = call_site(4)
        if getattr(comm, "one_call", False):
            comm._site = site
    spans = trace.recorder()._open   # (_span() and _on_gpu() inline)
    fields = (op, comm.dim, tuple(comm.ranks), (tensor.shape if shape is None else shape,),
              (tensor.dtype if dtype is None else dtype,), comm.ranks[peer], tag, "", spans[-1] if spans else "", site)
    return TrackedWork(work, rec, *rec._write(fields, b"i"),
                       tensor.device.index if rec.cuda_events and tensor.is_cuda else None)


def p2p_poster(comm, op, peer, tag):
    """What :func:`p2p` does for every message of one kind (``op``, ``peer``, ``tag``) that an
    algorithm posts in one call (``Comm.poster``), with what they share looked up once, not
    once a message: ``post(tensor)`` posts a message straight to the process group's send or
    recv and records it, in one Python frame (a ring posts 2(N-1) messages a call at least,
    between copies that leave the caches cold: each frame costs). An empty tensor, a complex
    one or, on gloo, one off the CPU goes through ``comm.post_slow``, the Comm's own path
    (which skips, views as real or refuses it). None when no recorder is on.

    The call site and the innermost span are read when the algorithm asks for ``post``
    (before its first message; nothing opens a span between them). The posts themselves are
    kept by the recorder from one call to the next (:meth:`FlightRecorder.poster_maker`), one
    per call site and span, keyed by the group's ranks: they hold this call's process group
    and Comm only weakly, so a group that is destroyed, or a Comm, is freed as if never
    posted to. Each message still gets its own record, index and sequence number, states
    waiting and completed: the records are those :func:`p2p` writes."""
    rec = _recorder
    if rec is None:
        return None
    site = comm._site
    if site is None:
        site = call_site(2)   # the layer's own frames are skipped: the algorithm's caller
        if comm.one_call:
            comm._site = site
    spans = trace.recorder()._open
    key = (op, comm.dim, tuple(comm.ranks), peer, tag, comm._p2p_cpu_only)
    make = rec._posters.get(key) or rec.poster_maker(*key)
    return make(site, spans[-1] if spans else "", comm)


def _poster_maker(rec, op, dim, ranks, peer, tag, cpu_only):
    """``make(site, span, comm) -> post``: the recorded posts of one kind of message (see
    :func:`p2p_poster`), one per call site and span, each with the encoded text of its shapes."""
    head, global_peer = (op, dim, ranks), ranks[peer]
    posts = {}          # (site, span) -> post
    now = [None] * 3    # this call's process group and Comm (weak references), the group's send / recv
    cuda, lock, slots, new = rec.cuda_events, rec._lock, rec.slots, object.__new__
    pack_slot, pack_count, text_at = _SLOT.pack_into, _COUNT.pack_into, _SLOT.size

    def make(site, span, comm):
        pg = comm._pg
        now[0], now[1], now[2] = weakref.ref(pg), weakref.ref(comm), getattr(type(pg), op)
        post = posts.get((site, span))
        if post is None:
            if len(posts) > _MEMO_MAX:
                posts.clear()
            post = posts[site, span] = _post(site, span)
        return post

    def _post(site, span):
        tail, texts = (global_peer, tag, "", span, site), {}   # texts: shape -> (dtype, counter, text, length)

        def post(tensor):
            shape, dtype = tensor.shape, tensor.dtype
            known = texts.get(shape)   # a shape seen before is not empty
            if known is None or known[0] is not dtype or (cpu_only and not tensor.is_cpu):
                if 0 in shape or dtype.is_complex or (cpu_only and not tensor.is_cpu):
                    return now[1]().post_slow(op, tensor, peer, tag)
                fields = head + ((shape,), (dtype,)) + tail
                count, text = rec._texts.get(fields) or rec._remember(fields)
                known = texts[shape] = (dtype, count, text, len(text))
            work = now[2](now[0](), [tensor], peer, tag)   # pg.send([tensor], peer, tag)
            _, count, text, length = known
            with lock:   # (FlightRecorder._put, inline)
                index = rec.index = rec.index + 1
                seq = count[0] = count[0] + 1
                offset = _HEADER_BYTES + (index - 1) % slots * SLOT_BYTES
                mm = rec._mm   # the text, then the head (its index makes the slot valid), then the count
                mm[offset + text_at:offset + text_at + length] = text
                pack_slot(mm, offset, b"i", length, index, seq)
                pack_count(mm, 8, index)
            tracked = new(TrackedWork)   # (TrackedWork(...) without its __init__'s frame)
            tracked._work, tracked._fr, tracked.index, tracked._offset, tracked.gpu = (
                work, rec, index, offset, tensor.device.index if cuda and tensor.is_cuda else None)
            return tracked
        return post
    return make


class TrackedWork(Entry):
    """A point-to-point work handle whose wait marks its record waiting, then completed
    (the record's Entry itself: one object a message)."""
    __slots__ = ("_work",)

    def __init__(self, work, fr, index, offset, gpu=None):
        self._work, self._fr, self.index, self._offset, self.gpu = work, fr, index, offset, gpu

    def wait(self, *args, **kwargs):
        fr = self._fr   # (Entry.waiting and .complete, inline: this runs per message)
        if fr._mm is not None and fr.index - self.index < fr.slots:
            fr._mm[self._offset] = _WAITING
        out = self._work.wait(*args, **kwargs)
        if self.gpu is not None:
            fr.enqueued(self)
        elif fr._mm is not None and fr.index - self.index < fr.slots:
            fr._mm[self._offset] = _COMPLETED
        return out

    def is_completed(self):
        done = self._work.is_completed()
        if done:
            self.complete()
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


__all__ = ["Record", "FlightRecorder", "Entry", "TrackedWork", "SLOTS", "install", "recorder", "read", "p2p_poster",
           "parse", "check_slots", "comparable_shapes", "shape_text", "call_site"]
