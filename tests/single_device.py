"""The DDP and ZeRO tests' reference, a thin use of ``course_lib.reference``: the same
data, reshuffled every step, and plain AdamW on the full batch (optionally accumulated
over micro-batches)."""
import torch

from course_lib import reference

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
