"""Graders of chapter 4 (ZeRO and FSDP): trained on real ranks against one device on the full
batch (:mod:`course_lib.grading.training`), the library's ZeRO / FSDP / DDP and formulas off.

    check_zero1_step(zero1_step)           # (flat, flat_grad, shard, optimizer): RS, step, AG
    check_zero2_hooks(make_zero2_hooks)    # one async reduce-scatter per bucket; keep the shard only
    check_clip_sharded(clip)               # find the bug: clip sharded gradients by the global norm
    check_bytes_per_step(predict)          # (n_params, root, stage, world_size, impl) -> bytes sent
    check_fsdp_unit(GatherParams)          # autograd.Function: all-gather fwd, reduce-scatter bwd
    check_fsdp_prefetch(run_units)         # next unit's all-gather in flight while a unit computes
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import compat
from course_lib.grading import Case, Mismatch, check_distributed, compare, learner, learner_class
from course_lib.grading import training as T
from course_lib.grading.data_parallel import BUCKET_CAPS
from course_lib.grading.guard import COURSE_DATA_PARALLEL, COURSE_FSDP, TORCH_DATA_PARALLEL
from course_lib.grading.harness import check_answers, number, on_ranks, table
from course_lib.grading.p2p import SameCollectives
from course_lib.lab.zero_measurements import MEASURED_PARAMS, MEASURED_ROOT_PARAMS, MEASURED_SENT
from course_lib.collectives import Comm
from course_lib.parallel.fsdp_params import ShardedUnit
from course_lib.parallel.zero import ShardedBucket, all_gather_buckets
from course_lib.planner.communication import dp_bytes_per_step

ZERO_LIBRARY = ("course_lib.parallel.zero:*", COURSE_FSDP, COURSE_DATA_PARALLEL, "course_lib.parallel.comm_ops:*",
                "course_lib.grading.training:single_device", TORCH_DATA_PARALLEL)
FORMULAS = ("course_lib.planner.formulas:*", "course_lib.planner.communication:*", "course_lib.memory:*")


def _zero_traffic_hint(watch, world):
    """None when one step moved reduce-scatter + all-gather worth of data, else a hint."""
    kinds = watch.kinds()
    if world > 1 and "broadcast" in kinds:
        return ("the updated slices travel with broadcasts: every rank contributes a slice and "
                "needs all of them, which is one all-gather")
    if world > 1 and "all_reduce" in kinds:
        return ("the gradients are all-reduced: each rank only needs the mean of its own slice, "
                "a reduce-scatter (half the bytes, and no full-size averaged gradient to keep)")
    if world > 1 and not {"reduce_scatter", "all_gather"} <= kinds:
        return f"expected a reduce-scatter and an all-gather per step, saw {sorted(kinds) or 'no collective'}"
    return None


# ----------------------------------------------------------------------------- 3. ZeRO-1
def _zero1_harness(zero1_step):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = T.mlp(0)                  # rank 0's MLP on every rank (seeded)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    size = math.ceil(numel / world)
    flat = torch.zeros(size * world)  # (world * S,) padded; the parameters become views into it
    for p, view in zip(params, flat.split([p.numel() for p in params] + [size * world - numel])):
        view.copy_(p.detach().view(-1))
        p.data = view.view_as(p)
    mine = slice(rank * size, (rank + 1) * size)
    shard = flat[mine].clone()  # this rank's master slice
    answer = learner(zero1_step, ZERO_LIBRARY, exercise="the ZeRO-1 step")
    optimizer = torch.optim.AdamW([shard], lr=1e-2, weight_decay=0.1)
    stepped = []   # shard.grad as each optimizer.step() found it: fp32 AdamW's parameter bound is
    # ~lr per step (course_lib.tolerance), so the gradient, the step count and the gather are checked
    optimizer.register_step_pre_hook(lambda *_: stepped.append(None if shard.grad is None else shard.grad.clone()))
    for batch in T.data():
        x, y = T.local(batch, rank, world)
        F.mse_loss(model(x), y).backward()
        flat_grad = torch.cat([p.grad.view(-1) for p in params] + [torch.zeros(flat.numel() - numel)])
        mean, magnitude = flat_grad.clone(), flat_grad.abs()  # the owned slice's mean; sum over ranks of |g_i|
        dist.all_reduce(mean)
        dist.all_reduce(magnitude)
        stepped.clear()
        with T.CollectiveWatch() as watch:
            answer(flat, flat_grad, shard, optimizer)
        hint = _zero_traffic_hint(watch, world)
        if hint:
            return hint
        if len(stepped) != 1:
            return f"optimizer.step() was called {len(stepped)} times in one zero1_step: once per step"
        if stepped[0] is not None:                     # AdamW hides a scale: check the gradient itself
            # world ranks' gradients summed in any order, then divided: world + 1 roundings of
            # sum |g_i| / world on each side (course_lib.tolerance), a sum for the mean is off by x world
            msg = compare(stepped[0], mean[mine] / world, dtype=mean.dtype, terms=world + 1,
                          scale=float(magnitude[mine].max()) / world,
                          what="shard.grad (the mean over ranks of this rank's slice)")
            if msg:
                return msg
        gathered = torch.empty_like(flat)              # every rank's updated shard: a copy, so exact
        compat.all_gather_into_tensor(gathered, shard.detach())
        msg = compare(flat, gathered, exact=True, what="flat after the step (every rank's updated shard)")
        if msg:
            return msg
        model.zero_grad()
    state = optimizer.state.get(shard, {})
    if "exp_avg" not in state:
        return "optimizer.step() was never called on the shard"
    if state["exp_avg"].numel() != size:
        return f"the optimizer state should cover this rank's shard only ({size} elements)"
    ref = []    # one AdamW over the single-device parameters, made at its first step

    def adamw(ps):
        ref[:] = ref or [torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)]
        ref[0].step()

    # fp32 AdamW's bound is ~lr per step (a gradient's rounding over eps): the gradients above are
    # the tight check, this one catches a wrong update (stale, skipped or doubled steps)
    return T.compare_params(params, T.single_device(adamw, optimizer="adamw", lr=1e-2))


def check_zero1_step(zero1_step):
    """zero1_step(flat, flat_grad, shard, optimizer): flat (world*S,) the full padded parameters,
    flat_grad this rank's (unsynchronised) gradient of them, shard (S,) the slice this rank
    owns with ``optimizer`` over it. Afterwards flat must hold the updated parameters."""
    return on_ranks("zero1_step", _zero1_harness, (2, 3, 1), f"MLP {T.SIZES}, AdamW", 60, zero1_step=zero1_step)


# ----------------------------------------------------------------------------- 4b. ZeRO-2 hooks
def _zero2_hooks_harness(make_hooks, cap):
    """Train with the learner's ZeRO-2 hooks; per step check: one reduce-scatter per bucket and
    no all-reduce, the first buckets launched before backward's last gradient (overlap), the
    full-size gradients freed, each shard the mean of this rank's slice; then SGD on the
    owned slices, all-gathered by the harness, against single-device training."""
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = T.hooked_steps(make_hooks, cap, "make_zero2_hooks", ZERO_LIBRARY, "ZeRO-2's reduce-scatter hooks")
    first = next(steps)
    if isinstance(first, str):
        return first
    params, buckets = first
    owned = [ShardedBucket(b, ids, params, rank, world) for b, ids in enumerate(buckets)]   # the library's layout
    comm = Comm(dim="dp")
    for step, shards, calls, overlapped in steps:
        kinds = [k for k, _ in calls]
        if world > 1 and "all_reduce" in kinds:
            return (f"step {step}: an all-reduce: each rank needs only the mean of its own slice, one "
                    f"reduce-scatter per bucket (and never reduce a reduced slice again)")
        if kinds.count("reduce_scatter") != len(buckets):
            return (f"step {step}: {kinds.count('reduce_scatter')} reduce-scatters for {len(buckets)} "
                    f"buckets: one per bucket, launched when its last gradient is ready")
        if not overlapped:
            return T.not_overlapped(step, "reduce-scatter")
        kept = [i for i, p in enumerate(params) if p.grad is not None]
        if kept:
            return (f"step {step}: parameters {kept} still hold their full-size gradient after "
                    f"finish(): ZeRO-2 keeps only the owned shard (set p.grad = None)")
        if not isinstance(shards, (list, tuple)) or len(shards) != len(buckets):
            return f"finish() should return one gradient shard per bucket ({len(buckets)}), got {shards!r}"
        for b, shard in zip(owned, shards):
            if not isinstance(shard, torch.Tensor) or tuple(shard.shape) != (b.shard,):
                got = tuple(shard.shape) if isinstance(shard, torch.Tensor) else type(shard).__name__
                return f"bucket {b.index}: the shard should be a ({b.shard},) tensor, got {got}"
        with torch.no_grad():   # SGD on the owned slices, all-gathered as the library's ZeRO does
            all_gather_buckets(owned, params, lambda b: [view - T.LR * shards[b.index][at:at + hi - lo]
                                                         for _, lo, hi, at, view in b.pieces], lambda b: comm)
    return T.compare_params(params, T.single_device(T.sgd))


def check_zero2_hooks(make_zero2_hooks):
    """make_zero2_hooks(params, buckets, world_size) registers gradient hooks and returns
    finish(); when a bucket's last gradient is ready its flat gradients (in bucket order,
    zero-padded to a multiple of world_size) are reduce-scattered asynchronously and the
    full-size gradients freed; finish() returns [mean gradient shard of this rank, per bucket]."""
    cases = [Case({"make_hooks": make_zero2_hooks, "cap": cap}, world_size=n, label=name)
             for name, cap in BUCKET_CAPS.items() for n in (2, 3)]
    return check_distributed("zero2_hooks", _zero2_hooks_harness, cases, timeout=60)


# ----------------------------------------------------------------------------- 4c. find the bug: clipping
_CLIP_CASES = [  # (label, gradient length, max_norm, world sizes)
    ("10 elements, the norm is clipped", 10, 0.5, (2, 3)),
    ("10 elements, the norm is below max_norm", 10, 100.0, (2, 3)),
    ("2 elements on 3 ranks: one rank owns none", 2, 0.5, (3,)),
]


def _clip_harness(clip, numel, max_norm):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.randn(numel, generator=torch.Generator().manual_seed(numel))  # the mean gradient
    size = math.ceil(numel / world)
    shard = g[rank * size:(rank + 1) * size].clone()  # this rank's reduced slice (maybe empty)
    expected = shard * min(1.0, max_norm / (g.norm().item() + 1e-6))
    with SameCollectives():
        got = learner(clip, ZERO_LIBRARY, "torch.nn.utils.clip_grad:clip_grad_norm_",
                      exercise="clipping by the global norm")(shard, max_norm)
    # the norm sums numel squares (all positive: relative rounding numel u), then a sqrt, a division
    # and a product: numel + 3 roundings of the clipped value (course_lib.tolerance)
    return compare(shard if got is None else got, expected, dtype=torch.float32, terms=numel + 3,
                   what=f"the clipped shard (global norm {g.norm():.3f})")


def check_clip_sharded(clip_sharded_grad, timeout: float = 15.0):
    """clip_sharded_grad(grad_shard, max_norm) -> this rank's slice of the mean gradient scaled
    by min(1, max_norm / (norm + 1e-6)), where norm is the 2-norm of the WHOLE gradient."""
    cases = [Case({"clip": clip_sharded_grad, "numel": n, "max_norm": m}, world_size=w, label=label)
             for label, n, m, worlds in _CLIP_CASES for w in worlds]
    return check_distributed("clip_sharded", _clip_harness, cases, timeout=timeout)


# ----------------------------------------------------------------------------- 5. bytes
# Models the measurements (course_lib.lab.zero_measurements) do not cover, which a lookup cannot
# answer: the planner's counting, which predicts the measurements within 1%, predicts these.
_UNMEASURED = [(10_000_000, 500_000, 3, 8, "ring"), (10_000_000, 500_000, 3, 8, "gloo"),
               (70_000_000, 1_000_000, 1, 3, "gloo"), (70_000_000, 1_000_000, 0, 5, "ring")]
_STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def check_bytes_per_step(predict):
    """predict(n_params, root_params, stage, world_size, impl) -> bytes one rank sends per step
    (fp32, stage 0 = DDP, impl "gloo" or "ring"), compared within 1% with ``MEASURED_SENT``
    and, for models that were not measured, with the planner's ``dp_bytes_per_step``."""
    def reference(n, root, stage, world, impl):
        want = MEASURED_SENT.get((impl, stage, world)) if n == MEASURED_PARAMS else None
        # gloo's reduce-scatter is an all-reduce keeping a piece (chapter 4 measures it)
        return ("measured", want) if want is not None else ("counted", dp_bytes_per_step(
            n, world, stage, 4, 4, root_params=root, reduce_scatter="all_reduce" if impl == "gloo" else "ring"))

    def differ(got, want, n, root, stage, world, impl):
        what, want = want
        if abs(got - want) > 0.01 * want:
            return (f"predicted {got:,.0f} bytes, {what} {want:,.0f} ({got / want:.3f}x; P = {n:,}, "
                    f"root unit {root:,}, {_STAGES[stage]}, {world} ranks, {impl})")

    rows = [(MEASURED_PARAMS, MEASURED_ROOT_PARAMS, s, w, impl) for (impl, s, w) in MEASURED_SENT] + _UNMEASURED
    return check_answers("bytes_per_step", predict, table(rows, lambda n, root, s, w, impl: f"P = {n:,}, "
                                                          f"{_STAGES[s]}, {w} ranks, {impl}"), reference,
                         guard=(ZERO_LIBRARY, FORMULAS), exercise="the bytes each stage sends", read=number,
                         differ=differ)


