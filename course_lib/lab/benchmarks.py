"""Step timings of our parallel layers next to torch's built-ins, run inside a launch.

The rank functions that both a notebook (chapter 5's side-by-side cell) and the command-line
benchmarks (``benchmarks/tensor_parallel.py``) call, so a notebook needs nothing but the
installed ``course_lib`` (in Colab there is no ``benchmarks/`` folder next to it).
"""
from __future__ import annotations

import statistics
import time

TP_KINDS = ("ours TP", "torch TP", "ours TP+SP", "torch TP+SP")


def tensor_parallel_step_times(cfg, steps: int, rounds: int, batch: int) -> dict:
    """On each rank of a TP group: {kind: (median step seconds, bytes sent in one step or None)}.

    Four models from the same single-device TinyGPT weights: ours
    (``tp_plan.parallelize``) and torch's DTensor plan (``tp_plan.torch_parallelize``:
    torchtitan's Llama plan), each without and with sequence parallelism. A step is
    forward + backward (+ our SP norm-gradient sync) + AdamW. The kinds run in alternating
    rounds (ours, torch's, torch's, ours, ...) so machine noise hits both alike; a step's time
    is its slowest rank's. Bytes: what this process handed to the kernel in one step
    (``/proc/self/io``, every gloo message with its headers; None where /proc is missing).
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel

    from course_lib import trace
    from course_lib.collectives.measure import bytes_written
    from course_lib.models import TinyGPT
    from course_lib.parallel.mesh import Mesh
    from course_lib.parallel.tp_plan import parallelize, sync_tensor_parallel_grads, torch_parallelize

    t = dist.get_world_size()
    mesh = Mesh(tp=t)

    def build(kind):
        model, sp = TinyGPT(cfg, seed=0), kind.endswith("SP")
        model = parallelize(model, mesh, sequence_parallel=sp) if kind.startswith("ours") else \
            torch_parallelize(model, t, sp)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(0)  # the same batch on every rank: TP splits the model, not the data
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen) for _ in range(4)]

    def step(kind, model, opt, k):
        x = data[k % len(data)]  # (batch, seq + 1) token ids
        with loss_parallel():
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
        if kind.startswith("ours"):
            sync_tensor_parallel_grads(model)
        opt.step()
        opt.zero_grad()

    built = {k: build(k) for k in TP_KINDS}
    sent = {}
    for k, (model, opt) in built.items():  # warm-up, then one step's bytes
        for i in range(2):
            step(k, model, opt, i)
        dist.barrier()
        before = bytes_written()
        step(k, model, opt, 0)
        after = bytes_written()
        sent[k] = None if before is None else after - before
    times = {k: [] for k in TP_KINDS}
    for r in range(rounds):
        for k in (TP_KINDS if r % 2 == 0 else TP_KINDS[::-1]):
            model, opt = built[k]
            for i in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                step(k, model, opt, i)
                elapsed = torch.tensor(time.perf_counter() - t0)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
                times[k].append(elapsed.item())
    trace.reset()
    return {k: (statistics.median(times[k]), sent[k]) for k in TP_KINDS}


def tensor_parallel_layer_bytes(layers, modes) -> dict:
    """On each rank of a TP group: {(layer index, mode): bytes one Llama layer's forward +
    backward sends through our ring}, counted by the tp Comm. ``layers``: (seq_len, batch,
    hidden, n_heads, dtype) each; ``modes``: {name: (sequence_parallel, re-gathered in backward)}."""
    import torch
    import torch.distributed as dist

    from course_lib.models import GPTConfig, TinyGPT
    from course_lib.parallel import Mesh, parallelize

    mesh = Mesh(tp=dist.get_world_size(), impl="course")
    t, r, comm = mesh.sizes["tp"], mesh.coord["tp"], mesh.comm("tp")
    out = {}
    for k, (s, b, h, heads, dtype) in enumerate(layers):
        cfg = GPTConfig(seq_len=s, hidden=h, n_heads=heads, n_layers=1)
        for mode, (sp, regather) in modes.items():
            model = parallelize(TinyGPT(cfg, seed=0).to(dtype), mesh, sequence_parallel=sp, keep_gathered=not regather)
            x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(0)).to(dtype)
            x = (x.chunk(t, 1)[r] if sp else x).requires_grad_()
            comm.reset()
            with comm.measuring():
                model.blocks[0](x).sum().backward()
            out[(k, mode)] = comm.bytes_sent()
    return out
