"""course_lib.virtual.megatron_p2p: Megatron-LM's pipeline exchange (``"megatron_p2p"``, stated for
Narayanan's and Korthikanti's rows in lab.dry_runs.SOFTWARE) on the course's pipeline runner:
the pieces of 1/t, the blocking waits, the host synchronised, the gather over the tensor-parallel
group. On gloo the values equal the default exchange's bit for bit; the dry run prices it as a
real launch of the same layout on the virtual clock."""
import types

import pytest
import torch

import course_lib
from course_lib.layout import Layout
from course_lib.planner.presets import gpt_spec
from course_lib.virtual import VirtualCluster, dry_run
from course_lib.virtual.megatron_p2p import MegatronP2P, piece_of, splits

STEPS = 2
SOFTWARE = ("megatron_p2p",)
# micro-batch 3 of 7 tokens (odd), hidden 16: an activation of 3 * 7 * 16 = 336 elements,
# 168 per tp rank; interleaved: 6 micro-batches of (1, 7, 16), a steady state (m > p);
# sequence parallelism: (3, 4, 16) per rank, sent whole
LAYOUTS = {"1f1b": (Layout(tp=2, pp=2, micro_batch=3, global_batch=6), 7),
           "interleaved": (Layout(tp=2, pp=2, schedule="interleaved", v=2, micro_batch=1, global_batch=6), 7),
           "sp": (Layout(tp=2, pp=2, sp=True, micro_batch=3, global_batch=6), 8)}


def train_tiny_gpt(layout, seq, software):
    """STEPS AdamW steps of a 4-layer GPT on this rank: losses, first-step gradients, shards, span names."""
    from course_lib import reference, trace
    from course_lib.gpt import GPTConfig, TinyGPT
    from course_lib.parallel.compose import parallelize_nd
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.software import install_runtime
    cfg = GPTConfig(vocab_size=32, seq_len=seq, n_layers=4, hidden=16, n_heads=2, dropout=0.0)
    net = parallelize_nd(TinyGPT(cfg, seed=0), Mesh.from_layout(layout), layout)
    install_runtime(net, software)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    trace.reset()
    losses, grads = [], None
    for x, y in reference.gpt_batches(cfg, batch=layout.global_batch, steps=STEPS):
        opt.zero_grad()
        losses.append(net.step(x, y))
        if grads is None:
            grads = {n: g.clone() for n, (g, _) in net.shards(grads=True).items()}
        opt.step()
    shards = {n: t.detach().clone() for n, (t, _) in net.shards().items()}
    return losses, grads, shards, [s.name for s in trace.spans()], len(net.runner.sends)


def _transport():
    """Megatron's exchange alone, pp rank 0 -> 1 on each tp rank: 20 elements (10 per rank, the
    pieces gathered) and 21 (odd: whole), then a gradient back. What each receiver got."""
    from course_lib import trace
    from course_lib.parallel.mesh import Mesh
    mesh = Mesh(tp=2, pp=2)
    runner = types.SimpleNamespace(comm=mesh.comm("pp"), blocking_sends=False, n=2, p=2)   # (2 stages, v 1)
    p2p = MegatronP2P(runner, mesh.comm("tp"))
    trace.reset()
    got, pp = [], mesh.coord["pp"]
    for n in (20, 21):
        sent = torch.arange(n, dtype=torch.float32).reshape(1, n) + 100 * n
        buf = torch.full((1, n), -1.0)
        if pp == 0:
            p2p.isend(sent, 1, tag=n).wait()
            p2p.irecv(buf, 1, tag=n + 1).wait()          # the gradient, back
        else:
            p2p.irecv(buf, 0, tag=n).wait()
            p2p.isend(sent * 2, 0, tag=n + 1).wait()
        got.append(torch.equal(buf, sent * (2 if pp == 0 else 1)))
    return got, [s.name for s in trace.spans() if s.name == "all-gather p2p"], runner.blocking_sends


def _values():
    out = {"transport": _transport()}
    for name, (layout, seq) in LAYOUTS.items():
        out[name] = (train_tiny_gpt(layout, seq, ()), train_tiny_gpt(layout, seq, SOFTWARE))
    return out


