"""Graders of chapter 4's FSDP questions, trained on real ranks and compared with
single-device training on the full batch (the harness: :mod:`course_lib.grading.training`).

    check_fsdp_unit(GatherParams)          # autograd.Function: all-gather fwd, reduce-scatter bwd
    check_fsdp_prefetch(run_units)         # next unit's all-gather in flight while a unit computes

Each prints one line (``fsdp_unit: 3/3 cases passed`` or the first failing case with a
hint). While the learner's code runs, course_lib's ZeRO / FSDP / data parallelism and
torch's are switched off (:mod:`course_lib.grading.guard`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib import reference
from course_lib.grading import Case, Mismatch, check_distributed, learner, learner_class
from course_lib.grading import training as T
from course_lib.grading.zero_fsdp import ZERO_LIBRARY


# ----------------------------------------------------------------------------- 4. FSDP unit
def _fsdp_unit_harness(GatherParams):
    import torch.distributed as dist

    from course_lib import compat
    from course_lib.parallel.fsdp_params import ShardedUnit

    rank, world = dist.get_rank(), dist.get_world_size()
    model = T.mlp(rank)
    for p in model.parameters():
        dist.broadcast(p.detach(), 0)
    units = []  # one unit per Linear: weight and bias cut along dim 0, this rank's rows packed: (S,)
    for layer in model.layers:
        unit = ShardedUnit(0, "", layer, [layer.weight, layer.bias], [], rank, world)
        units.append((unit, unit.flat_shard.clone().requires_grad_()))
    GatherParams = learner_class(GatherParams, ZERO_LIBRARY, exercise="the FSDP unit's gather and reduce-scatter")
    for batch in T.data():
        x, y = T.local(batch, rank, world)
        h = x
        with T.CollectiveWatch() as forward:   # the forward's collectives are the question too
            for k, (unit, shard) in enumerate(units):
                full = GatherParams.apply(shard)
                if not isinstance(full, torch.Tensor) or full.numel() != shard.numel() * world:
                    return f"GatherParams.apply(shard) should return the ({shard.numel() * world},) gathered vector"
                h = F.linear(h, *_unit_params(unit, full))
                h = F.relu(h) if k < len(units) - 1 else h
        msg = _one_per_unit(forward, world, len(units), "all_gather", "forward should all-gather each unit once",
                            "every rank contributes its shard and needs all of them: that is one all-gather")
        if msg:
            return msg
        with T.CollectiveWatch() as watch:
            F.mse_loss(h, y).backward()
        msg = _one_per_unit(watch, world, len(units), "reduce_scatter",
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
    got = []
    for unit, shard in units:  # gather the trained shards
        full = torch.empty(shard.numel() * world)
        compat.all_gather_into_tensor(full, shard.detach())
        got += _unit_params(unit, full)
    return T.compare_params(got, T.single_device(T.sgd))


def _one_per_unit(watch, world, n_units, kind, rule, why):
    """None if the watched phase called exactly one ``kind`` collective per unit and nothing else."""
    if world == 1:
        return None
    calls = [k for k, _ in watch.calls]
    if calls.count(kind) == n_units and set(calls) == {kind}:
        return None
    seen = ", ".join(f"{calls.count(k)} {k}" for k in sorted(set(calls))) or "no collective"
    return f"{rule}: it called {seen} for {n_units} units ({why})"


def _unit_params(unit, full):
    """(N * S,) rank after rank -> each parameter, full shape (differentiable: the checker's
    part; FSDP's copy_out does the same)."""
    by_rank = full.view(unit.world, unit.numel)
    return [by_rank[:, s.offset:s.offset + s.padded].reshape(unit.world * s.chunk, *s.shape[1:])[:s.shape[0]]
            for s in unit.slots]


def check_fsdp_unit(GatherParams):
    """GatherParams.apply(shard) -> the all-gathered flat parameters; its backward must
    reduce-scatter the gradient and return the *mean* gradient of this rank's shard."""
    cases = [Case({"GatherParams": GatherParams}, world_size=n, label=f"MLP {T.SIZES}, one unit per layer")
             for n in (2, 3, 1)]
    return check_distributed("fsdp_unit", _fsdp_unit_harness, cases)


# ----------------------------------------------------------------------------- 4b'. FSDP prefetch
class _PrefetchLog:
    """Inside a rank: the events of one pass of the learner's run_units, and the checks."""

    def __init__(self, units, world):
        self.units, self.world, self.events, self.live, self.peak = units, world, [], set(), 0

    def start_gather(self, k):
        from course_lib import compat

        unit, shard = self.units[k]
        full = torch.empty(shard.numel() * self.world)          # (N * S,) rank after rank
        work = compat.all_gather_into_tensor(full, shard.detach(), async_op=True)
        self.events.append(("gather", k))
        self.live.add(k)
        self.peak = max(self.peak, len(self.live))
        log = self

        class Handle:
            def wait(self):
                if work is not None:
                    work.wait()
                log.events.append(("wait", k))
                return _unit_params(unit, full)
        return Handle()

    def computing(self, order, fn):
        """The compute(k, full) handed to the learner: refuses a unit out of ``order`` at once."""
        def compute(k, full):
            done = sum(e == "compute" for e, _ in self.events)
            due = order[done] if done < len(order) else None
            if k != due:
                raise Mismatch(f"compute({k}) called when unit {due} was due: run the units in the order "
                               f"given ({list(order)}; backward passes them last to first)")
            self.events.append(("compute", k))
            fn(k, full)
        return compute

    def free(self, k):
        self.live.discard(k)
        self.events.append(("free", k))

    def problem(self, order, what):
        computed = [k for e, k in self.events if e == "compute"]
        if computed != list(order):
            return f"{what}: compute ran on units {computed}, expected each unit once in the order {list(order)}"
        gathers = [k for e, k in self.events if e == "gather"]
        if sorted(gathers) != sorted(order):
            return f"{what}: all-gathers of units {gathers}: each unit's parameters gathered exactly once"
        for i in range(1, len(order)):
            started = self.events.index(("gather", order[i]))
            if started > self.events.index(("compute", order[i - 1])):
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
    import torch.distributed as dist

    from course_lib import compat
    from course_lib.parallel.fsdp_params import ShardedUnit

    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = (T.SIZES[0],) + (10,) * (n_layers - 1) + (T.SIZES[-1],)  # n_layers Linear units
    model = _mlp_sizes(sizes, rank)
    for p in model.parameters():
        dist.broadcast(p.detach(), 0)
    units = []
    for layer in model.layers:
        unit = ShardedUnit(0, "", layer, [layer.weight, layer.bias], [], rank, world)
        units.append((unit, unit.flat_shard.clone()))
    last = len(units) - 1
    run_units = learner(run_units, ZERO_LIBRARY, exercise="FSDP's prefetch")
    for batch in _data_sizes(sizes):
        x, y = T.local(batch, rank, world)
        inputs, h = {}, [x]

        def forward(k, full):
            inputs[k] = h[0]
            out = F.linear(h[0], *full)
            h[0] = F.relu(out) if k < last else out

        log = _PrefetchLog(units, world)
        order = list(range(len(units)))
        run_units(order, log.start_gather, log.computing(order, forward), log.free)
        msg = log.problem(order, "forward")
        if msg:
            return msg
        out = h[0].detach().requires_grad_()
        grad = [torch.autograd.grad(F.mse_loss(out, y), out)[0]]
        grads = {}

        def backward(k, full):
            params = [p.detach().requires_grad_() for p in full]
            inp = inputs[k].detach().requires_grad_()
            out = F.linear(inp, *params)
            out = F.relu(out) if k < last else out
            *g_params, g_in = torch.autograd.grad(out, params + [inp], grad[0])
            grad[0] = g_in
            full_grad = torch.zeros(world, units[k][0].numel)  # packed like the shards, then reduce-scattered
            for s, g in zip(units[k][0].slots, g_params):
                rows = torch.zeros(world * s.chunk, *s.shape[1:])
                rows[:s.shape[0]] = g
                full_grad[:, s.offset:s.offset + s.padded] = rows.reshape(world, -1)
            mine = torch.empty(units[k][0].numel)
            compat.reduce_scatter_tensor(mine, full_grad.view(-1))
            grads[k] = mine / world

        log = _PrefetchLog(units, world)
        order = order[::-1]
        run_units(order, log.start_gather, log.computing(order, backward), log.free)
        msg = log.problem(order, "backward")
        if msg:
            return msg
        with torch.no_grad():
            for k, (_, shard) in enumerate(units):
                shard -= T.LR * grads[k]
    got = []
    for unit, shard in units:
        full = torch.empty(shard.numel() * world)
        compat.all_gather_into_tensor(full, shard)
        got += _unit_params(unit, full)
    return T.compare_params(got, _single_device_sizes(sizes))


def _mlp_sizes(sizes, seed):
    from course_lib.models import MLP

    return MLP(sizes, seed=seed)


def _data_sizes(sizes):
    return reference.mlp_batches(seed=0, batch=T.BATCH, steps=T.STEPS, sizes=sizes)


def _single_device_sizes(sizes):
    return T.single_device(T.sgd, model=_mlp_sizes(sizes, 0), batches=_data_sizes(sizes))


def check_fsdp_prefetch(run_units):
    """run_units(order, start_gather, compute, free): for each unit k of ``order`` call
    compute(k, full) with its gathered parameters (start_gather(k) -> handle, handle.wait() ->
    full), the next unit's all-gather started before this unit computes, each unit freed after
    (free(k)), at most two gathered at once. Driven in forward and in backward (reverse order)."""
    cases = [Case({"run_units": run_units, "n_layers": n}, world_size=w, label=f"{n} Linear units")
             for n, w in ((3, 2), (5, 3), (2, 2))]
    return check_distributed("fsdp_prefetch", _prefetch_harness, cases, timeout=60)


__all__ = ["check_fsdp_unit", "check_fsdp_prefetch"]
