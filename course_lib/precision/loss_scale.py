"""fp16 training with dynamic loss scaling: ``torch.amp.GradScaler``'s rule, from scratch,
with the overflow flag reduced over every rank of the mesh.

    scaler = DynamicLossScaler(comm=mesh.comm(MESH_DIMS))   # one flag over the whole mesh
    with torch.autocast("cpu", dtype=torch.float16):         # (or "cuda")
        loss = model(x, y)
    scaler.scale(loss).backward()       # gradients of scale * loss: small ones stay above
                                        # fp16's smallest subnormal (2**-24)
    model.finish_gradient_synchronization()                  # DDP, FSDP, ... as usual
    scaler.unscale_(optimizer)          # divide by S, ONE all-reduce(MAX) of the inf flag
    model.clip_grad_norm_(1.0)          # (if clipping: after unscale_, a norm all-reduced
                                        # over the shards: FSDP.clip_grad_norm_)
    scaler.step(optimizer)              # step, or skip the step on every rank
    scaler.update()                     # overflow: scale *= 0.5, tracker = 0;
                                        # growth_interval good steps in a row: scale *= 2

fp16 has 5 exponent bits: its largest value is 65504 and its smallest subnormal 2**-24, so
gradients of a loss averaged over many tokens (~1e-6 .. 1e-9) flush to zero. Multiplying the
loss by S shifts every gradient up by log2(S) binades; the scaler searches the largest S
that does not overflow. An overflow on ANY rank must skip the step on EVERY rank: with
sharded gradients (FSDP, ZeRO, TP, PP) each rank sees only its share, and a rank that steps
while another skips leaves the replicas different for good. torch's FSDP has the same rule
in ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` (its ``found_inf``
all-reduced over its process group).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

# torch.amp.GradScaler's defaults
INIT_SCALE, GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0 ** 16, 2.0, 0.5, 2000
MESH_DIMS = ("dp", "pp", "cp", "tp")   # every dimension: mesh.comm(MESH_DIMS) is the whole mesh
FP16_NAMES = ("fp16", "float16", "half")


def _f32(x: float) -> float:
    """x rounded to float32: torch keeps the scale in a float32 tensor."""
    return float(torch.tensor(x, dtype=torch.float32, device="cpu"))


def update_scale(scale: float, growth_tracker: int, found_inf: bool, *, growth_factor=GROWTH_FACTOR,
                 backoff_factor=BACKOFF_FACTOR, growth_interval=GROWTH_INTERVAL):
    """One step of the scale's rule (torch's ``_amp_update_scale_``): (new scale, new tracker).

    Overflow: back off and reset the tracker. Otherwise count this good step; the
    ``growth_interval``-th good step in a row grows the scale (unless that overflows
    float32) and resets the tracker."""
    if found_inf:
        return _f32(_f32(scale) * _f32(backoff_factor)), 0
    good = growth_tracker + 1
    if good == growth_interval:
        grown = _f32(_f32(scale) * _f32(growth_factor))
        return (grown if math.isfinite(grown) else scale), 0
    return scale, good


def overflow_on_any_rank(grads, comm=None) -> bool:
    """True if any gradient on any rank of ``comm`` holds an inf or a NaN.

    The local verdict is one number per rank; ONE all-reduce (MAX) of that single
    element makes it every rank's verdict (4 bytes, whatever the model's size)."""
    shared = comm is not None and comm.size > 1
    device = comm.backend_device if shared else "cpu"   # NCCL: on the GPU
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)   # (1,): 1.0 = this rank saw inf/NaN
    for g in grads:
        if not torch.isfinite(g).all():
            found_inf.fill_(1.0)
            break
    if shared:
        comm.all_reduce(found_inf, op=dist.ReduceOp.MAX, name="all-reduce found_inf")
    return bool(found_inf.item())


def check_loss_scaler(precision, scaler, what: str = "training",
                      fix: str = "pass scaler=DynamicLossScaler() (or torch.amp.GradScaler)"):
    """The rule a precision option enforces: fp16 needs a loss scaler (bf16 and fp32 do not:
    their 8 exponent bits reach 2**-133). ``precision``: a name or a torch dtype; ``fix``:
    what the caller can do instead."""
    name = str(precision).removeprefix("torch.")
    if name in FP16_NAMES and scaler is None:
        raise ValueError(f"{what}: precision {precision!r} is fp16, which needs a loss scaler: its smallest "
                         f"subnormal is 2**-24 and its largest value 65504, so small gradients flush "
                         f"to zero unscaled; {fix}")


def _positive_float(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


class DynamicLossScaler:
    """Dynamic loss scaling with GradScaler's semantics and defaults.

    comm: a Comm over every rank whose gradients belong to the step (``mesh.comm(MESH_DIMS)``;
    None: one process). The scale and tracker live on every rank and change identically,
    because every rank updates them from the same reduced flag.
    """

    def __init__(self, init_scale=INIT_SCALE, growth_factor=GROWTH_FACTOR, backoff_factor=BACKOFF_FACTOR,
                 growth_interval=GROWTH_INTERVAL, *, comm=None):
        _positive_float("init_scale", init_scale)
        _positive_float("growth_factor", growth_factor)
        _positive_float("backoff_factor", backoff_factor)
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1 (it grows the scale), got {growth_factor}")
        if backoff_factor >= 1.0:
            raise ValueError(f"backoff_factor must be < 1 (it shrinks the scale), got {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int (good steps), got {growth_interval!r}")
        self.scale_value, self.growth_tracker = _f32(init_scale), 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.comm = comm
        self.found_inf = None     # this step's global verdict, once unscale_ ran

    def get_scale(self) -> float:
        return self.scale_value

    def scale(self, loss):
        """``loss * S`` (float32 S, as torch): backward then produces S times every gradient."""
        return loss * torch.tensor(self.scale_value, dtype=torch.float32, device=loss.device)

    def unscale_(self, optimizer):
        """Divide every gradient by S (multiply by 1/S in float32, as torch), then decide
        overflow over all ranks. Once per step; returns the global verdict."""
        if self.found_inf is not None:
            raise RuntimeError("unscale_() was already called this step (call update() after step())")
        inv_scale = float(torch.tensor(self.scale_value, dtype=torch.float64, device="cpu").reciprocal().float())
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.found_inf = overflow_on_any_rank(grads, self.comm)
        with torch.no_grad():
            for g in grads:
                g.mul_(inv_scale)
        return self.found_inf

    def step(self, optimizer) -> bool:
        """optimizer.step() unless some rank overflowed; returns whether it stepped."""
        if self.found_inf is None:
            self.unscale_(optimizer)
        if self.found_inf:
            return False
        optimizer.step()
        return True

    def update(self):
        """Apply this step's verdict to the scale (see :func:`update_scale`)."""
        if self.found_inf is None:
            raise RuntimeError("update() needs a verdict: call step(optimizer) (or unscale_) first")
        self.scale_value, self.growth_tracker = update_scale(
            self.scale_value, self.growth_tracker, self.found_inf, growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor, growth_interval=self.growth_interval)
        self.found_inf = None


__all__ = ["DynamicLossScaler", "update_scale", "overflow_on_any_rank", "check_loss_scaler",
           "INIT_SCALE", "GROWTH_FACTOR", "BACKOFF_FACTOR", "GROWTH_INTERVAL", "MESH_DIMS"]
