"""Graders of the single-device chapter (solutions/00_single_device_exercises.ipynb).

    check_state_bytes(state_bytes)                      # bytes of params / grads / optimizer state
    check_llama_activation_bytes(llama_activation_bytes)  # the activation formula of our block
    check_average_gradients(average_gradients)          # data-parallel gradient averaging, 2-3 ranks

Each prints one stable line (``name: k/k cases passed`` or the first failing case with
a hint) and returns True iff every case passed; a learner's exception, NotImplementedError
or deadlock becomes the hint, never a traceback or a hang.
"""
from __future__ import annotations

import torch

from course_lib.grading import Case, check, check_distributed, compare

# ----------------------------------------------------------------------------- 1. training state


def _state_case(kind: str):
    """A model and optimizer after one step, built the same way every time."""
    from course_lib.models import MLP, GPTConfig, TinyGPT

    gen = torch.Generator().manual_seed(0)
    if kind == "mlp-sgd":
        model = MLP((8, 16, 4), seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 8, generator=gen)
        loss = model(x).square().mean()
    elif kind == "mlp-momentum":
        model = MLP((8, 16, 4), seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loss = model(torch.randn(4, 8, generator=gen)).square().mean()
    elif kind == "mlp-awkward-adamw":
        model = MLP((16, 32, 16, 32), frozen=(1,), shared=True, unused=True, seed=0)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        loss = model(torch.randn(4, 16, generator=gen)).square().mean()
    elif kind == "gpt-tied-bf16-adamw":
        cfg = GPTConfig(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, seq_len=16, tie_embeddings=True)
        model = TinyGPT(cfg, seed=0).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        idx = torch.randint(0, 256, (2, 16), generator=gen)
        loss = model(idx, idx)[1]
    else:  # pragma: no cover
        raise ValueError(kind)
    loss.backward()
    opt.step()
    return model, opt


_STATE_CASES = [
    Case({"kind": "mlp-sgd"}, label="MLP, plain SGD: no optimizer state"),
    Case({"kind": "mlp-momentum"}, label="MLP, SGD with momentum"),
    Case({"kind": "mlp-awkward-adamw"}, label="MLP with a frozen layer, a shared weight and an unused parameter, AdamW"),
    Case({"kind": "gpt-tied-bf16-adamw"}, label="bf16 TinyGPT with tied embeddings, AdamW"),
]


def check_state_bytes(state_bytes) -> bool:
    """``state_bytes(model, optimizer) -> {"params": int, "grads": int, "optimizer": int}``."""
    from course_lib.memory import model_state_bytes

    def run_case(case):
        model, opt = _state_case(case.params["kind"])
        held = model_state_bytes(model, opt)
        expected = {"params": held["parameters"], "grads": held["gradients"], "optimizer": held["optimizer_state"]}
        got = state_bytes(model, opt)
        if not isinstance(got, dict):
            return f"expected a dict with keys params, grads, optimizer; got {type(got).__name__}"
        for key in ("params", "grads", "optimizer"):
            if key not in got:
                return f"the dict has no {key!r} key"
            msg = compare(got[key], expected[key], rtol=0, atol=0.5, what=key)
            if msg:
                return msg
        return None

    return check("state_bytes", _STATE_CASES, run_case)


# ----------------------------------------------------------------------------- 2. activations

_ACT_CASES = [
    Case(dict(s=16, b=2, hidden=32, n_heads=4, n_kv_heads=4, dtype="bfloat16"), label="s=16 b=2 h=32 a=4 kv=4 bf16"),
    Case(dict(s=32, b=1, hidden=32, n_heads=4, n_kv_heads=4, dtype="bfloat16"), label="s=32 b=1 h=32 a=4 kv=4 bf16"),
    Case(dict(s=16, b=3, hidden=48, n_heads=6, n_kv_heads=2, dtype="bfloat16"), label="s=16 b=3 h=48 a=6 kv=2 bf16"),
    Case(dict(s=24, b=2, hidden=64, n_heads=4, n_kv_heads=1, dtype="float32"), label="s=24 b=2 h=64 a=4 kv=1 fp32"),
]


def _measured_block_bytes(s, b, hidden, n_heads, n_kv_heads, dtype):
    """Bytes one Llama-style TinyGPT block really saves (unique storages, everything)."""
    from course_lib.models import GPTConfig, TinyGPT, saved_activations

    cfg = GPTConfig(n_layers=1, hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads, seq_len=s)
    dt = getattr(torch, dtype)
    model = TinyGPT(cfg, seed=0).to(dt)
    x = torch.randn(b, s, hidden, generator=torch.Generator().manual_seed(0)).to(dt).requires_grad_()
    _, rows = saved_activations(model.blocks[0], x * 1.0)
    return cfg.ffn_hidden, sum(r.nbytes for r in rows)


def _known_slip(got, s, b, h, a, kv, f, dtype_bytes) -> str:
    """A hint when ``got`` is the course formula (planner.formulas) with one known slip."""
    from course_lib.planner.formulas import llama_activation_bytes_per_layer as formula

    slips = [(formula(s, b, h, a, kv, f, value_bytes=dtype_bytes, rstd=False),
              "the two (b, s, 1) rstd tensors are missing"),
             (formula(s, b, h, a, a, f, value_bytes=dtype_bytes),
              "K and V have kv heads of h/a channels each, not a heads"),
             (formula(s, b, h, a, kv, f, value_bytes=2), "multiply the elements by dtype_bytes")]
    for value, hint in slips:
        if abs(got - value) <= 0.5:
            return f": {hint}"
    return ""


def check_llama_activation_bytes(llama_activation_bytes) -> bool:
    """``llama_activation_bytes(s, b, h, a, kv, f, dtype_bytes)``: bytes one block saves,
    compared with a count of a real forward (rstd tensors included), which
    ``planner.formulas.llama_activation_bytes_per_layer`` equals (tests/test_planner_formulas.py)."""

    def run_case(case):
        p = dict(case.params)
        f, expected = _measured_block_bytes(**p)
        dtype_bytes = torch.empty(0, dtype=getattr(torch, p["dtype"])).element_size()
        s, b, h, a, kv = p["s"], p["b"], p["hidden"], p["n_heads"], p["n_kv_heads"]
        got = llama_activation_bytes(s, b, h, a, kv, f, dtype_bytes)
        if got is None:
            return "returned None: return the number of bytes"
        msg = compare(got, expected, rtol=0, atol=0.5, what=f"f={f}")
        if msg and isinstance(got, (int, float)):
            msg += f" (off by {got - expected:+,.0f} bytes{_known_slip(got, s, b, h, a, kv, f, dtype_bytes)})"
        return msg

    return check("llama_activation_bytes", _ACT_CASES, run_case)


# ----------------------------------------------------------------------------- 3. averaging gradients


class RareBranch(torch.nn.Module):
    """A layer that only rows whose first feature is positive go through, like an expert that
    only some tokens are routed to: on a rank where no row reaches it, its ``.grad`` is None."""

    def __init__(self):
        super().__init__()
        self.main, self.rare = torch.nn.Linear(16, 32), torch.nn.Linear(16, 32)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)

    def forward(self, x):                       # x: (rows, 16)
        out = self.main(x)
        routed = x[:, :1] > 0                   # (rows, 1)
        if routed.any():                        # skipped entirely when no row is routed
            out = out + routed * self.rare(x)
        return out


