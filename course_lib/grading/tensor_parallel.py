"""Graders of chapter 5 (tensor and sequence parallelism): a learner's pieces, run on real
ranks inside a Megatron MLP or a loss, compared with one device.

    check_megatron_f_g(CopyToParallel, ReduceFromParallel)   # autograd.Functions: f and g
    check_vocab_parallel_loss(vocab_parallel_loss)            # (logits_r, targets, start) -> loss, dlogits_r
    check_sequence_parallel_pair(AllGatherSequence, ReduceScatterSequence)   # SP g and g-bar
    check_tp_bytes_prediction(tp_bytes_per_layer)             # bytes one rank sends per layer, vs counted

Each prints one line (``megatron_f_g: 3/3 cases passed`` or the first failing case with a
hint) and returns True/False; a learner's exception or deadlock becomes the hint.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib.grading import Case, check, check_distributed, compare

SIZES = (6, 12, 6)  # an MLP h -> 12 -> h: 12 hidden features split over 1, 2, 3 (and 4) ranks
S, B = 6, 2         # sequence and batch of the inputs (6 tokens split over 1, 2, 3 ranks)


def _problem(seed=0):
    """X (s, b, h), W1 (12, h), W2 (h, 12), the output's upstream gradient C (s, b, h), in float64."""
    g = torch.Generator().manual_seed(seed)
    h, f = SIZES[0], SIZES[1]
    shapes = ((S, B, h), (f, h), (h, f), (S, B, h))
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes]


def _one_device():
    X, W1, W2, C = (t.clone().requires_grad_(k < 3) for k, t in enumerate(_problem()))
    Y = F.linear(F.relu(F.linear(X, W1)), W2)
    (Y * C).sum().backward()
    return Y.detach(), X.grad, W1.grad, W2.grad


def _apply(fn_class, x, what):
    if not (isinstance(fn_class, type) and issubclass(fn_class, torch.autograd.Function)):
        raise TypeError(f"{what} must be a torch.autograd.Function subclass (use it as {what}.apply(x)), "
                        f"got {fn_class!r}")
    out = fn_class.apply(x)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{what}.apply must return a tensor, got {type(out).__name__}")
    return out


# ----------------------------------------------------------------------------- 1. f and g
def _f_g_harness(f_class, g_class):
    import torch.distributed as dist

    r, t = dist.get_rank(), dist.get_world_size()
    Y, dX, dW1, dW2 = _one_device()
    X, W1, W2, C = _problem()
    x = X.clone().requires_grad_()
    w1 = W1.chunk(t, 0)[r].clone().requires_grad_()               # column: my rows of W1
    w2 = W2.chunk(t, 1)[r].clone().requires_grad_()               # row: my columns of W2
    y = _apply(g_class, F.linear(F.relu(F.linear(_apply(f_class, x, "CopyToParallel"), w1)), w2),
               "ReduceFromParallel")
    (y * C).sum().backward()
    if compare(y.detach(), Y, what="y"):
        return ("the MLP's output is wrong: each rank's row layer gives a PARTIAL sum of the output, g's "
                "forward must add them over ranks (all-reduce) | " + compare(y.detach(), Y, what="y"))
    if x.grad is None or compare(x.grad, dX, what="dx"):
        return ("the output is right but the input's gradient is not: every rank used the whole x, so its "
                "gradient is the SUM of the ranks' partial gradients: f's backward all-reduces")
    if w1.grad is None or w2.grad is None or compare(w1.grad, dW1.chunk(t, 0)[r]) or \
            compare(w2.grad, dW2.chunk(t, 1)[r]):
        return ("the weights' gradients are wrong: g's backward passes the gradient through unchanged "
                "(each rank's partial output got the whole output's gradient), f's forward is the identity")
    return None


