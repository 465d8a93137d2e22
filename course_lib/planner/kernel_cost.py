"""What one aten op costs on a GPU: its FLOPs, the bytes it moves, its class, and its seconds.

:func:`op_cost` reads an op as the GPU runs it: FLOPs from torch's FLOP-counter registry (a
GEMM, attention) or one per element (every other op that does arithmetic; copies and fills
none), the bytes of every tensor it reads and writes at the modelled precision (a broadcast
dimension read once; an embedding the rows it looks up, not its table), and its class
(:data:`CLASSES`). Where the CPU runs another kernel than the GPU would, the op is priced as
the GPU's (:data:`CPU_KERNELS`): ``F.scaled_dot_product_attention``'s CPU flash kernel as a
fused attention kernel with torch's SDPA FLOP formulas (causal: half), without the s x s
scores. A foreach op (an optimizer's CUDA path) launches the kernels of CUDA's
``multi_tensor_apply`` (:func:`foreach_launches`).

:class:`KernelModel` turns that into seconds on a Hardware: a GEMM on the tile x wave model of
:mod:`course_lib.planner.gemm`, fused attention at its own rate, every other kernel its bytes at
its class's fraction of HBM bandwidth, never less than the device's minimum per kernel. The
constants are fitted once on a recorded H100 run (``Hardware.sources`` names each one's source).
The virtual clock (``course_lib.virtual.compute``) and the planner's count of the course's
program (:mod:`course_lib.planner.kernels`) both price with these two.
"""
from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from course_lib.planner.gemm import attention_kernel_time, attention_rate, gemm_time

aten = torch.ops.aten
# ops that launch no kernel: allocation, metadata, host reads
FREE = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
        aten._unsafe_view, aten.lift_fresh, aten.scalar_tensor, aten.resize_, aten.set_,
        aten._local_scalar_dense, aten.is_same_size, aten.sym_size, aten.sym_stride, aten.sym_numel,
        aten.sym_storage_offset, aten._has_compatible_shallow_copy_type, aten.is_nonzero, aten.detach}

# the classes of kernels, each with its own efficiency (Hardware.kernel_efficiency)
GEMM, ATTENTION, REDUCTION, BROADCAST, ELEMENTWISE, COPY, FOREACH = (
    "gemm", "attention", "reduction", "broadcast", "elementwise", "copy", "foreach")
CLASSES = (GEMM, ATTENTION, REDUCTION, BROADCAST, ELEMENTWISE, COPY)   # (foreach: elementwise, batched)
_GEMM_SHAPED = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.addmm_, aten.baddbmm_}
# in place, the same GEMM (zero bubble's W adds dY^T X into .grad with addmm_): torch's FLOP
# counter has no formula for them (they were priced as one elementwise pass), so their
# out-of-place twin's
_IN_PLACE_GEMMS = {aten.addmm_: aten.addmm, aten.baddbmm_: aten.baddbmm}
_REDUCTIONS = {aten._softmax, aten._log_softmax, aten._softmax_backward_data, aten._log_softmax_backward_data,
               aten._masked_softmax, aten._masked_softmax_backward,
               aten._safe_softmax, aten.sum, aten.mean, aten.norm, aten.linalg_vector_norm, aten.var, aten.std,
               aten.var_mean, aten.std_mean, aten.amax, aten.amin, aten.aminmax, aten.max, aten.min, aten.argmax, aten.argmin,
               aten.logsumexp, aten.cumsum, aten.prod, aten.any, aten.all, aten.native_layer_norm,
               aten.native_layer_norm_backward, aten.native_batch_norm, aten.native_batch_norm_backward,
               aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training, aten.nll_loss_forward,
               aten.nll_loss2d_forward, aten.topk, aten.sort, aten.count_nonzero, aten.embedding_dense_backward,
               aten.index_add, aten.scatter_add, aten.scatter_add_, aten.index_put_, aten.index_put,
               aten.max_pool2d_with_indices, aten.max_pool2d_with_indices_backward, aten.avg_pool2d,
               aten.avg_pool2d_backward, aten._adaptive_avg_pool2d, aten._adaptive_avg_pool2d_backward,
               aten.histc, aten.bincount, aten.equal}