# ----------------------------------------------------------------------------- 4. FSDP unit
def _sharded_mlp(sizes=T.SIZES):
    """Rank 0's MLP on every rank, one FSDP unit per Linear (weight and bias cut along dim 0,
    this rank's rows packed: (S,)): [(unit, a copy of its shard)]."""
    rank, world = dist.get_rank(), dist.get_world_size()
    units = [ShardedUnit(0, "", layer, [layer.weight, layer.bias], [], rank, world) for layer in T.mlp(0, sizes).layers]
    return [(unit, unit.flat_shard.clone()) for unit in units]


def _gather(unit, shard, async_op=False):
    """(the unit's (N * S,) gathered flat, rank after rank; the work when async)."""
    full = torch.empty(shard.numel() * dist.get_world_size())
    return full, compat.all_gather_into_tensor(full, shard.detach(), async_op=async_op)


def _unit_params(unit, full):
    """(N * S,) rank after rank -> each parameter, full shape (differentiable): FSDP's own unpacking."""
    return unit.full_views(unit.copy_out(full))


def _trained(units):
    """Every unit's trained shards, gathered: the parameters to compare with one device."""
    return [p for unit, shard in units for p in _unit_params(unit, _gather(unit, shard)[0])]


def _one_per_unit(watch, world, n_units, kind, rule, why):
    """None if the watched phase called exactly one ``kind`` collective per unit and nothing else."""
    calls = [k for k, _ in watch.calls]
    if world == 1 or (calls.count(kind) == n_units and set(calls) == {kind}):
        return None
    seen = ", ".join(f"{calls.count(k)} {k}" for k in sorted(set(calls))) or "no collective"
    return f"{rule}: it called {seen} for {n_units} units ({why})"


