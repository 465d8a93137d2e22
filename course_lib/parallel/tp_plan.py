"""Tensor (+ sequence) parallelism applied to the tiny GPT by a plan: which weight is column,
which is row, where a region starts (torchtitan's ``parallelize_module`` plan, in our words).

    model = TinyGPT(cfg, seed=0)                          # the same single-device model on every rank
    parallelize(model, mesh, sequence_parallel=True)      # slices it in place, returns it
    logits, loss = model(idx, targets)                    # logits (b, s, V_r): my vocabulary slice
    loss.backward()
    sync_tensor_parallel_grads(model)                     # SP: norm gradients summed over "tp"
    optimizer.step()                                      # on the local shards

Not a second model: the same modules, some replaced by their parallel versions built from
them (the names stay, so a checkpoint maps one to one), a hook where a region starts, and
the loss made vocabulary-parallel. With a data-parallel dimension too, sum the gradients
with ``GradSync(model.parameters(), mesh)`` instead: it reads the ("dp", "tp") marks.
"""
from __future__ import annotations

import fnmatch
import types

import torch
import torch.nn as nn

from course_lib.collectives.comm import Comm
from course_lib.parallel.async_tp import async_region_entry
from course_lib.parallel.mesh import get_reduce_dims, set_reduce_dims
from course_lib.parallel.placement import tp_placement
from course_lib.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelDropout,
                                                 TensorParallelRNG, check_same_everywhere, enter_sequence_parallel,
                                                 head_rows)
from course_lib.parallel.tp_backward_overlap import enter_tensor_parallel
from course_lib.parallel.vocab_parallel import (VocabParallelEmbedding, shard_range, vocab_parallel_cross_entropy,
                                               vocab_rule)

# module name pattern -> how it is split. "region": a tensor-parallel region starts at this
# module's input (f, or SP's g); "norm" / "positions": whole on every rank without SP,
# on the rank's s/t tokens with SP (gradients then summed over tp); dropout: the mask's stream.
PLAN = {
    "tok_emb": "vocab_embedding",              # rows of the table; output: g, or SP reduce-scatter
    "pos_emb": "positions",                    # GPT-2's learned positions: SP keeps my tokens' rows
    "emb_dropout": "dropout",
    "blocks.*.attn_norm": "norm",
    "blocks.*.attn": "region",
    "blocks.*.attn.wq": "column_heads",        # my query heads' rows
    "blocks.*.attn.wk": "column_kv_heads",     # my K/V heads' rows (or a copy of one)
    "blocks.*.attn.wv": "column_kv_heads",
    "blocks.*.attn.attn_dropout": "dropout_heads",
    "blocks.*.attn.wo": "row_heads",           # my heads' columns; output: g, or SP reduce-scatter
    "blocks.*.attn_out_dropout": "dropout",
    "blocks.*.mlp_norm": "norm",
    "blocks.*.mlp": "region",
    "blocks.*.mlp.w1": "column", "blocks.*.mlp.w3": "column", "blocks.*.mlp.fc": "column",
    "blocks.*.mlp.w2": "row", "blocks.*.mlp.proj": "row",
    "blocks.*.mlp_out_dropout": "dropout",
    "norm": "norm",
    "lm_head": "column_vocab",                 # logits stay split along the vocabulary
}
SP_DIMS = ("dp", "tp")  # a parameter used on s/t tokens: its gradient is summed over tp too


def tp_comm(mesh) -> Comm:
    """The tensor-parallel Comm of ``mesh``: a Mesh / GroupMesh with a "tp" dimension, or a Comm."""
    if isinstance(mesh, Comm):
        return mesh
    sizes = getattr(mesh, "sizes", None)
    if not isinstance(sizes, dict) or "tp" not in sizes:
        raise ValueError(f"tensor parallelism needs a mesh with a 'tp' dimension (Mesh(tp=...), "
                         f"as_mesh(group=..., dim='tp') or a Comm), got {mesh!r}")
    comm = mesh.comm("tp")
    if comm.size != sizes["tp"]:
        raise ValueError(f"the mesh says tp={sizes['tp']} but its tp group has {comm.size} ranks")
    return comm


