"""The DDP and ZeRO tests' reference, a thin use of ``course_lib.reference``: the same
data, reshuffled every step, and plain AdamW on the full batch (optionally accumulated
over micro-batches), in float64 inside ``exact()``."""
import contextlib

import torch

from course_lib import reference, tolerance

SIZES = (16, 32, 16, 32)          # MLP widths; shared=True ties the last weight to the first
AWKWARD = dict(frozen=(1,), shared=True, unused=True)
BATCH, STEPS = 24, 5              # 24 rows: even micro-batches on 1, 2, 3 and 4 ranks
LR, WD = 1e-2, 0.1


def make_data(seed=0):
    return reference.mlp_data(seed, BATCH, STEPS, SIZES)


def train(model, X, Y, perms, micro=1):
    """AdamW with weight decay, one step per permutation, ``micro`` accumulated micro-batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    return reference.train(model, reference.shuffled(X, Y, perms), opt, micro=micro)[0]


@contextlib.contextmanager
def exact():
    """float64 as the default dtype while the block runs (models, data, optimizer states):
    exactness after AdamW steps can only be claimed in float64 (course_lib.tolerance)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def assert_trained_like(got, want, what=""):
    """Parameters after the tests' STEPS AdamW steps at LR, within the float64 bound."""
    return tolerance.assert_matches(got, want, optimizer="adamw", steps=STEPS, lr=LR, what=what)


def first_step_grads(model, X, Y, perms, micro=1):
    """The gradients of the first step (the first permutation's batch, ``micro`` accumulated)."""
    x, y = X[perms[0]], Y[perms[0]]
    for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
        (reference.mse_loss(model, xm, ym) / micro).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