# data movement, no arithmetic: 0 FLOPs
_COPIES = {aten.copy_, aten.clone, aten._to_copy, aten.cat, aten.stack, aten.index_select, aten.gather,
           aten.embedding, aten.index, aten._unsafe_index, aten.slice_scatter, aten.select_scatter,
           aten.as_strided_scatter, aten.constant_pad_nd, aten.repeat, aten.roll, aten.flip, aten.fill_,
           aten.zero_, aten.zeros, aten.zeros_like, aten.ones, aten.ones_like, aten.full, aten.full_like,
           aten.new_zeros, aten.new_ones, aten.new_full, aten.arange, aten.tril, aten.triu, aten.scatter,
           aten.masked_scatter, aten.diag_embed, aten.unfold_backward, aten.split_with_sizes_copy,
           aten.alias_copy, aten.view_copy, aten.permute_copy, aten.transpose_copy, aten.expand_copy,
           aten.lift_fresh_copy, aten._unsafe_index_put, aten.nonzero, aten.unique_dim, aten._unique2}
# The "copy" class's rate (Hardware.kernel_efficiency) was fitted on the recorded H100 block's
# copies (course_lib.virtual.gpu_check.fit_kernels), every one of them strided: the transposes of
# the heads' layout (clone of a (b, a, s, d) view, cat of rotary halves). A copy whose tensors
# are all contiguous (a cast, a clone, a cat of whole tensors, a fill) is one streaming pass over
# memory, what the "elementwise" rate was measured on (the record's add of 2 x 256 MiB): priced
# at that rate. Its destination is written, not read (copy_, fill_, zero_: the GPU's kernel
# writes the output and reads only the source).
STREAMING_COPIES = {aten.copy_, aten.clone, aten._to_copy, aten.cat, aten.stack, aten.fill_, aten.zero_,
                     aten.zeros, aten.zeros_like, aten.ones, aten.ones_like, aten.full, aten.full_like,
                     aten.new_zeros, aten.new_ones, aten.new_full}
WRITE_ONLY = {aten.copy_, aten.fill_, aten.zero_, aten._foreach_copy_}


def _causal(flops, is_causal):
    return flops // 2 if is_causal else flops      # the masked half of the tiles is skipped


def _cpu_attention(query, key, value, dropout_p=0.0, is_causal=False, *args, out_val=None, **kwargs):
    return _causal(sdpa_flop_count(query.shape, key.shape, value.shape), is_causal)


def _cpu_attention_backward(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *args,
                            out_val=None, **kwargs):
    return _causal(sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape), is_causal)


# kernels the CPU runs where the GPU runs another: priced as the GPU's (FLOP formula, class)
CPU_KERNELS = {
    aten._scaled_dot_product_flash_attention_for_cpu: (_cpu_attention, ATTENTION),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (_cpu_attention_backward, ATTENTION),
}
_GPU_ATTENTION = {aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
              aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_backward,
              aten._scaled_dot_product_efficient_attention_backward,
              aten._scaled_dot_product_cudnn_attention_backward, aten._flash_attention_forward,
              aten._flash_attention_backward, aten._efficient_attention_forward, aten._efficient_attention_backward}
_ATTENTION = _GPU_ATTENTION | set(CPU_KERNELS)


_CAUSAL_ARG: dict = {}     # op schema name -> (index, name) of its causal flag


def _is_causal(func, args, kwargs=None) -> bool:
    """A fused attention call's causal flag, read where its schema puts it: ``is_causal``, or
    the memory-efficient kernel's ``custom_mask_type`` (1 top left, 2 bottom right; 0 none)."""
    key = func._schema.name
    if key not in _CAUSAL_ARG:
        names = [a.name for a in func._schema.arguments]
        name = "is_causal" if "is_causal" in names else "custom_mask_type"
        _CAUSAL_ARG[key] = names.index(name), name
    at, name = _CAUSAL_ARG[key]
    return bool(args[at] if len(args) > at else (kwargs or {}).get(name, False))


def _gpu_causal(func, formula):
    """torch's FLOP formula for a CUDA attention kernel (flop_counter counts every tile: "we
    aren't accounting for causal attention here") halved when the call is causal
    (:func:`_is_causal`), as the CPU kernels' above: a GPU run under the clock prices SDPA as
    the dry run does."""
    def flops(*args, out_val=None, **kwargs):
        return _causal(formula(*args, out_val=out_val, **kwargs), _is_causal(func, args, kwargs))
    return flops