def _fsdp_unit_harness(GatherParams):
    rank, world = dist.get_rank(), dist.get_world_size()
    units = [(unit, shard.requires_grad_()) for unit, shard in _sharded_mlp()]
    GatherParams = learner_class(GatherParams, ZERO_LIBRARY, exercise="the FSDP unit's gather and reduce-scatter")
    for batch in T.data():
        x, y = T.local(batch, rank, world)
        with T.CollectiveWatch() as forward:   # the forward's collectives are the question too
            for k, (unit, shard) in enumerate(units):
                full = GatherParams.apply(shard)
                if not isinstance(full, torch.Tensor) or full.numel() != shard.numel() * world:
                    return f"GatherParams.apply(shard) should return the ({shard.numel() * world},) gathered vector"
                x = F.linear(x, *_unit_params(unit, full))
                x = F.relu(x) if k < len(units) - 1 else x
        msg = _one_per_unit(forward, world, len(units), "all_gather", "forward should all-gather each unit once",
                            "every rank contributes its shard and needs all of them: that is one all-gather")
        if msg:
            return msg
        with T.CollectiveWatch() as backward:
            F.mse_loss(x, y).backward()
        msg = _one_per_unit(backward, world, len(units), "reduce_scatter",
                            "backward should reduce-scatter the full gradient once per unit",
                            "each rank keeps the mean of its slice, no more")
        if msg:
            return msg
        with torch.no_grad():
            for _, shard in units:
                if shard.grad is None or shard.grad.shape != shard.shape:
                    return "backward should return the gradient of this rank's shard (same shape)"
                shard -= T.LR * shard.grad
                shard.grad = None
    return T.compare_params(_trained(units), T.single_device(T.sgd))


