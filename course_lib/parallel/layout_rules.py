"""The rules an N-D layout puts on the model and the batch, gathered from their dimensions.

Each dimension's module exports its rules (``tp_plan.rule_tensor`` / ``rule_sequence``,
``context_parallel.rule_context``, ``expert_parallel.rule_experts``, ``fsdp.rule_fsdp``; the
pipeline's and the options' are here); the plan's steps call them on every rank as they
apply their dimension, and :func:`check_layout` calls them all, in the plan's order, in plain
arithmetic before any rank starts. Each raises a ValueError naming the constraint.

    shape = check_layout(cfg, Layout(dp=2, pp=2, cp=2, tp=2, global_batch=8, microbatches=2))
    shape = check_layout(cfg, dp=2, pp=2, cp=2, tp=2, batch=8, microbatches=2)    # the same
"""
from __future__ import annotations

from course_lib.layout import DATA, Layout
from course_lib.parallel.context_parallel import rule_context, ulysses_heads  # noqa: F401  (re-exported)
from course_lib.parallel.expert_parallel import rule_experts
from course_lib.parallel.fsdp import rule_fsdp
from course_lib.parallel.mesh import MeshShape
from course_lib.parallel.tp_plan import local_heads, rule_sequence, rule_tensor  # noqa: F401
from course_lib.parallel.vocab_parallel import shard_range
from course_lib.precision.mixed import check_precision
from course_lib.recompute import layer_policies
from course_lib.schedules import make_schedule, positive_int, schedule_name, validate

# what parallelize_nd's keywords mean when not given (a Layout built directly keeps its own)
# SP with TP; one micro-batch (no gradient accumulation); the course's DDP sums after backward
RUNTIME_DEFAULTS = dict(sp=True, microbatches=1, overlap_dp=False)


def as_layout(layout=None, dims=None, **keywords) -> Layout:
    """The :class:`~course_lib.layout.Layout` of a call: ``layout`` (with ``keywords`` changed),
    or one built from the keywords (``parallelize_nd``'s spellings, its defaults) and ``dims``."""
    if layout is not None:
        if dims is not None and any(getattr(layout, d) != n for d, n in dims.items()):
            raise ValueError(f"the layout's dimensions {layout.sizes} differ from the mesh's {dims}")
        return Layout.of(layout, **keywords)
    for name, value in RUNTIME_DEFAULTS.items():
        keywords.setdefault(name, value)
    if "sequence_parallel" in keywords:
        keywords["sp"] = keywords.pop("sequence_parallel")
    return Layout.of(**(dims or {}), **keywords)


def partition_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous, balanced (:func:`shard_range`): the first ``n_layers % n_stages`` stages
    get one layer more."""
    if n_stages > n_layers:
        raise ValueError(f"more pipeline stages ({n_stages}) than layers ({n_layers}): every stage needs a layer")
    return [range(*shard_range(n_layers, n_stages, i)) for i in range(n_stages)]


def splits_weight_gradients(schedule, v=1) -> bool:
    """Does the schedule compute weight gradients apart (zb-h1's W actions)?"""
    if isinstance(schedule, str):
        return schedule_name(schedule, v) == "zb-h1"
    return any(a[0] == "W" for row in schedule for a in row)


# ------------------------------------------------------------------------ the rules, in order
def rule_names(cfg, L):
    """The options: counts, a recompute policy and a precision that exist."""
    positive_int("microbatches", L.microbatches)
    positive_int("v", L.v)
    layer_policies(L.recompute, cfg.n_layers)      # an unknown recompute policy: ValueError naming it
    check_precision(L.precision)                   # an unknown precision: ValueError naming it


def rule_pipeline(cfg, L):
    """Stages: at least one layer each; the schedule exists for (p, m, v) (v > 1: interleaved);
    zb-h1's split weight gradients (recorded Linear inputs, outside autograd) run neither
    under FSDP nor with recomputation, which does not keep those inputs."""
    if isinstance(L.schedule, str):
        make_schedule(schedule_name(L.schedule, L.v), L.pp, L.microbatches, L.v)
    else:
        validate(L.schedule, L.pp, L.microbatches, L.v)
    partition_layers(cfg.n_layers, L.pp * L.v)
    if not splits_weight_gradients(L.schedule, L.v):
        return
    if L.data == "fsdp":
        raise ValueError("zb-h1 computes weight gradients outside autograd: it does not run under FSDP here "
                         "(use data='ddp')")
    if any(p != "none" for p in layer_policies(L.recompute, cfg.n_layers)):
        raise ValueError("recompute with zb-h1: the zero-bubble split records each Linear call's input in "
                         "forward, which recomputation does not keep; use another schedule or recompute='none'")


def rule_batch(batch, dp, microbatches):
    """The global batch cuts into dp replicas of ``microbatches`` equal micro-batches."""
    if batch % dp:
        raise ValueError(f"the global batch ({batch} sequences) must be divisible by dp={dp}")
    if (batch // dp) % microbatches:
        raise ValueError(f"each DP replica's {batch // dp} sequences must cut into microbatches="
                         f"{microbatches} equal ones")


def rule_layout_batch(cfg, L):
    rule_batch(L.global_batch, L.dp, L.microbatches)
    if L.global_batch != L.dp * L.micro_batch * L.microbatches:
        raise ValueError(f"global_batch={L.global_batch} is not dp * micro_batch * microbatches = "
                         f"{L.dp} * {L.micro_batch} * {L.microbatches}")


# the plan's order: its steps call the same rules as they apply their dimension
RULES = (rule_names, rule_pipeline, rule_tensor, rule_sequence, rule_context, rule_experts, rule_fsdp)


def check_layout(cfg, layout=None, *, world_size=None, batch=None, **keywords) -> MeshShape:
    """Every constraint the layout puts on the model and the batch (the :data:`RULES`, then the
    world size and the batch), in plain arithmetic: call it before starting ranks. ValueError
    naming the first violated one; returns the :class:`MeshShape`. ``layout``: a
    :class:`~course_lib.layout.Layout`, or its fields as keywords (parallelize_nd's too:
    ``microbatches``, ``schedule``, ``sequence_parallel``, ``data``, ..., and ``batch``)."""
    L = as_layout(layout, batch=batch, **keywords)
    shape = MeshShape(**L.sizes)
    if world_size is not None and world_size != shape.world_size:
        s = shape.sizes
        raise ValueError(f"the layout dp*pp*cp*tp = {s['dp']}*{s['pp']}*{s['cp']}*{s['tp']} = {shape.world_size} "
                         f"ranks, but the world size is {world_size}: the product of the dimensions must equal it")
    for rule in RULES:
        rule(cfg, L)
    if "global_batch" in L.given:
        rule_layout_batch(cfg, L)
    return shape


__all__ = ["check_layout", "as_layout", "RULES", "positive_int", "partition_layers", "local_heads",
           "ulysses_heads", "rule_batch", "rule_names", "rule_pipeline", "splits_weight_gradients", "DATA"]
