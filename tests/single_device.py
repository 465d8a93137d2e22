"""The single-device reference the DDP and ZeRO tests compare with: the same data,
reshuffled every step, and plain AdamW on the full batch (optionally accumulated
over micro-batches)."""
import torch
import torch.nn.functional as F

SIZES = (16, 32, 16, 32)          # MLP widths; shared=True ties the last weight to the first
AWKWARD = dict(frozen=(1,), shared=True, unused=True)
BATCH, STEPS = 24, 5              # 24 rows: even micro-batches on 1, 2, 3 and 4 ranks
LR, WD = 1e-2, 0.1


def make_data(seed=0):
    g = torch.Generator().manual_seed(seed)
    X, Y = torch.randn(BATCH, SIZES[0], generator=g), torch.randn(BATCH, SIZES[-1], generator=g)
    perms = [torch.randperm(BATCH, generator=g) for _ in range(STEPS)]  # reshuffled every step
    return X, Y, perms


def train(model, X, Y, perms, micro=1):
    """AdamW with weight decay, one step per permutation, ``micro`` accumulated micro-batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for perm in perms:
        for x, y in zip(X[perm].chunk(micro), Y[perm].chunk(micro)):
            (F.mse_loss(model(x), y) / micro).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()