def check_fsdp_unit(GatherParams):
    """GatherParams.apply(shard) -> the all-gathered flat parameters; its backward must
    reduce-scatter the gradient and return the *mean* gradient of this rank's shard."""
    return on_ranks("fsdp_unit", _fsdp_unit_harness, (2, 3, 1), f"MLP {T.SIZES}, one unit per layer",
                    GatherParams=GatherParams)


# ----------------------------------------------------------------------------- 4b'. FSDP prefetch
class _PrefetchLog:
    """Inside a rank: the events of one pass of the learner's run_units, and the checks."""

    def __init__(self, units, order, fn):
        self.units, self.order, self.fn, self.events, self.live, self.peak = units, order, fn, [], set(), 0

    def start_gather(self, k):
        unit = self.units[k][0]
        full, work = _gather(unit, self.units[k][1], async_op=True)   # (N * S,) rank after rank
        self.events.append(("gather", k))
        self.live.add(k)
        self.peak = max(self.peak, len(self.live))

        def wait():
            if work is not None:
                work.wait()
            self.events.append(("wait", k))
            return _unit_params(unit, full)
        return SimpleNamespace(wait=wait)

    def compute(self, k, full):
        """The compute(k, full) handed to the learner: refuses a unit out of order at once."""
        done = sum(e == "compute" for e, _ in self.events)
        due = self.order[done] if done < len(self.order) else None
        if k != due:
            raise Mismatch(f"compute({k}) called when unit {due} was due: run the units in the order "
                           f"given ({list(self.order)}; backward passes them last to first)")
        self.events.append(("compute", k))
        self.fn(k, full)

    def free(self, k):
        self.live.discard(k)
        self.events.append(("free", k))

    def problem(self, run_units, what):
        run_units(self.order, self.start_gather, self.compute, self.free)
        order = self.order
        computed = [k for e, k in self.events if e == "compute"]
        if computed != list(order):
            return f"{what}: compute ran on units {computed}, expected each unit once in the order {list(order)}"
        gathers = [k for e, k in self.events if e == "gather"]
        if sorted(gathers) != sorted(order):
            return f"{what}: all-gathers of units {gathers}: each unit's parameters gathered exactly once"
        for i in range(1, len(order)):
            if self.events.index(("gather", order[i])) > self.events.index(("compute", order[i - 1])):
                return (f"{what}: unit {order[i]}'s all-gather started after unit {order[i - 1]} computed: "
                        f"start the next unit's all-gather before computing this one (prefetch)")
        if self.peak > 2:
            return f"{what}: {self.peak} units gathered at once: free each unit after it computed (at most 2)"
        if self.live:
            return f"{what}: units {sorted(self.live)} still gathered at the end: free(k) after compute"
        return None


