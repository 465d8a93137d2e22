"""Train the tiny GPT on a mesh (DP x PP x CP x TP, EP inside DP), or data-parallel only.

    python -m course_lib.examples.train --dp 2 --tp 2                  # course_lib.launch starts 4 ranks
    torchrun --standalone --nproc_per_node=8 -m course_lib.examples.train --dp 2 --tp 2 --pp 2
    torchrun --standalone --nproc_per_node=16 -m course_lib.examples.train --dp 2 --tp 2 --pp 2 --cp 2
    torchrun --standalone --nproc_per_node=4 -m course_lib.examples.train --dp 4 --ep 2 --experts 4
    torchrun --standalone --nproc_per_node=8 -m course_lib.examples.train --dp 2 --tp 2 --pp 2 \\
        --backend nccl                                                 # one GPU per rank

    python -m course_lib.examples.train --parallel fsdp --nproc 4      # data parallel only: our DDP,
    torchrun --standalone --nproc_per_node=8 -m course_lib.examples.train --parallel fsdp --backend nccl \\
        --dtype bf16                                                   # ZeRO-1, ZeRO-2 or FSDP

Mesh mode (the --dp/--pp/--cp/--tp/--ep flags; dimensions left out are 1, and with none of them
the ranks are all DP) cuts the model with ``parallelize_nd``: the world size is the product of
the dimensions. The layout is checked (``check_layout``, plain arithmetic) before any rank starts
or joins a process group: a bad one prints the violated constraint and exits with status 2.
Every rank draws the same global batch (same seed) and takes its part; the loss printed is the
step's global loss, equal to one device's (``--check`` runs one device and compares). With
--pp > 1 the default micro-batch count lets the pipeline pipeline (:func:`default_microbatches`).
At the end: the median step time, tokens/s, and every rank's peak memory in step 1.
Under torchrun a bad layout is printed once, by rank 0; every rank exits with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from course_lib import compat
from course_lib.launch import launch, under_torchrun

PARALLEL = ("ddp", "zero1", "zero2", "fsdp")
MESH_DIMS = ("dp", "pp", "cp", "tp", "ep")
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def gpt_config(seq_len=32, hidden=64, layers=2, experts=0, top_k=2):
    """The tiny GPT both modes train (and a single-device reference rebuilds)."""
    from course_lib.models import GPTConfig

    moe = dict(n_experts=experts, top_k=min(top_k, experts)) if experts else {}
    return GPTConfig(vocab_size=256, seq_len=seq_len, n_layers=layers, hidden=hidden, n_heads=4, **moe)


def training_batches(batch, seq_len, steps):
    """The global batches, the same on every rank: [(x, y)] of shape (batch, seq_len)."""
    from course_lib.data import batches, byte_tokens, synthetic_text

    tokens = byte_tokens(synthetic_text(20_000, seed=0))
    return list(batches(tokens, batch, seq_len, seed=1, n_batches=steps))


def _device():
    """This rank's device, read from its process group: NCCL ranks compute on their GPU (launch,
    and torchrun through launch, pinned each to its LOCAL_RANK GPU), gloo ranks on the CPU. Not
    a ``backend`` argument: ``launch(fn, n, backend=...)`` takes that keyword for itself, so fn
    would never see it (on a GPU the ranks computed on the CPU and failed at the first
    collective NCCL really ran: "No backend type associated with device type cpu")."""
    return compat.backend_device()


def train(parallel, steps=20, batch=8, seq_len=32, hidden=64, layers=2, lr=3e-3, dtype=None,
          log_every=5):
    """Data parallel only: our DDP, ZeRO-1/2 (sharded AdamW) or FSDP. Returns the step losses."""
    from course_lib.models import TinyGPT
    from course_lib.parallel import DDP, FSDP, ShardedOptimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    if batch % world:
        raise ValueError(f"--batch ({batch}) must be divisible by the number of ranks ({world})")
    device = _device()
    model = TinyGPT(gpt_config(seq_len, hidden, layers), seed=0).to(device)
    if parallel == "ddp":
        net = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    elif parallel in ("zero1", "zero2"):
        net = model
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=int(parallel[-1]), lr=lr)
    elif parallel == "fsdp":
        net = FSDP(model, compute_dtype=dtype)
        opt = torch.optim.AdamW(net.parameters(), lr=lr)
    else:
        raise ValueError(f"--parallel must be one of {PARALLEL}, got {parallel!r}")
    losses = []
    for step, (x, y) in enumerate(training_batches(batch, seq_len, steps)):
        rows = slice(rank * batch // world, (rank + 1) * batch // world)  # this rank's rows
        _, loss = net(x[rows].to(device), y[rows].to(device))
        loss.backward()
        if hasattr(net, "finish_gradient_synchronization"):
            net.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0 and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def train_nd(dims, cfg, steps=20, batch=8, microbatches=1, schedule="1f1b", v=1, data="ddp", lr=3e-3,
             log_every=5):
    """The tiny GPT cut along every dimension of ``Mesh(**dims)`` by ``parallelize_nd``; AdamW on
    this rank's parameters (shards). Returns {"losses" (global, the same on every rank),
    "step_time" (median seconds, the first step and the measured one left out), "peaks" (every
    rank's peak bytes in step 1, by ``course_lib.memory.measure``)}."""
    import time

    from course_lib.memory import measure
    from course_lib.models import TinyGPT
    from course_lib.parallel import Mesh, parallelize_nd

    device = _device()
    net = parallelize_nd(TinyGPT(cfg, seed=0).to(device), Mesh(**dims), microbatches=microbatches,
                         schedule=schedule, v=v, data=data)
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    held = torch.nn.ModuleList(net.modules.values())           # this rank's stages (or FSDP units)
    losses, times, peak = [], [], 0

    def one_step(x, y):
        losses.append(net.step(x.to(device), y.to(device)))    # the global batch; every rank takes its part
        opt.step()

    for step, (x, y) in enumerate(training_batches(batch, cfg.seq_len, steps)):
        t0 = time.perf_counter()
        if step == 1:                # optimizer state exists from here: a steady step's peak
            peak = measure(lambda: one_step(x, y), held, opt).peak
        else:
            one_step(x, y)
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step > 1 or steps == 1:
            times.append(time.perf_counter() - t0)
        if dist.get_rank() == 0 and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.6f}", flush=True)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    return {"losses": losses, "step_time": sorted(times)[len(times) // 2] if times else None, "peaks": peaks}


