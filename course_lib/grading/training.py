"""The training harness the chapter 3-4 graders share: an MLP whose sizes no world size of
the cases divides, trained on ranks (each on its slice of every batch) and compared with
single-device training on the full batch; a watch on the collectives a rank calls."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from course_lib import reference
from course_lib.grading import compare
from course_lib.grading.guard import switched_off
from course_lib.grading.traffic import COUNTED, counted_calls

SIZES = (6, 10, 5)   # 60 + 10 + 50 + 5 = 125 parameters: no world size of the cases divides it
BATCH, STEPS, LR = 12, 4, 0.1


def data(sizes=SIZES):
    return reference.mlp_batches(seed=0, batch=BATCH, steps=STEPS, sizes=sizes)


def mlp(seed, sizes=SIZES):
    from course_lib.models import MLP

    return MLP(sizes, seed=seed)


@dataclass
class Reference:
    """One device's parameters after ``STEPS`` steps, and the bounds (course_lib.tolerance) a
    correct parallel run stays within: ``optimizer`` steps at ``lr`` from fp32 gradients whose
    largest element is ``grad_scale``."""
    params: list
    bounds: dict


def single_device(update, optimizer="sgd", lr=LR, model=None, batches=None) -> Reference:
    """Full-batch training; ``update(params)`` applies one ``optimizer`` step at ``lr`` to the
    grads (``model`` and ``batches`` default to the MLP and ``data()``)."""
    model = mlp(0) if model is None else model
    largest = [0.0]

    def step(params):       # G of the SGD/AdamW bounds: the largest gradient element of any step
        largest[0] = max([largest[0]] + [float(p.grad.abs().max()) for p in params if p.grad is not None])
        update(params)

    batches = data() if batches is None else batches
    reference.train(model, batches, step)
    bounds = dict(dtype=torch.float32, optimizer=optimizer, steps=len(batches), lr=lr, grad_scale=largest[0])
    return Reference([p.detach().clone() for p in model.parameters()], bounds)


def sgd(params):
    reference.sgd_step(params, LR)


def local(batch, rank, world):
    x, y = batch
    return x.chunk(world)[rank], y.chunk(world)[rank]


class CollectiveWatch:
    """Inside a rank: the torch.distributed collectives called in a ``with`` block, as (kind,
    bytes of the largest tensor among the first two arguments) per call: traffic's
    ``counted_calls`` with this record. ``course_lib.compat`` looks the functions up on every
    call, so calls through it are seen too."""

    NAMES = {"all_reduce": "all_reduce", "broadcast": "broadcast", "reduce": "reduce",
             "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
             "all_gather_single": "all_gather", "reduce_scatter": "reduce_scatter",
             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter"}

    def __init__(self):
        self.calls = []

    def _record(self, name, args, kwargs):
        if name not in self.NAMES:   # counted only so that the collectives it calls are not seen
            return
        tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
        if name in ("all_gather", "reduce_scatter"):  # lists of tensors
            tensors = [t for a in args[:2] if isinstance(a, (list, tuple)) for t in a]
        self.calls.append((self.NAMES[name], max((t.numel() * t.element_size() for t in tensors), default=0)))

    def __enter__(self):
        self._counting = counted_calls(tuple(dict.fromkeys(COUNTED + tuple(self.NAMES))), self._record)
        self._counting.__enter__()
        return self

    def __exit__(self, *exc):
        return self._counting.__exit__(*exc)

    def kinds(self):
        return {k for k, _ in self.calls}


def compare_params(got, expected: Reference, what="parameters after training"):
    """Each trained tensor against one device's, within the bound of ``expected``'s optimizer
    steps (an SGD step moves a parameter by lr times a gradient's rounding; AdamW's bound is
    ~lr per step in fp32, so its graders also check the gradients themselves)."""
    for i, (g, e) in enumerate(zip(got, expected.params)):
        msg = compare(g.detach(), e, what=f"{what}, tensor {i}", **expected.bounds)
        if msg:
            return msg
    return None


def hooked_steps(make_hooks, cap, fn_name, targets=(), exercise=""):
    """The hook harnesses' shared training: the model (rank 0's weights everywhere), the
    course's buckets, the learner's hooks registered by ``make_hooks``. Yields first
    (params, buckets), then per step (step, finish()'s return, the collectives called, whether
    one had started before backward's last gradient); the caller checks them and updates the
    parameters. A str yielded is the learner's error: stop. ``targets`` are switched off
    (:mod:`course_lib.grading.guard`) while the learner's code runs: make_hooks, and each
    backward (where its hooks run) with finish()."""
    import torch.distributed as dist

    from course_lib.parallel.grad_sync import assign_buckets as course_buckets

    rank, world = dist.get_rank(), dist.get_world_size()
    model = mlp(rank)
    for p in model.parameters():
        dist.broadcast(p.detach(), 0)
    params = list(model.parameters())
    buckets = course_buckets(params, cap)
    seen_at_last_grad = []
    # registered before the learner's hooks, so it runs first: how many collectives had started
    # when the last gradient of backward (params[0], the first layer's weight) was ready
    params[0].register_post_accumulate_grad_hook(lambda p: seen_at_last_grad.append(len(watch.calls)))
    watch = CollectiveWatch()
    with watch:
        with switched_off(targets, exercise):
            finish = make_hooks(params, buckets, world)
        if not callable(finish):
            yield f"{fn_name} must return a finish() function, got {finish!r}"
            return
        yield params, buckets
        for step, batch in enumerate(data()):
            watch.calls.clear()
            seen_at_last_grad.clear()
            x, y = local(batch, rank, world)
            loss = F.mse_loss(model(x), y)
            with switched_off(targets, exercise):
                loss.backward()
                result = finish()
            overlapped = len(buckets) == 1 or bool(seen_at_last_grad and seen_at_last_grad[0] > 0)
            yield step, result, list(watch.calls), overlapped
            model.zero_grad()


def not_overlapped(step, kind):
    return (f"step {step}: no bucket's {kind} had started when backward produced its last "
            f"gradient: launch a bucket from the hook that completes it (async_op=True)")
