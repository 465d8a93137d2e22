"""Graders of the single-device chapter (solutions/00_single_device_exercises.ipynb).

    check_state_bytes(state_bytes)                      # bytes of params / grads / optimizer state
    check_max_micro_batch(max_micro_batch)              # the largest micro-batch that fits a budget
    check_average_gradients(average_gradients)          # data-parallel gradient averaging, 2-3 ranks
    check_accumulation(accumulate)                      # find the bug: micro-batches, uneven ones too

While the learner's function runs, the library's counting and data parallelism are switched off.
"""
from __future__ import annotations

import torch

from course_lib.grading import Case, check, check_distributed, compare, learner
from course_lib.grading.harness import check_answers, check_in_process, grads_differ, table
from course_lib.memory import model_state_bytes
from course_lib.models import init_uniform_
from course_lib.grading.guard import COURSE_DATA_PARALLEL, TORCH_DATA_PARALLEL
from course_lib.grading.p2p import SameCollectives

# what would count the bytes for the learner (exercise 1) or average the gradients (exercise 3)
MEMORY_LIBRARY = ("course_lib.memory:*",)
DP_LIBRARY = (COURSE_DATA_PARALLEL, TORCH_DATA_PARALLEL)

# ----------------------------------------------------------------------------- 1. training state


_STATE_CASES = {  # kind: label
    "mlp-sgd": "MLP, plain SGD: no optimizer state",
    "mlp-momentum": "MLP, SGD with momentum",
    "mlp-awkward-adamw": "MLP with a frozen layer, a shared weight and an unused parameter, AdamW",
    "gpt-tied-bf16-adamw": "bf16 TinyGPT with tied embeddings, AdamW",
}


def _state_case(kind: str):
    """A model and optimizer after one step, built the same way every time."""
    from course_lib.models import MLP, GPTConfig, TinyGPT

    gen = torch.Generator().manual_seed(0)
    if kind.startswith("gpt"):
        cfg = GPTConfig(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, seq_len=16, tie_embeddings=True)
        model = TinyGPT(cfg, seed=0).to(torch.bfloat16)
        idx = torch.randint(0, 256, (2, 16), generator=gen)
        loss = model(idx, idx)[1]
    else:
        awkward = kind == "mlp-awkward-adamw"
        model = (MLP((16, 32, 16, 32), frozen=(1,), shared=True, unused=True, seed=0) if awkward
                 else MLP((8, 16, 4), seed=0))
        loss = model(torch.randn(4, 16 if awkward else 8, generator=gen)).square().mean()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.AdamW(trainable, lr=1e-3) if kind.endswith("adamw")
           else torch.optim.SGD(trainable, lr=0.1, momentum=0.9 if kind == "mlp-momentum" else 0))
    loss.backward()
    opt.step()
    return model, opt


def _held(kind: str) -> dict:
    """The reference: the library's count of the case's storages."""
    held = model_state_bytes(*_state_case(kind))
    return {"params": held["parameters"], "grads": held["gradients"], "optimizer": held["optimizer_state"]}


_WHY = {"params": "is a storage counted twice (a tied weight counts once)?",
        "grads": "a frozen or unused parameter has no gradient (p.grad is None)",
        "optimizer": "count every tensor in optimizer.state, once"}


def _state_differ(got, want, kind):
    if not isinstance(got, dict):
        return f"expected a dict with keys params, grads, optimizer; got {type(got).__name__}"
    for key in want:
        if key not in got:
            return f"the dict has no {key!r} key"
        msg = compare(got[key], want[key], exact=True, what=key)     # bytes: integers
        if msg:
            return msg + (f": {_WHY[key]}" if isinstance(got[key], (int, float)) and got[key] > want[key] else "")


def check_state_bytes(state_bytes) -> bool:
    """``state_bytes(model, optimizer) -> {"params": int, "grads": int, "optimizer": int}``."""
    return check_answers("state_bytes", state_bytes, table(((k,) for k in _STATE_CASES), _STATE_CASES.get), _held,
                         guard=MEMORY_LIBRARY, exercise="counting storages", seconds=20, given=_state_case,
                         differ=_state_differ)


# ----------------------------------------------------------------------------- 2. the largest micro-batch

_CFGS = {
    "llama-2x32": dict(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, seq_len=16),
    "gpt2-dropout-3x48": dict(n_layers=3, hidden=48, n_heads=6, seq_len=24, block="gpt2", dropout=0.1),
    "llama-1x64-mqa": dict(n_layers=1, hidden=64, n_heads=4, n_kv_heads=1, seq_len=32, tie_embeddings=True),
}
# (config, micro-batch whose total sets the budget, extra bytes): budget = state + activations(b) + extra;
# extra < 0 puts the budget one byte short of b, "half" half a sequence's activations over it
_FIT_CASES = [("llama-2x32", 3, 0), ("llama-2x32", 4, -1), ("llama-2x32", 1, -1), ("llama-2x32", 0, -1),
              ("gpt2-dropout-3x48", 5, 0), ("llama-1x64-mqa", 7, "half")]


