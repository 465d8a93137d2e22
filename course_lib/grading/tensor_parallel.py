"""Graders of chapter 5 (tensor and sequence parallelism): a learner's pieces, run on real
ranks inside a Megatron MLP or a loss, compared with one device.

    check_megatron_f_g(CopyToParallel, ReduceFromParallel)   # autograd.Functions: f and g
    check_vocab_parallel_loss(vocab_parallel_loss)            # (logits_r, targets, start, V, smoothing) -> loss, dlogits_r
    check_sequence_parallel_pair(AllGatherSequence, ReduceScatterSequence)   # SP g and g-bar
    check_tp_bytes_prediction(tp_bytes_per_layer)             # bytes one rank sends per layer, vs counted
    check_tp_mlp_bias(tp_mlp)                                 # find the bug: a row layer's bias, added once

While the learner's code runs (forward AND backward), the library's tensor-parallel layers and
communication functions are switched off; the vocabulary loss's communication is counted.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.lab.benchmarks import tensor_parallel_layer_bytes
from course_lib.grading import Case, check, check_distributed, compare, reorder_tolerance
from course_lib.grading.traffic import counted_calls
from course_lib.grading.guard import learner
from course_lib.grading.harness import guarded
from course_lib.parallel.vocab_parallel import shard_range

SECONDS = 10   # a learner's function that runs longer (an endless loop) is stopped with a hint


# What would do this chapter's exercises, off while the learner's code runs: every function and
# class of these modules, the autograd Functions' forward and backward included ("module:*")
LIBRARY = ("course_lib.parallel.comm_ops:*", "course_lib.parallel.tensor_parallel:*",
           "course_lib.parallel.vocab_parallel:*")

SIZES = (6, 12, 6)  # an MLP h -> 12 -> h: 12 hidden features split over 1, 2, 3 (and 4) ranks
S, B = 6, 2         # sequence and batch of the inputs (6 tokens split over 1, 2, 3 ranks)


def _setup(dtype, bias=False):
    """On a rank: (rank, t, [X, W1, [b1,] W2, [b2]], C, one device's Y, its gradients as this rank
    holds them, their tolerance, this rank's X, W1's rows, [b1's rows,] W2's columns[, b2] as
    leaves). X (s, b, h), W1 (12, h), W2 (h, 12), C (s, b, h) the output's upstream gradient."""
    r, t = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7 if bias else 0)
    h, f = SIZES[0], SIZES[1]
    shapes = ((S, B, h), (f, h), (f,), (h, f), (h,), (S, B, h)) if bias else ((S, B, h), (f, h), (h, f), (S, B, h))
    *whole, C = [torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype) for shape in shapes]
    ref = [v.clone().requires_grad_() for v in whole]
    Y = _mlp(*ref)
    (Y * C).sum().backward()
    # column-parallel W1 (and b1) by rows, row-parallel W2 by columns, x and b2 whole
    cuts = (None, 0, 0, 1, None) if bias else (None, 0, 1)
    shard = [(lambda v: v) if d is None else (lambda v, d=d: v.chunk(t, d)[r]) for d in cuts]
    want = [cut(v.grad) for cut, v in zip(shard, ref)]
    mine = [cut(v).clone().requires_grad_() for cut, v in zip(shard, whole)]
    return r, t, whole, C, Y.detach(), want, reorder_tolerance(dtype, Y, *(v.grad for v in ref)), mine


def _mlp(x, w1, *rest):
    """relu(x W1^T [+ b1]) W2^T [+ b2]: rest is (W2,) or (b1, W2, b2)."""
    b1, w2, b2 = rest if len(rest) == 3 else (None, rest[0], None)
    return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)


def _apply(fn_class, x, what):
    if not (isinstance(fn_class, type) and issubclass(fn_class, torch.autograd.Function)):
        raise TypeError(f"{what} must be a torch.autograd.Function subclass (use it as {what}.apply(x)), "
                        f"got {fn_class!r}")
    out = fn_class.apply(x)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{what}.apply must return a tensor, got {type(out).__name__}")
    return out