# a fused attention op: (its query's argument, its key's, backward); the course's all-gather CP
# kernel is causal at the bottom right whatever it is passed
_ATTENTION_ARGS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": (0, 1, False),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": (1, 2, True),
    "aten::_scaled_dot_product_flash_attention": (0, 1, False),
    "aten::_scaled_dot_product_flash_attention_backward": (1, 2, True),
    "aten::_scaled_dot_product_efficient_attention": (0, 1, False),
    "aten::_scaled_dot_product_efficient_attention_backward": (1, 2, True),
    "aten::_scaled_dot_product_cudnn_attention": (0, 1, False),
    "aten::_scaled_dot_product_cudnn_attention_backward": (1, 2, True),
    "course::flash_attention_prefix": (0, 1, False),
    "course::flash_attention_prefix_backward": (1, 2, True),
}


def attention_shape(func, args, kwargs=None):
    """(heads, queries, keys, head dim, causal, backward) of a fused attention op whose query is
    (batch, heads, s_q, d) and key (batch, kv heads, s_k, d), the kernel model's input
    (:func:`course_lib.planner.gemm.attention_kernel_time`); None for another op or layout
    (the varlen kernels: their FLOPs at the forward's rate)."""
    name = func._schema.name
    spec = _ATTENTION_ARGS.get(name)
    if spec is None:
        return None
    qi, ki, backward = spec
    q, k = args[qi], args[ki]
    causal = True if name in COURSE_ATTENTION else _is_causal(func, args, kwargs)
    return q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3], causal, backward


def _qkv_rows(*w) -> int:
    return sum(t.shape[0] for t in w)


def _tokens(t) -> int:
    return t.numel() // t.shape[-1]


# the course's own fused kernels (``course::`` ops): op name -> (class, (M, N, K, batch) of its
# arguments for one priced as a GEMM, else None). As GEMMs: course_lib.virtual.fused_qkv,
# Megatron-LM's one QKV GEMM, its three weights one [(h + 2 kv)/t, h] operand as Megatron stores them
COURSE_KERNELS = {
    "course::fused_qkv": (GEMM, lambda x, wq, wk, wv, *b: (_tokens(x), _qkv_rows(wq, wk, wv), x.shape[-1], 1)),
    "course::fused_qkv_input_grad": (GEMM, lambda dq, dk, dv, wq, wk, wv: (_tokens(dq), wq.shape[1],
                                                                            _qkv_rows(wq, wk, wv), 1)),
    "course::fused_qkv_weight_grad": (GEMM, lambda x, dq, dk, dv: (dq.shape[-1] + dk.shape[-1] + dv.shape[-1],
                                                                    x.shape[-1], _tokens(x), 1)),
    "course::fused_qkv_bias_grad": (REDUCTION, None),     # the three biases' sum over tokens: one kernel
    # course_lib.fused: a fused RMSNorm (a row reduction, as LayerNorm's kernels), forward and
    # backward one kernel each; SwiGLU one streaming pass each way
    "course::rms_norm": (REDUCTION, None),
    "course::rms_norm_backward": (REDUCTION, None),
    "course::swiglu": (ELEMENTWISE, None),
    "course::swiglu_backward": (ELEMENTWISE, None),
}


def _prefix_flops(q, k, v, *args, out_val=None, **kwargs):
    """All-gather CP's chunk (course_lib.flash_prefix): the L - c past keys in full, the
    chunk's own c x c block causal (half), torch's SDPA formula for each."""
    b, a, c, d = q.shape
    past = (b, a, k.shape[2] - c, d)
    return (sdpa_flop_count(q.shape, past, past) if past[2] else 0) + _causal(sdpa_flop_count(q.shape, q.shape,
                                                                                              q.shape), True)


def _prefix_backward_flops(grad, q, k, v, *args, out_val=None, **kwargs):
    b, a, c, d = q.shape
    past = (b, a, k.shape[2] - c, d)
    return ((sdpa_backward_flop_count(q.shape, q.shape, past, past) if past[2] else 0)
            + _causal(sdpa_backward_flop_count(q.shape, q.shape, q.shape, q.shape), True))


