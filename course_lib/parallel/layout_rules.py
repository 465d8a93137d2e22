"""The rules an N-D layout puts on the model and the batch, gathered from their dimensions.

Each dimension's module exports its rules (``pipeline.rules.rule_pipeline`` / ``rule_batch``,
``tp_plan.rule_tensor`` / ``rule_sequence``, ``context_parallel.rule_context``,
``expert_parallel.rule_experts``, ``fsdp.rule_fsdp``; the options' are here); the plan's steps
call them on every rank as they apply their dimension, and :func:`check_layout` calls them all,
in the plan's order, in plain arithmetic before any rank starts. Each raises a ValueError naming the constraint.

    shape = check_layout(cfg, Layout(dp=2, pp=2, cp=2, tp=2, global_batch=8, microbatches=2))
    shape = check_layout(cfg, dp=2, pp=2, cp=2, tp=2, batch=8, microbatches=2)    # the same
"""
from __future__ import annotations

from course_lib.layout import DATA, Layout, rank_order
from course_lib.parallel.context_parallel import rule_context, ulysses_heads  # noqa: F401  (re-exported)
from course_lib.parallel.expert_parallel import rule_experts
from course_lib.parallel.fsdp import rule_fsdp
from course_lib.parallel.zero_nd import rule_zero
from course_lib.parallel.mesh import MeshShape
from course_lib.parallel.pipeline.rules import (partition_layers, rule_batch, rule_pipeline,  # noqa: F401
                                               splits_weight_gradients)
from course_lib.parallel.tp_plan import local_heads, rule_sequence, rule_tensor  # noqa: F401
from course_lib.precision.mixed import check_precision
from course_lib.recompute import layer_policies
from course_lib.schedules import positive_int

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


def rule_order(L: Layout, mesh_order: tuple, given: bool) -> Layout:
    """The layout's rank order is the mesh's: a layout (or an ``order=`` keyword) given must say
    the mesh's order (build the mesh with ``Mesh.from_layout``); other keywords take the mesh's."""
    mine = rank_order(L.order, L.sizes)
    live = lambda order: tuple(d for d in order if L.sizes[d] > 1)      # (a dim of size 1 numbers nothing)
    if live(mine) == live(mesh_order):
        return L
    if given:
        raise ValueError(f"the layout's rank order {mine} differs from the mesh's {mesh_order}: build the "
                         f"mesh with Mesh.from_layout(layout) (or give both one order)")
    return L.with_(order=mesh_order)


def rule_fold_order(L: Layout, mesh_fold_order: str, given: bool) -> Layout:
    """The layout's expert fold order is the mesh's (as :func:`rule_order`): a layout given with
    experts must say the mesh's; otherwise the layout takes the mesh's."""
    if L.fold_order == mesh_fold_order:
        return L
    if given and L.ep * L.etp > 1:
        raise ValueError(f"the layout's fold_order {L.fold_order!r} differs from the mesh's {mesh_fold_order!r}: "
                         f"build the mesh with Mesh.from_layout(layout) (or give both one fold order)")
    return L.with_(fold_order=mesh_fold_order)



# ------------------------------------------------------------------------ the rules, in order
def rule_names(cfg, L):
    """The options: counts, a recompute policy and a precision that exist."""
    positive_int("microbatches", L.microbatches)
    positive_int("v", L.v)
    layer_policies(L.recompute, cfg.n_layers)      # an unknown recompute policy: ValueError naming it
    check_precision(L.precision)                   # an unknown precision: ValueError naming it


def rule_layout_batch(cfg, L):
    rule_batch(L.global_batch, L.dp, L.microbatches)
    if L.global_batch != L.dp * L.micro_batch * L.microbatches:
        raise ValueError(f"global_batch={L.global_batch} is not dp * micro_batch * microbatches = "
                         f"{L.dp} * {L.micro_batch} * {L.microbatches}")


# the plan's order: its steps call the same rules as they apply their dimension
RULES = (rule_names, rule_pipeline, rule_tensor, rule_sequence, rule_context, rule_experts, rule_fsdp, rule_zero)


def check_layout(cfg, layout=None, *, world_size=None, batch=None, **keywords) -> MeshShape:
    """Every constraint the layout puts on the model and the batch (the :data:`RULES`, then the
    world size and the batch), in plain arithmetic: call it before starting ranks. ValueError
    naming the first violated one; returns the :class:`MeshShape`. ``layout``: a
    :class:`~course_lib.layout.Layout`, or its fields as keywords (parallelize_nd's too:
    ``microbatches``, ``schedule``, ``sequence_parallel``, ``data``, ..., and ``batch``)."""
    L = as_layout(layout, batch=batch, **keywords)
    shape = MeshShape(**L.sizes, etp=L.etp, order=L.order, fold_order=L.fold_order)   # (ValueError naming a rule)
    if world_size is not None and world_size != shape.world_size:
        s = shape.sizes
        raise ValueError(f"the layout dp*pp*cp*tp = {s['dp']}*{s['pp']}*{s['cp']}*{s['tp']} = {shape.world_size} "
                         f"ranks, but the world size is {world_size}: the product of the dimensions must equal it")
    for rule in RULES:
        rule(cfg, L)
    if "global_batch" in L.given:
        rule_layout_batch(cfg, L)
    return shape


__all__ = ["check_layout", "as_layout", "rule_order", "rule_fold_order", "RULES", "positive_int", "partition_layers", "local_heads",
           "ulysses_heads", "rule_batch", "rule_names", "rule_pipeline", "splits_weight_gradients", "DATA"]
