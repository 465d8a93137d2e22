"""Expert parallelism (course_lib/parallel/expert_parallel.py) against the one-device MoE
(course_lib/moe.py): a dense layer + MoE trained 5 AdamW steps in float64 with EP (torch's
and our all-to-all), dense params reduced over "dp", experts over "edp" only, has the
single-device gradients at step 1 and ends with the single-device weights (bounds from
course_lib.tolerance) (MoE(groups=dp): capacity per rank's tokens); the same dropped set at
a small capacity, none at a large one; bytes of the dispatch counted; bad input refused."""
import pytest
import torch
import torch.nn as nn

from course_lib import launch, tolerance
from course_lib.moe import MoE, route

H, F_, T, STEPS, LR, AUX = 8, 16, 12, 5, 1e-2, 0.01


class Net(nn.Module):
    def __init__(self, n_experts, top_k, cf, normalize=False):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(H, H)
        self.moe = MoE(H, F_, n_experts, top_k, cf, seed=1, normalize_topk=normalize)
        self.double()                                    # float64: exactness is the claim


def _data(world):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(world * T, H, generator=g, dtype=torch.float64),
             torch.randn(world * T, H, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def _loss(y, target, n_rows):
    return ((y - target) ** 2).sum() / n_rows


def _reference(world, n_experts, top_k, cf, normalize=False):
    net = Net(n_experts, top_k, cf, normalize)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    dropped, first_grads = [], None
    for x, t in _data(world):
        h = net.inp(x)
        y, aux = net.moe(h, groups=world)
        for hg in h.chunk(world):
            dropped.append((~route(net.moe.router(hg), top_k, cf)[2]).sum().item())
        (_loss(h + y, t, len(x)) + AUX * aux).backward()
        first_grads = first_grads or {n: p.grad.clone() for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
    return net.state_dict(), dropped, first_grads


def _train_ep(mesh_shape, n_experts, top_k, cf, impl, normalize=False):
    import torch.distributed as dist

    from course_lib.parallel.data_parallel import DDP
    from course_lib.parallel.expert_parallel import ExpertParallelMoE
    from course_lib.parallel.mesh import Mesh

    mesh = Mesh(**mesh_shape)
    world, rank = dist.get_world_size(), dist.get_rank()
    net = Net(n_experts, top_k, cf, normalize)
    net.moe = ExpertParallelMoE(net.moe, mesh, impl=impl)
    ddp = DDP(net, mesh=mesh, dims=("dp",), divisor=1)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    comm, first_grads = net.moe.comm, None
    for step, (x, t) in enumerate(_data(world)):
        xr, tr = x.chunk(world)[rank], t.chunk(world)[rank]
        h = net.inp(xr)
        comm.reset()
        y, aux = net.moe(h)
        kept = int(route(net.moe.router(h.detach()), top_k, cf)[2].sum())
        dispatched = [c.payload for c in comm.log if c.name == "dispatch"]
        loss = _loss(h + y, tr, len(x)) + AUX * aux / world          # the mean of the groups' aux
        loss.backward()
        ddp.finish_gradient_synchronization()
        first_grads = first_grads or {n: p.grad.clone() for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
    return net.state_dict(), mesh.coord["ep"], dispatched, kept, first_grads


@pytest.mark.parametrize("mesh_shape,n_experts,top_k,cf,impl", [
    (dict(dp=2, ep=2), 4, 2, 4.0, "torch"),      # large capacity: nothing dropped
    (dict(dp=2, ep=2), 4, 1, 0.5, "course"),     # small: the same tokens dropped, our all-to-all
    (dict(dp=3, ep=3), 6, 2, 0.75, "torch"),     # odd EP
    (dict(dp=4, ep=2), 4, 2, 1.0, "torch")])     # edp = 2: experts reduced over 2 ranks
def test_expert_parallel_training_equals_one_device(mesh_shape, n_experts, top_k, cf, impl):
    _check_equals_one_device(mesh_shape, n_experts, top_k, cf, impl)


def test_expert_parallel_normalize_topk_equals_one_device():
    # MoE(normalize_topk=True): each token's k kept weights renormalised to sum to 1, on every rank
    _check_equals_one_device(dict(dp=2, ep=2), 4, 2, 4.0, "torch", normalize=True)


def _check_equals_one_device(mesh_shape, n_experts, top_k, cf, impl, normalize=False):
    world = mesh_shape["dp"]
    ref, dropped, ref_grads = _reference(world, n_experts, top_k, cf, normalize)
    assert (sum(dropped) == 0) == (cf >= n_experts / top_k)
    ranks = launch(_train_ep, world, mesh_shape, n_experts, top_k, cf, impl, normalize)
    local = n_experts // mesh_shape["ep"]
    for state, ep_rank, dispatched, kept, grads in ranks:
        def global_name(name):            # this rank's expert i is expert ep_rank * local + i
            if name.startswith("moe.experts."):
                i = int(name.split(".")[2])
                return name.replace(f"experts.{i}.", f"experts.{ep_rank * local + i}.")
            return name

        tolerance.assert_matches({global_name(n): g for n, g in grads.items()},
                                 {global_name(n): ref_grads[global_name(n)] for n in grads}, what="step 1 gradients")
        tolerance.assert_matches({global_name(n): w for n, w in state.items()},
                                 {global_name(n): ref[global_name(n)] for n in state},
                                 optimizer="adamw", steps=STEPS, lr=LR)
        assert dispatched == [kept * H * 8]   # dispatch payload: every kept assignment's row (fp64)


def _bad_ep():
    from course_lib.parallel.expert_parallel import ExpertParallelMoE
    from course_lib.parallel.mesh import Mesh

    try:
        ExpertParallelMoE(MoE(H, F_, 3), Mesh(dp=2, ep=2))
    except ValueError as e:
        return str(e)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="top_k=5"):
        MoE(H, F_, 4, top_k=5)
    assert "divisible by ep=2" in launch(_bad_ep, 2)[0]