# the course's own fused attention kernels: op name -> FLOP formula (class "attention")
COURSE_ATTENTION = {"course::flash_attention_prefix": _prefix_flops,
                    "course::flash_attention_prefix_backward": _prefix_backward_flops}


def _course_gemm_flops(func):
    shape = COURSE_KERNELS[func._schema.name][1]

    def flops(*args, out_val=None, **kwargs):
        M, N, K, batch = shape(*args)
        return 2 * M * N * K * batch
    return flops


_FREE_OP = object()  # the memo's mark of an op that launches no kernel
_KINDS: dict = {}   # OpOverload -> _Kind or _FREE_OP: a memo


class _Kind:
    """How one aten op is priced: its FLOP formula (None: one FLOP per element, or none for a
    copy), its class, and which arguments it writes when it returns nothing (foreach ops)."""
    __slots__ = ("formula", "cls", "writes", "embedding", "streams", "write_only", "fused")

    def __init__(self, func):
        packet = func.overloadpacket
        self.formula, cls = CPU_KERNELS.get(packet, (flop_registry.get(_IN_PLACE_GEMMS.get(packet, packet)), None))
        if packet in _GPU_ATTENTION and self.formula is not None:
            self.formula = _gpu_causal(func, self.formula)
        course = COURSE_KERNELS.get(func._schema.name)
        if course is not None:
            cls, self.formula = course[0], _course_gemm_flops(func) if course[1] else None
        if func._schema.name in COURSE_ATTENTION:
            cls, self.formula = ATTENTION, COURSE_ATTENTION[func._schema.name]
        name = packet.__name__
        if cls is None:
            cls = (ATTENTION if packet in _ATTENTION else GEMM if self.formula is not None
                   else FOREACH if name.startswith(("_foreach_", "_fused_")) else REDUCTION if packet in _REDUCTIONS
                   else COPY if packet in _COPIES else ELEMENTWISE)
        self.cls = cls
        self.writes = tuple(i for i, a in enumerate(func._schema.arguments)
                            if a.alias_info is not None and a.alias_info.is_write)
        self.embedding = packet is aten.embedding
        # a course:: kernel is one fused pass (Megatron-LM's jit-fused bias + dropout + add, a
        # fused SwiGLU): a small operand (a bias) is read once, from cache, at the streaming
        # rate; the broadcast class was fitted on eager PyTorch's broadcasting kernels (the H100
        # block's muls: course_lib.virtual.gpu_check.fit_kernels)
        self.fused = func.namespace == "course"
        self.streams = cls is COPY and packet in STREAMING_COPIES      # priced as a stream when contiguous
        self.write_only = packet in WRITE_ONLY                         # its first argument is not read


def kernel_kind(func):
    """False if ``func`` launches no kernel, else its :class:`_Kind` (FLOP formula and class)."""
    try:
        kind = _KINDS[func]
    except KeyError:
        # aten's ops, and the course's own fused kernels (course_lib.virtual.software: "course::")
        priced = (isinstance(func, torch._ops.OpOverload) and func.namespace in ("aten", "course") and not func.is_view
                  and func.overloadpacket not in FREE)
        kind = _KINDS[func] = _Kind(func) if priced else _FREE_OP
    return False if kind is _FREE_OP else kind


def _elements(t) -> int:
    """Elements of ``t`` a kernel touches: a broadcast (stride 0) dimension is read once."""
    if t.is_contiguous():                  # the common case: no stride to read
        return t.numel()
    return _strided_elements(t)


def _strided_elements(t) -> int:
    n = 1
    for size, st in zip(t.shape, t.stride()):
        n *= size if st else 1
    return n


class _ElementBytes(dict):
    """dtype -> bytes per element on the modelled GPU: floating tensors at ``itemsize``, others
    at their own; ``itemsize`` None: every tensor at its own dtype's (a program that runs the
    GPU's dtypes for real). A memo: one dict lookup per tensor in place of two attribute reads."""

    def __init__(self, itemsize: int | None):
        super().__init__()
        self.itemsize = itemsize

    def __missing__(self, dtype):
        size = self[dtype] = self.itemsize if dtype.is_floating_point and self.itemsize else dtype.itemsize
        return size


_ELEMENT_BYTES: dict = {}   # modelled itemsize -> its _ElementBytes


