"""Non-finite tracing: the first op that produced a NaN or an Inf, and where.

    with NonFiniteTracer() as tracer:       # or launch(fn, n, debug="nonfinite")
        loss = model(x).sum(); loss.backward(); opt.step()
    # NonFiniteError: rank 1, step 2, forward of blocks.0.norm (RMSNorm): aten.div.Tensor made NaN
    #                 from finite inputs

A NaN spreads: one division by zero in one rank's layer norm becomes a NaN loss, then NaN
gradients on every rank after the all-reduce. What matters is where it *started*. A
:class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op (forward,
backward, optimizer, and the c10d collectives); the first op whose output holds a NaN while
no input did, or an Inf while every input (tensor or number) was finite, raises
:class:`NonFiniteError` naming the rank, the step (optimizer steps taken so far), the
module path (forward hooks keep a stack of the modules being run; in backward, the autograd
node running) and the op. A ``-inf`` written on purpose (an attention mask's
``masked_fill(mask, -inf)``) has a non-finite number among its inputs: not reported; nor is
an ``empty`` tensor, whose garbage may hold a NaN until something writes it.

The cost is one ``isfinite`` reduction per op output: a debugging mode, off by default.
"""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class NonFiniteError(FloatingPointError):
    """The first op that produced a NaN or an Inf: ``.rank``, ``.step``, ``.module``, ``.op``, ``.phase``."""
    launch_as = "FloatingPointError"   # how the launcher re-raises it in the caller

    def __init__(self, message, *, rank=None, step=0, module="", op="", phase="forward", kind="NaN"):
        super().__init__(message)
        self.rank, self.step, self.module, self.op, self.phase, self.kind = rank, step, module, op, phase, kind


def _flags(values) -> tuple:
    """(has NaN, has any non-finite) over the tensors and numbers in ``values``."""
    nan = bad = False
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() or v.is_complex():
                if v.numel() and not bool(torch.isfinite(v).all()):
                    bad = True
                    nan = nan or bool(torch.isnan(v).any())
        elif isinstance(v, float) and not math.isfinite(v):
            bad = True
            nan = nan or math.isnan(v)
    return nan, bad


# ops whose output is uninitialised memory (garbage may hold a NaN): never a producer
UNINITIALISED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted",
                 "resize_", "resize_as_"}


class NonFiniteTracer(TorchDispatchMode):
    """Raise :class:`NonFiniteError` at the first op whose output turns non-finite."""

    def __init__(self, rank=None):
        super().__init__()
        self.rank, self.step = rank, 0
        self._stack, self._names, self._handles = [], {}, []

    # ---------------------------------------------------------------- where: module and step
    def _enter_module(self, module, args):
        if not self._stack and id(module) not in self._names:   # a new root: name its submodules
            self._names.update({id(m): name for name, m in module.named_modules()})
        self._stack.append(module)

    def _exit_module(self, module, args, output):
        if self._stack and self._stack[-1] is module:
            self._stack.pop()

    def _stepped(self, optimizer, args, kwargs):
        self.step += 1

    def where(self) -> tuple:
        """(phase, module path) of the op running now."""
        node = torch._C._current_autograd_node()
        if node is not None:
            return "backward", node.name()
        if self._stack:
            m = self._stack[-1]
            name = self._names.get(id(m), "")
            return "forward", f"{name or '(root)'} ({type(m).__name__})"
        return "outside any module", ""

    def __enter__(self):
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim
        self._handles = [nn_module.register_module_forward_pre_hook(self._enter_module),
                         nn_module.register_module_forward_hook(self._exit_module),
                         optim.register_optimizer_step_post_hook(self._stepped)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return super().__exit__(*exc)

    # ---------------------------------------------------------------- the check
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tree_flatten((args, kwargs))[0]
        mutable = func._schema.is_mutable
        before = _flags(inputs) if mutable else None    # an in-place op overwrites its input
        out = func(*args, **kwargs)
        if func.overloadpacket.__name__ in UNINITIALISED:
            return out
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        nan_out, bad_out = _flags(outputs)
        if bad_out:
            nan_in, bad_in = before if mutable else _flags(inputs)
            if (nan_out and not nan_in) or not bad_in:
                self._raise(func, "NaN" if nan_out and not nan_in else "Inf", bad_in)
        return out

    def _raise(self, func, kind, bad_in):
        phase, module = self.where()
        name = str(func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else func)
        op = f"{func.namespace}.{func.__name__}" if hasattr(func, "namespace") else name
        inputs = "inputs with an Inf but no NaN" if bad_in else "finite inputs"
        who = f"rank {self.rank}, " if self.rank is not None else ""
        where = f"{phase} of {module}" if module else phase
        raise NonFiniteError(f"{who}step {self.step}, {where}: {op} made {kind} from {inputs}",
                             rank=self.rank, step=self.step, module=module, op=op, phase=phase, kind=kind)


__all__ = ["NonFiniteTracer", "NonFiniteError"]
