"""Graders of chapter 11, debugging (solutions/11_debugging_exercises.ipynb).

    check_divergence(first_divergence)        # merge per-rank records: each group's first bad position
    check_fingerprint(fingerprint)            # which collectives may run together
    check_which_reduction(which_reduction)    # missing / scaled reduction from the ranks' gradients
    check_first_nan(first_nan_module)         # the module whose own computation made the NaN
    check_sync_fix(sync_gradients)            # find and fix: a dp x cp gradient sync, on real ranks
    check_pipeline_exchange(exchange_boundaries)  # both pipeline neighbours send first: a hang
    check_gather_group(gather_outputs)            # an all-gather on the wrong mesh dimension
    check_token_loss(token_step)                  # a loss divided by the local token count
    check_uneven_gather(gather_rows)              # an all-gather of shards of uneven length

Questions 5-9 run on real ranks. While the learner's function runs, course_lib.debug, data
parallelism and this module's references are off. The find-and-fix questions compare what
every rank holds with one device's (float64, tiny sizes): a fix that only silences the
symptom (zeros, a local copy, a mean of means, padding left in) fails, and no single
hard-coded count or shape passes.
"""
from __future__ import annotations

import random

import torch
import torch.nn as nn

from course_lib.debug import desync
from course_lib.models import MLP
from course_lib.reference import mlp_data
from course_lib.grading import Case, Mismatch, check, check_distributed, compare, learner
from course_lib.grading.harness import check_answers, grads_differ, on_ranks
from course_lib.grading.guard import COURSE_DATA_PARALLEL, COURSE_FSDP, TORCH_DATA_PARALLEL

_HERE = "course_lib.grading.debugging:"
REFERENCES = _HERE + "_*"   # this module's references and data, off while the learner's code runs
LIBRARY = ("course_lib.debug.flight_recorder:*", "course_lib.debug.diagnosis:*", "course_lib.debug.desync:*",
           "course_lib.debug.bisect:*", "course_lib.debug.nonfinite:*")


# ----------------------------------------------------------------------------- 1. merging records

def _first_divergence(calls: dict) -> dict:
    """{group: first 1-based position on that group where its members' calls differ}."""
    groups = sorted({c[0] for recs in calls.values() for c in recs})
    out = {}
    for g in groups:
        per = {r: [c[1:] for c in calls.get(r, []) if c[0] == g] for r in g}
        for k in range(max(len(v) for v in per.values())):
            if len({tuple(v[k:k + 1]) for v in per.values()}) > 1:
                out[g] = k + 1
                break
    return out


def _divergence_cases():
    rng = random.Random(11)
    dp0, dp1, tp0, tp1 = (0, 2), (1, 3), (0, 1), (2, 3)
    ar, ag = ("all_reduce", (8, 64)), ("all_gather", (8, 64))

    def spmd(n):   # every rank: n rounds of (tp all-reduce, dp all-reduce), on its own groups
        tp, dp = (lambda r: tp0 if r < 2 else tp1), (lambda r: dp0 if r % 2 == 0 else dp1)
        return {r: [c for _ in range(n) for c in ((tp(r),) + ar, (dp(r),) + ar)] for r in range(4)}

    def planted(n, rank, edit):   # spmd(n), rank's record edited
        c = spmd(n)
        c[rank] = edit(c[rank])
        return c
    cases = [Case({"args": (c,)}, label=label) for c, label in [
        (spmd(3), "2x2 mesh, every rank the same program on its own groups"),
        (planted(3, 3, lambda r: r[:3] + [(dp1, "all_reduce", (8, 32))] + r[4:]),
         "rank 3's second dp call has another shape"),
        (planted(3, 2, lambda r: r[:3]), "rank 2 stopped after 3 calls (never reached the rest)"),
        (planted(2, 1, lambda r: [r[1], r[0]] + r[2:]), "rank 1 made its first two calls in the other order"),
        ({0: [(tp0,) + ar], 1: []}, "rank 1 has no record at all"),
        (planted(2, 0, lambda r: r[:2] + [(tp0,) + ag] + r[3:]), "rank 0 all-gathers where rank 1 all-reduces")]]
    for k in range(3):   # random programs on one group of 3 ranks, one planted difference
        g = (0, 1, 2)
        base = [(g, rng.choice(["all_reduce", "broadcast"]), (rng.randint(1, 4), 8)) for _ in range(6)]
        c = {r: list(base) for r in g}
        at = rng.randrange(6)
        c[rng.choice(g)][at] = (g, base[at][1], (9, 8))
        cases.append(Case({"args": (c,)}, label=f"one group of 3 ranks, random program {k + 1}"))
    return cases


