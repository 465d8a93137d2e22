"""GradSync (course_lib/parallel/grad_sync.py) on a 2-D mesh, against sums computed by hand.

Mesh(dp=2, tp=2) on 4 ranks (rank = dp * 2 + tp). Every rank's gradient of each parameter
is a known function of its rank, so the parent computes what each rank must end with:
the sum over the ranks the parameter's reduce dims name, divided by the dp degree.
One launch runs every check.
"""
import pytest
import torch

from course_lib import launch, tolerance
from course_lib.parallel.grad_sync import assign_buckets
from course_lib.planner.formulas import collective_bytes_per_rank

HEADERS = 2048  # bytes per call above the ring formula that gloo's message headers may add (N <= 4)

SHAPES = {"norm": (3,), "w": (4, 5), "b": (5,), "expert": (2,), "rare": (6,), "unused": (7,), "frozen": (2,)}
DIMS = {"norm": ("dp", "tp"), "w": ("dp",), "b": None, "expert": ("dp", "tp"), "rare": ("dp",), "unused": ("dp",)}
DP, TP = 2, 2


def coeff(name, rank, call=0):
    """The gradient rank ``rank`` produces for ``name`` in backward call ``call``."""
    numel = torch.Size(SHAPES[name]).numel()
    return (torch.arange(numel, dtype=torch.float32).view(SHAPES[name]) + 1) * (rank + 1) * (10 ** call)


def used_on(name, rank):
    return {"rare": rank == 1, "unused": False}.get(name, True)


def make_params():
    from course_lib.parallel.mesh import set_reduce_dims

    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}
    params["frozen"].requires_grad_(False)
    for n, dims in DIMS.items():
        if dims is not None:
            set_reduce_dims(params[n], dims)
    return params


def backward(params, rank, call=0):
    """A loss whose gradient with respect to each used parameter is coeff(name, rank, call)."""
    loss = sum((p * coeff(n, rank, call)).sum() for n, p in params.items()
               if p.requires_grad and used_on(n, rank))
    loss.backward()


def rank_checks():
    import torch.distributed as dist

    from course_lib import trace
    from course_lib.parallel.grad_sync import GradSync, OverlappedGradSync
    from course_lib.parallel.mesh import GroupMesh, Mesh

    rank = dist.get_rank()
    mesh = Mesh(dp=DP, tp=TP)
    out = {}

    def grads(params):
        return {n: (None if p.grad is None else p.grad.clone()) for n, p in params.items()}

    # explicit start / finish, no hooks; 1-element buckets: several per set of dims
    params = make_params()
    sync = GradSync(params.values(), mesh, divisor=DP, bucket_cap_mb=0)
    backward(params, rank)
    sync.start()
    sync.finish()
    out["explicit"] = grads(params)
    out["bucket_dims"] = sorted({b.comm.dim for b in sync.buckets})
    try:
        sync.start(); sync.start()
    except RuntimeError as exc:
        out["start_twice"] = str(exc)
    sync.finish()

    # hooks, two backward calls per step (the first inside no_sync), several steps
    params = make_params()
    sync = OverlappedGradSync(params.values(), mesh, divisor=DP, bucket_cap_mb=25)
    trace.reset()
    out["accumulated"] = []
    for step in range(2):
        with sync.no_sync():
            backward(params, rank, call=0)
        backward(params, rank, call=1)
        sync.finish()
        out["accumulated"].append(grads(params))
        for p in params.values():
            p.grad = None
    out["span_dims"] = sorted({s.dim for s in trace.spans() if s.kind == "comm"})
    backward(params, rank)
    try:  # a second backward while armed: finish() was forgotten
        backward(params, rank)
    except RuntimeError as exc:
        out["ready_twice"] = str(exc)
    sync.finish()

    # bytes: one bucket per set of dims; payload = gradients + one flag per parameter
    params = make_params()
    sync = GradSync(params.values(), mesh, divisor=DP)
    backward(params, rank)
    for comm in sync.comms():
        comm.reset()
    with mesh.comm("dp").measuring(), mesh.comm(("dp", "tp")).measuring():
        sync.finish()
    out["logs"] = {c.dim: [(x.payload, x.sent) for x in c.log] for c in sync.comms()}

    errors = []
    for bad in (dict(divisor=0), dict(divisor="2"), dict(bucket_cap_mb=-1), dict(bucket_cap_mb=float("nan"))):
        try:
            GradSync(make_params().values(), mesh, **bad)
        except ValueError as exc:
            errors.append(str(exc))
    for build in (lambda: GradSync(make_params().values(), GroupMesh(None, "dp")),   # ("dp", "tp") on one group
                  lambda: GradSync([make_params()["frozen"]], mesh)):
        try:
            build()
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def runs():
    return launch(rank_checks, DP * TP, timeout=120)