# ----------------------------------------------------------------------------- 1. f and g
def _f_g_harness(f_class, g_class, dtype=torch.float64):
    r, t, _, C, Y, (dX, dw1, dw2), tol, (x, w1, w2) = _setup(dtype)
    run = guarded(LIBRARY, exercise="Megatron's f and g", seconds=SECONDS)
    y = run(lambda: _apply(g_class, _mlp(_apply(f_class, x, "CopyToParallel"), w1, w2), "ReduceFromParallel"))
    run(lambda: (y * C).sum().backward())
    if compare(y.detach(), Y, what="y", **tol):
        return ("the MLP's output is wrong: each rank's row layer gives a PARTIAL sum of the output, g's "
                "forward must add them over ranks (all-reduce) | " + compare(y.detach(), Y, what="y", **tol))
    if t > 1 and w2.grad is not None and torch.allclose(w2.grad, t * dw2, **tol):
        return (f"every gradient is {t} times too large: g's backward must not all-reduce (each rank's partial "
                f"output got the whole output's gradient already)")
    if x.grad is None or compare(x.grad, dX, what="dx", **tol):
        return ("the output is right but the input's gradient is not: every rank used the whole x, so its "
                "gradient is the SUM of the ranks' partial gradients: f's backward all-reduces")
    if w1.grad is None or w2.grad is None or compare(w1.grad, dw1, **tol) or compare(w2.grad, dw2, **tol):
        return ("the weights' gradients are wrong: g's backward passes the gradient through unchanged "
                "(each rank's partial output got the whole output's gradient), f's forward is the identity")
    return None


def check_megatron_f_g(CopyToParallel, ReduceFromParallel):
    """f: identity forward, all-reduce backward; g: all-reduce forward, identity backward.
    Run as f -> column -> ReLU -> row -> g on 1, 2 and 3 ranks; output and gradients vs one device."""
    cases = [Case({"f_class": CopyToParallel, "g_class": ReduceFromParallel, "dtype": dt}, world_size=n,
                  label=f"MLP {SIZES}, W1 by rows, W2 by columns, {str(dt)[6:]}")
             for n, dt in ((1, torch.float64), (2, torch.float64), (3, torch.float64), (4, torch.float32))]
    return check_distributed("megatron_f_g", _f_g_harness, cases)


# ----------------------------------------------------------------------------- 2. vocabulary-parallel loss
def _vocab_harness(fn, vocab, offset, n=10, dtype=torch.float64, smoothing=0.0):
    r, t = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3 + offset).to(dtype)   # (N, V)
    targets = torch.randint(0, vocab, (n,), generator=g)
    whole = logits.clone().requires_grad_()
    expected = F.cross_entropy(whole, targets, reduction="none", label_smoothing=smoothing)
    expected.sum().backward()
    plain = F.cross_entropy(logits, targets, reduction="none")
    tol = reorder_tolerance(dtype, expected, whole.grad)
    start, stop = shard_range(vocab, t, r)
    with counted_calls() as calls:
        out = learner(fn, LIBRARY, exercise="the vocabulary-parallel cross-entropy", seconds=SECONDS)(
            logits[:, start:stop].clone(), targets.clone(), start, vocab, smoothing)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        return f"return (loss per token (N,), gradient of the loss sum w.r.t. my logits (N, V_r)), got {out!r}"
    loss, grad = out
    msg = compare(loss, expected.detach(), what="loss per token", **tol)
    if msg:
        if isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all():
            hint = "not finite: subtract a maximum over the WHOLE vocabulary (all-reduce MAX) before exp"
        elif smoothing and isinstance(loss, torch.Tensor) and compare(loss, plain, **tol) is None:
            hint = f"this is the loss without label smoothing (smoothing={smoothing})"
        else:
            hint = msg
        return f"columns [{start}, {stop}) of V={vocab}, smoothing={smoothing}: {hint}"
    msg = compare(grad, whole.grad[:, start:stop], what="gradient", **tol)
    if msg:
        return (f"columns [{start}, {stop}), smoothing={smoothing}: the loss is right, its gradient is not: the "
                f"softmax over the WHOLE vocabulary, less what the smoothed target puts on each of my columns | {msg}")
    moved = calls.elements()
    if t > 1 and moved > 6 * n:
        return (f"right values, but this rank moved {moved} values ({sorted(calls.ops())}) for N={n} tokens and "
                f"V={vocab}: never gather the logits; a few numbers per token cross the ranks (O(N), not O(N V))")
    return None