def _average_gradients_harness(average_gradients, model_kind, n_steps=2, global_batch=6):
    """On each rank: my slice of the global batch, backward, the learner's averaging, a step;
    then compare with the single-device run of the whole batch (done on this rank too)."""
    import torch
    import torch.distributed as dist

    from course_lib.grading import compare
    from course_lib.models import MLP, GPTConfig, TinyGPT

    rank, world = dist.get_rank(), dist.get_world_size()
    local = global_batch // world
    gen = torch.Generator().manual_seed(1)

    def build():
        if model_kind == "mlp":
            return MLP((16, 32, 16, 32), frozen=(1,), shared=True, unused=True, seed=0)
        if model_kind == "branch":
            return RareBranch()
        return TinyGPT(GPTConfig(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, seq_len=16), seed=0)

    def loss_of(model, batch):
        if model_kind in ("mlp", "branch"):
            x, y = batch
            return torch.nn.functional.mse_loss(model(x), y)
        return model(batch[0], batch[1])[1]

    if model_kind == "mlp":
        data = [(torch.randn(global_batch, 16, generator=gen), torch.randn(global_batch, 32, generator=gen))
                for _ in range(n_steps)]
    elif model_kind == "branch":        # only the first row of the global batch takes the rare branch
        data = []
        for _ in range(n_steps):
            x = torch.randn(global_batch, 16, generator=gen)
            x[:, 0] = -x[:, 0].abs() - 0.1
            x[0, 0] = 1.0
            data.append((x, torch.randn(global_batch, 32, generator=gen)))
    else:
        data = []
        for _ in range(n_steps):
            idx = torch.randint(0, 256, (global_batch, 17), generator=gen)
            data.append((idx[:, :-1], idx[:, 1:]))

    ref, mine = build(), build()
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    opt = torch.optim.SGD([p for p in mine.parameters() if p.requires_grad], lr=0.1)
    for step, batch in enumerate(data):
        ref_opt.zero_grad()
        loss_of(ref, batch).backward()
        ref_opt.step()
        opt.zero_grad()
        loss_of(mine, tuple(t[rank * local:(rank + 1) * local] for t in batch)).backward()
        average_gradients(mine)
        for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
            if (p.grad is None) != (q.grad is None):
                return f"step {step}: {name}.grad is {'None' if p.grad is None else 'set'}, expected " \
                       f"{'None' if q.grad is None else 'a gradient'}"
            if p.grad is not None:
                msg = compare(p.grad, q.grad, rtol=1e-4, atol=1e-6, what=f"step {step} {name}.grad")
                if msg:
                    return msg
        opt.step()
    return None


_AVG_CASES = [
    Case({"model_kind": "mlp"}, world_size=2, label="MLP with frozen, shared and unused parameters"),
    Case({"model_kind": "mlp"}, world_size=3, label="MLP with frozen, shared and unused parameters"),
    Case({"model_kind": "branch"}, world_size=2, label="a layer only rank 0's rows reach (its grad is None on rank 1)"),
    Case({"model_kind": "branch"}, world_size=3, label="a layer only rank 0's rows reach (its grad is None on ranks 1, 2)"),
    Case({"model_kind": "gpt"}, world_size=2, label="TinyGPT, grouped KV heads"),
    Case({"model_kind": "gpt"}, world_size=3, label="TinyGPT, grouped KV heads"),
]


def check_average_gradients(average_gradients, timeout: float = 60.0) -> bool:
    """``average_gradients(model)`` on every rank: afterwards each ``p.grad`` must be the
    gradient of the whole global batch (the single-device gradient), on 2 and 3 ranks."""
    cases = [Case({**c.params, "average_gradients": average_gradients}, c.world_size, c.label) for c in _AVG_CASES]
    return check_distributed("average_gradients", _average_gradients_harness, cases, timeout=timeout)


__all__ = ["check_state_bytes", "check_llama_activation_bytes", "check_average_gradients"]