def element_bytes(itemsize: int | None) -> _ElementBytes:
    """The dtype -> bytes-per-element memo of one modelled ``itemsize`` (None: each dtype's own)."""
    try:
        return _ELEMENT_BYTES[itemsize]
    except KeyError:
        sizes = _ELEMENT_BYTES[itemsize] = _ElementBytes(itemsize)
        return sizes


def _add_bytes(t, itemsize) -> int:
    """Bytes of one tensor the kernel touches; floating tensors at the modelled ``itemsize``,
    others at their own (``itemsize`` None: every tensor at its own)."""
    dtype = t.dtype
    return _elements(t) * (itemsize if dtype.is_floating_point and itemsize else dtype.itemsize)


_Tensor = torch.Tensor
CHUNK, MAX_BLOCKS, MAX_TENSORS = 65536, 320, (110, 64, 48, 36, 30)   # ATen's MultiTensorApply.cuh


def foreach_launches(numels, depth: int) -> int:
    """Kernels CUDA's ``multi_tensor_apply`` launches for a foreach op over tensors of ``numels``
    elements and ``depth`` tensor lists: a launch holds at most 320 chunks of 65536 elements
    and 110 / 64 / 48 / 36 / 30 tensors (depth 1 to 5)."""
    max_tensors = MAX_TENSORS[min(max(depth, 1), 5) - 1]
    launches = blocks = tensors = 0
    for n in numels:
        if not n:
            continue
        chunks, tensors = -(-n // CHUNK), tensors + 1
        while chunks:
            take = min(chunks, MAX_BLOCKS - blocks)
            blocks, chunks = blocks + take, chunks - take
            if blocks == MAX_BLOCKS or (not chunks and tensors == max_tensors):
                launches, blocks, tensors = launches + 1, 0, (1 if chunks else 0)
    return launches + (blocks > 0)


def op_cost(func, args, kwargs, out, itemsize: int | None):
    """(FLOPs, bytes, class, detail) of one aten op as the GPU runs it, or None if it launches no
    kernel. ``detail``: a GEMM's (M, N, K, batch), a foreach op's kernel launches, else None.
    ``itemsize``: floating tensors' bytes per element (None: each tensor's own dtype's)."""
    kind = kernel_kind(func)
    if kind is False:
        return None
    return kind_cost(kind, func, args, kwargs, out, element_bytes(itemsize))


def _any_strided(args, out) -> bool:
    """Whether the result, or a tensor in a list argument (cat's), is not contiguous."""
    if isinstance(out, _Tensor) and not out.is_contiguous():
        return True
    return any(isinstance(t, _Tensor) and not t.is_contiguous()
               for v in args if isinstance(v, (list, tuple)) for t in v)


def _list_bytes(v, sizes) -> int:
    n = 0
    for t in v:
        if isinstance(t, _Tensor):
            n += (t.numel() if t.is_contiguous() else _strided_elements(t)) * sizes[t.dtype]
    return n


def kind_cost(kind, func, args, kwargs, out, sizes):
    """:func:`op_cost` of an op whose :func:`kernel_kind` is ``kind`` (not free), ``sizes`` its
    modelled bytes per element (:func:`element_bytes`): the virtual clock's per-op path, which
    looks the kind up once by the op's C++ operator."""
    nbytes = most = 0
    least = None                                       # the smallest input that is not a scalar
    lists = None
    strided = False                                    # a tensor argument is not contiguous
    for v in args:
        if isinstance(v, _Tensor):
            if v.is_contiguous():
                n = v.numel()
            else:
                n, strided = _strided_elements(v), True
            nbytes += n * sizes[v.dtype]
            if n > most:
                most = n
            if (least is None or n < least) and v.dim():
                least = n
        elif isinstance(v, (list, tuple)):             # foreach ops: one level of lists
            nbytes += _list_bytes(v, sizes)
            if v and isinstance(v[0], _Tensor):
                lists = (lists or 0) + 1
    if kwargs:
        for k, v in kwargs.items():
            if k == "out":                             # counted once, as the result
                continue
            if isinstance(v, _Tensor):
                nbytes += (v.numel() if v.is_contiguous() else _strided_elements(v)) * sizes[v.dtype]
            elif isinstance(v, (list, tuple)):
                nbytes += _list_bytes(v, sizes)
    cls, detail, flops = kind.cls, None, 0
    if isinstance(out, _Tensor):
        n = out.numel() if out.is_contiguous() else _strided_elements(out)
        nbytes += n * sizes[out.dtype]
        if cls is ELEMENTWISE:
            flops = n                                  # one FLOP per element (memory bound)
            if least is not None and least < n and not kind.fused:
                cls = BROADCAST                        # an input smaller than the output: read again per row
    elif isinstance(out, (list, tuple)):
        nbytes += _list_bytes(out, sizes)
        if cls is FOREACH:
            lists = (lists or 0) + 1
    elif out is None and kind.writes and not kind.write_only:   # in place, returns nothing (foreach): the
        # writes (a foreach copy's destinations: counted once, among its arguments; written, not read)
        for i in kind.writes:
            v = args[i] if i < len(args) else None
            if isinstance(v, (list, tuple)):
                nbytes += _list_bytes(v, sizes)
    if kind.streams:
        if kind.write_only:                            # the destination is written (the result), not read
            nbytes -= _elements(args[0]) * sizes[args[0].dtype]
        if not (strided or _any_strided(args, out)):
            cls = ELEMENTWISE                          # one streaming pass (see STREAMING_COPIES)
    if kind.embedding:                                 # the rows read, not the table
        weight, indices = args[0], args[1]
        nbytes -= (_elements(weight) - indices.numel() * weight.shape[-1]) * sizes[weight.dtype]
    if kind.formula is not None:
        flops, detail = _flops(func, kind.formula, args, kwargs, out)
        if cls is ATTENTION:
            detail = attention_shape(func, args, kwargs)
    elif cls is REDUCTION:
        flops = most
    elif cls is FOREACH:
        first = next(v for v in args if isinstance(v, (list, tuple)))
        numels = [t.numel() for t in first if isinstance(t, _Tensor)]
        flops, detail = sum(numels), foreach_launches(numels, lists or 1)
        if all(not t.dim() for t in first if isinstance(t, _Tensor)):
            detail, nbytes = 0, 0      # an optimizer's step counters: on the CPU under CUDA (not capturable)
    return flops, nbytes, cls, detail


_FLOPS: dict = {}   # (op, argument shapes) -> (FLOPs, GEMM shape): torch's formulas read shapes only (slow)


def _gemm_shape(func, args):
    """(M, N, K, batch) of mm / addmm / bmm / baddbmm, else None."""
    packet = func.overloadpacket
    if packet not in _GEMM_SHAPED:
        course = COURSE_KERNELS.get(func._schema.name)
        return course[1](*args) if course is not None and course[1] else None
    a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm, *_IN_PLACE_GEMMS) else (args[0], args[1])
    if a.dim() == 3:
        return a.shape[1], b.shape[2], a.shape[2], a.shape[0]
    return a.shape[0], b.shape[1], a.shape[1], 1