def expected(rank, calls=(0,)):
    """What rank ``rank`` must hold: the sum over the ranks its dims name, / DP."""
    dp_i, tp_i = divmod(rank, TP)
    out = {}
    for name in SHAPES:
        dims = DIMS.get(name) or ("dp",)
        if name == "frozen":
            out[name] = None
            continue
        group = range(DP * TP) if "tp" in dims else [d * TP + tp_i for d in range(DP)]
        users = [r for r in group if used_on(name, r)]
        out[name] = None if not users else sum(coeff(name, r, c) for r in users for c in calls) / DP
    return out


def assert_grads(got, want):
    assert list(got) == list(want)
    for name in want:
        if want[name] is None:
            assert got[name] is None, name
        else:
            tolerance.assert_matches(got[name], want[name], what=name)


def test_explicit_start_finish_sums_over_each_parameters_dims(runs):
    for rank, out in enumerate(runs):
        assert_grads(out["explicit"], expected(rank))
        assert out["bucket_dims"] == ["dp", "dp+tp"]


def test_hooks_with_accumulation_over_several_steps(runs):
    for rank, out in enumerate(runs):
        for step_grads in out["accumulated"]:
            assert_grads(step_grads, expected(rank, calls=(0, 1)))
        assert out["span_dims"] == ["dp", "dp+tp"]  # every all-reduce tagged with its group


def test_forgotten_finish_is_an_error(runs):
    assert "start() was called twice" in runs[0]["start_twice"]
    assert "became ready twice" in runs[0]["ready_twice"] and "no_sync" in runs[0]["ready_twice"]


def test_bucket_payload_is_gradients_plus_flags(runs):
    params = make_params()
    for dim in ("dp", "dp+tp"):
        members = [n for n in SHAPES if n != "frozen" and "+".join(DIMS.get(n) or ("dp",)) == dim]
        payload = 4 * sum(params[n].numel() + 1 for n in members)
        n = DP * TP if dim == "dp+tp" else DP
        for out in runs:
            [(logged, sent)] = out["logs"][dim]
            assert logged == payload
            assert 0 <= sent - collective_bytes_per_rank("all_reduce", payload, n) <= HEADERS


def test_bad_input_is_named(runs):
    errors = runs[0]["errors"]
    assert len(errors) == 6
    assert "divisor" in errors[0] and "divisor" in errors[1]
    assert "bucket_cap_mb" in errors[2] and "bucket_cap_mb" in errors[3]
    assert "pass mesh=Mesh" in errors[4]
    assert "no parameter requires a gradient" in errors[5]


def test_assign_buckets_reverse_order_cap_and_keys():
    params = [torch.zeros(n) for n in (10, 20, 30, 5, 5)]  # 40, 80, 120, 20, 20 bytes
    assert assign_buckets(params, 130) == [[4, 3], [2], [1, 0]]
    assert assign_buckets(params, 100) == [[4, 3], [2], [1], [0]]
    assert assign_buckets(params, 0) == [[4], [3], [2], [1], [0]]  # one bucket per parameter
    assert assign_buckets(params, 10**9) == [[4, 3, 2, 1, 0]]
    mixed = [torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2)]
    assert assign_buckets(mixed, 10**9) == [[2, 0], [1]]  # one open bucket per dtype
    tags = ["a", "b", "a", "a", "b"]
    assert assign_buckets(params, 100, key=lambda p: tags[[id(q) for q in params].index(id(p))]) == \
        [[3], [2], [4, 1], [0]]  # a closes twice; b stays open, opened before a's last
