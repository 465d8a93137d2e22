"""The Megatron communication operators (course_lib/parallel/comm_ops.py): forward and backward
of a column -> row parallel MLP, with and without sequence parallelism, equal to one device;
the all-gather that concatenates column outputs; the gradient sum over copies of one tensor."""
import pytest
import torch
import torch.nn.functional as F

from course_lib import launch, tolerance

B, S, H, FF = 2, 6, 4, 12  # S and FF split over 1, 2 and 3 ranks


def problem():
    g = torch.Generator().manual_seed(0)
    X, W1, W2, C = (torch.randn(*shape, generator=g) for shape in ((B, S, H), (FF, H), (H, FF), (B, S, H)))
    return X, W1, W2, C


def reference():
    X, W1, W2, C = (t.clone().requires_grad_(k < 3) for k, t in enumerate(problem()))
    Y = F.linear(F.relu(F.linear(X, W1)), W2)
    (Y * C).sum().backward()
    return Y.detach(), X.grad, W1.grad, W2.grad


def rank_run():
    import torch.distributed as dist

    from course_lib.collectives.comm import Comm
    from course_lib.parallel import comm_ops as ops

    comm = Comm(dim="tp")
    r, t = dist.get_rank(), dist.get_world_size()
    X, W1, W2, C = problem()
    w1, w2 = W1.chunk(t, 0)[r].clone().requires_grad_(), W2.chunk(t, 1)[r].clone().requires_grad_()
    out = {}
    # tensor parallel: f -> column -> ReLU -> row -> g
    x = X.clone().requires_grad_()
    y = ops.reduce_from_parallel(F.linear(F.relu(F.linear(ops.copy_to_parallel(x, comm), w1)), w2), comm)
    (y * C).sum().backward()
    out["tp"] = (y.detach(), x.grad, w1.grad.clone(), w2.grad.clone())
    # sequence parallel: my rows of the sequence -> SP g (all-gather) -> column -> row -> SP g-bar
    w1.grad = w2.grad = None
    xs = X.chunk(t, 1)[r].clone().requires_grad_()
    ys = ops.scatter_to_sequence_parallel(
        F.linear(F.relu(F.linear(ops.gather_from_sequence_parallel(xs, comm, dim=1), w1)), w2), comm, dim=1)
    (ys * C.chunk(t, 1)[r]).sum().backward()
    out["sp"] = (ys.detach(), xs.grad, w1.grad.clone(), w2.grad.clone())
    x = X.clone().requires_grad_()
    (ops.split_to_parallel(x, comm, dim=1) * C.chunk(t, 1)[r]).sum().backward()
    out["split"] = x.grad
    # leaving a sharded region: the concatenated column outputs (an all-gather), my slice's gradient back
    x = X.clone().requires_grad_()
    w1.grad = None
    yg = ops.gather_from_parallel(F.linear(x, w1), comm, dim=-1)
    (yg * F.linear(X, W1)).sum().backward()
    out["gather"] = (yg.detach(), w1.grad.clone())
    # one tensor held by every rank: its gradient is the sum of the copies' gradients
    w = torch.ones(3, requires_grad=True)
    (ops.sum_over_copies(w, comm, 0, 1) * (r + 1)).sum().backward()
    out["copies"] = w.grad
    out["bytes"] = [(c.op, c.payload) for c in comm.log]
    out["in_place"] = _in_place_block(comm, r, t)
    try:
        ops.scatter_to_sequence_parallel(torch.zeros(1, t + 1, 2), comm) if t > 1 else None
        out["uneven"] = None
    except ValueError as exc:
        out["uneven"] = str(exc)
    return out


def _block_problem():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g, dtype=torch.float64)
            for shape in ((B, S, H), (FF, H), (FF,), (FF, H), (H, FF), (H,), (B, S, H))]


def _block(x, w1, b1, w3, w2, b2, f=lambda h: h, g=lambda y: y):
    """x + W2 (gelu(W1 f(x) + b1) * W3 f(x)) + b2: f's output read by two matmuls (its gradient
    is their sum), x read twice (the residual: its gradient is used twice)."""
    h = f(x)
    return x + g(F.linear(F.gelu(F.linear(h, w1, b1)) * F.linear(h, w3), w2)) + b2