def check_megatron_f_g(CopyToParallel, ReduceFromParallel):
    """f: identity forward, all-reduce backward; g: all-reduce forward, identity backward.
    Run as f -> column -> ReLU -> row -> g on 1, 2 and 3 ranks; output and gradients vs one device."""
    cases = [Case({"f_class": CopyToParallel, "g_class": ReduceFromParallel}, world_size=n,
                  label=f"MLP {SIZES}, W1 by rows, W2 by columns") for n in (1, 2, 3)]
    return check_distributed("megatron_f_g", _f_g_harness, cases)


# ----------------------------------------------------------------------------- 2. vocabulary-parallel loss
def _vocab_harness(fn, vocab, offset):
    import torch.distributed as dist

    from course_lib.parallel.vocab_parallel import shard_range

    r, t = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(10, vocab, generator=g, dtype=torch.float64) * 3 + offset   # (N, V)
    targets = torch.randint(0, vocab, (10,), generator=g)
    whole = logits.clone().requires_grad_()
    expected = F.cross_entropy(whole, targets, reduction="none")
    expected.sum().backward()
    start, stop = shard_range(vocab, t, r)
    out = fn(logits[:, start:stop].clone(), targets.clone(), start)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        return f"return (loss per token (N,), gradient of the loss sum w.r.t. my logits (N, V_r)), got {out!r}"
    loss, grad = out
    msg = compare(loss, expected.detach(), rtol=1e-9, atol=1e-9, what="loss per token")
    if msg:
        hint = "not finite: subtract the GLOBAL maximum (all-reduce MAX) before exp" if \
            isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all() else msg
        return f"columns [{start}, {stop}) of V={vocab}: {hint}"
    msg = compare(grad, whole.grad[:, start:stop], rtol=1e-9, atol=1e-9, what="gradient")
    if msg:
        return (f"columns [{start}, {stop}): the loss is right, its gradient is not: softmax over the WHOLE "
                f"vocabulary (my columns), minus 1 at the target where I hold it | {msg}")
    return None


def check_vocab_parallel_loss(vocab_parallel_loss):
    """vocab_parallel_loss(logits_r, targets, vocab_start) on each rank, logits_r = columns
    [vocab_start, vocab_start + V_r) of the logits (N, V): returns the per-token cross entropy
    (N,) (the same on every rank) and the gradient of its sum w.r.t. logits_r."""
    cases = [Case({"fn": vocab_parallel_loss, "vocab": v, "offset": o}, world_size=n,
                  label=f"V={v}" + (f", logits around {o}" if o else ""))
             for n, v, o in ((1, 8, 0), (2, 8, 0), (3, 11, 0), (3, 11, 1000.0))]
    return check_distributed("vocab_parallel_loss", _vocab_harness, cases)


# ----------------------------------------------------------------------------- 3. the SP pair
def _sp_harness(gather_class, scatter_class):
    import torch.distributed as dist

    r, t = dist.get_rank(), dist.get_world_size()
    Y, dX, dW1, dW2 = _one_device()
    X, W1, W2, C = _problem()
    xs = X.chunk(t, 0)[r].clone().requires_grad_()                # my s/t tokens, (s/t, b, h)
    w1 = W1.chunk(t, 0)[r].clone().requires_grad_()
    w2 = W2.chunk(t, 1)[r].clone().requires_grad_()
    full = _apply(gather_class, xs, "AllGatherSequence")
    if tuple(full.shape) != tuple(X.shape):
        return f"AllGatherSequence: shape {tuple(full.shape)} from {tuple(xs.shape)}, expected {tuple(X.shape)}"
    if compare(full.detach(), X):
        return "AllGatherSequence's forward: every rank's tokens, in rank order, along dim 0"
    partial = F.linear(F.relu(F.linear(full, w1)), w2)            # (s, b, h): a partial sum
    ys = _apply(scatter_class, partial, "ReduceScatterSequence")
    if compare(ys.detach(), Y.chunk(t, 0)[r]):
        return ("ReduceScatterSequence's forward: the SUM over ranks of the partial outputs, this rank keeping "
                "its own s/t tokens | " + compare(ys.detach(), Y.chunk(t, 0)[r], what="y"))
    (ys * C.chunk(t, 0)[r]).sum().backward()
    if xs.grad is None or compare(xs.grad, dX.chunk(t, 0)[r]):
        return ("the forward is right, the input's gradient is not: the transpose of an all-gather is a "
                "reduce-scatter, of a reduce-scatter an all-gather")
    if compare(w1.grad, dW1.chunk(t, 0)[r]) or compare(w2.grad, dW2.chunk(t, 1)[r]):
        return "the weights' gradients are wrong: ReduceScatterSequence's backward must all-gather the gradient"
    return None