def _style(name, plan):
    return next((style for pattern, style in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)


def _parent(model, name):
    parent, _, attr = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), attr


def local_heads(n_heads: int, n_kv_heads: int, tp: int) -> tuple[int, int]:
    """(query heads, K/V heads) one tensor-parallel rank holds, by TP's own split
    (:func:`~course_lib.parallel.tensor_parallel.head_rows`: ValueError where heads cannot be cut)."""
    (q0, q1), (k0, k1), _ = head_rows(n_heads, n_kv_heads, 1, tp, 0)
    return q1 - q0, k1 - k0


def mlp_width_rule(width: int, tp: int):
    """A column / row split of the MLP cuts its width into tp equal parts."""
    if width % tp:
        raise ValueError(f"the MLP width {width} is not divisible by tp={tp}")


def rule_tensor(cfg, layout):
    """TP's rules for a TinyGPT config: heads, MLP width, vocabulary (an MoE's experts are on
    their own mesh: expert_parallel.rule_experts)."""
    if layout.tp == 1:
        return
    local_heads(cfg.n_heads, cfg.n_kv_heads, layout.tp)
    if not cfg.n_experts:
        mlp_width_rule(cfg.ffn_hidden, layout.tp)
    vocab_rule(cfg.vocab_size, layout.tp)


def rule_sequence(cfg, layout):
    """SP scatters each rank's seq_len / cp tokens over tp; async TP decomposes SP's collectives."""
    if getattr(layout, "async_tp", False) and (layout.tp == 1 or not layout.sp):
        raise ValueError(f"async_tp decomposes sequence parallelism's all-gather and reduce-scatter: it "
                         f"needs sequence_parallel=True and tp > 1 (got sp={layout.sp}, tp={layout.tp})")
    tokens = cfg.seq_len // layout.cp
    if layout.tp > 1 and layout.sp and tokens % layout.tp:
        raise ValueError(f"sequence parallelism splits each rank's {tokens} tokens over tp={layout.tp}: "
                         f"not divisible")


def check_plan(model, plan, comm):
    """Every split the plan asks for is possible (ValueError naming the constraint: the rules
    above), and every Linear / Embedding has a place in the plan. Runs before anything is modified."""
    t, r = comm.size, comm.rank
    for name, mod in model.named_modules():
        style = _style(name, plan)
        if style is None and isinstance(mod, (nn.Linear, nn.Embedding)):
            raise ValueError(f"the plan does not say how to split {name} ({type(mod).__name__}); add it "
                             f"to the plan")
        if style in ("column_heads", "column_kv_heads", "row_heads"):
            attn = _parent(model, name)[0]
            head_rows(attn.n_heads, attn.n_kv_heads, attn.head_dim, t, r)
        elif style == "column":
            mlp_width_rule(mod.out_features, t)
        elif style == "row":
            mlp_width_rule(mod.in_features, t)
        elif style in ("vocab_embedding", "column_vocab"):
            vocab_rule(mod.weight.shape[0], t)