def default_microbatches(batch, dp, pp, schedule="1f1b"):
    """With pp > 1, enough micro-batches for the pipeline to pipeline: the most that divide each
    replica's batch, up to 4 pp (Megatron's m >= 4p; bubble (p-1)/(m+p-1)), in equal rounds
    for the interleaved schedule (torch's: max(1, m // pp) of them). 1 without a pipeline."""
    rows = batch // dp if batch % dp == 0 else 0
    fits = [m for m in range(1, min(rows, 4 * pp) + 1) if rows % m == 0 and
            (m % max(1, m // pp) == 0 or "interleaved" not in schedule.lower())]
    return max(fits) if pp > 1 and fits else 1


def one_device_check(cfg, dims, batch, microbatches, steps, lr, losses):
    """The same run on one device (course_lib.reference): the first step's loss within the bound
    of ``course_lib.tolerance`` (fp32, one step), and the largest loss difference over the run."""
    from course_lib import reference, tolerance
    from course_lib.models import TinyGPT

    model = TinyGPT(cfg, seed=0)
    for block in model.blocks:     # MoE: one routing group per DP replica's micro-batch, as the ranks
        if hasattr(block.mlp, "aux_weight"):
            block.mlp.groups = dims["dp"] * microbatches
    _, want = reference.train_gpt(model, training_batches(batch, cfg.seq_len, steps),
                                  torch.optim.AdamW(model.parameters(), lr=lr), micro=dims["dp"] * microbatches)
    first = tolerance.compare(losses[:1], want[:1], dtype=torch.float32)
    worst = max(abs(a - b) for a, b in zip(losses, want))
    return (f"one device: first loss within {first.bound:.1e}: {first.ok}; "
            f"largest loss difference over {steps} steps {worst:.1e}")


def _parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mesh = p.add_argument_group("mesh mode (parallelize_nd)")
    for d, what in (("dp", "data parallel"), ("pp", "pipeline stages"), ("cp", "context parallel"),
                    ("tp", "tensor parallel"), ("ep", "expert parallel, inside dp (needs --experts)")):
        mesh.add_argument(f"--{d}", type=int, default=None, help=f"{what} degree (default 1)")
    mesh.add_argument("--microbatches", type=int, default=None,
                      help="per DP replica and step (default: 1, with --pp > 1 enough to pipeline)")
    mesh.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved (with --v) or zb-h1")
    mesh.add_argument("--v", type=int, default=1, help="virtual stages per pp rank (interleaved)")
    mesh.add_argument("--data", default="ddp", help="ddp (gradient sums) or fsdp (sharded over dp x cp)")
    mesh.add_argument("--experts", type=int, default=0, help="MoE variant: experts per block (0: dense)")
    mesh.add_argument("--top-k", type=int, default=2, help="experts per token (MoE variant)")
    p.add_argument("--parallel", choices=PARALLEL, nargs="+", default=None,
                   help="data parallel only, one or more strategies trained one after the other")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks to start (ignored under torchrun; mesh mode: the product of the dimensions)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--check", action="store_true", help="mesh mode: compare the losses with one device")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32",
                   help="FSDP compute dtype with --parallel fsdp (master weights stay fp32)")
    return p


def _fail(message):
    """A bad layout or argument: one clean line (rank 0 alone under torchrun), status 2. The other
    ranks wait a moment first, so rank 0 prints before torchrun stops them (torchrun then adds
    its own failure summary, naming rank 0's exit code 2)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(2)
    sys.exit(2)


def _is_rank0():
    return not under_torchrun() or dist.get_rank() == 0


def _positive(args, names):
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def main(argv=None):
    args = _parser().parse_args(argv)
    torchrun_world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else None
    _positive(args, MESH_DIMS + ("nproc", "steps", "batch", "seq_len", "hidden", "layers", "log_every"))
    given = [d for d in MESH_DIMS if getattr(args, d) is not None]
    if args.parallel is not None:
        if given:
            _fail(f"--parallel (data parallel only) and the mesh flags ({', '.join('--' + d for d in given)}) "
                  f"are two modes: use one")
        return _main_data_parallel(args, torchrun_world)
    if args.dtype != "fp32":
        _fail("--dtype applies to --parallel fsdp; the mesh mode trains in fp32")
    dims = {d: getattr(args, d) or 1 for d in MESH_DIMS}
    if not given:  # no layout named: every rank data parallel
        dims["dp"] = torchrun_world or args.nproc or 2
    m = args.microbatches or default_microbatches(args.batch, dims["dp"], dims["pp"], args.schedule)
    try:
        from course_lib.parallel import check_layout

        cfg = gpt_config(args.seq_len, args.hidden, args.layers, args.experts, args.top_k)
        shape = check_layout(cfg, **dims, world_size=torchrun_world, batch=args.batch,
                             microbatches=m, schedule=args.schedule, v=args.v, data=args.data)
        if torchrun_world is None and args.nproc is not None and args.nproc != shape.world_size:
            raise ValueError(f"--nproc {args.nproc}, but the layout dp*pp*cp*tp has {shape.world_size} ranks "
                             f"(leave --nproc out in mesh mode)")
    except ValueError as exc:  # before any rank starts or joins a process group
        _fail(str(exc))
    mesh_dims = {d: dims[d] for d in MESH_DIMS}
    out = launch(train_nd, None if under_torchrun() else shape.world_size, mesh_dims, cfg,
                 steps=args.steps, batch=args.batch, microbatches=m, schedule=args.schedule,
                 v=args.v, data=args.data, lr=args.lr, backend=args.backend, log_every=args.log_every,
                 timeout=600)[0]
    if _is_rank0():
        losses, t = out["losses"], out["step_time"]
        if t:
            print(f"step time {t * 1e3:.1f} ms (median), {args.batch * cfg.seq_len / t:,.0f} tokens/s", flush=True)
        print("peak memory per rank (step 1, MiB): " + " ".join(f"{b / 2**20:.1f}" for b in out["peaks"]))
        if args.check:
            print(one_device_check(cfg, dims, args.batch, m, args.steps, args.lr, losses), flush=True)
        moe = f", {cfg.n_experts} experts top-{cfg.top_k}" if cfg.n_experts else ""
        print(f"{shape.describe()} ({args.data}, {args.schedule}, {m} microbatches{moe}): "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps", flush=True)


def _main_data_parallel(args, torchrun_world):
    world = torchrun_world or args.nproc or 2
    if args.batch % world:
        _fail(f"--batch ({args.batch}) must be divisible by the number of ranks ({world})")
    dtype = DTYPES[args.dtype]
    for parallel in args.parallel:
        losses = launch(train, None if under_torchrun() else world, parallel, steps=args.steps, batch=args.batch,
                        seq_len=args.seq_len, hidden=args.hidden, layers=args.layers, lr=args.lr, dtype=dtype,
                        backend=args.backend, log_every=args.log_every, timeout=600)[0]
        if _is_rank0():
            print(f"{parallel}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps "
                  f"on {world} ranks", flush=True)


if __name__ == "__main__":
    main()
