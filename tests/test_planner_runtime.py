"""course_lib/planner/runtime.py and kernels.py: the planner's model of the course's own program.

The kernels it traces on the meta device are those a real step launches (counted by the virtual
clock's dispatch mode in this process), priced the same way; TP's collectives per layer are the
program's 10 with SP; the default runtime (Megatron's) has no launch term. The program itself,
run on virtual GPUs, is compared in tests/test_virtual_runs.py."""
import pytest
import torch

from course_lib import reference
from course_lib.gpt import GPTConfig, TinyGPT
from course_lib.planner import HARDWARE, Layout, estimate
from course_lib.planner.calibration import model_spec
from course_lib.planner.kernels import KernelCounter
from course_lib.planner.runtime import group_in_node, tp_calls
from course_lib.virtual import VirtualCluster
from course_lib.virtual.compute import ComputeStream

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layers=2, hidden=32, n_heads=4, n_kv_heads=2)
H100 = HARDWARE["h100-sxm"]


class _Clock:      # what ComputeStream reads of a rank's clock
    def __init__(self, cluster):
        self.cluster, self.t, self.kernels, self.muted_depth = cluster, 0.0, 0, 0


@pytest.mark.parametrize("fused", [False, True], ids=["written-out", "flash"])
def test_traced_kernels_are_a_real_steps(fused):
    """Op by op, the meta trace launches what a real CPU step launches, except the clones
    autograd's gradient accumulation makes of a gradient it cannot take over (at most one per
    parameter); priced the same, the step's time agrees within 1%. On a Hardware that states
    fused attention both run the course's FlashAttention core (course_lib.fused)."""
    from course_lib import fused as kernels
    hw = H100.with_(fused_attention=fused)
    model = TinyGPT(CFG, seed=0)
    if fused:
        assert kernels.install_flash(model) == CFG.n_layers
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = reference.gpt_batches(CFG, batch=2, steps=1)[0]

    def step():
        model(x, y, n_tokens=y.numel())[1].backward()
        opt.step()
        opt.zero_grad()
    step()                                        # AdamW's state exists: a steady step
    clock = _Clock(VirtualCluster(hw, dtype=torch.bfloat16))
    with ComputeStream(clock):
        step()
    with KernelCounter(hw, 2) as real:
        model(x, y, n_tokens=y.numel())[1].backward()
    with torch.device("meta"):
        net, xm = TinyGPT(CFG, seed=0), torch.zeros(2, CFG.seq_len, dtype=torch.long)
        if fused:
            kernels.install_flash(net)
    with KernelCounter(hw, 2) as traced:
        net(xm, xm, n_tokens=xm.numel())[1].backward()
    ops = {k: v.count for k, v in real.by_op.items()}
    ops_traced = {k: v.count for k, v in traced.by_op.items()}
    n_tensors = len(list(model.parameters()))
    assert {k: n for k, n in ops.items() if k != "clone"} == {k: n for k, n in ops_traced.items() if k != "clone"}
    assert 0 <= ops.get("clone", 0) - ops_traced.get("clone", 0) <= n_tensors
    assert ("_scaled_dot_product_flash_attention_for_cpu" in " ".join(ops)) == fused
    est = estimate(model_spec(CFG), hw, Layout(micro_batch=2, global_batch=2), runtime="course")
    assert 0 <= clock.kernels - est.stages[0].kernels <= n_tensors
    assert abs(est.step_time / clock.t - 1) < 0.01


def test_tp_collectives_are_the_programs():
    sp = Layout(tp=2, sp=True)
    per_layer = sum(tp_calls(sp, False, False, 1).values())
    assert per_layer == 10                                     # 2 AG + 2 RS forward; 2 RS + 4 AG backward
    ends = tp_calls(sp, True, True, 0)
    assert ends[("fwd", "loss")] == 2 and sum(ends.values()) == 2 + 5   # embedding 2, head 3, loss 2
    assert sum(tp_calls(Layout(tp=2), False, False, 1).values()) == 4   # no SP: 2 + 2 all-reduces
    assert tp_calls(Layout(dp=2), True, True, 3) == {}


def test_groups_inside_a_node_and_the_default_runtime():
    lay = Layout(dp=2, tp=2, pp=2, cp=2)                       # 16 ranks, TP innermost
    assert group_in_node(lay, H100, ("tp", "cp", "pp")) and not group_in_node(lay, H100, ("dp",))
    lay = Layout(tp=2, sp=True, micro_batch=2, global_batch=2)
    meg, course = estimate(model_spec(CFG), H100, lay), estimate(model_spec(CFG), H100, lay, runtime="course")
    assert meg.time["launch"] == 0 < course.time["launch"]
    # per layer 10, the embedding, head and loss 7, the norms' gradients one bucket over tp
    assert course.stages[0].calls["tp"] == 10 * CFG.n_layers + 7 + 1
    with pytest.raises(ValueError, match="runtime must be one of"):
        estimate(model_spec(CFG), H100, Layout(), runtime="torch")


def test_the_planners_kernel_counts_of_the_parallel_code_are_the_programs():
    """The planner sits below parallel/ and holds the kernels that the vocabulary-parallel loss
    and ring attention add as numbers: they are the counts of the code itself."""
    from course_lib.planner import runtime
    from course_lib.lab.virtual_runs import count_ring_attention_kernels, count_vocab_parallel_loss_kernels

    assert runtime.VOCAB_LOSS_KERNELS == count_vocab_parallel_loss_kernels()
    for grouped in (False, True):
        for cp in (2, 3, 5, 8):
            assert runtime.ring_attention_kernels(cp, grouped) == count_ring_attention_kernels(cp, grouped), (cp, grouped)
