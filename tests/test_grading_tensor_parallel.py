"""Chapter 5's graders (course_lib/grading/tensor_parallel.py): a differently written right
answer passes; classic mistakes, an answer tuned to one printed case and a library shortcut
each fail with a hint that names the mistake. The vocabulary loss's traffic is counted: the
right values computed from gathered logits fail."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.grading import tensor_parallel as G
from grading_answers import fails_with, graded


def _sum(x):
    x = x.contiguous().clone()
    dist.all_reduce(x)
    return x


def _fn(forward, backward):
    """An autograd Function from two plain functions."""
    return type("Op", (torch.autograd.Function,), {"forward": staticmethod(lambda ctx, x: forward(x)),
                                                   "backward": staticmethod(lambda ctx, g: backward(g))})


# ----------------------------------------------------------------------------- f and g
def _gather_sum(x):                                   # an all-reduce written as all-gather + sum
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.stack(parts).sum(0)


def test_megatron_f_g(capsys):
    f, g = _fn(lambda x: x.clone(), _gather_sum), _fn(_gather_sum, lambda g: g.clone())
    assert graded(capsys, G.check_megatron_f_g, f, g)[0]
    fails_with(capsys, G.check_megatron_f_g, _fn(lambda x: x.clone(), lambda g: g), g, hint="f's backward all-reduces")
    fails_with(capsys, G.check_megatron_f_g, f, _fn(_sum, _sum), hint="times too large")
    fails_with(capsys, G.check_megatron_f_g, f, _fn(lambda x: x.clone(), lambda g: g), hint="PARTIAL sum")
    fails_with(capsys, G.check_megatron_f_g, f, _fn(lambda x: _sum(x) / dist.get_world_size(), lambda g: g),
               hint="PARTIAL sum")

    def library(x):
        from course_lib.parallel import Mesh
        from course_lib.parallel.comm_ops import reduce_from_parallel
        return reduce_from_parallel(x, Mesh(tp=dist.get_world_size()).comm("tp"))
    fails_with(capsys, G.check_megatron_f_g, f, _fn(library, lambda g: g), hint="write this yourself")


# ----------------------------------------------------------------------------- vocabulary loss (smoothed)
def _hit(logits, targets, vocab_start):
    cols = torch.arange(vocab_start, vocab_start + logits.shape[1])
    return (cols[None, :] == targets[:, None]).to(logits.dtype)             # (N, V_r): 1 at my target


def vocab_loss(logits, targets, vocab_start, vocab_size, smoothing):
    """Separate all-reduces (max, then the sums); the smoothed target as a (N, V_r) distribution."""
    m = logits.amax(1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    z = logits - m[:, None]
    target = (1 - smoothing) * _hit(logits, targets, vocab_start) + smoothing / vocab_size   # q over my columns
    sum_exp, target_z = z.exp().sum(1), (z * target).sum(1)
    dist.all_reduce(sum_exp)
    dist.all_reduce(target_z)
    return sum_exp.log() - target_z, z.exp() / sum_exp[:, None] - target


def gathered(logits, targets, vocab_start, vocab_size, smoothing):     # right values, O(N V) traffic
    sizes = torch.tensor([logits.shape[1]])
    every = [torch.empty_like(sizes) for _ in range(dist.get_world_size())]
    dist.all_gather(every, sizes)
    parts = [torch.empty(logits.shape[0], int(s), dtype=logits.dtype) for s in every]
    dist.all_gather(parts, logits.contiguous())
    whole = torch.cat(parts, 1).requires_grad_()
    loss = F.cross_entropy(whole, targets, reduction="none", label_smoothing=smoothing)
    loss.sum().backward()
    return loss.detach(), whole.grad[:, vocab_start:vocab_start + logits.shape[1]]


def zero_padded(logits, targets, vocab_start, vocab_size, smoothing):   # the wrong answer
    whole = torch.zeros(logits.shape[0], vocab_size, dtype=logits.dtype)
    whole[:, vocab_start:vocab_start + logits.shape[1]] = logits
    dist.all_reduce(whole)
    whole.requires_grad_()
    loss = F.cross_entropy(whole, targets, reduction="none", label_smoothing=smoothing)
    loss.sum().backward()
    return loss.detach(), whole.grad[:, vocab_start:vocab_start + logits.shape[1]]


def local_max(logits, targets, vocab_start, vocab_size, smoothing):   # each rank its own max
    z = logits - logits.amax(1)[:, None]
    target = (1 - smoothing) * _hit(logits, targets, vocab_start) + smoothing / vocab_size
    parts = torch.stack([z.exp().sum(1), (z * target).sum(1)])
    dist.all_reduce(parts)
    return parts[0].log() - parts[1], z.exp() / parts[0][:, None] - target


def lecture_unsmoothed(logits, targets, vocab_start, vocab_size, smoothing):   # the lecture's loss, no smoothing
    return vocab_loss(logits, targets, vocab_start, vocab_size, 0.0)


def local_vocabulary(logits, targets, vocab_start, vocab_size, smoothing):   # eps / V_r instead of eps / V
    return vocab_loss(logits, targets, vocab_start, logits.shape[1], smoothing)


def test_vocab_parallel_loss(capsys):
    assert graded(capsys, G.check_vocab_parallel_loss, vocab_loss)[0]
    fails_with(capsys, G.check_vocab_parallel_loss, gathered, hint="never gather the logits")
    fails_with(capsys, G.check_vocab_parallel_loss, zero_padded, hint="never gather the logits")
    fails_with(capsys, G.check_vocab_parallel_loss, local_max, hint=("WHOLE vocabulary", "loss per token"))
    fails_with(capsys, G.check_vocab_parallel_loss, lecture_unsmoothed, hint="without label smoothing")
    fails_with(capsys, G.check_vocab_parallel_loss, local_vocabulary, hint="loss per token")

    def library(logits, targets, vocab_start, vocab_size, smoothing):
        from course_lib.parallel import Mesh
        from course_lib.parallel.vocab_parallel import vocab_parallel_cross_entropy
        return vocab_parallel_cross_entropy(logits, targets, Mesh(tp=dist.get_world_size()).comm("tp"), vocab_start)
    fails_with(capsys, G.check_vocab_parallel_loss, library, hint="write this yourself")


# ----------------------------------------------------------------------------- the SP pair
def _gather0(x):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, 0)


def _scatter0(x):                                      # a reduce-scatter as all-reduce + my chunk
    return _sum(x).chunk(dist.get_world_size(), 0)[dist.get_rank()].clone()


def _mine(x):
    return x.chunk(dist.get_world_size(), 0)[dist.get_rank()].clone()


def test_sequence_parallel_pair(capsys):
    gather, scatter = _fn(_gather0, _scatter0), _fn(_scatter0, _gather0)
    assert graded(capsys, G.check_sequence_parallel_pair, gather, scatter)[0]
    fails_with(capsys, G.check_sequence_parallel_pair, _fn(_gather0, _mine), scatter, hint="input's gradient")
    fails_with(capsys, G.check_sequence_parallel_pair, gather, _fn(_mine, _gather0), hint="SUM over ranks")

    def along_batch(x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, 1)
    fails_with(capsys, G.check_sequence_parallel_pair, _fn(along_batch, _scatter0), scatter, hint="shape")

    def library(x):
        from course_lib.parallel import Mesh
        from course_lib.parallel.comm_ops import gather_from_sequence_parallel
        return gather_from_sequence_parallel(x, Mesh(tp=dist.get_world_size()).comm("tp"), dim=0)
    fails_with(capsys, G.check_sequence_parallel_pair, _fn(library, _scatter0), scatter, hint="write this yourself")


# ----------------------------------------------------------------------------- bytes per layer
def layer_bytes(s, b, h, t, sp, regather, dtype_bytes):
    """Per collective: g after attention and after the MLP, f before them in backward."""
    act = s * b * h * dtype_bytes
    per_rank_piece = act / t
    ring_all_reduce = 2 * (t - 1) * per_rank_piece
    extra_gathers = 2 * (t - 1) * per_rank_piece if sp and regather else 0
    return 4 * ring_all_reduce + extra_gathers


def test_tp_bytes_prediction(capsys):
    assert graded(capsys, G.check_tp_bytes_prediction, layer_bytes)[0]
    fails_with(capsys, G.check_tp_bytes_prediction, lambda s, b, h, t, sp, rg, db: layer_bytes(s, b, h, t, sp, rg, 4),
               hint="dtype_bytes=2")
    fails_with(capsys, G.check_tp_bytes_prediction,
               lambda s, b, h, t, sp, rg, db: layer_bytes(s, b, h, t, sp, False, db), hint="re-gathered")
    fails_with(capsys, G.check_tp_bytes_prediction,
               lambda s, b, h, t, sp, rg, db: 4 * s * b * h * db * (1 + (sp and rg) / 4), hint="t=4")
    fails_with(capsys, G.check_tp_bytes_prediction, lambda *a: 524288, hint="predicted")

    def library(s, b, h, t, sp, regather, dtype_bytes):
        from course_lib.planner.communication import tp_bytes_per_layer
        return tp_bytes_per_layer(s, b, h, t, sp, dtype_bytes=dtype_bytes)
    fails_with(capsys, G.check_tp_bytes_prediction, library, hint="write this yourself")


# ----------------------------------------------------------------------------- the row layer's bias
def tp_mlp(x, w1, b1, w2, b2):
    f, g = _fn(lambda x: x.clone(), _sum), _fn(_sum, lambda g: g.clone())
    partial = F.linear(F.relu(F.linear(f.apply(x), w1) + b1), w2)
    return g.apply(partial) + b2


def bias_on_every_rank(x, w1, b1, w2, b2):           # the bug the exercise shows
    f, g = _fn(lambda x: x.clone(), _sum), _fn(_sum, lambda g: g.clone())
    return g.apply(F.linear(F.relu(F.linear(f.apply(x), w1, b1)), w2, b2))


def bias_over_t(x, w1, b1, w2, b2):                   # sums right, learns 1/t
    f, g = _fn(lambda x: x.clone(), _sum), _fn(_sum, lambda g: g.clone())
    return g.apply(F.linear(F.relu(F.linear(f.apply(x), w1, b1)), w2, b2 / dist.get_world_size()))


def no_f(x, w1, b1, w2, b2):                          # x's gradient not summed over the ranks
    g = _fn(_sum, lambda g: g.clone())
    return g.apply(F.linear(F.relu(F.linear(x, w1, b1)), w2)) + b2


def test_tp_mlp_bias(capsys):
    assert graded(capsys, G.check_tp_mlp_bias, tp_mlp)[0]
    fails_with(capsys, G.check_tp_mlp_bias, bias_on_every_rank, hint="b2 2 times")
    fails_with(capsys, G.check_tp_mlp_bias, bias_over_t, hint="2 times too small")
    fails_with(capsys, G.check_tp_mlp_bias, no_f, hint="x.grad")

    def library(x, w1, b1, w2, b2):
        from course_lib.parallel import Mesh, RowParallelLinear
        RowParallelLinear(torch.nn.Linear(12, 6), Mesh(tp=dist.get_world_size()))
    fails_with(capsys, G.check_tp_mlp_bias, library, hint="write this yourself")
