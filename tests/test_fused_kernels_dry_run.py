"""course_lib.fused's RMSNorm and SwiGLU as the ranks run them: one ``course::`` kernel each way,
priced as one; a Hardware with ``fused_kernels`` makes the dry run run them (the planner's
statement, so the same arguments run the same program); what they no longer keep, to the byte."""
from dataclasses import replace

import pytest
import torch

from course_lib import fused, gpt, tolerance
from course_lib.lab.dry_run_memory import layer_activations
from course_lib.lab.nd_runs import LR, single_device
from course_lib.planner import Layout, estimate
from course_lib.planner.kernel_cost import ELEMENTWISE, REDUCTION, op_cost
from course_lib.planner.presets import HARDWARE, MODELS
from course_lib.virtual import dry_run

SMALL = replace(MODELS["llama3-8b"], n_layers=2, name="llama3-8b, 2 layers")
H100 = HARDWARE["h100-sxm"]


def _loss_and_grads(model, idx):
    model.zero_grad()
    loss = model(idx, idx)[1]
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("experts", [0, 4])
def test_installed_kernels_give_the_plain_ops_results(experts):
    """float64: the loss and every gradient of a Llama TinyGPT (SwiGLU experts too) with the
    fused kernels installed equal the plain ops' within the one-step float64 bound, tensor by
    tensor (the fused backward sums the same terms in another order)."""
    kw = dict(n_experts=experts, top_k=2, expert_mlp="swiglu") if experts else {}
    cfg = gpt.GPTConfig(n_layers=2, seq_len=16, hidden=32, n_heads=4, n_kv_heads=2, **kw)
    idx = torch.randint(0, cfg.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    plain = _loss_and_grads(gpt.TinyGPT(cfg, seed=0).double(), idx)
    model = gpt.TinyGPT(cfg, seed=0).double()
    mlps = experts if experts else 1            # SwiGLU modules of a block: the MLP, or its experts
    assert fused.install(model) == (2 + mlps) * cfg.n_layers + 1     # the two norms; the final norm
    got = _loss_and_grads(model, idx)
    for name, want in plain.items():
        tolerance.assert_matches(got[name], want, dtype=torch.float64, what=name)
    assert gpt.RMSNorm.forward is not fused._norm_forward      # this instance only


def test_each_fused_op_is_one_kernel_of_its_class():
    """Priced as one kernel: the norm a row reduction reading x and the weight, writing y and
    the fp32 1/rms; SwiGLU one streaming pass over a, b and the product (bf16 bytes)."""
    x, w = torch.empty(8, 64, device="meta"), torch.empty(64, device="meta")
    out = torch.ops.course.rms_norm(x, w, 1e-5)
    flops, nbytes, cls, _ = op_cost(torch.ops.course.rms_norm.default, (x, w, 1e-5), {}, out, 2)
    assert cls == REDUCTION and nbytes == (8 * 64 * 2 + 64 + 8) * 2
    back = torch.ops.course.rms_norm_backward(x, x, w, out[1])
    _, nbytes, cls, _ = op_cost(torch.ops.course.rms_norm_backward.default, (x, x, w, out[1]), {}, back, 2)
    assert cls == REDUCTION and nbytes == (3 * 8 * 64 + 2 * 64 + 8) * 2
    a = torch.empty(8, 256, device="meta")
    _, nbytes, cls, _ = op_cost(torch.ops.course.swiglu.default, (a, a), {}, torch.ops.course.swiglu(a, a), 2)
    assert cls == ELEMENTWISE and nbytes == 3 * 8 * 256 * 2
    back = torch.ops.course.swiglu_backward(a, a, a)
    _, nbytes, cls, _ = op_cost(torch.ops.course.swiglu_backward.default, (a, a, a), {}, back, 2)
    assert cls == ELEMENTWISE and nbytes == 5 * 8 * 256 * 2


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
def test_fused_hardware_runs_the_fused_program(tp, sp):
    """A Hardware with ``fused_kernels``: the dry run keeps, per layer, exactly the plain
    program's bytes less each norm's x / rms (s b h, over t with SP) and SwiGLU's silu(w1 x)
    (s b f / t), 16-bit; launches fewer kernels and is faster; the planner's course runtime
    (which traces the same program) moves with it, time and activations."""
    lay = Layout(tp=tp, sp=sp, micro_batch=1, global_batch=2, recompute="selective")
    s, h, f = SMALL.seq_len, SMALL.hidden, SMALL.ffn
    runs, plans, layers = {}, {}, {}
    for fk in (False, True):
        hw = H100.with_(fused_kernels=fk)
        runs[fk] = dry_run(SMALL, hw, lay, progress=None, optimizer="foreach")   # the AdamW the planner counts
        plans[fk] = estimate(SMALL, hw, lay, runtime="course")
        layers[fk] = layer_activations(SMALL, hw, lay, fusions=())
    assert "rmsnorm_swiglu" in runs[True].fusions and "rmsnorm_swiglu" not in runs[False].fusions
    gone = 2 * s * h * 2 / (tp if sp else 1) + s * f * 2 / tp
    assert layers[False] - layers[True] == gone
    # one micro-batch in flight; the planner's formula counts the plain norms' 1/rms at the
    # activations' 2 bytes a token and the fused kernels' at fp32's 4 (the dry run both at 2):
    # its difference is 2 x (2 - 4) bytes a token of the norms' rows less than the dry run's
    assert plans[False].memory["activations"] - plans[True].memory["activations"] == \
        SMALL.n_layers * (gone - 4 * s / (tp if sp else 1))
    assert runs[True].kernels < runs[False].kernels and runs[True].step_time < runs[False].step_time
    for fk in (False, True):     # the planner's course runtime within 5% of the dry run, fused or not
        assert plans[fk].step_time == pytest.approx(runs[fk].step_time, rel=0.05)


def _fused_run(layout, kw, cfg, batch, steps):
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    from course_lib import reference

    model = gpt.TinyGPT(cfg, seed=0).double()
    fused.install(model)                       # before the plan cuts it, as the dry run does
    net = parallelize_nd(model, Mesh(**layout), **kw)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    losses, grads = [], None
    for x, y in reference.gpt_batches(cfg, batch=batch, steps=steps):
        losses.append(net.step(x, y))
        if grads is None and kw.get("data") != "fsdp":
            grads = net.shards(grads=True)     # the first step's: AdamW would hide a wrong scale
        opt.step()
        opt.zero_grad()
    return losses, net.shards(), grads


@pytest.mark.parametrize("layout,kw", [(dict(dp=2, tp=2), {}),                                   # TP + SP
                                       (dict(dp=2, tp=2), dict(data="fsdp", sequence_parallel=False))])
def test_fused_kernels_train_like_one_device_on_ranks(layout, kw):
    """The fused kernels installed on a Llama TinyGPT cut by ``parallelize_nd`` (TP + SP, FSDP x
    TP: the norms on sequence shards, SwiGLU's w1 and w3 column-parallel) train 3 AdamW steps
    in float64 like the plain model on one device: the first step's gradients within the
    one-step bound (not under FSDP, which keeps shards only), losses and parameters within the
    AdamW bound."""
    from course_lib import launch
    from course_lib.parallel.compose import assemble_nd, check_layout

    cfg = gpt.GPTConfig(vocab_size=96, seq_len=16, n_layers=2, hidden=32, n_heads=4, n_kv_heads=2)
    batch, steps = 8, 3
    shape = check_layout(cfg, **layout, batch=batch, **kw)
    ref = single_device(cfg, batch, steps, groups=shape.sizes["dp"], dtype=torch.float64)
    ranks = launch(_fused_run, shape.world_size, layout, kw, cfg, batch, steps, threads=1)
    for losses, _, _ in ranks:
        tolerance.assert_matches(losses, ref.losses, optimizer="adamw", steps=steps, lr=LR, what="losses")
    if kw.get("data") != "fsdp":
        grads = assemble_nd([g for _, _, g in ranks], shape)
        tolerance.assert_matches(grads, ref.grads, what="the first step's gradients")
    full = assemble_nd([shards for _, shards, _ in ranks], shape)
    tolerance.assert_matches(full, ref.state, optimizer="adamw", steps=steps, lr=LR)


def test_stating_the_fused_kernels_for_a_model_without_them_is_refused():
    """Stated for a GPT-2-style model (LayerNorm, GeLU) the item would change nothing: refused by
    name before any rank starts. A Hardware with ``fused_kernels`` runs such a model as it is
    (the planner's flag applies to Llama blocks only)."""
    gpt2 = replace(MODELS["gpt3-175b"], n_layers=1, name="GPT test")
    lay = Layout(micro_batch=1, global_batch=1)
    with pytest.raises(ValueError, match="'rmsnorm_swiglu' fuses RMSNorm and SwiGLU"):
        dry_run(gpt2, H100, lay, progress=None, fusions=("rmsnorm_swiglu",))
    r = dry_run(gpt2, H100.with_(fused_kernels=True), lay, progress=None)
    assert r.kernels == dry_run(gpt2, H100, lay, progress=None).kernels
