"""The kernels of the course's own program, counted: how many it launches and what each moves.

A kernel on a GPU costs its roofline plus its launch (:meth:`Hardware.kernel_time`):
``max(FLOPs / (peak x matmul_efficiency), bytes / (HBM x hbm_efficiency)) + launch_overhead``.
FLOPs come from torch's FLOP-counter registry (mm, bmm, attention, ...; 0 for elementwise
kernels), bytes from every tensor the kernel reads and writes at the modelled precision;
views and metadata (:data:`FREE`) launch nothing. The virtual clock (``course_lib.virtual``)
prices every op of a running rank with :func:`op_cost`; the planner's ``runtime="course"``
counts the same ops of the course's TinyGPT once, on PyTorch's ``meta`` device (shapes, no
data, any size), with :func:`trace_step`: the count is the program's own, not a constant.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
# ops that launch no kernel: allocation, metadata, host reads
FREE = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
        aten._unsafe_view, aten.lift_fresh, aten.scalar_tensor, aten.resize_, aten.set_,
        aten._local_scalar_dense, aten.is_same_size, aten.sym_size, aten.sym_stride, aten.sym_numel,
        aten.sym_storage_offset, aten._has_compatible_shallow_copy_type, aten.is_nonzero, aten.detach}

_FREE_OP = object()  # the memo's mark of an op that launches no kernel
_KINDS: dict = {}   # OpOverload -> its FLOP formula, None (priced, no FLOPs) or _FREE_OP: a memo


def kernel_kind(func):
    """False if ``func`` launches no kernel, else its FLOP formula (None: no FLOPs counted)."""
    try:
        kind = _KINDS[func]
    except KeyError:
        priced = (isinstance(func, torch._ops.OpOverload) and func.namespace == "aten" and not func.is_view
                  and func.overloadpacket not in FREE)
        kind = _KINDS[func] = flop_registry.get(func.overloadpacket) if priced else _FREE_OP
    return False if kind is _FREE_OP else kind


def _add_bytes(t, itemsize) -> int:
    """Bytes of one tensor the kernel touches: a broadcast (stride 0) dimension is read once;
    floating tensors at the modelled ``itemsize``, others at their own."""
    if t.is_contiguous():                  # the common case: no stride to read
        n = t.numel()
    else:
        n = 1
        for size, st in zip(t.shape, t.stride()):
            n *= size if st else 1
    dtype = t.dtype
    return n * (itemsize if dtype.is_floating_point else dtype.itemsize)


_Tensor = torch.Tensor


def op_cost(func, args, kwargs, out, itemsize: int):
    """(FLOPs, bytes) of one aten op as one kernel, or None if it launches none."""
    formula = kernel_kind(func)
    if formula is False:
        return None
    nbytes = 0
    for v in args:
        if isinstance(v, _Tensor):
            nbytes += _add_bytes(v, itemsize)
        elif isinstance(v, (list, tuple)):             # foreach ops: one level of lists
            for t in v:
                if isinstance(t, _Tensor):
                    nbytes += _add_bytes(t, itemsize)
    if kwargs:
        for k, v in kwargs.items():
            if k == "out":                             # counted once, as the result
                continue
            if isinstance(v, _Tensor):
                nbytes += _add_bytes(v, itemsize)
            elif isinstance(v, (list, tuple)):
                for t in v:
                    if isinstance(t, _Tensor):
                        nbytes += _add_bytes(t, itemsize)
    if isinstance(out, _Tensor):
        nbytes += _add_bytes(out, itemsize)
    elif isinstance(out, (list, tuple)):
        for t in out:
            if isinstance(t, _Tensor):
                nbytes += _add_bytes(t, itemsize)
    return (_flops(func, formula, args, kwargs, out) if formula is not None else 0), nbytes


_FLOPS: dict = {}   # (op, argument shapes) -> FLOPs: torch's formulas read shapes only, through pytree (slow)


def _flops(func, formula, args, kwargs, out) -> int:
    key = (func, *[tuple(a.shape) if isinstance(a, _Tensor) else
                   (tuple(x.shape if isinstance(x, _Tensor) else x for x in a) if isinstance(a, list) else a)
                   for a in args])
    if kwargs:
        key += tuple(kwargs.items())
    try:
        return _FLOPS[key]
    except KeyError:
        pass
    except TypeError:                      # an unhashable argument: no memo
        return int(formula(*args, **(kwargs or {}), out_val=out))
    flops = _FLOPS[key] = int(formula(*args, **(kwargs or {}), out_val=out))
    return flops


@dataclass(frozen=True)
class Kernels:
    """Kernels a piece of the program launches: how many, their FLOPs and bytes, and their time
    on a Hardware (each at its own roofline, summed, launches included)."""

    count: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    time: float = 0.0           # seconds without launches (sum of the kernels' rooflines)

    def __add__(self, o):
        return Kernels(self.count + o.count, self.flops + o.flops, self.bytes + o.bytes, self.time + o.time)

    def __sub__(self, o):
        return Kernels(self.count - o.count, self.flops - o.flops, self.bytes - o.bytes, self.time - o.time)

    def scaled(self, data: float) -> "Kernels":
        """The same kernels on ``data`` times the elements (time and bytes scale, count does not)."""
        return Kernels(self.count, self.flops * data, self.bytes * data, self.time * data)

    def seconds(self, hw) -> float:
        return self.time + self.count * hw.launch_overhead


class _Counter(TorchDispatchMode):
    def __init__(self, hw, itemsize):
        super().__init__()
        self.hw, self.itemsize, self.total, self.by_op = hw, itemsize, Kernels(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        cost = op_cost(func, args, kwargs, out, self.itemsize)
        if cost is not None:
            t = self.hw.kernel_time(*cost) - self.hw.launch_overhead if self.hw is not None else 0.0
            k, name = Kernels(1, cost[0], cost[1], t), func.overloadpacket.__name__
            self.total = self.total + k
            self.by_op[name] = self.by_op.get(name, Kernels()) + k
        return out


def _config(model, layers):
    from course_lib.gpt import GPTConfig
    return GPTConfig(vocab_size=model.vocab, seq_len=model.seq_len, n_layers=layers, hidden=model.hidden,
                     n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, ffn_hidden=model.ffn,
                     block="gpt2" if model.mlp == "gelu" else "llama", tie_embeddings=model.tied)


@functools.lru_cache(maxsize=64)
def trace_step(model, hw, b: int, s: int, itemsize: int = 2) -> dict:
    """The kernels of one forward + backward of the course's TinyGPT with ``model``'s shapes on
    one micro-batch of ``b`` sequences of ``s`` tokens, by part and pass: "layer_fwd"/"layer_bwd"
    (one block), "embedding_*", "head_*" (final norm, LM head, loss); "tensors_per_layer" /
    "tensors_outside" (parameter tensors); "adamw_per_element": torch's AdamW per element (its
    count per tensor). Traced on the meta device at two depths: a block is their difference."""
    from course_lib.gpt import TinyGPT

    def run(layers):
        cfg = _config(model, layers)
        with torch.device("meta"):
            net = TinyGPT(cfg, seed=0)
            x = torch.zeros(b, s, dtype=torch.long)
        with _Counter(hw, itemsize) as fwd:
            loss = net(x, x, n_tokens=x.numel())[1]
        with _Counter(hw, itemsize) as bwd:
            loss.backward()
        return fwd, bwd, len(list(net.parameters()))
    (f1, b1, n1), (f2, b2, n2) = run(1), run(2)

    def part(c, names):
        return sum((c.by_op.get(k, Kernels()) for k in names), Kernels())
    emb_f, emb_b = part(f1, ("embedding",)), part(b1, ("embedding_dense_backward",))
    layer_f, layer_b = f2.total - f1.total, b2.total - b1.total
    return {"layer_fwd": layer_f, "layer_bwd": layer_b, "embedding_fwd": emb_f, "embedding_bwd": emb_b,
            "head_fwd": f1.total - layer_f - emb_f, "head_bwd": b1.total - layer_b - emb_b,
            "tensors_per_layer": n2 - n1, "tensors_outside": n1 - (n2 - n1),
            "adamw_per_element": _adamw(hw, itemsize)}


def _adamw(hw, itemsize) -> Kernels:
    """torch's AdamW (single-tensor path, as the course runs it) on one parameter, per element:
    its kernels are elementwise, so count and bytes per element hold for any size."""
    n = 4096
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.zeros(n)
    opt = torch.optim.AdamW([p], lr=1e-3)
    opt.step()                                  # the first step creates the state
    with _Counter(hw, itemsize) as c:
        opt.step()
    k = c.total
    return Kernels(k.count, k.flops / n, k.bytes / n, k.time / n)


__all__ = ["FREE", "Kernels", "kernel_kind", "op_cost", "trace_step"]