def _as_positions(got, calls):
    if not isinstance(got, dict):
        raise Mismatch(f"expected a dict {{group: position}}, got {type(got).__name__}")
    return got


def check_divergence(first_divergence) -> bool:
    """``first_divergence(calls) -> {group: position}``; ``calls[rank]`` = [(group, op, shape), ...]."""
    return check_answers("first_divergence", first_divergence, _divergence_cases(), _first_divergence,
                         guard=(LIBRARY, REFERENCES), exercise="merging the ranks' records",
                         read=_as_positions, hint=lambda *_: " (positions count each group's calls from 1)")


# ----------------------------------------------------------------------------- 2. fingerprints

def _fingerprint_cases():
    t = torch.randn
    pairs = [
        ("all_reduce", [t(8, 64)], [t(8, 64)], "the same shape, other values"),
        ("all_reduce", [t(8, 64)], [t(8, 32)], "another shape"),
        ("all_reduce", [t(8, 64)], [t(8, 64, dtype=torch.float64)], "another dtype"),
        ("all_to_all_single", [t(3, 5), t(4, 5)], [t(2, 5), t(1, 5)], "uneven all-to-all splits"),
        ("all_to_all_single", [t(3, 5), t(4, 5)], [t(3, 6), t(4, 6)], "all-to-all rows of another width"),
        ("all_gather_into_tensor", [t(12, 4), t(3, 4)], [t(4, 4), t(1, 4)], "uneven all-gather shards"),
        ("broadcast", [torch.zeros(2, 2)], [torch.ones(2, 2)], "a broadcast's receiver holds other values"),
        ("reduce_scatter_tensor", [t(2, 4), t(4, 4)], [t(2, 4), t(4, 4)], "the same reduce-scatter"),
    ]
    return [Case({"op": op, "a": a, "b": b}, label=label) for op, a, b, label in pairs] + \
        [Case({"op": "all_reduce", "a": [t(8, 64)], "b": [t(8, 64)], "other_op": "broadcast"},
              label="another op, the same tensors")]


def check_fingerprint(fingerprint) -> bool:
    """``fingerprint(op, tensors) -> hashable``: equal exactly when the calls may run together."""
    answer = learner(fingerprint, LIBRARY, exercise="a collective's fingerprint", seconds=10)

    def run_case(case):
        p = case.params
        other = p.get("other_op", p["op"])
        want = desync.fingerprint(p["op"], p["a"], "", None, ()) == desync.fingerprint(other, p["b"], "", None, ())
        fa, fb = answer(p["op"], list(p["a"])), answer(other, list(p["b"]))
        fa2 = answer(p["op"], [x.clone() + 1 for x in p["a"]])
        if hash(fa) != hash(fa2) or fa != fa2:
            return "the fingerprint changes with the tensors' values: ranks hold different values in a correct call"
        if (fa == fb) != want:
            verdict = "differ, but these calls may" if want else "are equal, but these calls may not"
            return f"fingerprints {verdict} run together"
    return check("fingerprint", _fingerprint_cases(), run_case)


# ----------------------------------------------------------------------------- 3. which reduction