@pytest.fixture(scope="module")
def values():
    return course_lib.launch(_values, 4, timeout=240)


def test_pieces_and_gather_move_the_whole_tensor(values):
    """One 20-element message in two pieces of 10, gathered (once per receive, on both tp
    ranks); 21 elements (t does not divide them) whole, as Megatron-LM 55ba1f7b does."""
    for rank, out in enumerate(values):
        got, gathers, blocking = out["transport"]
        assert got == [True, True], rank
        assert len(gathers) == 1 and blocking, rank          # 20 in pieces: one gather; 21 whole
    t = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(torch.cat([piece_of(t, r, 3) for r in range(3)]), t.reshape(-1))
    assert splits(t, 3, True) and not splits(t, 5, True) and not splits(t, 3, False) and not splits(t, 1, True)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_megatron_exchange_trains_bit_for_bit_as_the_default_one(values, name):
    """tp 2 x pp 2 (1F1B, interleaved v 2, sequence parallel), 2 AdamW steps: losses, the first
    step's gradients and the weights equal the default exchange's, bit for bit (the same bytes
    arrive); the pieces are gathered (not under sequence parallelism), no send left for the end."""
    for rank, out in enumerate(values):
        (l0, g0, s0, spans0, _), (l1, g1, s1, spans1, left) = out[name]
        assert l0 == l1, (name, rank)
        assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0), (name, rank)
        assert all(torch.equal(s0[k], s1[k]) for k in s0), (name, rank)
        gathers = sum(n == "all-gather p2p" for n in spans1)
        assert "all-gather p2p" not in spans0 and left == 0
        assert (gathers == 0) if name == "sp" else (gathers > 0), (name, rank, gathers)


