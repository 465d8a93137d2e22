"""course_lib/memory.py: storages counted once, the tracker's peak, and the ZeRO formulas."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib import launch
from course_lib.lab.zero_measurements import MEASURED_BYTES, MEASURED_CONFIG, MEASURED_PARAMS
from course_lib.memory import MemoryTracker, measure, model_state_bytes, storage_bytes
from course_lib.models import MLP, GPTConfig, TinyGPT
from course_lib.planner.formulas import zero_memory_bytes

GPT = GPTConfig(**MEASURED_CONFIG)  # the model whose bytes the chapter-4 exercise is graded against


def test_storages_count_once():
    w = torch.zeros(10, 10)
    assert storage_bytes([w, w[:3], w.t(), w.view(-1)]) == 400
    model = MLP((16, 32, 16, 32), shared=True)
    params = list(model.parameters())
    names = dict(model.named_parameters(remove_duplicate=False))
    assert storage_bytes(names.values()) == storage_bytes(params) == sum(p.numel() * 4 for p in params)


def test_model_states_of_adamw_are_16_bytes_per_trainable_parameter():
    model = MLP((16, 32, 16, 32), frozen=(1,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    F.mse_loss(model(torch.randn(4, 16)), torch.randn(4, 32)).backward()
    opt.step()
    held = model_state_bytes(model, opt)
    P = sum(p.numel() for p in model.parameters())
    T = sum(p.numel() for p in model.parameters() if p.requires_grad)
    steps = 4 * sum(1 for p in model.parameters() if p.requires_grad)  # one fp32 step counter each
    assert held == {"parameters": 4 * P, "gradients": 4 * T, "optimizer_state": 8 * T + steps,
                    "total": 4 * P + 12 * T + steps}


def test_tracker_peak_and_frees():
    with MemoryTracker() as tracker:
        a = torch.empty(1000)          # 4000 bytes
        b = torch.empty(500)           # 2000
        del a
        c = torch.empty(250)           # 1000: the peak stays 6000
        live = tracker.live
    assert tracker.peak == 6000 and live == 3000
    del b, c


def test_a_free_on_another_thread_is_applied_by_the_trackers_thread():
    """A transport thread may drop a buffer's last reference: the tracker's counters change on
    its own thread, at its next event, not concurrently with it."""
    import threading
    with MemoryTracker() as tracker:
        box = [torch.empty(1000)]                       # 4000 bytes
        t = threading.Thread(target=box.clear)           # the last reference dies on that thread
        t.start()
        t.join()
        queued = tracker.live
        c = torch.empty(10)                              # next event: the free is applied first
        live, peak = tracker.live, tracker.peak
    assert queued == 4000 and live == 40 and peak == 4000
    del c


def test_measure_counts_activations_in_the_peak():
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(512, 256)

    def step():
        model(x).sum().backward()
        opt.step()

    rep = measure(step, model, opt)
    assert rep.parameters == rep.gradients == 4 * sum(p.numel() for p in model.parameters())
    assert rep.optimizer_state == 0 and rep.temporaries == 0
    assert rep.peak >= rep.model_states + 512 * 256 * 4  # at least one saved activation


def rank_memory(stage):
    import torch.distributed as dist

    from course_lib import memory
    from course_lib.parallel import DDP, FSDP, ShardedOptimizer

    model = TinyGPT(GPT, seed=dist.get_rank())
    if stage == 0:
        net, opt = DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif stage in (1, 2):
        net, opt = model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-3)
    else:
        net = FSDP(model)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randint(0, GPT.vocab_size, (2, GPT.seq_len + 1), generator=torch.Generator().manual_seed(0))

    def step():
        net(x[:, :-1], x[:, 1:])[1].backward()
        if hasattr(net, "finish_gradient_synchronization"):
            net.finish_gradient_synchronization()
        opt.step()

    step()  # the optimizer state exists from the first step on
    opt.zero_grad()
    return memory.measure(step, net, opt)


def all_stages():
    return [rank_memory(stage) for stage in (0, 1, 2, 3)]


@pytest.mark.parametrize("world", [2, 4])
def test_model_states_match_the_zero_formulas(world):
    P = sum(p.numel() for p in TinyGPT(GPT).parameters())
    assert P == MEASURED_PARAMS
    reports = launch(all_stages, world, timeout=120)
    for rank in range(world):
        for stage, rep in enumerate(reports[rank]):
            formula = zero_memory_bytes(P, stage, world, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
            assert rep.parameters == pytest.approx(formula["params"], rel=0.05)
            assert rep.gradients == pytest.approx(formula["grads"], rel=0.05)
            assert rep.optimizer_state == pytest.approx(formula["optimizer"], rel=0.05)
            assert rep.peak > rep.model_states
            if rank == 0:  # the numbers the exercise grader compares predictions with
                assert (rep.parameters, rep.gradients, rep.optimizer_state) == MEASURED_BYTES[stage, world]
    dp, zero3 = reports[0][0], reports[0][3]
    assert zero3.temporaries > 0 and zero3.peak < dp.peak  # gathered units, never the whole model