RATED = (GEMM, ATTENTION)    # the classes whose FLOP rate is the dtype's (tensor cores)


def compute_dtype(args, out):
    """The dtype a kernel computes in: its output's (a GEMM's, an attention's), else its first
    tensor argument's; None if it has no tensor."""
    if isinstance(out, _Tensor):
        return out.dtype
    for v in (out, *args) if isinstance(out, (list, tuple)) else args:
        if isinstance(v, _Tensor):
            return v.dtype
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], _Tensor):
            return v[0].dtype
    return None


def _flops(func, formula, args, kwargs, out):
    # keyed by the op's C++ operator (an OpOverload hashes in Python) and torch.Size (a tuple)
    key = (getattr(func, "_op", func), *[a.shape if isinstance(a, _Tensor) else
                                         (tuple(x.shape if isinstance(x, _Tensor) else x for x in a)
                                          if isinstance(a, list) else a) for a in args])
    if kwargs:
        key += tuple(kwargs.items())
    try:
        return _FLOPS[key]
    except KeyError:
        pass
    except TypeError:                      # an unhashable argument: no memo
        return int(formula(*args, **(kwargs or {}), out_val=out)), _gemm_shape(func, args)
    cost = _FLOPS[key] = int(formula(*args, **(kwargs or {}), out_val=out)), _gemm_shape(func, args)
    return cost