def check_vocab_parallel_loss(vocab_parallel_loss):
    """vocab_parallel_loss(logits_r, targets, vocab_start, vocab_size, smoothing) on each rank,
    logits_r = columns [vocab_start, vocab_start + V_r) of the logits (N, V) (the first V % t
    ranks hold one column more): returns the per-token cross entropy with label smoothing
    (``F.cross_entropy(..., label_smoothing=smoothing)``), the same on every rank, and the
    gradient of its sum w.r.t. logits_r, in the logits' dtype; at most a few values per token
    may cross the ranks (counted)."""
    cases = [Case({"fn": vocab_parallel_loss, "vocab": v, "offset": o, "dtype": dt, "smoothing": e}, world_size=n,
                  label=f"V={v}, {str(dt)[6:]}, smoothing {e}" + (f", logits around {o}" if o else ""))
             for n, v, o, dt, e in ((1, 8, 0, torch.float64, 0.0), (2, 8, 0, torch.float64, 0.0),
                                    (3, 11, 0, torch.float64, 0.1), (3, 11, 1000.0, torch.float64, 0.0),
                                    (2, 64, 0, torch.float32, 0.3), (4, 13, -500.0, torch.float32, 0.1))]
    return check_distributed("vocab_parallel_loss", _vocab_harness, cases)


# ----------------------------------------------------------------------------- 3. the SP pair
def _sp_harness(gather_class, scatter_class, dtype=torch.float64):
    r, t, (X, _, _), C, Y, (dX, dw1, dw2), tol, (_, w1, w2) = _setup(dtype)
    xs = X.chunk(t, 0)[r].clone().requires_grad_()                # my s/t tokens, (s/t, b, h)
    run = guarded(LIBRARY, exercise="the sequence-parallel pair", seconds=SECONDS)
    full = run(_apply, gather_class, xs, "AllGatherSequence")
    if tuple(full.shape) != tuple(X.shape):
        return f"AllGatherSequence: shape {tuple(full.shape)} from {tuple(xs.shape)}, expected {tuple(X.shape)}"
    if compare(full.detach(), X, **tol):
        return "AllGatherSequence's forward: every rank's tokens, in rank order, along dim 0"
    ys = run(_apply, scatter_class, _mlp(full, w1, w2), "ReduceScatterSequence")   # of a partial sum (s, b, h)
    if compare(ys.detach(), Y.chunk(t, 0)[r], **tol):
        return ("ReduceScatterSequence's forward: the SUM over ranks of the partial outputs, this rank keeping "
                "its own s/t tokens | " + compare(ys.detach(), Y.chunk(t, 0)[r], what="y", **tol))
    run(lambda: (ys * C.chunk(t, 0)[r]).sum().backward())
    if xs.grad is None or compare(xs.grad, dX.chunk(t, 0)[r], **tol):
        return ("the forward is right, the input's gradient is not: the transpose of an all-gather is a "
                "reduce-scatter, of a reduce-scatter an all-gather")
    if compare(w1.grad, dw1, **tol) or compare(w2.grad, dw2, **tol):
        return "the weights' gradients are wrong: ReduceScatterSequence's backward must all-gather the gradient"
    return None


def check_sequence_parallel_pair(AllGatherSequence, ReduceScatterSequence):
    """AllGatherSequence: (s/t, b, h) -> (s, b, h) all-gather forward, reduce-scatter backward;
    ReduceScatterSequence: the transpose. Run around a column -> ReLU -> row MLP on 1, 2, 3 ranks."""
    cases = [Case({"gather_class": AllGatherSequence, "scatter_class": ReduceScatterSequence, "dtype": dt},
                  world_size=n, label=f"x (s={S}, b={B}, h={SIZES[0]}) split along s, {str(dt)[6:]}")
             for n, dt in ((1, torch.float64), (2, torch.float64), (3, torch.float64), (3, torch.float32))]
    return check_distributed("sequence_parallel_pair", _sp_harness, cases)


# ----------------------------------------------------------------------------- 4. bytes per layer
MODES = {"TP": (False, False), "TP+SP": (True, False), "TP+SP, re-gathered in backward": (True, True)}
# (seq_len, batch, hidden, n_heads, dtype): shapes and dtypes the prediction is counted at
# large enough that the transport's headers (~150 bytes a message, counted by the kernel) stay under 1%
LAYERS = ((64, 4, 128, 4, torch.float32), (96, 4, 128, 4, torch.bfloat16), (32, 4, 96, 4, torch.float64))


