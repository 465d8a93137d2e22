"""The vocabulary split over the tensor-parallel ranks: embedding, logits and loss.

    emb = VocabParallelEmbedding(model.tok_emb, comm)        # rows [start, stop) of the table
    x = emb(idx)                                             # (b, s, h): summed over ranks (g)
    logits = lm_head_shard(x)                                # (b, s, V_r): my slice of the vocabulary
    loss = vocab_parallel_cross_entropy(logits, targets, comm, start, n_tokens)

No rank ever holds the full (b, s, V) logits: the softmax needs, per token, the maximum
logit and the sum of exponentials over the WHOLE vocabulary, and the target's logit,
which lives on one rank. Each is a number per token, all-reduced over the group
(Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al. 2019):

    m      = max_r max_local(logits)                          all-reduce MAX   (b*s,)
    S      = sum_r sum_local exp(logits - m)                  all-reduce SUM   (b*s,)
    z_t    = sum_r (logit of the target if this rank owns it, else 0)   (SUM, with S)
    loss   = sum over tokens of (log S - (z_t - m)) / n_tokens

and the gradient of the local logits is (softmax_local - onehot_local) / n_tokens: local.
The vocabulary may split unevenly (the first V % t ranks hold one more row).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from course_lib.collectives.comm import Comm
from course_lib.parallel.comm_ops import reduce_from_parallel, scatter_to_sequence_parallel

IGNORE_INDEX = -100  # F.cross_entropy's default: such a target counts no loss and no token


def shard_range(n: int, t: int, r: int) -> tuple[int, int]:
    """Rows [start, stop) of ``n`` that rank ``r`` of ``t`` keeps: contiguous, as even as
    possible (the first n % t ranks get one more)."""
    if not 0 <= r < t:
        raise ValueError(f"rank {r} is not in a group of {t}")
    base, extra = divmod(n, t)
    start = r * base + min(r, extra)
    return start, start + base + (1 if r < extra else 0)


def vocab_rule(rows: int, tp: int):
    """Every TP rank holds at least one row of the vocabulary (embedding, head)."""
    if rows < tp:
        raise ValueError(f"a vocabulary of {rows} rows cannot be split over {tp} ranks (each needs at least one row)")


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of a single-device ``nn.Embedding`` (sliced, never re-drawn).

    A token outside this rank's rows looks up zeros, so the ranks' outputs are partial sums
    with exactly one non-zero term per token: ``output="reduce"`` all-reduces them (g);
    ``"reduce_scatter"`` (sequence parallelism) reduce-scatters them along the sequence,
    each rank keeping its s/t tokens; ``"partial"`` returns the partial sum.
    """

    def __init__(self, embedding: nn.Embedding, comm: Comm, output: str = "reduce"):
        super().__init__()
        if not isinstance(comm, Comm):
            raise TypeError(f"pass the tensor-parallel group's Comm (mesh.comm('tp')), got {type(comm).__name__}")
        if output not in ("reduce", "reduce_scatter", "partial"):
            raise ValueError(f"output must be 'reduce', 'reduce_scatter' or 'partial', got {output!r}")
        vocab_rule(embedding.num_embeddings, comm.size)
        self.comm, self.output = comm, output
        self.num_embeddings = embedding.num_embeddings             # the full vocabulary V
        self.start, self.stop = shard_range(self.num_embeddings, comm.size, comm.rank)
        w = embedding.weight
        self.weight = nn.Parameter(w.detach()[self.start:self.stop].clone(), requires_grad=w.requires_grad)
        self.weight.tp_shard = (0, self.start, self.stop, self.num_embeddings)

    def forward(self, idx):  # (b, s) int64 -> (b, s, h)
        outside = (idx < self.start) | (idx >= self.stop)                  # (b, s) bool
        local = (idx - self.start).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # partial sum
        if self.output == "reduce":
            return reduce_from_parallel(x, self.comm, in_place=True)   # x: the fresh masked rows
        if self.output == "reduce_scatter":
            return scatter_to_sequence_parallel(x, self.comm, dim=1)
        return x

    def extra_repr(self):
        return f"rows [{self.start}, {self.stop}) of {self.num_embeddings}, output={self.output}"


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits split along the vocabulary (never gathered)."""

    @staticmethod
    def forward(ctx, logits, targets, comm, start, ignore_index=IGNORE_INDEX):  # logits (N, V_r), targets (N,)
        n, v_local = logits.shape
        m = logits.max(dim=-1).values                                     # (N,) my maximum
        comm.all_reduce(m, op=dist.ReduceOp.MAX, name="loss: all-reduce max")
        exp = (logits - m.unsqueeze(-1)).exp()                            # (N, V_r), <= 1
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < v_local)                       # I hold the target's logit
        rows = torch.arange(n, device=logits.device)
        target_logit = torch.where(mine, logits[rows, local_t.clamp(0, v_local - 1)] - m, 0.0)
        valid = targets != ignore_index
        owned = (mine & valid).sum().to(exp.dtype).unsqueeze(0)          # targets whose logit I hold
        sums = torch.cat([exp.sum(dim=-1), target_logit, owned])          # (2N + 1,): one all-reduce
        comm.all_reduce(sums, name="loss: all-reduce sum-exp, target logit")
        sum_exp, target_logit, owned = sums[:n], sums[n:2 * n], sums[2 * n]
        n_valid = int(valid.sum().item())
        if int(owned.item()) != n_valid:                                  # the same answer on every rank
            raise ValueError(f"every target must be a class of the vocabulary (0 .. V-1) or ignore_index="
                             f"{ignore_index}: {n_valid - int(owned.item())} target(s) are not (they range "
                             f"from {targets[valid].min().item()} to {targets[valid].max().item()})")
        loss = torch.where(valid, sum_exp.log() - target_logit, 0.0)      # (N,)
        exp.div_(sum_exp.unsqueeze(-1))                                   # softmax over MY columns
        ctx.save_for_backward(exp, local_t, mine & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, grad):  # grad (N,)
        softmax, local_t, hit, valid = ctx.saved_tensors
        g = softmax.clone()                                               # d loss / d logits
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows[hit], local_t[hit]] -= 1.0                                 # - onehot, where I hold it
        g.mul_((grad * valid).unsqueeze(-1))
        return g, None, None, None, None


def vocab_parallel_cross_entropy(logits, targets, comm: Comm, start: int, n_tokens=None,
                                 ignore_index: int = IGNORE_INDEX):
    """Cross entropy summed over tokens / ``n_tokens`` (the global token count; None: the
    number of targets that are not ``ignore_index``, as ``F.cross_entropy``'s mean: NaN when
    every target is ignored), from this rank's vocabulary columns [start, start + V_r) of the
    logits. The same value on every rank of ``comm``. A target that is neither a class nor
    ``ignore_index`` is a ValueError on every rank (``F.cross_entropy`` raises too)."""
    if not isinstance(comm, Comm):
        raise TypeError(f"pass the tensor-parallel Comm (mesh.comm('tp')), got {type(comm).__name__}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets must have the shape of logits without the vocabulary axis, "
                         f"{tuple(logits.shape[:-1])}, got {tuple(targets.shape)}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    dtype = torch.promote_types(logits.dtype, torch.float32)              # at least fp32 (float64 stays)
    logits, targets = logits.to(dtype).flatten(0, -2), targets.flatten()  # (N, V_r), (N,)
    per_token = VocabParallelCrossEntropy.apply(logits, targets, comm, start, ignore_index) if comm.size > 1 else \
        F.cross_entropy(logits, targets, reduction="none", ignore_index=ignore_index)
    if n_tokens is None:
        n_tokens = (targets != ignore_index).sum()
    elif isinstance(n_tokens, bool) or not isinstance(n_tokens, (int, float, torch.Tensor)) or n_tokens < 1:
        raise ValueError(f"n_tokens (the global token count) must be a number >= 1, got {n_tokens!r}")
    return per_token.sum() / n_tokens


__all__ = ["vocab_rule", "shard_range", "VocabParallelEmbedding", "VocabParallelCrossEntropy", "vocab_parallel_cross_entropy",
           "IGNORE_INDEX"]