def _grads(local, sizes, kind):
    """Each rank's gradient on a (dp, cp) mesh (rank = dp_i * cp + cp_i) for a planted ``kind``."""
    dp, cp = sizes["dp"], sizes["cp"]
    total = sum(local)                                              # the right sum, rank order
    if kind == "ok":
        return {r: total.clone() for r in range(dp * cp)}
    if kind == "missing cp":      # summed over dp only: ranks with the same cp index
        return {r: sum(local[d * cp + r % cp] for d in range(dp)) for r in range(dp * cp)}
    if kind == "missing dp":
        return {r: sum(local[(r // cp) * cp + c] for c in range(cp)) for r in range(dp * cp)}
    return {r: total * float(kind) for r in range(dp * cp)}        # a scale


def _which_cases():
    out = []
    for sizes in ({"dp": 2, "cp": 3}, {"dp": 3, "cp": 2}):
        for kind in ("ok", "missing cp", "missing dp", "2", "0.5", "3", f"{1 / (sizes['dp'] * sizes['cp'])}"):
            gen = torch.Generator().manual_seed(len(kind) + 7 * sizes["dp"])
            local = [torch.randn(64, 32, generator=gen) for _ in range(sizes["dp"] * sizes["cp"])]  # float32
            want = (("ok", None) if kind == "ok" else ("missing", kind.split()[1]) if kind.startswith("missing")
                    else ("scaled", float(kind)))   # one device's gradient below: the same sum in another order
            out.append(Case(dict(args=(_grads(local, sizes, kind), sum(reversed(local)), sizes), want=want),
                            label=f"dp={sizes['dp']}, cp={sizes['cp']}: {kind}"))
    return out


def _which_differ(got, want, *args):
    if not (isinstance(got, tuple) and len(got) == 2):
        return f"expected a pair like ('missing', 'cp'), got {got!r}"
    near = want[0] == "scaled" and isinstance(got[1], (int, float)) and abs(got[1] - want[1]) <= 1e-3 * want[1]
    if got[0] != want[0] or (want[0] == "missing" and got[1] != want[1]) or (want[0] == "scaled" and not near):
        return f"got {got!r}, expected {want!r}"


def check_which_reduction(which_reduction) -> bool:
    """``which_reduction(grads, reference, sizes) -> ("ok", None) | ("missing", dim) | ("scaled", factor)``."""
    return check_answers("which_reduction", which_reduction, _which_cases(), None,
                         guard=(LIBRARY, REFERENCES), exercise="naming the wrong reduction",
                         differ=_which_differ)


# ----------------------------------------------------------------------------- 4. the first NaN

class _Op(nn.Module):
    """A tensor operation ``fn`` as a module of its own (a name in named_modules), then its
    children in order: ``_Op(torch.log, proj=...)`` makes a NaN itself, then calls a child."""
    def __init__(self, fn=None, **children):
        super().__init__()
        self.fn = fn
        for name, child in children.items():
            self.add_module(name, child)

    def forward(self, x):
        x = self.fn(x) if self.fn else x
        for child in self.children():
            x = child(x)
        return x


def _mask(scores):      # (rows, keys): hide keys at or after the row's index (a row may hide all)
    hide = torch.arange(scores.shape[-1])[None, :] >= torch.arange(scores.shape[0])[:, None]
    return scores.masked_fill(hide, float("-inf"))     # -inf on purpose: not a NaN


def _nan_case(kind):
    torch.manual_seed(0)
    if kind == "row norm":
        x = torch.randn(3, 4)
        x[1] = 0
        return nn.Sequential(nn.Linear(4, 4, bias=False), _Op(lambda x: x / x.norm(dim=-1, keepdim=True)), nn.Linear(4, 2)), x, "1"
    if kind == "parent's own op":
        block = _Op(inner=_Op(torch.log, proj=nn.Linear(4, 4)), out=nn.Linear(4, 4))   # log of a negative
        return nn.Sequential(nn.Linear(4, 4), block), torch.randn(5, 4), "1.inner"
    if kind == "masked attention":
        return nn.Sequential(nn.Linear(4, 4), _Op(_mask), _Op(lambda x: x.softmax(-1)), nn.Linear(4, 4)), torch.randn(4, 4), "2"
    if kind == "none":
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), torch.randn(3, 4), None
    raise ValueError(kind)


def check_first_nan(first_nan_module) -> bool:
    """``first_nan_module(model, x) -> name`` (as in ``model.named_modules()``) or None."""
    kinds = {"row norm": "a zero row divided by its norm", "parent's own op": "a module makes the NaN itself, "
             "then calls a child", "masked attention": "a -inf mask (on purpose) before a softmax over a row "
             "that hides every key", "none": "no NaN at all"}
    cases = [Case(dict(args=(model, x), want=want), label=v) for k, v in kinds.items()
             for model, x, want in [_nan_case(k)]]
    return check_answers("first_nan_module", first_nan_module, cases, None,  # (the models' _Op stays on)
                         guard=(LIBRARY, _HERE + "_nan_case"),
                         exercise="finding the first NaN")


# ----------------------------------------------------------------------------- 5. find and fix

SYNC_LIBRARY = (COURSE_DATA_PARALLEL, COURSE_FSDP, "course_lib.parallel.zero:*")


def _net():
    """The net of the sync questions, the same on every rank (float64)."""
    return MLP((8, 16, 2), seed=0).double()


def _data(rows, seed):
    """Its inputs (rows, 8) and targets (rows, 2), float64: course_lib.reference's MLP data."""
    X, Y, _ = mlp_data(seed, rows, 0, (8, 16, 2))
    return X.double(), Y.double()


def _sync_harness(sync, sizes):
    """One step on ``Mesh(**sizes)``: the rows split over dp and cp (tp ranks share theirs), the
    loss summed over a rank's rows / all rows; the learner's ``sync(net, mesh)``; every gradient
    against one device's (float64, the one-step bound)."""
    from course_lib.parallel.mesh import Mesh

    mesh = Mesh(**sizes)
    X, Y = _data(24, 11)
    ref = _net()                                             # one device, outside the guard
    ((ref(X) - Y) ** 2).sum().div(len(X)).backward()
    shards, c = mesh.sizes["dp"] * mesh.sizes["cp"], mesh.coord
    mine = c["dp"] * mesh.sizes["cp"] + c["cp"]                 # this rank's rows: (24 / shards, 8)
    x, y = X.chunk(shards)[mine], Y.chunk(shards)[mine]
    net = _net()
    ((net(x) - y) ** 2).sum().div(len(X)).backward()
    # (course_lib.debug stays on: Comm records its calls through it; it fixes nothing)
    learner(sync, SYNC_LIBRARY, TORCH_DATA_PARALLEL, exercise="the gradient sync", seconds=20)(net, mesh)
    bad = grads_differ(net, ref)
    return bad and bad + " (one device's gradient is the sum over every rank holding other rows)"


def check_sync_fix(sync_gradients) -> bool:
    """``sync_gradients(net, mesh)``: after each rank's backward, every gradient equals one device's."""
    cases = [Case({"sync": sync_gradients, "sizes": dict(dp=2, cp=2)}, 4, "dp=2, cp=2"),
             Case({"sync": sync_gradients, "sizes": dict(cp=2, tp=2)}, 4, "cp=2, tp=2 (tp ranks share rows)"),
             Case({"sync": sync_gradients, "sizes": dict(dp=3)}, 3, "dp=3")]
    return check_distributed("sync_gradients", _sync_harness, cases, timeout=30)


F64 = torch.float64


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


def check_pipeline_exchange(exchange_boundaries, timeout: float = 10.0) -> bool:
    """``exchange_boundaries(comm, output, input_grad) -> (input_act, output_grad)`` on 3 and 4 stages
    (``timeout``: seconds a case may take before it is a hang)."""
    return on_ranks("exchange_boundaries", _pipeline_harness, (3, 4), "{} stages".format, timeout,
                    exchange=exchange_boundaries)


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
    X, Y = _data(len(counts) * rows, sum(counts))
    keep = (torch.arange(rows)[None, :] < torch.tensor(counts)[:, None]).flatten()
    ref = _net()
    (((ref(X) - Y) ** 2).sum(-1)[keep].sum() / keep.sum()).backward()
    return X, Y, keep, ref


def _token_harness(step, splits):
    comm = _comm("dp")
    r, n = comm.rank, comm.size
    fn = learner(step, REFERENCES, SYNC_LIBRARY, TORCH_DATA_PARALLEL, exercise="the token-weighted loss", seconds=20)
    for counts in splits:
        X, Y, keep, ref = _token_data(counts)
        net = _net()
        fn(net, X.chunk(n)[r].clone(), Y.chunk(n)[r].clone(), keep.chunk(n)[r].clone(), comm)
        bad = grads_differ(net, ref)
        if bad:
            return f"real tokens per rank {list(counts)}: {bad} (one device divides by every rank's real tokens)"


def check_token_loss(token_step) -> bool:
    """``token_step(net, x, y, keep, comm)``: backward and gradient sum; every gradient equals one device's."""
    return on_ranks("token_step", _token_harness, (3,), "3 ranks, real tokens (5, 1, 3) then (0, 4, 6)", 10,
                    step=token_step, splits=[(5, 1, 3), (0, 4, 6)])


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
    return on_ranks("gather_rows", _rows_harness, (3,), "3 ranks, rows (3, 1, 4), (0, 5, 2), (2, 2, 2)", 10,
                    gather=gather_rows, splits=[(3, 1, 4), (0, 5, 2), (2, 2, 2)])


__all__ = ["check_divergence", "check_fingerprint", "check_which_reduction", "check_first_nan", "check_sync_fix",
           "check_pipeline_exchange", "check_gather_group", "check_token_loss", "check_uneven_gather"]