def check_tp_bytes_prediction(tp_bytes_per_layer):
    """tp_bytes_per_layer(s, b, h, t, sp, regather, dtype_bytes) -> bytes one rank sends in one
    layer's forward + backward; compared with the bytes counted on a real Llama layer (ring
    collectives, t = 2 and 4, three shapes in float32, bfloat16 and float64), within 3% (the
    transport's headers)."""
    from course_lib.launch import launch

    counted = {}
    predict = learner(tp_bytes_per_layer, "course_lib.planner.communication:*",
                      "course_lib.lab.benchmarks:tensor_parallel_layer_bytes", exercise="predicting the bytes",
                      seconds=SECONDS)

    def run(case):
        t, mode, k = case.params["t"], case.params["mode"], case.params["layer"]
        if t not in counted:
            counted[t] = launch(tensor_parallel_layer_bytes, t, LAYERS, MODES, timeout=90, quiet=True)[0]
        sp, regather = MODES[mode]
        s, b, h, _, dtype = LAYERS[k]
        size = torch.empty((), dtype=dtype).element_size()
        got = predict(s, b, h, t, sp, regather, size)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return f"return a number of bytes, got {got!r}"
        measured = counted[t][(k, mode)]
        if abs(got - measured) > 0.03 * measured:
            ratio = got / measured if measured else float("inf")
            why = ""
            if size != 4 and abs(ratio - 4 / size) < 0.05:
                why = f": a {size}-byte dtype here (dtype_bytes={size})"
            return f"predicted {got:,.0f} bytes, counted {measured:,} (s={s}, b={b}, h={h}, {str(dtype)[6:]}){why}"
        return None

    cases = [Case({"t": t, "mode": m, "layer": k}, label=f"t={t}, {m}, s={LAYERS[k][0]} b={LAYERS[k][1]} "
                  f"h={LAYERS[k][2]} {str(LAYERS[k][4])[6:]}") for t in (2, 4) for k in range(len(LAYERS)) for m in MODES]
    return check("tp_bytes_per_layer", cases, run)


# ----------------------------------------------------------------------------- 5. the bias of a row layer
def _bias_harness(fn, dtype=torch.float64):
    r, t, whole, C, Y, want, tol, mine = _setup(dtype, bias=True)
    run = guarded(LIBRARY, exercise="a tensor-parallel MLP with biases", seconds=SECONDS)
    y = run(fn, *mine)
    if not isinstance(y, torch.Tensor) or y.shape != Y.shape:
        return f"return the MLP's output {tuple(Y.shape)}, got " + (
            f"{tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__)
    if y.requires_grad:
        run(lambda: (y * C).sum().backward())
    if compare(y.detach(), Y, **tol):
        if t > 1 and torch.allclose(y.detach(), Y + (t - 1) * whole[4], **tol):
            return (f"the output holds the bias b2 {t} times: every rank added it to its partial sum before the "
                    f"all-reduce; add it once, after")
        return compare(y.detach(), Y, what="y", **tol)
    for name, got, w in zip(("x", "w1", "b1", "w2", "b2"), mine, want):
        if got.grad is None:
            return f"{name} got no gradient"
        if compare(got.grad, w, **tol):
            if name == "b2" and t > 1 and torch.allclose(got.grad * t, w, **tol):
                return (f"the output is right, b2's gradient is {t} times too small: a bias divided by t on every "
                        f"rank sums right, but each copy then learns 1/t of its gradient")
            return compare(got.grad, w, what=f"{name}.grad", **tol)
    return None


def check_tp_mlp_bias(tp_mlp):
    """tp_mlp(x, w1, b1, w2, b2) on each rank: the MLP relu(x W1^T + b1) W2^T + b2 with W1, b1
    split by rows (column-parallel), W2 by columns (row-parallel), b2 whole on every rank;
    output and every gradient compared with one device."""
    cases = [Case({"fn": tp_mlp, "dtype": dt}, world_size=n, label=f"{n} ranks, {str(dt)[6:]}")
             for n, dt in ((1, torch.float64), (2, torch.float64), (3, torch.float64), (4, torch.float32))]
    return check_distributed("tp_mlp_bias", _bias_harness, cases)


__all__ = ["check_megatron_f_g", "check_vocab_parallel_loss", "check_sequence_parallel_pair",
           "check_tp_bytes_prediction", "check_tp_mlp_bias"]
