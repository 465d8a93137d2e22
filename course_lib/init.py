"""Weight initialisation that gives the same values on every device.

The course's models draw their weights from one seeded CPU generator, in registration order
(one seed, not one per shard: every rank builds the same full model, then keeps its part).
A CPU generator cannot fill a CUDA tensor, so the values are drawn on the CPU and copied: a
model built under ``torch.device("cuda")`` equals the one built on the CPU. On PyTorch's
``meta`` device (shapes without data) nothing is drawn.
"""
from __future__ import annotations


def draw_device(p) -> str:
    """Where an init draws ``p``'s values from a CPU generator: the CPU (then copied to ``p``'s
    device), or ``meta`` for a parameter without data (no values, no memory)."""
    return "meta" if p.is_meta else "cpu"


__all__ = ["draw_device"]