def _prefetch_harness(run_units, n_layers):
    """A stack of Linear units, FSDP-sharded by rows; forward and backward (recomputing each
    unit from its saved input) both driven by the learner's run_units; SGD on the shards."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = (T.SIZES[0],) + (10,) * (n_layers - 1) + (T.SIZES[-1],)  # n_layers Linear units
    units, last = _sharded_mlp(sizes), n_layers - 1
    run_units = learner(run_units, ZERO_LIBRARY, exercise="FSDP's prefetch")
    for batch in T.data(sizes):
        x, y = T.local(batch, rank, world)
        inputs, h, grads = {}, [x], {}

        def forward(k, full):
            inputs[k] = h[0]
            out = F.linear(h[0], *full)
            h[0] = F.relu(out) if k < last else out

        msg = _PrefetchLog(units, list(range(len(units))), forward).problem(run_units, "forward")
        if msg:
            return msg
        out = h[0].detach().requires_grad_()
        grad = [torch.autograd.grad(F.mse_loss(out, y), out)[0]]

        def backward(k, full):
            params = [p.detach().requires_grad_() for p in full]
            inp = inputs[k].detach().requires_grad_()
            out = F.linear(inp, *params)
            out = F.relu(out) if k < last else out
            *g_params, grad[0] = torch.autograd.grad(out, params + [inp], grad[0])
            flat = torch.zeros(world * units[k][0].numel, requires_grad=True)   # packed like the shards:
            full_grad, = torch.autograd.grad(_unit_params(units[k][0], flat), flat, g_params)  # FSDP's unpacking
            mine = torch.empty(units[k][0].numel)                                 # transposed
            compat.reduce_scatter_tensor(mine, full_grad)
            grads[k] = mine / world

        msg = _PrefetchLog(units, list(range(len(units)))[::-1], backward).problem(run_units, "backward")
        if msg:
            return msg
        with torch.no_grad():
            for k, (_, shard) in enumerate(units):
                shard -= T.LR * grads[k]
    return T.compare_params(_trained(units), T.single_device(T.sgd, model=T.mlp(0, sizes), batches=T.data(sizes)))


def check_fsdp_prefetch(run_units):
    """run_units(order, start_gather, compute, free): for each unit k of ``order`` call
    compute(k, full) with its gathered parameters (start_gather(k) -> handle, handle.wait() ->
    full), the next unit's all-gather started before this unit computes, each unit freed after
    (free(k)), at most two gathered at once. Driven in forward and in backward (reverse order)."""
    cases = [Case({"run_units": run_units, "n_layers": n}, world_size=w, label=f"{n} Linear units")
             for n, w in ((3, 2), (5, 3), (2, 2))]
    return check_distributed("fsdp_prefetch", _prefetch_harness, cases, timeout=60)


__all__ = ["check_zero1_step", "check_zero2_hooks", "check_clip_sharded", "check_bytes_per_step",
           "check_fsdp_unit", "check_fsdp_prefetch"]
