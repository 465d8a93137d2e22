"""The rules an N-D layout puts on the model and the batch: one function per constraint.

``check_layout`` calls every rule in plain arithmetic, before any rank starts; the ranks
call the same functions (``parallelize_nd`` runs ``check_layout`` on every rank, and the
layers that enforce a rule at run time, e.g. Ulysses' head split, call its rule), so the
check and the ranks cannot drift apart. Each rule raises a ValueError naming the constraint.

    shape = check_layout(cfg, dp=2, pp=2, cp=2, tp=2, batch=8, microbatches=2)
"""
from __future__ import annotations

from dataclasses import dataclass

from course_lib.parallel.mesh import MeshShape
from course_lib.parallel.tensor_parallel import head_rows
from course_lib.parallel.vocab_parallel import shard_range
from course_lib.precision.mixed import check_precision
from course_lib.recompute import layer_policies
from course_lib.schedules import make_schedule, positive_int, schedule_name, validate

DATA = ("ddp", "fsdp")
CP_METHODS = ("ring", "ulysses")
CP_LAYOUTS = ("zigzag", "contiguous")


def partition_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous, balanced (:func:`shard_range`): the first ``n_layers % n_stages`` stages
    get one layer more."""
    if n_stages > n_layers:
        raise ValueError(f"more pipeline stages ({n_stages}) than layers ({n_layers}): every stage needs a layer")
    return [range(*shard_range(n_layers, n_stages, i)) for i in range(n_stages)]


def local_heads(n_heads: int, n_kv_heads: int, tp: int) -> tuple[int, int]:
    """(query heads, K/V heads) one tensor-parallel rank holds, by TP's own split
    (:func:`~course_lib.parallel.tensor_parallel.head_rows`: ValueError where heads cannot be cut)."""
    (q0, q1), (k0, k1), _ = head_rows(n_heads, n_kv_heads, 1, tp, 0)
    return q1 - q0, k1 - k0


def ulysses_heads(q_heads: int, kv_heads: int, cp: int):
    """Ulysses hands each CP rank heads / cp of the local query and K/V heads."""
    if q_heads % cp or kv_heads % cp:
        raise ValueError(f"Ulysses needs the local query heads ({q_heads}) and key/value heads ({kv_heads}) "
                         f"divisible by cp={cp}; use ring attention instead")


@dataclass(frozen=True)
class NDLayout:
    """Everything ``parallelize_nd`` is asked to do, as plain values."""
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    microbatches: int = 1
    v: int = 1
    schedule: object = "1f1b"       # a name, or an action list per pp rank
    sequence_parallel: bool = True
    cp_method: str = "ring"
    cp_layout: str = "zigzag"
    data: str = "ddp"
    recompute: object = "none"      # a policy, or one per block (course_lib.recompute)
    precision: str = "full"         # course_lib.precision.mixed.PRECISIONS


# ------------------------------------------------------------------------ the rules, in order
def rule_names(cfg, L):
    if L.data not in DATA:
        raise ValueError(f"data must be one of {DATA}, got {L.data!r}")
    if L.cp_method not in CP_METHODS or L.cp_layout not in CP_LAYOUTS:
        raise ValueError(f"cp_method must be one of {CP_METHODS} and cp_layout one of {CP_LAYOUTS}, "
                         f"got {L.cp_method!r}, {L.cp_layout!r}")
    positive_int("microbatches", L.microbatches)
    positive_int("v", L.v)
    layer_policies(L.recompute, cfg.n_layers)      # an unknown recompute policy: ValueError naming it
    check_precision(L.precision)                   # an unknown precision: ValueError naming it


def rule_pipeline(cfg, L):
    """Stages: at least one layer each; the schedule exists for (p, m, v) (v > 1: interleaved)."""
    if isinstance(L.schedule, str):
        make_schedule(schedule_name(L.schedule, L.v), L.pp, L.microbatches, L.v)
    else:
        validate(L.schedule, L.pp, L.microbatches, L.v)
    partition_layers(cfg.n_layers, L.pp * L.v)


def rule_tensor(cfg, L):
    if L.tp == 1:
        return
    local_heads(cfg.n_heads, cfg.n_kv_heads, L.tp)
    if cfg.n_experts:
        raise ValueError("the MoE variant's experts are not tensor-parallel here: split them with ep "
                         "(inside dp) and keep tp=1")
    if cfg.ffn_hidden % L.tp:
        raise ValueError(f"the MLP width {cfg.ffn_hidden} is not divisible by tp={L.tp}")
    if cfg.vocab_size < L.tp:
        raise ValueError(f"a vocabulary of {cfg.vocab_size} rows cannot be split over tp={L.tp}")


def rule_context(cfg, L):
    if L.cp == 1:
        return
    parts = 2 * L.cp if L.cp_layout == "zigzag" else L.cp
    if cfg.seq_len % parts:
        raise ValueError(f"context parallelism ({L.cp_layout}) cuts the sequence into {parts} chunks: "
                         f"seq_len={cfg.seq_len} must be divisible by {parts}")
    if L.cp_method == "ulysses":
        ulysses_heads(*local_heads(cfg.n_heads, cfg.n_kv_heads, L.tp), L.cp)
    if cfg.n_experts:
        raise ValueError("the MoE variant routes each rank's tokens as one group: keep cp=1 with experts "
                         "(a CP shard is not a contiguous group of the single-device batch)")
    if cfg.dropout:
        raise ValueError("context parallelism here has no attention dropout (Llama trains without)")


def rule_sequence(cfg, L):
    tokens = cfg.seq_len // L.cp
    if L.tp > 1 and L.sequence_parallel and tokens % L.tp:
        raise ValueError(f"sequence parallelism splits each rank's {tokens} tokens over tp={L.tp}: not divisible")


def rule_experts(cfg, L):
    if L.ep == 1:
        return
    if not cfg.n_experts:
        raise ValueError(f"ep={L.ep} splits experts, but the model has none (GPTConfig(n_experts=...))")
    if cfg.n_experts % L.ep:
        raise ValueError(f"the number of experts ({cfg.n_experts}) must be divisible by ep={L.ep}")


def rule_fsdp(cfg, L):
    if L.data != "fsdp":
        return
    split = schedule_name(L.schedule, L.v) == "zb-h1" if isinstance(L.schedule, str) else \
        any(a[0] == "W" for row in L.schedule for a in row)
    if split:
        raise ValueError("zb-h1 computes weight gradients outside autograd: it does not run under FSDP here "
                         "(use data='ddp')")
    if cfg.tie_embeddings and L.pp * L.v > 1:
        raise ValueError("a tied embedding on two pipeline stages (pp > 1, or pp = 1 with v > 1 chunks) is "
                         "one weight in two FSDP units: not supported here; untie it or use data='ddp'")


def rule_recompute(cfg, L):
    """Recomputation re-runs a block inside autograd's backward: the zero-bubble split (weight
    gradients from recorded Linear calls, outside autograd) cannot see inside it."""
    if all(p == "none" for p in layer_policies(L.recompute, cfg.n_layers)):
        return
    split = schedule_name(L.schedule, L.v) == "zb-h1" if isinstance(L.schedule, str) else \
        any(a[0] == "W" for row in L.schedule for a in row)
    if split:
        raise ValueError("recompute with zb-h1: the zero-bubble split records each Linear call's input in "
                         "forward, which recomputation does not keep; use another schedule or recompute='none'")


def rule_batch(batch, dp, microbatches):
    """The global batch cuts into dp replicas of ``microbatches`` equal micro-batches."""
    if batch % dp:
        raise ValueError(f"the global batch ({batch} sequences) must be divisible by dp={dp}")
    if (batch // dp) % microbatches:
        raise ValueError(f"each DP replica's {batch // dp} sequences must cut into microbatches="
                         f"{microbatches} equal ones")


RULES = (rule_names, rule_pipeline, rule_tensor, rule_context, rule_sequence, rule_experts, rule_fsdp,
         rule_recompute)


def check_layout(cfg, *, world_size=None, batch=None, **layout) -> MeshShape:
    """Every constraint the layout puts on the model and the batch (the :data:`RULES`, then the
    world size and the batch), in plain arithmetic: call it before starting ranks. ValueError
    naming the first violated one; returns the :class:`MeshShape`. ``layout``: the fields of
    :class:`NDLayout` (dp, pp, cp, tp, ep, microbatches, v, schedule, ...)."""
    shape = MeshShape(**{d: layout.get(d, 1) for d in ("dp", "pp", "cp", "tp", "ep")})
    if world_size is not None and world_size != shape.world_size:
        s = shape.sizes
        raise ValueError(f"the layout dp*pp*cp*tp = {s['dp']}*{s['pp']}*{s['cp']}*{s['tp']} = {shape.world_size} "
                         f"ranks, but the world size is {world_size}: the product of the dimensions must equal it")
    L = NDLayout(**layout)
    for rule in RULES:
        rule(cfg, L)
    if batch is not None:
        rule_batch(batch, L.dp, L.microbatches)
    return shape


__all__ = ["check_layout", "NDLayout", "RULES", "positive_int", "partition_layers", "local_heads",
           "ulysses_heads", "rule_batch", "DATA"]
