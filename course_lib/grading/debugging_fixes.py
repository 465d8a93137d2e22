"""Graders of chapter 11's find-and-fix questions 6-9 (solutions/11_debugging_exercises.ipynb).

    check_pipeline_exchange(exchange_boundaries)  # both pipeline neighbours send first: a hang
    check_gather_group(gather_outputs)            # an all-gather on the wrong mesh dimension
    check_token_loss(token_step)                  # a loss divided by the local token count
    check_uneven_gather(gather_rows)              # an all-gather of shards of uneven length

Each runs the learner's fixed function on real ranks (course_lib.launch, float64, tiny sizes)
and compares what every rank holds with one device's, through grading.compare (bit for bit
where data only moves, the one-step bound where it is summed). A fix that only silences the
symptom (no hang, no error any more, but zeros, a local copy, a mean of means, padding left in
or rows cut off) moves other numbers than one device's and fails. One launch per check, each
case's inputs chosen so that no single hard-coded count or shape passes. While the learner's
function runs, course_lib's data-parallel code and this module's references are switched off.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from course_lib.grading import Case, check_distributed, compare, learner
from course_lib.grading.debugging import SYNC_LIBRARY, sync_net
from course_lib.grading.guard import TORCH_DATA_PARALLEL

F64 = torch.float64
_HERE = "course_lib.grading.debugging_fixes:"
REFERENCES = tuple(_HERE + name for name in ("_boundaries", "_linear", "_token_data", "_rows_of"))


def _comm(dim):
    from course_lib.collectives import Comm
    return Comm(None, dim=dim)


# ----------------------------------------------------------------------------- 6. pipeline exchange

def _boundaries(stages):
    """One device: acts[s] = the (4, 8) activation entering stage s (acts[stages] = the output),
    grads[s] = d loss / d acts[s], for ``stages`` tanh(Linear(8, 8)) stages."""
    torch.manual_seed(6)
    layers = [nn.Linear(8, 8).double() for _ in range(stages)]
    acts = [torch.randn(4, 8, dtype=F64, requires_grad=True)]
    for layer in layers:
        acts.append(torch.tanh(layer(acts[-1])))
        acts[-1].retain_grad()
    (acts[-1] ** 2).sum().backward()
    return [a.detach() for a in acts], [a.grad for a in acts]


def _pipeline_harness(exchange):
    comm = _comm("pp")
    s, last = comm.rank, comm.size - 1
    acts, grads = _boundaries(comm.size)            # outside the guard
    fn = learner(exchange, REFERENCES, exercise="the pipeline's boundary exchange", seconds=20)
    got = fn(comm, acts[s + 1].clone(), grads[s].clone())   # my output, my input's gradient
    if not (isinstance(got, tuple) and len(got) == 2):
        return f"expected a pair (input activation, output gradient), got {type(got).__name__}"
    for value, want, what, none in ((got[0], acts[s], "the activation from stage s - 1", s == 0),
                                    (got[1], grads[s + 1], "the gradient from stage s + 1", s == last)):
        if none:
            if value is not None:
                return f"stage {s} has no such neighbour: {what} must be None"
            continue
        bad = compare(value, want, what=f"stage {s}, {what}", exact=True)
        if bad:
            return bad + " (one device hands this tensor on unchanged; a message only moves it)"


def check_pipeline_exchange(exchange_boundaries) -> bool:
    """``exchange_boundaries(comm, output, input_grad) -> (input_act, output_grad)`` on 3 and 4 stages."""
    cases = [Case({"exchange": exchange_boundaries}, 3, "3 stages"),
             Case({"exchange": exchange_boundaries}, 4, "4 stages")]
    return check_distributed("exchange_boundaries", _pipeline_harness, cases, timeout=3)


# ----------------------------------------------------------------------------- 7. the wrong group

def _linear(dp, rows=3):
    """One device: W (4, 8), b (4,), X (dp * rows, 8) and the output X @ W.T + b."""
    gen = torch.Generator().manual_seed(7)
    W, b = torch.randn(4, 8, generator=gen, dtype=F64), torch.randn(4, generator=gen, dtype=F64)
    X = torch.randn(dp * rows, 8, generator=gen, dtype=F64)
    return W, b, X, X @ W.T + b


def _gather_harness(gather, sizes):
    """Rank (dp_i, tp_j): its dp shard's rows times W's j-th block of input columns (row-parallel
    linear; tp rank 0 adds the bias). The learner's ``gather(mesh, partial)`` must return the
    whole (dp * rows, 4) output of one device on every rank."""
    from course_lib.parallel.mesh import Mesh
    mesh = Mesh(**sizes)
    dp, tp, c = mesh.sizes["dp"], mesh.sizes["tp"], mesh.coord
    W, b, X, want = _linear(dp)
    cols = slice(c["tp"] * 8 // tp, (c["tp"] + 1) * 8 // tp)
    partial = X.chunk(dp)[c["dp"]][:, cols] @ W[:, cols].T + (b if c["tp"] == 0 else 0)   # (rows, 4)
    got = learner(gather, REFERENCES, TORCH_DATA_PARALLEL, exercise="the output gather", seconds=20)(mesh, partial)
    return compare(got, want, what="the gathered output", dtype=F64, terms=tp + 1)


def check_gather_group(gather_outputs) -> bool:
    """``gather_outputs(mesh, partial) -> (dp * rows, 4)`` on dp=2 x tp=2 and dp=3."""
    cases = [Case({"gather": gather_outputs, "sizes": dict(dp=2, tp=2)}, 4, "dp=2 x tp=2"),
             Case({"gather": gather_outputs, "sizes": dict(dp=3)}, 3, "dp=3 (tp=1)")]
    return check_distributed("gather_outputs", _gather_harness, cases, timeout=10)


# ----------------------------------------------------------------------------- 8. tokens

def _token_data(counts, rows=6):
    """Every rank ``rows`` rows, the first counts[r] real, the rest padding; one device's
    loss = squared error summed over every real token / the number of real tokens."""
    gen = torch.Generator().manual_seed(sum(counts))
    X = torch.randn(len(counts) * rows, 8, generator=gen, dtype=F64)
    Y = torch.randn(len(counts) * rows, 2, generator=gen, dtype=F64)
    keep = torch.zeros(len(counts) * rows, dtype=torch.bool)
    for r, k in enumerate(counts):
        keep[r * rows: r * rows + k] = True
    ref = sync_net()
    (((ref(X) - Y) ** 2).sum(-1)[keep].sum() / keep.sum()).backward()
    return X, Y, keep, ref


def _token_harness(step, splits):
    comm = _comm("dp")
    r, n = comm.rank, comm.size
    fn = learner(step, REFERENCES, SYNC_LIBRARY, TORCH_DATA_PARALLEL, exercise="the token-weighted loss", seconds=20)
    for counts in splits:
        X, Y, keep, ref = _token_data(counts)
        net = sync_net()
        fn(net, X.chunk(n)[r].clone(), Y.chunk(n)[r].clone(), keep.chunk(n)[r].clone(), comm)
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            bad = compare(p.grad, q.grad, what=name, dtype=F64)
            if bad:
                return f"real tokens per rank {list(counts)}: {bad} (one device divides by every rank's real tokens)"


def check_token_loss(token_step) -> bool:
    """``token_step(net, x, y, keep, comm)``: backward and gradient sum; every gradient equals one device's."""
    case = Case({"step": token_step, "splits": [(5, 1, 3), (0, 4, 6)]}, 3,
                "3 ranks, real tokens (5, 1, 3) then (0, 4, 6)")
    return check_distributed("token_step", _token_harness, [case], timeout=10)