def check_sequence_parallel_pair(AllGatherSequence, ReduceScatterSequence):
    """AllGatherSequence: (s/t, b, h) -> (s, b, h) all-gather forward, reduce-scatter backward;
    ReduceScatterSequence: the transpose. Run around a column -> ReLU -> row MLP on 1, 2, 3 ranks."""
    cases = [Case({"gather_class": AllGatherSequence, "scatter_class": ReduceScatterSequence}, world_size=n,
                  label=f"x (s={S}, b={B}, h={SIZES[0]}) split along s") for n in (1, 2, 3)]
    return check_distributed("sequence_parallel_pair", _sp_harness, cases)


# ----------------------------------------------------------------------------- 4. bytes per layer
MODES = {"TP": (False, False), "TP+SP": (True, False), "TP+SP, re-gathered in backward": (True, True)}
LAYER = dict(seq_len=64, hidden=128, n_heads=4, n_layers=1)


def _count_layer_bytes():
    """On each rank: bytes one Llama layer's forward + backward sends through our ring, per mode."""
    import torch.distributed as dist

    from course_lib.models import GPTConfig, TinyGPT
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.tp_plan import parallelize

    mesh = Mesh(tp=dist.get_world_size(), impl="course")
    t, r, comm = mesh.sizes["tp"], mesh.coord["tp"], mesh.comm("tp")
    cfg, out = GPTConfig(**LAYER), {}
    for mode, (sp, regather) in MODES.items():
        model = parallelize(TinyGPT(cfg, seed=0), mesh, sequence_parallel=sp, keep_gathered=not regather)
        x = torch.randn(4, cfg.seq_len, cfg.hidden, generator=torch.Generator().manual_seed(0))
        x = (x.chunk(t, 1)[r] if sp else x).requires_grad_()
        comm.reset()
        with comm.measuring():
            model.blocks[0](x).sum().backward()
        out[mode] = comm.bytes_sent()
    return out


def check_tp_bytes_prediction(tp_bytes_per_layer):
    """tp_bytes_per_layer(s, b, h, t, sp, regather, dtype_bytes) -> bytes one rank sends in one
    layer's forward + backward; compared with the bytes counted on a real Llama layer (fp32,
    ring collectives, t = 2 and 4), within 3% (the transport's headers)."""
    from course_lib.launch import launch

    counted = {}

    def run(case):
        t, mode = case.params["t"], case.params["mode"]
        if t not in counted:
            counted[t] = launch(_count_layer_bytes, t, timeout=60, quiet=True)[0]
        sp, regather = MODES[mode]
        got = tp_bytes_per_layer(LAYER["seq_len"], 4, LAYER["hidden"], t, sp, regather, 4)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return f"return a number of bytes, got {got!r}"
        measured = counted[t][mode]
        if abs(got - measured) > 0.03 * measured:
            return (f"predicted {got:,.0f} bytes, counted {measured:,} (s={LAYER['seq_len']}, b=4, "
                    f"h={LAYER['hidden']}, fp32)")
        return None

    cases = [Case({"t": t, "mode": m}, label=f"t={t}, {m}") for t in (2, 4) for m in MODES]
    return check("tp_bytes_per_layer", cases, run)


__all__ = ["check_megatron_f_g", "check_vocab_parallel_loss", "check_sequence_parallel_pair",
           "check_tp_bytes_prediction"]
