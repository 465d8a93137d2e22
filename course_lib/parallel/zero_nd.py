"""ZeRO-1 and ZeRO-2 inside :func:`~course_lib.parallel.compose.parallelize_nd`: chapter 4's
sharded optimizer (:mod:`course_lib.parallel.zero`'s buckets and owned slices) on a mesh.

    net = parallelize_nd(model, Mesh(dp=2, pp=2, tp=2), Layout(dp=2, pp=2, tp=2, zero=2, ...))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)   # the owned slices only
    loss = net.step(x, y); opt.step(); opt.zero_grad()

The ZeRO group of a parameter is the ranks that hold the same parameter and sum its gradient:
its reduce dims among "dp" and "cp" (the plan's, :func:`~course_lib.parallel.compose.data_dims`);
an expert split over ep: every rank holding it, "edp" (the ranks of the expert fold holding it)
and the dims the fold leaves out (cp, tp, or dp under ``fold_order="tp_first"``), as
Megatron-Core's distributed optimizer shards experts over their expert-data-parallel group and
FSDP over every rank holding them (:func:`shard_dims`). The other reduce dims (a
sequence-parallel norm weight's "tp", w2's bias's "etp") are summed after, on the slice.
Per step (``layout.grad_reduce``, :data:`~course_lib.layout.GRAD_REDUCE`):

    step start   all-gather the parameters from the owned slices (the optimizer updated them)
    schedule     every micro-batch's backward accumulates the full local gradient in ``p.grad``
    after it     "step" (Megatron-LM 2021-22's ``allreduce_gradients()`` after the schedule): one
                 reduce-scatter per bucket: each rank receives the sum of the slices it owns
                 (+ one "used" flag per parameter, as FSDP's), then the sum over the other dims
    or in it     "chunk": a pipeline chunk's buckets as soon as its last micro-batch's backward
                 has run, under the backwards of the chunks still to come (torch 2.13's
                 pipelining with FSDP2: ``perform_reduce_grad`` after a stage's last backward;
                 Megatron-Core's ``overlap_grad_reduce``); "round": after each round of N
                 micro-batches through the chunk (``schedules.microbatch_group``), the rounds'
                 sums added on the owned slices (Llama 3, Sec. 3.3.2: N chosen "for the best
                 communication and memory efficiency")

The parameters are gathered once, at the step's start, in every mode.

Megatron-Core's distributed optimizer overlaps both (``--overlap-grad-reduce``,
``--overlap-param-gather``; :meth:`ZeroSync.overlap_grad_reduce` and
:meth:`ZeroSync.overlap_param_gather`, run where a source states them,
:mod:`course_lib.virtual.software`): each bucket reduce-scattered in the last backward of its
chunk as soon as its gradients are complete (by default on the first pipeline stage only; the
others launch theirs as their schedule ends), and each bucket gathered in the first forward
just before a module uses it, the next bucket's gather started as this one's is waited for.

``stage=1`` keeps the full gradients to the next step (ZeRO-1: gradients not sharded; the owned
slices' sums are written into them, as :class:`~course_lib.parallel.zero.ShardedOptimizer`
does); ``stage=2`` frees them once reduced (only the owned slices' sums stay). The optimizer sees one
parameter per (parameter, owned slice): a parameter no rank used keeps no gradient.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from course_lib.layout import rule_grad_reduce
from course_lib.parallel.grad_sync import assign_buckets, register_grad_ready_hooks
from course_lib.parallel.zero import ShardedBucket, all_gather_buckets, end_gather, owned_gradient, start_gather
from course_lib.precision.mixed import MainGrads, check_precision

SHARD_DIMS = ("dp", "cp", "edp")   # the dims a ZeRO group spans (the ranks holding the same parameters)


def shard_dims(dims: tuple) -> tuple:
    """(ZeRO's group, the dims summed after on the owned slice) of a parameter summed over
    ``dims``: a dense one's among :data:`SHARD_DIMS`; an expert's ("edp" in its dims) every
    dim of the ranks holding it (a tp or dp outside the fold too: they hold the same expert),
    only w2's bias's "etp" (each etp rank adds it for its rows) summed after."""
    if "edp" in dims:
        return tuple(x for x in dims if x != "etp"), tuple(x for x in dims if x == "etp")
    return tuple(x for x in dims if x in SHARD_DIMS), tuple(x for x in dims if x not in SHARD_DIMS)


def rule_zero(cfg, layout):
    """ZeRO-1/2 in ``parallelize_nd``: parameters in one dtype (under a mixed precision the
    owned slices are the master weights); ``grad_reduce`` other than "step" only with ZeRO-2
    (ZeRO-1 keeps the whole gradients to the step anyway)."""
    rule_grad_reduce(layout)
    if layout.zero not in (1, 2):
        return
    check_precision(layout.precision)


class ZeroSync:
    """The gradient sums and parameter gathers of ZeRO-``stage`` (1 or 2) for ``params`` (this
    rank's model parameters, each once) on ``mesh``; ``dims``: {id(parameter): its reduce dims}.
    ``parameters()``: the owned slices, for the optimizer; ``begin_step()`` before a step's
    schedule, ``finish()`` after it (the runtime's gradient sum); ``gather()`` anytime on every
    rank (after the last ``opt.step()``: before reading the full parameters).

    Mixed precision (``compute``, ``reduce``: dtypes, :func:`~course_lib.precision.mixed.
    check_precision`'s): the owned slices, made in the parameters' dtype, are the master weights
    (fp32), the parameters are cast to ``compute`` and gathered in it; the gradients are
    reduce-scattered in ``reduce`` and handed to the slices in their dtype. ``accumulate``: each
    backward's gradient is added into a ``reduce``-dtype buffer as autograd produces it
    (:class:`~course_lib.precision.mixed.MainGrads`), which the reduce-scatter reads."""

    def __init__(self, params, mesh, dims, stage, bucket_cap_mb=25, compute=None, reduce=None, accumulate=False,
                 chunks=None):
        if stage not in (1, 2):
            raise ValueError(f"ZeroSync: stage must be 1 or 2, got {stage!r}")
        self.stage, self.params, self.compute = stage, [q for q in params if q.requires_grad], compute
        key = {id(q): tuple(dims[id(q)]) for q in self.params}
        chunk = chunks or {}               # {id(parameter): its pipeline chunk}: buckets never span two
        self.buckets = []
        for ids in assign_buckets(self.params, bucket_cap_mb * 2**20,
                                  key=lambda q: (q.dtype, q.device, key[id(q)], chunk.get(id(q)))):
            d = key[id(self.params[ids[0]])]
            shard, rest = shard_dims(d)
            if not shard:
                raise ValueError(f"ZeroSync: a parameter summed over {d} has no ZeRO group among {SHARD_DIMS}")
            comm = mesh.comm(shard)
            b = ShardedBucket(len(self.buckets), ids, self.params, comm.rank, comm.size)
            b.comm, b.rest = comm, (mesh.comm(rest) if rest else None)
            b.chunk = chunk.get(id(self.params[ids[0]]))
            b.slices = [nn.Parameter(view.detach().clone()) for *_, view in b.pieces]
            b.reduce_dtype = reduce or compute or b.dtype
            if compute is not None:
                b.dtype = compute                       # gathered in the compute dtype
            b.launched, b.ready, b.gathered, b.gathering, b.chunks, b.next_gather = False, 0, True, None, None, None
            self.buckets.append(b)
        self.bucket_of = {i: b for b in self.buckets for i in b.param_ids}
        if compute is not None:
            for q in self.params:
                q.data = q.data.to(compute)             # the model computes in 16 bits
        self.main_grads = MainGrads(self.params, reduce or compute) if accumulate else None
        self.all_reduce = False     # True: each bucket all-reduced, each rank keeping its slice (DeepSpeed's BF16_Optimizer)
        self.rounds = None          # None: after the schedule; "chunk" / "round": :meth:`reduce_in_rounds`
        self.pending = []           # reductions launched in the schedule, in flight
        self.freed = set()          # chunks whose sums a round freed, their next backward to come
        self.overlapped = False     # True: each chunk's buckets launched in its last backward (overlap_grad_reduce)
        self.hooked = False         # True: by the gradients' hooks, each bucket as it fills
        self.order = []             # the buckets launched so, in their order
        self.armed = set()          # chunks whose last backward of the step has started
        self.deferred = []          # buckets gathered in the first forward (overlap_param_gather)

    def reduce_in_rounds(self, per: str):
        """Reduce-scatter each chunk's buckets (those of ``chunks``) in the schedule, under the
        backwards that follow, and free its gradients (ZeRO-2): ``per="chunk"`` once, after the
        chunk's last backward (torch's pipelining with FSDP2); ``per="round"`` after each round
        of its backwards (Llama 3), the rounds' sums added on the owned slices. The runner says
        when (:meth:`gradients_done`). The buckets of no chunk (a tied embedding, summed over the
        pipeline after the schedule) and the last reductions finish in :meth:`finish`."""
        if self.stage != 2:
            raise ValueError("ZeroSync.reduce_in_rounds frees the gradients it reduced: ZeRO-2 only")
        if per not in ("chunk", "round"):
            raise ValueError(f"ZeroSync.reduce_in_rounds: per must be 'chunk' or 'round', got {per!r}")
        self.rounds = per

    def gradients_done(self, chunk, round_end: bool, last: bool):
        """The runner's call when one more micro-batch's weight gradients of ``chunk`` are
        complete (``round_end``: the last of a round of them; ``last``: of the step): then the
        reductions launched before are waited for (they had a round of backwards to run under)
        and this chunk's launched."""
        if self.overlapped and last:        # its buckets left incomplete (a parameter no backward reached)
            self._launch_complete(ended=chunk)
            return
        if self.rounds is None or not (last or (round_end and self.rounds == "round")):
            return
        self._drain()
        self.pending += [self._launch(b, async_op=True) for b in self.buckets if b.chunk == chunk]
        if not last:
            self.freed.add(chunk)

    @torch.no_grad()
    def gradients_starting(self, chunk, last: bool = False):
        """Before a backward of ``chunk``: if a round freed its sums, their buffers again, zeros
        (as the round's first backward would make them; every backward then adds into its
        buffers alike, and a dry run replays one price for all of them), for the parameters
        that had one. ``last``: it is the chunk's last of the step: under
        :meth:`overlap_grad_reduce` its gradient hooks count from now."""
        if last and self.overlapped:
            self.armed.add(chunk)
        if chunk not in self.freed:
            return
        self.freed.discard(chunk)
        main = self.main_grads
        for b in self.buckets:
            if b.chunk != chunk:
                continue
            for i in b.refill:          # (a parameter no backward reached keeps none, as on one device)
                p = self.params[i]
                if main is not None:
                    main.grads.setdefault(id(p), torch.zeros(p.shape, dtype=main.dtype, device=p.device))
                elif p.grad is None:
                    p.grad = torch.zeros_like(p)

    def parameters(self) -> list:
        """The owned slices (one per parameter piece this rank owns): what the optimizer updates."""
        return [q for b in self.buckets for q in b.slices]

    def shard_gradients(self) -> list:
        """Gradients held besides the parameters' own: ZeRO-2's once reduced, the owned slices'
        (ZeRO-1's are slices of ``p.grad``); ZeRO-1 summing in its own buffers (``accumulate``):
        those, kept to the next step as ZeRO-1 keeps the full gradients."""
        if self.stage == 2:             # (+ the packed sums in flight and the owned sums arrived: :meth:`reduce_in_rounds`)
            return [q.grad for q in self.parameters() if q.grad is not None] + \
                [packed for _, packed, _, _ in self.pending] + \
                [b.arrived for b in self.buckets if getattr(b, "arrived", None) is not None]
        return list(self.main_grads.grads.values()) if self.main_grads is not None else []

    def begin_step(self):
        """A step starts: the last step's local gradients go (ZeRO-1 kept them), the parameters
        are gathered from the slices the optimizer updated."""
        for q in self.params:
            q.grad = None
        if self.main_grads is not None:
            self.main_grads.clear()
        self.pending, self.freed, self.armed = [], set(), set()
        for b in self.buckets:
            b.arrived, b.launched, b.ready = None, False, 0
            b.gathered, b.gathering = b not in self.deferred, None
        self.gather([b for b in self.buckets if b not in self.deferred])

    @torch.no_grad()
    def gather(self, buckets=None):
        """All-gather every bucket's (or ``buckets``') owned slices into the full parameters (two
        buckets in flight)."""
        buckets = self.buckets if buckets is None else buckets
        if buckets:
            all_gather_buckets(buckets, self.params, self._sources, lambda b: b.comm)

    @staticmethod
    def _sources(b):
        return [q.detach() for q in b.slices]

    @torch.no_grad()
    def finish(self):
        """Reduce-scatter each bucket's local gradients (with one "used" flag per parameter),
        sum the owned slice over the other dims, and give each owned slice its gradient (added
        to one not zeroed since the last step, as on one device). ZeRO-2 frees ``p.grad``.
        Reduced chunk by chunk: the reductions still in flight, each chunk's sums handed out,
        then the buckets of no chunk."""
        self._drain()
        for b in self.buckets:
            if not b.gathered:          # (a bucket no forward used: gathered now, as before the step)
                self._wait_gather(b, chain=False)
            if not b.launched:          # (after the schedule; or a bucket of no chunk)
                self._arrive(self._launch(b))
            self._hand_out(b)
            b.launched = False

    def _drain(self):
        while self.pending:
            self._arrive(self.pending.pop(0))

    def _launch(self, b, async_op=False):
        """Pack bucket ``b``'s gradients (+ its flags) and start their reduce-scatter; ZeRO-2
        frees them (the packed copy is what is sent). Returns what :meth:`_arrive` takes."""
        n, t = b.comm.size, len(b.param_ids)
        # torch.empty, as FSDP2's reduce-scatter input: every element is written below, the
        # gradients by one copy, the holes (a parameter no backward reached, the rows' padding)
        # by one zero, not the whole buffer zeroed first (a write of the bucket per launch)
        packed = torch.empty(n * (b.shard + t), dtype=b.reduce_dtype, device=b.device).view(n, b.shard + t)
        flat = packed[:, :b.shard]
        main = self.main_grads
        grads = [self.params[i].grad if main is None else main.pop(self.params[i]) if self.stage == 2
                 else main.grads.get(id(self.params[i])) for i in b.param_ids]   # (ZeRO-1 keeps them)
        with torch.no_grad():           # (unbind's and split's views are written in place)
            rows = flat.unbind(0)
            pieces = [piece for i, g in zip(b.param_ids, grads) if g is not None
                      for piece in row_pieces(flat, b.offsets[i], g.view(-1), rows)]
            if pieces:                  # one foreach copy for the bucket (CUDA: a multi-tensor
                torch._foreach_copy_(*zip(*pieces))   # apply launch per ~21M elements), not one per piece
            holes = [(b.offsets[i], self.params[i].numel()) for i, g in zip(b.param_ids, grads) if g is None]
            holes += [(b.numel, n * b.shard - b.numel)] if n * b.shard > b.numel else []
            holes = [view for at, size in holes for view in row_views(rows, b.shard, at, size)]
            if holes:
                torch._foreach_zero_(holes)
        had = [float(g is not None) for g in grads]
        b.refill = [i for i, g in zip(b.param_ids, grads) if g is not None]   # (:meth:`gradients_starting`)
        packed[:, b.shard:].copy_(torch.tensor(had, dtype=b.reduce_dtype, device=b.device).expand(n, t))
        if self.all_reduce:         # the whole sum on every rank (twice a reduce-scatter's bytes), this rank's row kept
            work = b.comm.all_reduce(packed.view(-1), async_op=async_op, name=f"all-reduce b{b.index}")
            out = packed[b.comm.rank]
        else:
            out = torch.empty(b.shard + t, dtype=b.reduce_dtype, device=b.device)   # (all of it received)
            work = b.comm.reduce_scatter_tensor(out, packed.view(-1), async_op=async_op,
                                                name=f"reduce-scatter b{b.index}")
        if self.stage == 2:
            for i in b.param_ids:
                self.params[i].grad = None
        b.launched = True
        return b, packed, out, work if async_op else None

    # ------------------------------------------------ Megatron-Core's overlapped distributed optimizer
    def overlap_grad_reduce(self, chunks: dict, hooked: bool = True):
        """Reduce-scatter each bucket in its chunk's last backward of the step, as soon as that
        backward has made all its gradients (Megatron-Core's ``--overlap-grad-reduce``: a
        backward hook per parameter, ``register_grad_ready``; here a post-accumulate-grad hook,
        after the fp32 sum's add), under the rest of the backward. ``chunks``: {id(parameter):
        its pipeline chunk} (``compose.chunk_of``): a bucket holding a parameter of no chunk (a
        tied embedding, summed over the pipeline after the schedule) goes after the schedule.
        The buckets launch in their order (the same on every rank of a group), all in flight
        until the schedule ends, as Megatron's (which reduce-scatters its contiguous gradient
        buffer in place, where the course packs a copy of each bucket to send: that copy's
        bytes are held meanwhile), and those a parameter without gradient left incomplete
        launch when that backward ends. The runner tells when a chunk's last
        backward starts (:meth:`gradients_starting`) and ends (:meth:`gradients_done`).
        ``hooked=False``: no hook launches anything; each chunk's buckets all launch (in order,
        without waiting) when its last backward ends, as Megatron-Core's pipeline stages other
        than the first do by default (``align_grad_reduce``: "other pipeline stages do grad
        reduction during pipeline bubble", megatron/core/pipeline_parallel/schedules.py).
        ZeRO-1 keeps the gradients; ZeRO-2 frees them once packed."""
        if self.rounds is not None:
            raise ValueError(f"overlap_grad_reduce reduces each bucket in its chunk's last backward: run it with "
                             f"grad_reduce='step', not {self.rounds!r}")
        for b in self.buckets:
            held = {chunks.get(id(self.params[i])) for i in b.param_ids}
            b.chunks = None if None in held else held
        if hooked and not self.hooked:
            register_grad_ready_hooks(self, self.params, "ZeroSync")
        self.hooked = hooked or self.hooked
        self.overlapped, self.order = True, [b for b in self.buckets if b.chunks is not None]

    def _grad_ready(self, i):
        b = self.bucket_of[i]
        if not self.hooked or b.chunks is None or not b.chunks <= self.armed or b.launched:
            return
        b.ready += 1
        self._launch_complete()

    def _launch_complete(self, ended=None):
        """Launch the buckets now complete, in order (``ended``: that chunk's last backward is
        over: its buckets count as complete)."""
        for b in self.order:
            if b.launched:
                continue
            if not (b.ready == len(b.param_ids) or (ended is not None and b.chunks <= self.armed
                                                    and ended in b.chunks)):
                return
            self.pending.append(self._launch(b, async_op=True))

    def overlap_param_gather(self, units, chunks: dict):
        """Gather each bucket in the step's first forward, where a module first uses it
        (Megatron-Core's ``--overlap-param-gather``: a forward pre-hook per module waits for its
        parameters' buckets, ``finish_param_sync``, and starts the next bucket's all-gather).
        ``units``: the modules whose forward reads their parameters (each waits for the buckets
        of all of them); ``chunks``: {id(parameter): its pipeline chunk}; a bucket of several
        chunks, or of none, or holding a parameter of no unit, is gathered at the step's start
        as before. The next bucket of each chain (one per chunk
        and group, as Megatron-Core keeps one per buffer of a model chunk) in forward order."""
        where = {id(q): i for i, q in enumerate(self.params)}
        covered = {where[id(q)] for mod in units for q in mod.parameters() if id(q) in where}
        mine = []
        for mod in units:
            ids = [where[id(q)] for q in mod.parameters() if id(q) in where]
            buckets = list({id(self.bucket_of[i]): self.bucket_of[i] for i in ids}.values())
            mine += [b for b in buckets if b not in mine]
            mod.register_forward_pre_hook(_GatherHook(self, buckets))
        chunk = {}
        for b in self.buckets:
            held = {chunks.get(id(self.params[i])) for i in b.param_ids}
            chunk[id(b)] = held.pop() if len(held) == 1 else None
        self.deferred = [b for b in mine if chunk[id(b)] is not None and covered.issuperset(b.param_ids)]
        for b in self.buckets:
            b.next_gather = None
        chains = {}
        for b in sorted(self.deferred, key=self.buckets.index, reverse=True):   # forward order
            key = (chunk[id(b)], id(b.comm))
            if key in chains:
                chains[key].next_gather = b
            chains[key] = b

    @torch.no_grad()
    def _wait_gather(self, b, chain: bool = True):
        """Bucket ``b``'s parameters gathered: its all-gather started if not yet, waited for,
        copied in; then (``chain``) the next bucket's started."""
        if b.gathered:
            return
        if b.gathering is None:
            b.gathering = start_gather(b, self._sources(b), b.comm)
        end_gather(b, self.params, *b.gathering)
        b.gathered, b.gathering = True, None
        nxt = b.next_gather if chain else None
        if nxt is not None and not nxt.gathered and nxt.gathering is None:
            nxt.gathering = start_gather(nxt, self._sources(nxt), nxt.comm)

    @staticmethod
    def _arrive(launched):
        """Wait for a bucket's reduction; its owned sum (and flags) added to the bucket's
        ``arrived`` (one reduction per round: their sum; nothing read by the host)."""
        b, _packed, out, work = launched
        if work is not None:
            work.wait()
        arrived = getattr(b, "arrived", None)
        b.arrived = out if arrived is None else arrived.add_(out)

    def _hand_out(self, b):
        """The bucket's arrived sum: summed over the other dims, its flags read, handed to the
        owned slices (added to what they hold: a step not zeroed)."""
        out = getattr(b, "arrived", None)
        if out is None:
            return
        b.arrived = None
        if b.rest is not None:
            b.rest.all_reduce(out, name=f"all-reduce b{b.index} over {b.rest.dim}")
        used = (out[b.shard:] > 0).tolist()
        # each step below is one kernel for all the pieces, however many: every rank of the
        # group does the same work (the first the most bytes: its slice is never short)
        mine = [(i, lo, hi, at, q) for (i, lo, hi, at, _), q in zip(b.pieces, b.slices)
                if used[b.param_ids.index(i)]]
        held = [(out[at:at + hi - lo], q) for i, lo, hi, at, q in mine if q.grad is not None]
        if held:                        # not zeroed since the last step: accumulate, as on one device
            torch._foreach_add_([q.grad for _, q in held], [g for g, _ in held])
        fresh = [m for m in mine if m[4].grad is None]
        if not fresh:
            return
        if self.compute is not None:    # mixed precision: the masters' gradients, in their dtype
            _, lo, hi, at, _ = b.pieces[-1]        # (the pieces lie end to end from 0)
            cast = out[:at + hi - lo].to(fresh[0][4].dtype)
            for i, lo, hi, at, q in fresh:
                q.grad = cast[at:at + hi - lo]
        elif self.stage == 2:           # the sums themselves
            for i, lo, hi, at, q in fresh:
                q.grad = out[at:at + hi - lo]
        else:                           # ZeRO-1: the sums in the owned slices of the full gradients
            views = [owned_gradient(self.params[i], lo, hi, None, 1) for i, lo, hi, at, q in fresh]
            torch._foreach_copy_(views, [out[at:at + hi - lo] for i, lo, hi, at, q in fresh])
            for view, (*_, q) in zip(views, fresh):
                q.grad = view


class _GatherHook:
    """Forward pre-hook of one unit: its buckets gathered before it runs (while the step's
    first forward still gathers)."""

    def __init__(self, zero, buckets):
        self.zero, self.buckets = weakref.ref(zero), buckets

    def __call__(self, module, args):
        zero = self.zero()
        if zero is not None:
            for b in self.buckets:
                zero._wait_gather(b)


def row_pieces(flat, start, src, rows=None):
    """[(destination, source)]: ``src`` written to elements [start, start + len) of ``flat``
    (n, S) read row after row (the vector runs on through the rows; each row is a rank's slice
    followed by its flags), one contiguous piece per row it reaches. ``rows``: ``flat``'s rows
    (``flat.unbind(0)``, made once a bucket). The views are made in bulk (one split of ``src``,
    whole rows as they are): the dry run prices each view's dispatch in CPU, not in time."""
    rows = flat.unbind(0) if rows is None else rows
    views = row_views(rows, flat.shape[1], start, src.numel())
    return list(zip(views, src.split([v.numel() for v in views]) if len(views) > 1 else (src,)))


def row_views(rows, s: int, start: int, size: int) -> list:
    """The views of elements [start, start + size) of rows of ``s`` elements read one after the
    other (``rows``: a buffer's ``unbind(0)``), one per row the range reaches."""
    r, c = divmod(start, s)
    out = []
    while size:
        k = min(s - c, size)
        out.append(rows[r] if k == s else rows[r][c:c + k])
        r, c, size = r + 1, 0, size - k
    return out


__all__ = ["ZeroSync", "rule_zero", "SHARD_DIMS", "shard_dims", "row_pieces", "row_views"]