# ----------------------------------------------------------------------------- 9. uneven shards

def _rows_of(counts):
    """One device's (sum(counts), 4) rows; rank r holds the r-th block of counts[r] rows."""
    gen = torch.Generator().manual_seed(len(counts) * 10 + sum(counts))
    return torch.randn(sum(counts), 4, generator=gen, dtype=F64)


def _rows_harness(gather, splits):
    comm = _comm("dp")
    fn = learner(gather, REFERENCES, exercise="gathering uneven shards", seconds=20)
    for counts in splits:
        X = _rows_of(counts)
        got = fn(X.split(list(counts))[comm.rank].clone(), comm)
        bad = compare(got, X, what=f"rows per rank {list(counts)}: the gathered rows", exact=True)
        if bad:
            return bad + " (one device holds exactly these rows, in rank order)"


def check_uneven_gather(gather_rows) -> bool:
    """``gather_rows(mine, comm) -> (sum of every rank's rows, 4)``, rows known only to their rank."""
    case = Case({"gather": gather_rows, "splits": [(3, 1, 4), (0, 5, 2), (2, 2, 2)]}, 3,
                "3 ranks, rows (3, 1, 4), (0, 5, 2), (2, 2, 2)")
    return check_distributed("gather_rows", _rows_harness, [case], timeout=10)


__all__ = ["check_pipeline_exchange", "check_gather_group", "check_token_loss", "check_uneven_gather"]
