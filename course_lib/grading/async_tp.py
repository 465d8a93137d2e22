"""Grader of chapter 5's async TP question, on real ranks: a decomposed all-gather matmul.

    check_decomposed_all_gather_matmul(ag_matmul)   # (x_shard, weight, rows) -> all_gather(X) W^T

Prints one line. Expected: the definition, every rank's rows of X (in rank order) times W^T,
float64. The traffic is watched, in order (:class:`RingWatch`): no collective; t - 1 sends of
one chunk each to the next rank and t - 1 receives from the previous one (chunk r - i at step
i); and each receive waited for only after a matmul was issued since it was posted (the
overlap: the chunk in hand multiplies while the next one travels). While the learner's code
runs, the library's async TP and the course's collective algorithms are switched off.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.grading import Case, check_distributed, compare, learner
from course_lib.grading.traffic import POINT_TO_POINT, counted_calls

LIBRARY = ("course_lib.parallel.async_tp:*", "course_lib.collectives.ring:*", "course_lib.collectives.tree:*",
           "course_lib.collectives.naive:*", "course_lib.collectives.pairwise:*")
MATMULS = ("mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "dot", "_addmm_activation")


class _Waited:
    """A message's work handle that notes in the watch's log when it is waited for."""

    def __init__(self, work, log, index):
        self._work, self._log, self._index = work, log, index

    def wait(self, *args, **kwargs):
        self._log.append(("wait", self._index))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class RingWatch(TorchDispatchMode):
    """Inside a rank, around the learner's function: ``events`` in order, ("post", i) when
    message i is posted, ("wait", i) when it is waited for, ("matmul",) when a matmul runs;
    ``messages`` [(op, peer, elements)], ``collectives`` [op names of any other call]."""

    def __enter__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.events, self.messages, self.collectives = [], [], []
        self._saved = {op: getattr(c10d, op) for op in ("isend", "irecv")}
        for op, fn in self._saved.items():
            posted = self._handing_out(op, fn)          # one object in both modules (P2POp compares)
            for module in (dist, c10d):
                setattr(module, op, posted)
        self._count = counted_calls(record=self._record)
        self._count.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        try:
            return super().__exit__(*exc)
        finally:
            self._count.__exit__(*exc)
            for op, fn in self._saved.items():
                for module in (dist, c10d):
                    setattr(module, op, fn)

    def _record(self, op, args, kwargs):
        if op not in POINT_TO_POINT:
            self.collectives.append(op)
            return
        tensor = args[0] if args else kwargs.get("tensor")
        peer = args[1] if len(args) > 1 else kwargs.get("dst", kwargs.get("src"))
        self.messages.append(("send" if "send" in op else "recv", peer, tensor.numel()))
        self.events.append(("post", len(self.messages) - 1))
        if op in ("send", "recv"):                     # blocking: waited for at once
            self.events.append(("wait", len(self.messages) - 1))

    def _handing_out(self, op, fn):
        def posted(*args, **kwargs):
            work = fn(*args, **kwargs)
            return None if work is None else _Waited(work, self.events, len(self.messages) - 1)
        posted.__name__ = fn.__name__
        return posted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATMULS:
            self.events.append(("matmul",))
        return func(*args, **(kwargs or {}))


def _data(seed, rows, h, f):
    """(X (n, h), W (f, h)) float64, the same on every rank; rank r holds rows[r] rows of X."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(sum(rows), h, generator=g, dtype=torch.float64),
            torch.randn(f, h, generator=g, dtype=torch.float64))


def _traffic(watch, rank, t, rows, h):
    """None if the messages are the ring's hops and each receive overlaps a matmul, else a hint."""
    if "batch_isend_irecv" in watch.collectives:
        return ("post each message with dist.isend / dist.irecv and wait on its own handle: the check follows "
                "every message to its wait, which batch_isend_irecv hides")
    if watch.collectives:
        return (f"you called {watch.collectives[0]}: decompose the all-gather into t - 1 = {t - 1} ring hops "
                f"(dist.isend to the next rank, dist.irecv from the previous) under the matmuls")
    nxt, prv = (rank + 1) % t, (rank - 1) % t
    sends = [(p, n) for op, p, n in watch.messages if op == "send"]
    recvs = [(p, n) for op, p, n in watch.messages if op == "recv"]
    want_sends = [(nxt, rows[(rank - i) % t] * h) for i in range(t - 1)]
    want_recvs = [(prv, rows[(rank - i - 1) % t] * h) for i in range(t - 1)]
    if sends != want_sends or recvs != want_recvs:
        return (f"messages (peer, elements): sent {sends}, received {recvs}; a ring passes one chunk a step: "
                f"t - 1 sends to the next rank {want_sends} and receives from the previous {want_recvs}")
    order = watch.events
    for i, (op, _, _) in enumerate(watch.messages):
        if op != "recv":
            continue
        posted, waited = order.index(("post", i)), order.index(("wait", i)) if ("wait", i) in order else None
        if waited is None:
            return f"receive #{sum(o == 'recv' for o, _, _ in watch.messages[:i]) + 1} is never waited for"
        if ("matmul",) not in order[posted:waited]:
            step = sum(o == "recv" for o, _, _ in watch.messages[:i]) + 1
            return (f"no overlap at step {step}: its receive was waited for before any matmul ran since it was "
                    f"posted; post the hop (isend + irecv), multiply the chunk you hold, THEN wait")
    return None


def _harness(ag_matmul, rows, h, f, seed):
    import torch.distributed as dist

    rank, t = dist.get_rank(), dist.get_world_size()
    x, w = _data(seed, rows, h, f)
    start = sum(rows[:rank])
    shard = x[start:start + rows[rank]].clone()
    want = x @ w.T                                                     # (n, f): the definition
    answer = learner(ag_matmul, *LIBRARY, exercise="the decomposed all-gather matmul")
    with RingWatch() as watch:
        got = answer(shard, w.clone(), list(rows))
    if not torch.is_tensor(got) or tuple(got.shape) != tuple(want.shape):
        return f"return Y, a tensor of shape {tuple(want.shape)} (every rank's rows), got {getattr(got, 'shape', got)!r}"
    wrong = compare(got, want, dtype=torch.float64, terms=h + 1, scale=float((x.abs() @ w.abs().T).max()),
                    what="Y = all_gather(X) W^T (rows of rank 0's chunk first, then rank 1's, ...)")
    return wrong or _traffic(watch, rank, t, rows, h)


def check_decomposed_all_gather_matmul(ag_matmul):
    """ag_matmul(x_shard, weight, rows): x_shard (rows[r], h) this rank's rows of X, weight (f, h)
    the same on every rank, rows the row count of every rank; return Y = all_gather(X) W^T,
    (sum(rows), f), as a ring of t - 1 hops, each under the matmul of the chunk in hand."""
    cases = [Case({"ag_matmul": ag_matmul, "rows": rows, "h": h, "f": f, "seed": i}, world_size=len(rows),
                  label=f"rows {rows}, h = {h}, f = {f}")
             for i, (rows, h, f) in enumerate((([3, 3], 4, 5), ([2, 4, 3], 5, 3), ([1, 3, 2, 2], 3, 4)))]
    return check_distributed("decomposed_all_gather_matmul", _harness, cases, timeout=60)


__all__ = ["check_decomposed_all_gather_matmul", "RingWatch"]