def parallelize(model, mesh, *, sequence_parallel=False, keep_gathered=False, seed=0, plan=None,
                async_tp=False):
    """Make ``model`` (a TinyGPT, the same on every rank) tensor-parallel over ``mesh``'s "tp"
    group, in place; with ``sequence_parallel`` the activations between the regions are split
    along the sequence. ``keep_gathered``: SP keeps the all-gathered region inputs for backward
    (torch DTensor's way: less communication, t x more memory for them) instead of re-gathering
    them (Megatron's). ``seed``: of the dropout streams (:class:`TensorParallelRNG`).
    ``async_tp``: SP's all-gathers and reduce-scatters decomposed under the matmuls
    (:mod:`course_lib.parallel.async_tp`; needs sequence_parallel)."""
    plan = PLAN if plan is None else plan
    comm = tp_comm(mesh)
    t, r, sp = comm.size, comm.rank, bool(sequence_parallel)
    if async_tp and not sp:
        raise ValueError("async_tp decomposes sequence parallelism's collectives: it needs sequence_parallel=True")
    run_async = bool(async_tp) and t > 1
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError("this model is already tensor-parallel: parallelize it once")
    check_same_everywhere(model, comm, "parallelize")
    check_plan(model, plan, comm)
    device = next(model.parameters()).device
    rng = TensorParallelRNG(comm, seed, device)
    out = "reduce_scatter" if sp else "reduce"
    heads = {name: (m.n_heads, m.n_kv_heads, m.head_dim) for name, m in model.named_modules()  # before any slicing
             if hasattr(m, "n_kv_heads") and hasattr(m, "head_dim")}
    for name, mod in list(model.named_modules()):
        style = _style(name, plan)
        if style is None:
            continue
        parent, attr = _parent(model, name)
        new = None
        if style in ("column_heads", "column_kv_heads", "row_heads"):
            q, kv, copies = head_rows(*heads[name.rpartition(".")[0]], t, r)
            if style == "column_heads":
                new = ColumnParallelLinear(mod, comm, input="entered", rows=q, check=False)
            elif style == "column_kv_heads":
                new = ColumnParallelLinear(mod, comm, input="entered", rows=kv, copies=copies, check=False)
            else:
                new = RowParallelLinear(mod, comm, output=out, cols=q, check=False, async_tp=run_async)
        elif style == "column":
            new = ColumnParallelLinear(mod, comm, input="entered", check=False)
        elif style == "row":
            new = RowParallelLinear(mod, comm, output=out, check=False, async_tp=run_async)
        elif style == "column_vocab":
            new = ColumnParallelLinear(mod, comm, input="sequence" if sp else "replicated", keep_gathered=keep_gathered,
                                       rows=shard_range(mod.out_features, t, r), check=False, async_tp=run_async)
        elif style == "vocab_embedding":
            new = VocabParallelEmbedding(mod, comm, output=out)
        elif style == "region":
            mod.register_forward_pre_hook(async_region_entry(comm, _region_columns) if run_async
                                          else _region_entry(comm, sp, keep_gathered))
        elif style in ("norm", "positions") and sp:
            set_reduce_dims(mod, SP_DIMS)              # each rank's gradient covers its tokens only
            if style == "positions":                   # (s, h) -> my (s/t, h) rows
                mod.register_forward_hook(lambda m, args, y: y.chunk(t, 0)[r])
        elif style in ("dropout", "dropout_heads"):
            sharded = sp or style == "dropout_heads"
            new = TensorParallelDropout(mod.p, rng.sharded if sharded else rng.replicated,
                                        region="sharded" if sharded else "replicated")
        if new is not None:                            # (a row layer marks its SP bias itself)
            setattr(parent, attr, new)
    if getattr(getattr(model, "config", None), "tie_embeddings", False) and \
            getattr(model, "lm_head", None) is not None and getattr(model, "tok_emb", None) is not None:
        model.lm_head.weight = model.tok_emb.weight    # the same rows of the same table: still one
    model.tensor_parallel = types.SimpleNamespace(comm=comm, sequence_parallel=sp, rng=rng, plan=plan,
                                                  keep_gathered=keep_gathered, placements=tp_placements(model, t),
                                                  async_tp=run_async)
    model.loss = types.MethodType(_vocab_parallel_loss, model)
    return model


def tp_slice_of(p):
    """The TP layers' tag on a parameter they cut (``slice_parameter``): ((dim, start, stop,
    full size), copies), or (None, 1). Read here only, into the plan's :class:`Placement`."""
    return getattr(p, "tp_shard", None), getattr(p, "tp_copies", 1)


