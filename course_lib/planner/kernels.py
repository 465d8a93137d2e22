"""The kernels of the course's own program, counted: how many it launches and what each moves.

Each aten op is priced as the GPU runs it (:mod:`course_lib.planner.kernel_cost`: FLOPs, bytes,
class, seconds on the device); the host issues one op every ``Hardware.launch_overhead``
seconds (eager PyTorch), so a run of kernels takes their work or their issue, the longer
(:meth:`Kernels.seconds`). The virtual clock (``course_lib.virtual``) prices every op of a
running rank the same way; the planner's ``runtime="course"`` counts the same ops of the
course's TinyGPT once, on PyTorch's ``meta`` device (shapes, no data, any size), with
:func:`trace_step`, and AdamW as torch runs it on CUDA (foreach: one op per operation and step,
:func:`_adamw`): the count is the program's own, not a constant.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.meta import balanced_topk, mixed_devices, to_meta
from course_lib.planner.kernel_cost import (ATTENTION, CLASSES, COPY, CPU_KERNELS, ELEMENTWISE, FOREACH,  # noqa: F401
                                            FREE, GEMM, RATED, KernelModel, compute_dtype, foreach_launches,
                                            kernel_kind, op_cost)


@dataclass(frozen=True)
class Kernels:
    """Kernels a piece of the program launches: how many, their FLOPs and bytes, and their time
    on a Hardware (each at its own roofline, summed, launches included)."""

    count: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    time: float = 0.0           # seconds of the kernels' work (sum of their rooflines, no floor, no host)
    device: float = 0.0         # seconds on the device: each kernel its roofline or the floor, the longer

    def __add__(self, o):
        return Kernels(self.count + o.count, self.flops + o.flops, self.bytes + o.bytes, self.time + o.time,
                       self.device + o.device)

    def __sub__(self, o):
        return Kernels(self.count - o.count, self.flops - o.flops, self.bytes - o.bytes, self.time - o.time,
                       self.device - o.device)

    def scaled(self, data: float) -> "Kernels":
        """The same kernels on ``data`` times the elements (time and bytes scale, count does not)."""
        return Kernels(self.count, self.flops * data, self.bytes * data, self.time * data, self.device * data)

    def times(self, n: int) -> "Kernels":
        """``n`` runs of the same kernels."""
        return Kernels(self.count * n, self.flops * n, self.bytes * n, self.time * n, self.device * n)

    def seconds(self, hw) -> float:
        """Their work, or ``count`` times the longer of the kernel floor and the host's issue
        interval if that is longer (many small kernels: eager PyTorch paces them)."""
        return max(self.time, self.count * max(hw.kernel_floor, hw.launch_overhead))


class KernelCounter(TorchDispatchMode):
    """Inside the block, every op torch runs is counted as a kernel: ``total`` and ``by_op``
    (launches, FLOPs, bytes; with ``hw``, its roofline time on that GPU, else 0)."""

    def __init__(self, hw, itemsize, record: bool = False):
        super().__init__()
        self.model = KernelModel(hw, {2: "bfloat16", 4: "float32"}.get(itemsize, "bfloat16")) if hw is not None else None
        self.hw, self.models = hw, {}           # itemsize None: a GEMM's / attention's rate is its dtype's
        self.itemsize, self.total, self.by_op = itemsize, Kernels(), {}
        self.ops = [] if record else None       # record=True: (name, Kernels) of every op, in order
        self.by_class = {}                      # kernel class -> bytes its kernels move

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _TOPK and args[0].is_meta:        # a router's choice: balanced (meta.balanced_topk)
            out = balanced_topk(*args, **kwargs)
        elif func is _READ and args[0].is_meta:      # a value read on meta is 1, as the dry run reads it
            out = 1.0 if args[0].is_floating_point() else 1     # (virtual.priced.MetaScalars)
        else:
            if mixed_devices(args):                         # routing indices (values) meet meta activations
                args = tuple(to_meta(a) for a in args)
            out = func(*args, **kwargs)
        if func is _READ and self.ops is not None:     # the host reads a value: it waits for the stream
            self.ops.append(("|read", None))
        cost = op_cost(func, args, kwargs, out, self.itemsize)
        if cost is not None:
            model = self.model
            if model is not None and self.itemsize is None and cost[2] in RATED:   # as the clock's own dtypes
                dtype = compute_dtype(args, out)
                model = self.models.get(dtype) or self.models.setdefault(
                    dtype, KernelModel(self.hw, str(dtype).removeprefix("torch.")))
            t = model.roofline(*cost) if model is not None else 0.0
            floor = model.floor if model is not None else 0.0
            k, name = Kernels(1, cost[0], cost[1], t, max(t, floor)), func.overloadpacket.__name__
            self.total = self.total + k
            self.by_op[name] = self.by_op.get(name, Kernels()) + k
            self.by_class[cost[2]] = self.by_class.get(cost[2], 0) + cost[1]
            if self.ops is not None:
                self.ops.append((name, k))
        return out


_TOPK = torch.ops.aten.topk.default
_READ = torch.ops.aten._local_scalar_dense.default


def course_config(model, layers, recompute="none", seq_len=None):
    """The course's GPTConfig of ``model`` at ``layers`` layers; a mixture of experts as the
    course runs it (experts with the model's MLP, capacity factor 1.25);
    ``seq_len``: the sequence (else the model's)."""
    from course_lib.gpt import GPTConfig
    moe = {}
    if model.n_experts > 1:
        moe = dict(n_experts=model.n_experts, top_k=model.top_k, capacity_factor=1.25,
                   expert_mlp=model.mlp)
    return GPTConfig(vocab_size=model.vocab, seq_len=seq_len or model.seq_len, n_layers=layers, hidden=model.hidden,
                     n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, ffn_hidden=model.ffn,
                     block="gpt2" if model.mlp == "gelu" else "llama", tie_embeddings=model.tied,
                     recompute=recompute, **moe)


def tp_rank(net, model, t: int) -> None:
    """``net`` (on meta) cut in place as one of ``t`` tensor-parallel ranks holds it, Megatron's
    split as the course's ``parallel/`` runs it: each block's query, key/value and MLP input
    matrices by rows (its heads, at least one K/V head; its FFN columns), its output matrices by
    columns (their bias whole: added once, after the sum), the embedding and LM head by
    vocabulary rows; the norms and an MoE layer whole (its experts are the expert mesh's). Shapes
    only (meta): the same program, on a rank's shapes."""
    def cut(linear, rows=None, cols=None):
        out, inp = linear.weight.shape
        linear.weight = torch.nn.Parameter(torch.empty(rows or out, cols or inp, device="meta"))
        if rows and linear.bias is not None:
            linear.bias = torch.nn.Parameter(torch.empty(rows, device="meta"))
    d, share = model.head_dim, (lambda n: -(-n // t))
    for block in net.blocks:
        attn, mlp = block.attn, block.mlp
        cut(attn.wq, rows=share(model.n_heads) * d)
        for w in (attn.wk, attn.wv):
            cut(w, rows=max(1, model.n_kv_heads // t) * d)
        cut(attn.wo, cols=share(model.n_heads) * d)
        if hasattr(mlp, "moe"):        # an MoE's experts are cut by the expert mesh, not by TP; its
            continue                   # router is whole (with SP each TP rank routes its s / tp tokens)
        first, second = (("w1", "w3"), "w2") if hasattr(mlp, "w1") else (("fc",), "proj")
        for name in first:
            cut(getattr(mlp, name), rows=share(model.ffn))
        cut(getattr(mlp, second), cols=share(model.ffn))
    rows = share(model.vocab)
    net.tok_emb.weight = torch.nn.Parameter(torch.empty(rows, model.hidden, device="meta"))
    if model.tied:
        net.lm_head.weight = net.tok_emb.weight
    else:
        cut(net.lm_head, rows=rows)


class _RowLinear(torch.nn.Linear):
    """An output Linear as the course's ``RowParallelLinear`` runs it: the partial sum (a GEMM
    without the bias), then the group's sum (``reduced(y)``: where :func:`_mark_tp` marks the
    blocking collective), then the bias, added once to the summed output (its own kernel after
    the collective, on a rank's s / t tokens under SP). Traced as one ``addmm``, the bias in its
    epilogue before the sum, GPT 22B's TP 8 forward on H100s was 13% fast against the dry run:
    two (s, h) adds a layer, each paced by the host after the collective it waits for."""

    reduced = staticmethod(lambda y: None)

    def forward(self, x):
        y = torch.nn.functional.linear(x, self.weight)
        self.reduced(y)
        return y + self.bias if self.bias is not None else y


def _copied(g) -> None:
    if not (g.is_contiguous() and g._base is None):
        g.contiguous().clone()


def f_copies(net) -> None:
    """Without SP, ``f`` (a tensor-parallel region's entry) all-reduces dX in backward in place
    only where dX is a whole fresh tensor, else a copy of it, as the course's
    ``comm_ops._all_reduce`` does: each region's input (attention's, a dense MLP's, the LM
    head's) gets that copy in its gradient's hook, before the all-reduce's mark
    (:func:`_mark_tp`, installed after). A column layer's dX reshaped from its GEMM's output is
    a view (GPT-2's MLP, the head: one copy each); the attention's three dX, summed by
    autograd, are fresh. On both traces, so that their ops pair."""
    def pre(mod, args):
        if isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(_copied)
    for block in net.blocks:
        block.attn.register_forward_pre_hook(pre)
        if not hasattr(block.mlp, "moe"):
            block.mlp.register_forward_pre_hook(pre)
    net.lm_head.register_forward_pre_hook(pre)


def row_outputs(net) -> None:
    """Each block's output Linears (attention's, a dense MLP's second) made :class:`_RowLinear`
    in place, as a TP rank runs them; the whole model's trace too, so that its ops pair with a
    rank's one for one (:func:`_rank_pass`)."""
    for block in net.blocks:
        mlp = block.mlp
        block.attn.wo.__class__ = _RowLinear
        if not hasattr(mlp, "moe"):
            (mlp.w2 if hasattr(mlp, "w2") else mlp.proj).__class__ = _RowLinear


class _Pass:
    """One traced pass as a rank runs it: its kernels in order, their total and by op."""

    def __init__(self, ops):
        self.ops, self.total, self.by_op = ops, Kernels(), {}
        for name, k in ops:
            if k is None:                           # a mark (:func:`_mark_tp`)
                continue
            self.total = self.total + k
            self.by_op[name] = self.by_op.get(name, Kernels()) + k


def _rank_pass(whole, local, t: int, sp: bool, c: int, floor: float) -> _Pass:
    """The kernels of one tensor- and context-parallel rank, from the pass traced on one device
    (``whole``) and on a TP rank's shapes (``local``, the same ops in the same order, and the
    marks of :func:`_mark_tp`, kept in place): with SP an op TP does not cut (it costs what it
    costs on one device: a norm, a residual add) runs on 1/t of the tokens; a CP rank runs every
    op on 1/c of its tokens, except the embedding's backward, which writes its whole table. The
    vocabulary-parallel embedding looks every token up (then reduce-scatters). Each op at least
    the floor."""
    ops, kernels = [], iter([op for op in whole.ops if op[1] is not None])
    for name, k in local.ops:
        if k is None:                               # a mark
            ops.append((name, None))
            continue
        w = next(kernels)[1]
        uncut = (w.flops, w.bytes) == (k.flops, k.bytes) and not name.startswith("embedding")
        share = (c if name != "embedding_dense_backward" else 1) * (t if sp and t > 1 and uncut else 1)
        k = Kernels(1, k.flops / share, k.bytes / share, k.time / share, max(k.time / share, floor))
        ops.append((name, k))
    return _Pass(ops)


def _mark_tp(net, where: list, sp: bool, collectives: bool = True) -> None:
    """Marks in ``where[-1]`` (the running counter's op list) where one TP rank's program issues a blocking
    collective ("|all_gather", "|reduce_scatter", "|all_reduce", as :func:`runtime.tp_calls`
    counts them) and where each part begins ("|block i", "|head"; backward "|bblock i", "|bemb"):
    module hooks on the forward, gradient hooks for the backward (with full recomputation the
    block's forward runs again in the backward, its marks too). ``collectives=False``: the parts'
    marks only (a context-parallel rank without TP: the host's reads are its waits)."""
    def mark(what):
        if collectives or what.startswith(("block", "bblock", "bemb", "head")):
            where[-1].append(("|" + what, None))

    def on_grad(x, *what):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(lambda g: [mark(w) for w in what] and None)

    def sublayer(module, row):     # attention, MLP: column- then row-parallel
        def pre(mod, args):
            if sp:
                mark("all_gather")
            on_grad(args[0], *(("all_gather", "reduce_scatter") if sp else ("all_reduce",)))

        def summed(y):             # the row layer's partial sum, before its bias
            mark("reduce_scatter" if sp else "all_reduce")
            if sp:
                on_grad(y, "all_gather")
        module.register_forward_pre_hook(pre)
        if isinstance(row, _RowLinear):
            row.reduced = summed
        else:
            module.register_forward_hook(lambda mod, args, out: summed(out))
    for i, block in enumerate(net.blocks):
        block.register_forward_pre_hook(lambda mod, args, i=i: mark(f"block {i}"))
        block.register_forward_hook(lambda mod, args, out, i=i: on_grad(out, f"bblock {i}"))
        sublayer(block.attn, block.attn.wo)
        mlp = block.mlp
        if not hasattr(mlp, "moe"):     # an MoE under SP routes the rank's own tokens: no TP calls
            sublayer(mlp, mlp.w2 if hasattr(mlp, "w2") else mlp.proj)

    def embedded(mod, args, out):
        mark("reduce_scatter" if sp else "all_reduce")
        on_grad(out, *(("bemb", "all_gather") if sp else ("bemb",)))
    net.tok_emb.register_forward_hook(embedded)
    net.norm.register_forward_pre_hook(lambda mod, args: mark("head"))

    def head(mod, args):
        if sp:
            mark("all_gather")
        on_grad(args[0], *(("all_gather", "reduce_scatter") if sp else ("all_reduce",)))
    net.lm_head.register_forward_pre_hook(head)


@functools.lru_cache(maxsize=64)
def trace_step(model, hw, b: int, s: int, itemsize: int | None = 2, recompute: str = "none", tp: int = 1,
               sp: bool = False, cp: int = 1, ring: str | None = None, order: bool = False,
               method: str = "ring", ep: int = 0, etp: int = 1) -> dict:
    """The kernels of one forward + backward of the course's TinyGPT with ``model``'s shapes on
    one micro-batch of ``b`` sequences of ``s`` tokens, by part and pass: "layer_fwd"/"layer_bwd"
    (one block), "embedding_*", "head_*" (final norm, LM head, loss); "tensors_per_layer" /
    "tensors_outside" (parameter tensors); "params": (name, elements) of each parameter of the one-block model, on a
    TP rank, in registration order; "param_shapes": ((name, shape), ...) of the one-block model, uncut;
    "adamw_per_element": one AdamW step as torch runs it
    on CUDA (its ops per step, bytes and time per element). Traced on the meta device at two
    depths: a block is their difference. ``recompute``: the blocks' policy (GPTConfig's), its
    forward again inside the backward. ``tp``, ``sp``, ``cp``: the kernels of one rank of that
    tensor- (:func:`tp_rank`) and context-parallel layout (:func:`_rank_pass`: every op on 1/cp
    of the tokens); each kernel's ``device`` time is its roofline or the GPU's floor, the longer.
    ``ring`` (cp > 1; "zigzag" or "contiguous", the ranks' split): a CP rank's own program
    instead, traced on its s / cp tokens at their positions with ring attention
    (:mod:`.ring_ops`), the busiest rank's; "sequence" then holds its order, the host's value
    reads marked (the ring's trim reads its positions); ``method`` "all_gather" or "ulysses": that
    CP rank's program instead (:mod:`.cp_ops`: Llama 3's all-gathered K/V, FlashAttention per
    query chunk where ``hw`` states fused attention; Ulysses' head shards, its core FlashAttention on the sequence put in order where ``hw``
    states fused attention, else written out),
    the busiest rank's. ``ep`` >= 1: an MoE's layers as expert-parallel rank 0 of ``ep`` runs them
    (:mod:`.ep_ops`: its E / ep experts on the rows every rank routes to them, its dispatch's
    bookkeeping; ``etp``: etp rank 0's slices of them, its etp group's rows gathered; the
    layouts :func:`~.ep_ops.traced_ep` covers), the parameters still the
    one-device model's (the runtime cuts the experts). ``order``: "sequence" also without TP,
    a ring or host reads (ZeRO-3: FSDP's own kernels join the issue chain, :mod:`.fsdp_ops`).
    ``itemsize``: every float priced at so many bytes (2: the dry run's precision "full"), or
    None: a mixed precision's bf16 model, each tensor priced at its own dtype as the dry run
    prices it then (the fp32 the program computes in: its norms' statistics, the loss)."""
    from course_lib import fused
    from course_lib.gpt import TinyGPT
    from course_lib.planner.cp_ops import gather_core, ulysses_core
    from course_lib.planner.ep_ops import install_ep
    from course_lib.planner.ring_ops import rank_positions, ring_core, ring_kernels

    ring = ring if cp > 1 else None

    def trace(layers, t=1, rank=None):
        cfg = course_config(model, layers, recompute=recompute, seq_len=s)   # the traced sequence, as the dry run's
        with torch.device("meta"):
            net = TinyGPT(cfg, seed=0)
            if getattr(hw, "fused_kernels", False):       # RMSNorm and SwiGLU as one kernel each way
                fused.install(net)
            if getattr(hw, "fused_attention", False) and not ring:   # FlashAttention (a ring runs its own)
                fused.install_flash(net)
            if tp > 1:                                    # (both traces: their ops pair one for one)
                row_outputs(net)
            if t > 1:
                tp_rank(net, model, t)
            if itemsize is None:                          # a mixed precision: the bf16 model (buffers too)
                net = net.to(torch.bfloat16)
            x = torch.zeros(b, s // cp if ring else s, dtype=torch.long)
        params = (tuple((name, p.numel()) for name, p in net.named_parameters()),
                  tuple((name, tuple(p.shape)) for name, p in net.named_parameters()))
        kw = {}
        if ring:                                   # a CP rank: its tokens, its method for every block's core
            kw = dict(positions=rank_positions(s, cp, rank, ring))
            flash = getattr(hw, "fused_attention", False)
            for block in net.blocks:
                attn = block.attn
                attn.attend = ring_core(cp, rank, s, ring, flash) if method == "ring" else \
                    gather_core(cp, rank, s, ring, flash, attn.attend) if method == "all_gather" else \
                    ulysses_core(cp, rank, s, ring, attn.attend, flash)
        linears = []                                # zero bubble's W: each Linear call's shapes
        for mod in net.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.register_forward_hook(lambda mod, a, o: linears.append(
                    (tuple(a[0].shape), tuple(o.shape), mod.bias is not None, mod.weight.dtype)))
        where = [[]]                                # the op list marks go to
        if tp > 1 and not sp:                       # f's copies of dX (both traces: they pair)
            f_copies(net)
        if t == tp:                                 # the rank's own trace: its parts (and TP's collectives) marked
            _mark_tp(net, where, sp, collectives=t > 1)
        if ep:                                      # an EP rank's MoE layers (their experts E / ep), the
            group = cp * (tp if sp else 1)          # routing group's and the ep group's calls marked; a TP
            install_ep(net, ep, lambda what: where[-1].append(("|" + what, None)), group,   # rank's own
                       shard=t if sp else 1, etp=etp, dispatch=model.moe_dispatch)   # tokens under SP
        with KernelCounter(hw, itemsize, record=True) as fwd:
            fwd.ops = where[-1]
            loss = net(x, x, n_tokens=b * s, **kw)[1]
            if t > 1:                              # the vocabulary-parallel loss's two all-reduces
                fwd.ops += [("|loss", None)] * 2
        where.append([])
        with KernelCounter(hw, itemsize, record=True) as bwd:
            bwd.ops = where[-1]
            loss.backward()
        return (fwd, bwd) + params + (linears,)

    def run(layers, rank=None):
        fwd, bwd, params, shapes, linears = trace(layers, rank=rank)
        if tp > 1:
            fwd_t, bwd_t, params, _, linears = trace(layers, tp, rank)
        else:
            fwd_t, bwd_t = fwd, bwd
        floor, c = hw.kernel_floor, 1 if ring else cp
        return (_rank_pass(fwd, fwd_t, tp, sp, c, floor), _rank_pass(bwd, bwd_t, tp, sp, c, floor), params, shapes,
                _w_pass(hw, itemsize, linears, c, floor))

    def rank_trace(rank=None):
        (f1, b1, p1, shapes, w1), (f2, b2, p2, _, w2) = run(1, rank=rank), run(2, rank=rank)
        return f1, b1, p1, shapes, f2, b2, p2, w1, w2
    traces = [rank_trace(r) for r in range(cp)] if ring else [rank_trace()]
    # the busiest rank's (a ring rank's blocks differ: rank 0's later ones (s/2N, s/N), rank N-1's (s/N, s/2N))
    f1, b1, p1, shapes, f2, b2, p2, w1, w2 = max(traces, key=lambda x: (x[4].total - x[0].total + x[5].total
                                                                        - x[1].total).device)
    n1, n2 = len(p1), len(p2)

    def part(c, names):
        return sum((c.by_op.get(k, Kernels()) for k in names), Kernels())
    emb_f, emb_b = part(f1, ("embedding",)), part(b1, ("embedding_dense_backward",))
    layer_f, layer_b = f2.total - f1.total, b2.total - b1.total
    ring_pass = {}
    if ring and method == "ring":   # the ring alone on the busiest rank: a K/V hop travels under one of its blocks
        busiest = traces.index(max(traces, key=lambda x: (x[4].total - x[0].total + x[5].total - x[1].total).device))
        heads, kv_heads = -(-model.n_heads // tp), max(1, model.n_kv_heads // tp)
        ring_pass = dict(zip(("ring_fwd", "ring_bwd"), ring_kernels(hw, b, heads, kv_heads, model.head_dim, s, cp,
                                                                     busiest, ring, itemsize)))
    seq = {}
    reads = any(name == "|read" for name, _ in f2.ops + b2.ops)
    if tp > 1 or ring or reads or order or ep:   # the marked order of one rank's kernels (:mod:`.issue`)
        seq = {"fwd": _split(f2.ops, ("|block 0", "|block 1", "|head"), ("embedding", None, "layer", "head")),
               "bwd": _split(b2.ops, ("|bblock 1", "|bblock 0", "|bemb"), ("head", "layer", None, "embedding"))}
    return {"layer_fwd": layer_f, "layer_bwd": layer_b, "embedding_fwd": emb_f, "embedding_bwd": emb_b,
            "sequence": seq, **ring_pass,
            "layer_w": w2[0] - w1[0], "head_w": w1[0] - (w2[0] - w1[0]),      # zero bubble's W (_w_pass)
            "layer_w_elements": w2[1] - w1[1], "head_w_elements": w1[1] - (w2[1] - w1[1]),
            "layer_w_tensors": w2[2] - w1[2], "head_w_tensors": w1[2] - (w2[2] - w1[2]),
            "head_fwd": f1.total - layer_f - emb_f, "head_bwd": b1.total - layer_b - emb_b,
            "tensors_per_layer": n2 - n1, "tensors_outside": n1 - (n2 - n1), "params": p1, "param_shapes": shapes,
            "adamw_per_element": _adamw(hw, itemsize or 2)}     # (the runtime prices the masters' fp32)


def _w_pass(hw, itemsize, linears, c: int, floor: float) -> tuple:
    """Zero bubble's W of one pass (ZB-H1, ZB-V, DualPipeV; the course's runner and
    ``parallel.weight_grads``): for each Linear call of the forward, (input shape, output shape,
    bias, dtype), dW = dY^T X added into ``.grad`` in place (``addmm_``: the accumulation is the
    GEMM's, no add of its own) and db = the sum of dY added; a CP rank's on 1/c of the tokens.
    (its Kernels, the parameter elements and tensors it accumulates): B is the whole backward less these
    GEMMs (the same shapes as autograd's dW) and less their accumulation."""
    elements = tensors = 0
    with KernelCounter(hw, itemsize) as w:
        for x_shape, y_shape, bias, dtype in linears:
            tokens, n_in, n_out = math.prod(x_shape[:-1]), x_shape[-1], y_shape[-1]
            x2 = torch.empty(tokens, n_in, device="meta", dtype=dtype)
            g2 = torch.empty(tokens, n_out, device="meta", dtype=dtype)
            torch.empty(n_out, n_in, device="meta", dtype=dtype).addmm_(g2.t(), x2)
            elements, tensors = elements + n_out * n_in, tensors + 1
            if bias:
                torch.empty(n_out, device="meta", dtype=dtype).add_(g2.sum(0))
                elements, tensors = elements + n_out, tensors + 1
    k = w.total
    return Kernels(k.count, k.flops / c, k.bytes / c, k.time / c, max(k.time / c, k.count * floor)), elements, tensors


def _split(ops, at, names) -> dict:
    """{name: [device seconds of a kernel, or the name of a collective]} of ``ops`` cut at the
    marks ``at`` (a ``None`` name: a piece left out)."""
    out, piece, i = {}, [], 0
    for name, k in ops:
        if i < len(at) and name == at[i]:
            if names[i] is not None:
                out[names[i]] = piece
            piece, i = [], i + 1
        elif k is None:
            if not name.startswith(("|block", "|bblock", "|bemb", "|head")):
                piece.append(name[1:])
        else:
            piece.append(k.device)
    if names[i] is not None:
        out[names[i]] = piece
    return out


def _adamw(hw, itemsize) -> Kernels:
    """torch's AdamW as it runs on CUDA (``foreach``: each operation one op over every tensor),
    on one parameter: ``count`` its ops per step (whatever the number of tensors), FLOPs, bytes
    and time per element (the bytes at the elementwise rate: for the sizes that matter, the
    kernels' floors are a rounding error)."""
    n = 4096
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.zeros(n)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    opt.step()                                  # the first step creates the state
    with KernelCounter(None, itemsize) as c:
        opt.step()
    k, rate = c.total, KernelModel(hw, {2: "bfloat16", 4: "float32"}.get(itemsize, "bfloat16")).bytes_rate[FOREACH]
    return Kernels(k.count, k.flops / n, k.bytes / n, k.bytes / n / rate)


__all__ = ["Kernels", "KernelCounter", "trace_step", "course_config", "FREE", "CLASSES", "CPU_KERNELS", "KernelModel", "kernel_kind", "op_cost",
           "foreach_launches"]