class KernelModel:
    """Seconds one kernel runs on the device, on ``hw`` at the dtype ``dtype_name``:

    * a GEMM (mm, bmm, ...): the tile x wave model (:func:`~course_lib.planner.gemm.gemm_time`)
      at the class's fraction of peak per tile, or its bytes at HBM's streaming rate if longer;
    * fused attention: its tile x wave model (:func:`~course_lib.planner.gemm.attention_kernel_time`,
      the op's shape from :func:`attention_shape`), or its bytes if longer;
    * every other kernel: its bytes at its class's fraction of HBM bandwidth (its FLOPs, one per
      element, at the dtype's non-tensor rate, never the bound); a foreach op launches
      :func:`foreach_launches` kernels;
    * never less than ``hw.kernel_floor`` a kernel.
    The host's issue interval (``hw.launch_overhead``) is not in it: the stream adds it."""

    def __init__(self, hw, dtype_name: str = "bfloat16"):
        peak = hw.peak_flops_for(dtype_name)
        if peak is None:
            known = ["bfloat16"] + [d for d, _ in hw.dtype_flops]
            raise ValueError(f"dtype {dtype_name} has no FLOP rate on {hw.name}: the preset knows {known}")
        eff = hw.efficiencies()
        self.hw, self.efficiency, self.peak = hw, eff, peak
        self.gemm_hw = hw.with_(peak_flops=peak, matmul_efficiency=eff[GEMM])
        self.flops_rate = {GEMM: peak * eff[GEMM], ATTENTION: attention_rate(hw, peak)}   # the planner's
        vector = hw.peak_flops_for("float32") or peak       # CUDA cores: elementwise arithmetic
        for cls in (REDUCTION, BROADCAST, ELEMENTWISE, COPY, FOREACH):
            self.flops_rate[cls] = vector
        self.bytes_rate = {cls: hw.hbm_bandwidth * eff[cls] for cls in CLASSES}
        self.bytes_rate[GEMM] = self.bytes_rate[ATTENTION] = self.bytes_rate[ELEMENTWISE]
        self.bytes_rate[FOREACH] = hw.hbm_bandwidth * eff[FOREACH]      # the elementwise share unless stated
        self.floor, self.issue = hw.kernel_floor, hw.launch_overhead
        self._gemm: dict = {}               # (M, N, K, batch) -> seconds of the tile model
        self._attention: dict = {}          # attention_shape -> seconds of its tile model

    def compute(self, flops, cls=ELEMENTWISE, detail=None) -> float:
        """Seconds of the kernel's arithmetic: a GEMM's or a fused attention kernel's tile
        model where its shape is known, else its FLOPs at its class's rate."""
        if cls is GEMM and detail is not None:
            try:
                return self._gemm[detail]
            except KeyError:
                M, N, K, batch = detail
                t = self._gemm[detail] = gemm_time(M, N, K, self.gemm_hw, batch)
                return t
        if cls is ATTENTION and detail is not None:
            try:
                return self._attention[detail]
            except KeyError:
                t = self._attention[detail] = attention_kernel_time(self.hw, *detail, peak=self.peak)
                return t
        return flops / self.flops_rate[cls]

    def roofline(self, flops, nbytes, cls=ELEMENTWISE, detail=None) -> float:
        """Seconds of the kernel's work alone: its compute or its memory traffic (no floor)."""
        compute = self.compute(flops, cls, detail)
        memory = nbytes / self.bytes_rate[cls]
        return compute if compute > memory else memory

    def seconds(self, flops, nbytes, cls=ELEMENTWISE, detail=None) -> float:
        """Seconds the kernel occupies the device: its roofline, at least the floor (a foreach
        op: the floor per launch; an op that launches none, 0: host work)."""
        t = self.roofline(flops, nbytes, cls, detail)
        floor = self.floor * detail if cls is FOREACH else self.floor
        return t if t > floor else floor


__all__ = ["FREE", "COURSE_KERNELS", "STREAMING_COPIES", "WRITE_ONLY",
           "CLASSES", "GEMM", "ATTENTION", "REDUCTION", "BROADCAST", "ELEMENTWISE", "COPY", "FOREACH",
           "CPU_KERNELS", "KernelModel", "kernel_kind", "op_cost", "attention_shape", "kind_cost", "element_bytes", "foreach_launches",
           "RATED", "compute_dtype"]