def tp_placements(model, t) -> dict:
    """{name: Placement} of a model ``parallelize`` cut over ``t`` ranks (``reduce``: its marks)."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tp, copies = tp_slice_of(p)
        shape = [tp[3] if tp and i == tp[0] else n for i, n in enumerate(p.shape)]
        out[name] = tp_placement(shape, tp, copies, get_reduce_dims(p, ("dp",)), t)
    return out


def _region_entry(comm, sp, keep_gathered):
    def enter(module, args):  # f, or SP's g: once for every column layer of the region
        x, *rest = args
        # (the region's input is read by its column layers only: f sums their gradient in place)
        x = enter_sequence_parallel(x, comm, keep_gathered) if sp else enter_tensor_parallel(x, comm)
        return (x, *rest)
    return enter


def _region_columns(module):
    """The column layers reading a region's input (W_q, W_k, W_v; W_1, W_3): one async TP ring."""
    return [m for m in module.children() if isinstance(m, ColumnParallelLinear) and m.input == "entered"]


def _vocab_parallel_loss(model, logits, targets, n_tokens=None):
    """TinyGPT.loss on vocabulary-split logits (the same number on every rank)."""
    return vocab_parallel_cross_entropy(logits, targets, model.tensor_parallel.comm, model.lm_head.rows[0],
                                        n_tokens)


def sync_tensor_parallel_grads(model):
    """Sum over the tp group the gradients of the parameters marked ("dp", "tp") (sequence
    parallelism: norm weights, row-parallel biases, positions, each used on s/t tokens).
    One all-reduce; returns how many parameters it summed. Sharded weights are NOT summed:
    each rank's gradient of its own slice is already complete."""
    state = getattr(model, "tensor_parallel", None)
    if state is None:
        raise ValueError("sync_tensor_parallel_grads: the model is not tensor-parallel (call parallelize first)")
    params = [p for p in model.parameters() if p.grad is not None and "tp" in get_reduce_dims(p, ())]
    if params and state.comm.size > 1:
        flat = torch.cat([p.grad.flatten() for p in params])
        state.comm.all_reduce(flat, name="SP: norm gradients all-reduce")
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p.grad))
    return len(params)


def local_shards(model, grads=False) -> dict:
    """{name: (tensor, tp_shard)}: this rank's parameters (or gradients) and where each sits in
    the single-device tensor, ``(dim, start, stop, full size)`` or None (whole). Picklable."""
    out, where = {}, model.tensor_parallel.placements
    for name, p in model.named_parameters():
        value = p.grad if grads else p
        out[name] = (None if value is None else value.detach().clone(), where[name].tp)
    return out


def assemble(per_rank) -> dict:
    """The single-device tensors from every rank's :func:`local_shards` (in rank order)."""
    full = {}
    for name, (first, shard) in per_rank[0].items():
        if first is None or shard is None:
            full[name] = first
            continue
        dim, _, _, size = shard
        shape = list(first.shape)
        shape[dim] = size
        out = first.new_zeros(shape)
        for shards in per_rank:
            value, (_, start, stop, _) = shards[name]
            out.narrow(dim, start, stop - start).copy_(value)
        full[name] = out
    return full


def torch_parallelize(model, t, sequence_parallel=False):
    """The same split with torch's own tensor parallelism (``torch.distributed.tensor.parallel``
    on DTensor, torchtitan's Llama plan): ColwiseParallel / RowwiseParallel on the weights,
    SequenceParallel on the norms, PrepareModuleInput where a region starts. Llama blocks;
    run forward and backward inside ``loss_parallel()`` (the logits stay vocabulary-split).
    ``t``: the TP degree (a 1-D mesh over all ranks), or a 1-D DeviceMesh (``mesh["tp"]``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    mesh = init_device_mesh("cpu", (t,)) if isinstance(t, int) else t
    seq = Shard(1) if sequence_parallel else Replicate()  # the activations between the regions
    parallelize_module(model, mesh, {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)})
    for block in model.blocks:
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=seq), "mlp.w1": ColwiseParallel(),
                "mlp.w3": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=seq)}
        if sequence_parallel:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                         "attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                    desired_input_layouts=(Replicate(), None)),
                         "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        parallelize_module(block, mesh, plan)
    return model


__all__ = ["PLAN", "parallelize", "check_plan", "local_heads", "mlp_width_rule", "vocab_rule", "rule_tensor",
           "rule_sequence", "tp_slice_of", "tp_placements", "sync_tensor_parallel_grads", "local_shards", "assemble", "tp_comm",
           "torch_parallelize"]