def _in_place_block(comm, r, t):
    """The block in float64 with f and g summing in place (and copying, the default), the
    clones each made; and why the default copies: f's output added to another tensor hands
    the same gradient tensor to f and to that tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from course_lib.parallel import comm_ops as ops

    class Clones(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket is torch.ops.aten.clone
            return func(*args, **(kwargs or {}))
    X, W1, B1, W3, W2, B2, C = _block_problem()
    rows = [W.chunk(t, 0)[r] for W in (W1, B1, W3)]
    out = {}
    for in_place in (True, False):
        x = X.clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in (*rows, W2.chunk(t, 1)[r], B2)]
        with Clones() as clones:
            y = _block(x, *ws, f=lambda h: ops.copy_to_parallel(h, comm, in_place=in_place),
                       g=lambda y: ops.reduce_from_parallel(y, comm, in_place=in_place))
            (y * C).sum().backward()
        out[in_place] = (y.detach(), x.grad, *[w.grad for w in ws], clones.n)
    for in_place in (True, False):     # f(x) + z: AddBackward passes one gradient tensor to both
        x, z = X.clone().requires_grad_(), X.clone().requires_grad_()
        w = z * 2.0                    # (its backward runs after f's: autograd runs newer nodes first)
        (ops.copy_to_parallel(x, comm, in_place=in_place) + w).mul(C).sum().backward()
        out[("shared", in_place)] = (x.grad, z.grad)
    return out


@pytest.fixture(scope="module")
def runs():
    return {t: launch(rank_run, t, timeout=120) for t in (1, 2, 3)}


@pytest.mark.parametrize("t", [1, 2, 3])
def test_tensor_and_sequence_parallel_mlp_equal_one_device(runs, t):
    Y, gX, gW1, gW2 = reference()
    _, _, _, C = problem()
    for r, out in enumerate(runs[t]):
        y, gx, gw1, gw2 = out["tp"]
        tolerance.assert_matches(y, Y)
        tolerance.assert_matches(gx, gX)                       # f all-reduced the input's gradient
        tolerance.assert_matches(gw1, gW1.chunk(t, 0)[r])      # my rows of W1
        tolerance.assert_matches(gw2, gW2.chunk(t, 1)[r])      # my columns of W2
        ys, gxs, gw1, gw2 = out["sp"]
        tolerance.assert_matches(ys, Y.chunk(t, 1)[r])         # my part of the sequence
        tolerance.assert_matches(gxs, gX.chunk(t, 1)[r])
        tolerance.assert_matches(gw1, gW1.chunk(t, 0)[r])
        tolerance.assert_matches(gw2, gW2.chunk(t, 1)[r])
        tolerance.assert_matches(out["split"], C)              # every rank's slice gradient, gathered
        yg, gw1 = out["gather"]
        tolerance.assert_matches(yg, F.linear(problem()[0], problem()[1]))   # the whole output everywhere
        Xf, W1f = problem()[0], problem()[1].clone().requires_grad_()
        (F.linear(Xf, W1f) * F.linear(Xf, problem()[1])).sum().backward()
        tolerance.assert_matches(gw1, W1f.grad.chunk(t, 0)[r])  # backward keeps my slice only
        tolerance.assert_matches(out["copies"], torch.full((3,), t * (t + 1) / 2))


@pytest.mark.parametrize("t", [1, 2, 3])
def test_in_place_reduce_equals_one_device_in_float64(runs, t):
    """f and g summing in place (the library's TP layers) give one device's block in float64,
    forward and backward, with f's gradient the sum of two matmuls' and the block input's
    gradient used twice (the residual): no clone, where the copying default makes two. Where
    f's output meets another branch in an add, autograd hands both the SAME gradient tensor:
    summed in place, the other branch's gradient is summed too (2 t C, not 2 C): why the
    default copies."""
    X, W1, B1, W3, W2, B2, C = _block_problem()
    leaves = [w.clone().requires_grad_() for w in (X, W1, B1, W3, W2, B2)]
    Y = _block(*leaves)
    (Y * C).sum().backward()
    for r, out in enumerate(runs[t]):
        want = [Y, leaves[0].grad, *[w.grad.chunk(t, 0)[r] for w in leaves[1:4]],
                leaves[4].grad.chunk(t, 1)[r], leaves[5].grad]   # b2: added once, after the sum
        for in_place in (True, False):
            *got, clones = out["in_place"][in_place]
            tolerance.assert_matches(got, want, dtype=torch.float64, what=f"in_place={in_place}, rank {r}")
            assert clones == (0 if in_place or t == 1 else 2), (in_place, clones)
        x_grad, z_grad = out["in_place"][("shared", False)]
        assert torch.equal(x_grad, t * C) and torch.equal(z_grad, 2 * C)
        if t > 1:
            x_grad, z_grad = out["in_place"][("shared", True)]
            assert torch.equal(z_grad, 2 * t * C)     # the hazard, shown: z's gradient was summed too


@pytest.mark.parametrize("t", [2, 3])
def test_bytes_and_errors(runs, t):
    act = B * S * H * 4
    ops = runs[t][0]["bytes"]
    assert ops[:2] == [("all_reduce", act), ("all_reduce", act)]   # g forward, f backward
    assert ("all_gather_into_tensor", act) in ops and ("reduce_scatter_tensor", act) in ops  # SP: same volume
    assert "does not split evenly" in runs[t][0]["uneven"]


def test_bad_comm():
    from course_lib.parallel.comm_ops import copy_to_parallel
    with pytest.raises(TypeError, match="Comm"):
        copy_to_parallel(torch.zeros(2), None)


def test_bad_slot():
    def bad():
        from course_lib.collectives.comm import Comm
        from course_lib.parallel.comm_ops import sum_over_copies
        try:
            sum_over_copies(torch.zeros(2), Comm(), 2, 2)
        except ValueError as exc:
            return str(exc)
    assert "slot" in launch(bad, 2)[0]