def megatron_interleaved(p: int, m: int, v: int, r: int) -> list:
    """Megatron-LM's interleaved schedule on pipeline rank ``r`` (de7dc40 megatron/schedules.py
    L141-360, restated): its forwards, backwards and sends in order, named as the course's runner
    names its spans. Warm-up: (p - r - 1) * 2 + (v - 1) * p forwards (all of them if m = p), each
    sending at once; steady state: a forward, a backward, then one exchange sending both; cool-down:
    each backward sending at once. Microbatch k runs chunk (k mod pv) // p (backward: reversed)."""
    total, n = m * v, p * v
    warm = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
    out = []

    def run(op, k):
        c = (k % n) // p
        s, mb = (c if op == "F" else v - 1 - c) * p + r, (k // n) * p + k % p
        out.append(f"{op}{mb}" + (f"@{s}" if s else ""))
        return s, mb

    def send(kind, s, mb):
        if (kind == "act" and s < n - 1) or (kind == "grad" and s > 0):
            out.append(f"send {kind} {mb}")
    for k in range(warm):
        send("act", *run("F", k))
    for k in range(total - warm):
        f = run("F", k + warm)
        send("grad", *run("B", k))
        send("act", *f)
    for k in range(total - warm, total):
        send("grad", *run("B", k))
    return out


def test_interleaved_exchanges_where_megatron_does(values):
    """tp 2 x pp 2, v 2, 6 micro-batches: every rank's forwards, backwards and sends come in the
    order of Megatron-LM's interleaved schedule (a steady-state forward's activation leaves after
    the next backward's gradient); the default exchange sends each at once (another order)."""
    import re
    event = re.compile(r"^(?:[FB]\d+(?:@\d+)?|send (?:act|grad) \d+)$")
    for rank, out in enumerate(values):
        (_, _, _, plain, _), (_, _, _, spans, _) = out["interleaved"]
        events = [n for n in spans if event.match(n)]
        expected = megatron_interleaved(2, 6, 2, rank // 2)
        assert events[:len(expected)] == expected, (rank, events[:len(expected)])   # step 1 of 2
        assert [n for n in plain if event.match(n)][:len(expected)] != expected, rank


SPEC, HW = gpt_spec("GPT test", 6, 64, 4, V=256, s=32), "a100-80gb"     # as tests/test_dry_run_software.py


def _real_rank(cfg, layout, software):
    from course_lib.parallel.mesh import Mesh
    from course_lib.virtual.dry_run import train_step
    return train_step(cfg, layout, Mesh.from_layout(layout), fusions=software)


def test_dry_run_prices_megatrons_exchange_as_a_real_launch():
    """tp 2 x pp 2, interleaved v 2, 4 micro-batches, two GPUs a node (each tp pair on NVLink,
    every pipeline hop over the network): the dry run with Megatron's exchange gives the real
    4-rank launch's step to the bit. Each piece is half the activation's bytes; every receive
    ends in a gather; at a compute-bound shape the blocking exchange costs time."""
    from course_lib.virtual.dry_run import model_config
    layout = Layout(tp=2, pp=2, schedule="interleaved", v=2, micro_batch=1, global_batch=4)
    software = ("scale_mask_softmax",) + SOFTWARE
    real = course_lib.launch(_real_rank, layout.n_gpus, model_config(SPEC, layout), layout, software,
                             clock=VirtualCluster(HW, gpus_per_node=2), timeout=180)
    r = dry_run(SPEC, HW, layout, fusions=software, gpus_per_node=2, progress=None)
    assert r.kernels == real[0]["kernels"] + real[2]["kernels"]
    assert r.step_time == max(x["t"] for x in real), (r.step_time, max(x["t"] for x in real))
    plain = dry_run(SPEC, HW, layout, fusions="scale_mask_softmax", gpus_per_node=2, progress=None)
    gathers = [s for s in r.spans if s.name == "all-gather p2p"]
    receives = [s for s in r.spans if s.name.startswith("recv from")]
    assert len(gathers) == len(receives) == 2 * (2 * 2 - 1) * 4      # 3 boundaries, F and B, 4 micro-batches
    sends = lambda run: sorted(s.end - s.start for s in run.spans if s.name.startswith("send to"))
    assert all(a < b for a, b in zip(sends(r), sends(plain)))        # 1/2 of the bytes on the wire
    # Megatron's timers: a synchronised host at every pass and exchange, priced as a real launch
    timed = software + ("megatron_timers",)
    real = course_lib.launch(_real_rank, layout.n_gpus, model_config(SPEC, layout), layout, timed,
                             clock=VirtualCluster(HW, gpus_per_node=2), timeout=180)
    t = dry_run(SPEC, HW, layout, fusions=timed, gpus_per_node=2, progress=None)
    assert t.step_time == max(x["t"] for x in real) and t.kernels == r.kernels
    assert t.step_time > r.step_time, (t.step_time, r.step_time)
    with pytest.raises(ValueError, match="give 'megatron_p2p' with it"):
        dry_run(SPEC, HW, layout, fusions=("megatron_timers",))
    wide = gpt_spec("GPT wide", 4, 2048, 16, V=256, s=2048)
    lay = Layout(tp=2, pp=2, micro_batch=1, global_batch=4)
    assert dry_run(wide, HW, lay, fusions=software, progress=None).step_time > \
        dry_run(wide, HW, lay, fusions="scale_mask_softmax", progress=None).step_time


def test_a_rank_with_only_warm_up_forwards_sends_each_at_once():
    """m = p: on the first ranks every forward is a warm-up one (m v chunks within Megatron's
    warm-up count), and Megatron sends each activation at once (send_forward_recv_forward),
    never after a backward. Holding the last one for the first backward deadlocked the next
    stage (pp 4, v 2, m 4 hung before 2026-11-29): the run must finish."""
    import threading

    spec = gpt_spec("GPT test", 8, 64, 4, V=256, s=32)
    layout = Layout(tp=2, pp=4, sp=True, schedule="interleaved", v=2, global_batch=4)
    done = []
    run = threading.Thread(target=lambda: done.append(
        dry_run(spec, HW, layout, progress=None, fusions=("megatron_p2p",))), daemon=True)
    run.start()
    run.join(120)
    assert done and done[0].step_time > 0, "the dry run did not finish in 120 s: a deadlock"