def _training_bytes(cfg_kwargs, batches):
    """(fp32 AdamW state after one step, {b: activation bytes of model(idx, targets)})."""
    from course_lib.models import GPTConfig, TinyGPT, saved_activations

    cfg = GPTConfig(**cfg_kwargs)
    model = TinyGPT(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    acts = {0: 0}
    for b in batches:
        idx = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1), generator=gen)
        _, rows = saved_activations(model, idx[:, :-1], idx[:, 1:])
        acts[b] = sum(r.nbytes for r in rows)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), generator=gen)
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    opt.step()
    return model_state_bytes(model, opt)["total"], acts


def _fit_harness(max_micro_batch, cfg_name, b, extra):
    """One case, in a process of its own (an endless search is stopped by the timeout)."""
    from course_lib.models import GPTConfig

    torch.set_num_threads(1)
    state, acts = _training_bytes(_CFGS[cfg_name], range(1, b + 2))
    budget = state + acts[b] + ((acts[b + 1] - acts[b]) // 2 if extra == "half" else extra)
    want = max(q for q in acts if state + acts[q] <= budget) if state <= budget else 0
    got = learner(max_micro_batch, "course_lib.grading.single_device:*", exercise="the search for the largest b")(
        GPTConfig(**_CFGS[cfg_name]), budget)
    if isinstance(got, bool) or not isinstance(got, int):
        return f"expected an int (a number of sequences), got {got!r}"
    if got == want:
        return None
    if got > want:
        over = state + acts.get(got, acts[max(acts)]) - budget
        return (f"budget {budget:,} B: got b={got}, expected b={want}" +
                (f" (b={got} needs {over:,} B more than the budget)" if got in acts else ""))
    return (f"budget {budget:,} B: got b={got}, expected b={want} (state {state:,} B + activations "
            f"{acts[want]:,} B = {state + acts[want]:,} B fits)")


def check_max_micro_batch(max_micro_batch, timeout: float = 30.0) -> bool:
    """``max_micro_batch(cfg, budget_bytes) -> int``: the largest b whose fp32 AdamW training
    state plus the activations TinyGPT(cfg) saves for a (b, seq_len) batch fit the budget,
    0 if none; budgets are set exactly on the boundaries from a real count."""
    cases = [Case(dict(max_micro_batch=max_micro_batch, cfg_name=c, b=b, extra=e),
                  label=f"{c}, budget = state + activations(b={b})"
                  + ("" if e == 0 else " - 1 byte" if e == -1 else " + half a sequence")) for c, b, e in _FIT_CASES]
    return check_in_process("max_micro_batch", _fit_harness, cases, timeout, hang="an endless search?")


# ----------------------------------------------------------------------------- 3. averaging gradients


class RareBranch(torch.nn.Module):
    """A layer that only rows whose first feature is positive go through, like an expert that
    only some tokens are routed to: on a rank where no row reaches it, its ``.grad`` is None."""

    def __init__(self):
        super().__init__()
        self.main, self.rare = torch.nn.Linear(16, 32), torch.nn.Linear(16, 32)
        init_uniform_(self, 0)

    def forward(self, x):                       # x: (rows, 16)
        out = self.main(x)
        routed = x[:, :1] > 0                   # (rows, 1)
        if routed.any():                        # skipped entirely when no row is routed
            out = out + routed * self.rare(x)
        return out


def _avg_model(kind):
    from course_lib.models import MLP, GPTConfig, TinyGPT

    if kind == "mlp":
        return MLP((16, 32, 16, 32), frozen=(1,), shared=True, unused=True, seed=0)
    return RareBranch() if kind == "branch" else TinyGPT(GPTConfig(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2,
                                                                   seq_len=16), seed=0)


def _avg_batch(kind, gen, rows):
    """One step's global batch (x, y); for "branch" only its first row takes the rare branch."""
    if kind == "gpt":
        idx = torch.randint(0, 256, (rows, 17), generator=gen)
        return idx[:, :-1], idx[:, 1:]
    x = torch.randn(rows, 16, generator=gen)
    if kind == "branch":
        x[:, 0] = -x[:, 0].abs() - 0.1
        x[0, 0] = 1.0
    return x, torch.randn(rows, 32, generator=gen)


def _average_gradients_harness(average_gradients, model_kind, n_steps=2, global_batch=6):
    """On each rank: my slice of the global batch, backward, the learner's averaging, a step;
    compared with one device's gradient of the whole batch (computed on this rank too)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    data = [_avg_batch(model_kind, gen, global_batch) for _ in range(n_steps)]
    ref, mine = _avg_model(model_kind), _avg_model(model_kind)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in (ref, mine)]
    answer, in_step = learner(average_gradients, DP_LIBRARY, exercise="averaging gradients"), SameCollectives()
    for step, batch in enumerate(data):
        for model, (x, y) in ((ref, batch), (mine, [t.chunk(world)[rank] for t in batch])):
            model.zero_grad(set_to_none=True)
            (model(x, y)[1] if model_kind == "gpt" else torch.nn.functional.mse_loss(model(x), y)).backward()
        with in_step:
            answer(mine)
        # one step's gradients: the one-step bound (course_lib.tolerance), one scale for them all; at
        # step 1 the parameters differ by one SGD step of that rounding, a second-order change
        largest = max([float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None] or [0.0])
        msg = grads_differ(mine, ref, f"step {step}: ", scale=largest)
        if msg:
            return msg
        for opt in opts:
            opt.step()
    return None


_AVG_CASES = {"mlp": "MLP with frozen, shared and unused parameters", "gpt": "TinyGPT, grouped KV heads",
              "branch": "a layer only rank 0's rows reach (its grad is None on {})"}


def check_average_gradients(average_gradients, timeout: float = 20.0) -> bool:
    """``average_gradients(model)`` on every rank: afterwards each ``p.grad`` must be the
    gradient of the whole global batch (the single-device gradient), on 2 and 3 ranks."""
    others = {2: "rank 1", 3: "ranks 1, 2"}
    cases = [Case({"model_kind": kind, "average_gradients": average_gradients}, n,
                  _AVG_CASES[kind].format(others[n])) for kind in ("mlp", "branch", "gpt") for n in (2, 3)]
    return check_distributed("average_gradients", _average_gradients_harness, cases, timeout=timeout)


# ----------------------------------------------------------------------------- 4. find the bug: accumulation
# (rows, micro-batches, dtype): tensor_split makes uneven micro-batches when rows % k != 0
_ACCUM_CASES = [(12, 3, "float32"), (10, 4, "float32"), (7, 7, "float64"), (5, 1, "float32"), (9, 2, "float64"),
                (11, 3, "float64")]


def _accum_case(rows, k, dtype):
    """(model, x, y, per-parameter full-batch gradient, rows a micro-batch may hold)."""
    from course_lib.models import MLP

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(rows * 10 + k)
    x = torch.randn(rows, 8, generator=gen, dtype=torch.float64).to(dt)
    y = torch.randn(rows, 4, generator=gen, dtype=torch.float64).to(dt)
    ref = MLP((8, 16, 4), seed=0).to(dt)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    return MLP((8, 16, 4), seed=0).to(dt), x, y, [p.grad for p in ref.parameters()], -(-rows // k)


def check_accumulation(accumulate) -> bool:
    """accumulate(model, loss_fn, x, y, micro_batches): forward and backward each of
    x.tensor_split(micro_batches) (never the whole batch at once) so that afterwards every
    p.grad is the gradient of loss_fn(model(x), y), the mean over the whole batch."""
    answer = learner(accumulate, "course_lib.grading.single_device:_accum_case", exercise="gradient accumulation",
                     seconds=20)

    def run_case(case):
        rows, k, dtype = case.params["rows"], case.params["k"], case.params["dtype"]
        model, x, y, want, most = _accum_case(rows, k, dtype)
        seen = []
        model.register_forward_pre_hook(lambda module, args: seen.append(len(args[0])))
        answer(model, torch.nn.functional.mse_loss, x, y, k)
        if seen and max(seen) > most:
            return (f"a forward on {max(seen)} rows: accumulation exists to hold one micro-batch's activations "
                    f"at a time (at most {most} rows here)")
        if len(seen) != k:
            return f"{len(seen)} forwards for {k} micro-batches: one forward and backward per micro-batch"
        # the full batch's gradient summed in micro-batches: the one-step bound (course_lib.tolerance)
        tol = dict(dtype=getattr(torch, dtype), scale=max(float(g.abs().max()) for g in want))
        for (name, p), g in zip(model.named_parameters(), want):
            if p.grad is None:
                return f"{name}.grad is None: no backward reached it"
            ratio = (p.grad.double().norm() / g.double().norm()).item()
            msg = compare(p.grad, g, what=f"{name}.grad", **tol)
            if msg:
                return msg + f" (|grad| is {ratio:.3g}x the full batch's)"
        return None

    cases = [Case(dict(rows=r, k=k, dtype=dt), label=f"{r} rows in {k} micro-batches "
                  f"{[len(c) for c in torch.arange(r).tensor_split(k)]}, {dt}") for r, k, dt in _ACCUM_CASES]
    return check("accumulation", cases, run_case)


__all__ = ["check_state_bytes", "check_max_micro_batch", "check_average_gradients", "check_accumulation"]

