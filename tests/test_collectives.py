"""course_lib.collectives against the definition of each collective, on 1..8 real ranks.

One launch per world size runs a battery of cases inside the ranks (launching is
the slow part); every rank builds its inputs from (seed, rank), so each rank can
compute the expected answer alone. Results of all-reduce must also agree bit for
bit across ranks (it is the same sum, not N similar ones).
"""
import hashlib

import pytest
import torch

from course_lib import launch, tolerance
from course_lib import collectives as C
from course_lib.collectives import ring_schedule, simulate_ring_all_reduce

R = C.ReduceOp
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)


def make(rank, numel, dtype, seed=0, positive=False):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        x = torch.rand(numel, generator=g, dtype=torch.float64) + 0.5 if positive else \
            torch.randn(numel, generator=g, dtype=torch.float64)
        return x.to(dtype)
    return torch.randint(1, 3, (numel,), generator=g) if positive else torch.randint(-50, 50, (numel,), generator=g)


def expected_reduce(xs, op):
    stack = torch.stack([x.double() if x.is_floating_point() else x for x in xs])
    out = {R.SUM: lambda s: s.sum(0), R.AVG: lambda s: s.mean(0), R.MAX: lambda s: s.max(0).values,
           R.MIN: lambda s: s.min(0).values, R.PRODUCT: lambda s: s.prod(0)}[op](stack)
    return out.to(xs[0].dtype)


def close(got, xs, op=R.SUM, part=slice(None)):
    """``got`` against the exact reduction of ``xs`` (its elements ``part``): integers, MAX and
    MIN exactly; sums within N-1 additions' rounding (+ AVG's division, + the expected
    value's own rounding to the dtype) of sum |x_i|; products within as many relative
    roundings of the result (course_lib.tolerance)."""
    want = expected_reduce(xs, op)[part]
    if not want.is_floating_point() or op in (R.MAX, R.MIN):
        return torch.equal(got, want)
    terms = sum(x.double().abs() for x in xs)[part] if op in (R.SUM, R.AVG) else want.double().abs()
    scale = float(terms.max()) / (len(xs) if op == R.AVG else 1) if terms.numel() else 0.0
    return bool(tolerance.compare(got, want, dtype=want.dtype, terms=len(xs) + 1, scale=scale))


def digest(t):
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:12]


def battery():
    """Run every case on this rank; return (failures, digests of all-reduce results)."""
    import torch.distributed as dist

    r, N = dist.get_rank(), dist.get_world_size()
    fails, digests = [], []

    def want(ok, label):
        if not ok:
            fails.append(f"rank {r}: {label}")

    case = 0
    ops_of = {torch.float32: [R.SUM, R.AVG, R.MAX, R.MIN, R.PRODUCT], torch.float64: [R.SUM],
              torch.bfloat16: [R.SUM, R.AVG], torch.int64: [R.SUM, R.MAX, R.PRODUCT]}
    for dtype in DTYPES:
        ops = ops_of[dtype]
        for numel in (0, 1, 2 * N + 3):
            for op in ops:
                for algo in ("ring", "recursive_doubling", "naive", "serialized_ring"):
                    if algo in ("naive", "serialized_ring") and (op != R.SUM or numel != 2 * N + 3):
                        continue
                    case += 1
                    pos = op == R.PRODUCT
                    xs = [make(q, numel, dtype, case, pos) for q in range(N)]
                    # a non-contiguous view for odd-sized float cases: (cols, rows).t()
                    if numel == 2 * N + 3 and dtype.is_floating_point:
                        buf = torch.zeros(numel, 2, dtype=dtype)
                        buf[:, 0] = xs[r]
                        x = buf[:, 0]                  # stride 2
                        assert not x.is_contiguous()
                    else:
                        x = xs[r].clone()
                    C.all_reduce(x, op, algorithm=algo)
                    want(close(x, xs, op), f"all_reduce {algo} {dtype} n={numel} {op}")
                    if not x.is_contiguous():
                        want(not buf[:, 1].any(), "all_reduce wrote outside a non-contiguous view")
                    digests.append(digest(x))
        # reduce-scatter / all-gather, tensor form (N equal pieces) and list form (uneven pieces)
        for algo in ("ring", "naive"):
            case += 1
            k = 3
            xs = [make(q, N * k, dtype, case) for q in range(N)]
            out = torch.empty(k, dtype=dtype)
            C.reduce_scatter_tensor(out, xs[r].clone(), algorithm=algo)
            want(close(out, xs, R.SUM, slice(r * k, (r + 1) * k)), f"reduce_scatter_tensor {algo} {dtype}")
            full = torch.empty(N, k, dtype=dtype)
            C.all_gather_into_tensor(full, xs[r][:k].clone(), algorithm=algo)
            want(torch.equal(full, torch.stack([x[:k] for x in xs])), f"all_gather_into_tensor {algo} {dtype}")
        sizes = [q + 1 for q in range(N)]          # rank q's piece has q+1 elements
        case += 1
        xs = [make(q, sum(sizes), dtype, case) for q in range(N)]
        pieces = list(xs[r].split(sizes))
        out = torch.empty(sizes[r], dtype=dtype)
        C.reduce_scatter(out, pieces)
        want(close(out, xs, R.SUM, slice(sum(sizes[:r]), sum(sizes[:r + 1]))), f"reduce_scatter uneven {dtype}")
        got = [torch.empty(s, dtype=dtype) for s in sizes]
        C.all_gather(got, xs[r][:sizes[r]].clone())
        want(all(torch.equal(got[q], xs[q][:sizes[q]]) for q in range(N)), f"all_gather uneven {dtype}")
    # broadcast and reduce, every algorithm, a non-zero root, a non-contiguous tensor
    for algo in ("tree", "naive"):
        for root in {0, N - 1, N // 2}:
            case += 1
            xs = [make(q, 24, torch.float32, case) for q in range(N)]
            x = xs[r].clone().view(4, 6).t()
            C.broadcast(x, root, algorithm=algo)
            want(torch.equal(x, xs[root].view(4, 6).t()), f"broadcast {algo} root={root}")
            y = xs[r].clone()
            C.reduce(y, root, algorithm=algo)
            if r == root:
                want(close(y, xs), f"reduce {algo} root={root}")
            elif algo == "tree":
                want(torch.equal(y, xs[r]), f"tree reduce left a non-root input changed (root={root})")
    # scatter, gather, all-to-all with uneven splits, barrier
    for root in {0, N - 1}:
        pieces = [torch.full((q + 2,), float(q)) for q in range(N)]
        mine = torch.empty(r + 2)
        C.scatter(mine, pieces if r == root else None, src=root)
        want(torch.equal(mine, pieces[r]), f"scatter root={root}")
        got = [torch.empty(q + 2) for q in range(N)] if r == root else None
        C.gather(torch.full((r + 2,), float(r)), got, dst=root)
        if r == root:
            want(all(torch.equal(got[q], pieces[q]) for q in range(N)), f"gather root={root}")
    # rank r sends (r + j) % 3 + 1 rows of 2 to rank j
    send = [(r + j) % 3 + 1 for j in range(N)]
    recv = [(i + r) % 3 + 1 for i in range(N)]
    inp = torch.cat([torch.full((s, 2), 100.0 * r + j) for j, s in enumerate(send)])
    out = torch.empty(sum(recv), 2)
    C.all_to_all_single(out, inp, recv, send)
    exp = torch.cat([torch.full((s, 2), 100.0 * i + r) for i, s in enumerate(recv)])
    want(torch.equal(out, exp), "all_to_all_single uneven")
    C.barrier()
    return fails, digests


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8])
def test_collectives_match_their_definition(world_size):
    results = launch(battery, world_size, timeout=120, quiet=True)
    fails = [f for rank_fails, _ in results for f in rank_fails]
    assert not fails, "\n".join(fails[:20])
    first = results[0][1]
    for rank, (_, digests) in enumerate(results):
        assert digests == first, f"rank {rank}'s all-reduce results differ bit-wise from rank 0's"


def subgroups_and_counts():
    import torch.distributed as dist

    r, N = dist.get_rank(), dist.get_world_size()
    odd = dist.new_group([q for q in range(N) if q % 2])
    even = dist.new_group([q for q in range(N) if q % 2 == 0])
    mine = odd if r % 2 else even
    members = [q for q in range(N) if q % 2 == r % 2]
    x = torch.full((10,), float(r))
    C.all_reduce(x, group=mine)
    y = torch.full((5,), float(r))
    C.broadcast(y, src=members[-1], group=mine)     # src is a global rank, as in torch
    outside = C.all_reduce(torch.ones(3), group=odd) if r % 2 == 0 else "member"
    # byte counts of the ring: 2(N-1)/N * n per rank for all-reduce, (N-1)/N * n for RS and AG
    n = 12 * N
    counter = C.TrafficCounter()
    C.all_reduce(torch.ones(n), counter=counter)
    ar = counter.bytes_sent
    counter.reset()
    C.reduce_scatter_tensor(torch.empty(12), torch.ones(n), counter=counter)
    rs = counter.bytes_sent
    counter.reset()
    C.all_gather_into_tensor(torch.empty(n), torch.ones(12), counter=counter)
    ag = counter.bytes_sent
    from course_lib.collectives import measure
    gloo_ar = measure.bytes_sent_by(lambda: dist.all_reduce(torch.ones(n)))  # the kernel's count
    return x[0].item(), y[0].item(), outside, ar, rs, ag, gloo_ar


def test_subgroups_and_byte_counts():
    N = 5
    res = launch(subgroups_and_counts, N, quiet=True)
    for r, (x, y, outside, ar, rs, ag, gloo_ar) in enumerate(res):
        members = [q for q in range(N) if q % 2 == r % 2]
        assert x == sum(members) and y == members[-1]
        assert outside is None if r % 2 == 0 else outside == "member"
        n_bytes = 12 * N * 4
        assert ar == 2 * (N - 1) * n_bytes // N and rs == ag == (N - 1) * n_bytes // N
        assert gloo_ar is None or ar <= gloo_ar < ar + 4096   # gloo's ring: same payload + headers


def torch_conventions():
    """The same calls, spelled as torch spells them, to ours and to torch.distributed."""
    import torch.distributed as dist

    r, N = dist.get_rank(), dist.get_world_size()
    high = dist.new_group(list(range(1, N)))          # global ranks 1..N-1: group rank = global - 1
    out = {}
    for name, lib in (("ours", C), ("torch", dist)):
        got = {}
        x = torch.arange(4.) + r
        work = lib.all_reduce(x, R.SUM, None, True)    # positional async_op, as in torch
        got["handle"] = (work.wait(), work.is_completed())
        got["all_reduce"] = x.tolist()
        x = torch.arange(4.) + r
        got["sync"] = lib.all_reduce(x, async_op=False) is None if lib is dist else True
        y = torch.full((3,), float(r))
        if r:                                            # group_src: a rank of the group
            lib.broadcast(y, group=high, group_src=1)
            got["group_src"] = y.tolist()
        z = torch.full((2,), float(r + 1))
        lib.reduce(z, group_dst=0, async_op=True).wait()
        got["group_dst"] = z.tolist() if r == 0 else None
        piece = torch.empty(2)
        lib.scatter(piece, [torch.full((2,), float(q)) for q in range(N)] if r == 0 else None)   # default root: 0
        got["scatter"] = piece.tolist()
        o = torch.empty(N * 2)
        w = lib.all_gather_into_tensor(o, torch.full((2,), float(r)), async_op=True)
        w.wait()
        got["all_gather_into_tensor"] = o.tolist()
        lib.barrier(async_op=True).wait()
        out[name] = got
    errors = []
    for call in (lambda: C.broadcast(torch.zeros(2), src=0, group_src=0),
                 lambda: C.broadcast(torch.zeros(2)),
                 lambda: C.all_reduce(torch.zeros(2), async_op="yes")):
        try:
            call()
            errors.append("no error")
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    return out, errors


def test_torch_calling_conventions():
    """async_op (positional or keyword) returns a completed handle; group_src/group_dst name
    a rank of the group; scatter's root defaults to rank 0: as torch.distributed does."""
    for r, (out, errors) in enumerate(launch(torch_conventions, 3, timeout=60, quiet=True)):
        assert out["ours"] == out["torch"], (r, out)
        assert out["ours"]["handle"] == (True, True)
        both, neither, bad_async = errors
        assert "not both" in both and "group_src" in neither and "async_op must be True or False" in bad_async


def bad_inputs():
    import torch.distributed as dist

    r = dist.get_rank()
    msgs = []

    def expect(fn, *a, **k):
        try:
            fn(*a, **k)
        except (ValueError, TypeError) as exc:
            msgs.append(f"{type(exc).__name__}: {exc}")
        else:
            msgs.append("no error")

    expect(C.all_reduce, torch.zeros(4 if r != 2 else 5))                         # shape
    expect(C.all_reduce, torch.zeros(4, dtype=torch.float64 if r == 1 else torch.float32))
    expect(C.all_reduce, torch.zeros(4), op=R.MAX if r == 0 else R.SUM)           # op
    expect(C.broadcast, torch.zeros(4), src=r % 2)                                # root
    expect(C.all_reduce, torch.zeros(4), op=R.PREMUL_SUM)                         # unsupported op
    expect(C.all_reduce, torch.zeros(4, dtype=torch.complex64))                   # unsupported dtype
    expect(C.all_reduce, torch.zeros(4, dtype=torch.int64), op=R.AVG)
    expect(C.all_reduce, torch.zeros(4), algorithm="bogus")
    expect(C.reduce_scatter_tensor, torch.empty(3), torch.zeros(7))
    expect(C.all_gather, [torch.empty(2) for _ in range(3)], torch.zeros(2 + (r == 1)))
    expect(C.all_to_all_single, torch.empty(3), torch.zeros(3), [1, 1, 1], [1, 1, 1] if r else [0, 1, 2])
    C.all_reduce(torch.zeros(2))  # the group still works after all those errors
    return msgs


def test_bad_input_is_a_clear_error_on_every_rank_not_a_hang():
    res = launch(bad_inputs, 3, timeout=60, quiet=True)
    for r, msgs in enumerate(res):
        shape, dtype, op, root, premul, cplx, avg_int, algo, rs, ag, a2a = msgs
        assert shape.startswith("ValueError") and "ranks 0, 1: float32 (4,); rank 2: float32 (5,)" in shape
        assert "rank 1: float64 (4,)" in dtype
        assert "rank 0: MAX" in op and "ranks 1, 2: SUM" in op
        assert "different roots" in root
        assert "PREMUL_SUM is not supported" in premul
        assert "complex64" in cplx and "not support" in cplx
        assert "AVG needs a floating-point dtype" in avg_int
        assert "unknown algorithm 'bogus'" in algo
        assert "world_size (3) x output" in rs
        assert "all_gather" in ag and ("sizes" in ag or "match" in ag)
        assert "rank 0 sends 0 elements to rank 0" in a2a or "expects" in a2a


def test_ring_schedule_and_symbolic_run():
    for N in (1, 2, 3, 4, 7):
        states = simulate_ring_all_reduce(N)
        assert len(states) == 2 * (N - 1) + 1
        end = states[-1]["holds"]
        assert all(h == frozenset(range(N)) for row in end for h in row)
        mid = states[N - 1]["holds"]  # after reduce-scatter, rank r owns chunk r
        assert all(mid[r][r] == frozenset(range(N)) for r in range(N))
        for s in range(N - 1):  # every chunk is on the wire exactly once per step
            assert sorted(ring_schedule(N, "reduce_scatter", r, s)[0] for r in range(N)) == list(range(N))
    with pytest.raises(ValueError):
        ring_schedule(4, "broadcast", 0, 0)


# ----------------------------------------------------------------------------- the graders


def _whole_buffer_ring(tensor):
    """Correct sums, but the whole buffer goes around: the byte check must catch it."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    total, cur, buf = tensor.clone(), tensor.clone(), torch.empty_like(tensor)
    for _ in range(world - 1):
        reqs = [dist.isend(cur, (rank + 1) % world), dist.irecv(buf, (rank - 1) % world)]
        for q in reqs:
            q.wait()
        total += buf
        cur = buf.clone()
    tensor.copy_(total)


def _deadlocking_ring(tensor):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dist.recv(tensor, (rank - 1) % world)   # everyone waits to receive first
    dist.send(tensor, (rank + 1) % world)


def test_graders_name_the_mistake_in_one_line(capsys):
    from course_lib.grading import collective_algorithms as G

    assert not G.check_ring_all_reduce(_whole_buffer_ring)
    line = capsys.readouterr().out.strip()
    assert line.startswith("ring_all_reduce: FAILED case") and "not the whole buffer" in line
    assert "\n" not in line
    assert not G.check_ring_all_reduce(_deadlocking_ring, timeout=4)
    line = capsys.readouterr().out.strip()
    assert "deadlock: rank 0 waits in recv from rank 1, called from _deadlocking_ring()" in line
    assert "rank 1 waits in recv from rank 0" in line


def test_fit_grader_accepts_the_relative_least_squares(capsys):
    import numpy as np

    from course_lib.grading import collective_algorithms as G

    def fit(ms):
        rows = [[2 * (N - 1) / t, 2 * (N - 1) / N * n / t] for n, N, t in ms]
        return tuple(np.linalg.lstsq(np.array(rows), np.ones(len(rows)), rcond=None)[0])

    assert G.check_fit_alpha_beta(fit)
    assert capsys.readouterr().out.strip() == "fit_alpha_beta: 6/6 cases passed"
    assert not G.check_fit_alpha_beta(lambda ms: (0.0, 1e-9))


def segmented_vs_unsegmented():
    """The segmented ring against the unsegmented one: bitwise the same, more and smaller messages."""
    import torch.distributed as dist

    from course_lib.collectives import ring

    r, N = dist.get_rank(), dist.get_world_size()
    same, counts = [], {}
    for numel in (0, 1, 2 * N + 3, 1000 * N + 7):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            x = make(r, numel, dtype, seed=7)
            for op in (R.SUM, R.MAX) + ((R.AVG,) if dtype.is_floating_point else ()):
                outs = []
                for seg in (None, 256, 1000):                  # one segment; many; a few, uneven
                    y = x.clone()
                    ring.all_reduce(y, op, segment_bytes=seg)
                    outs.append(y)
                same.append(all(torch.equal(o, outs[0]) for o in outs))
            sizes = [numel + q for q in range(N)]             # uneven pieces
            pieces = [make(r, s, dtype, seed=8 + q) for q, s in enumerate(sizes)]
            got = []
            for seg in (None, 256):
                out = torch.empty(sizes[r], dtype=dtype)
                ring.reduce_scatter(out, [p.clone() for p in pieces], segment_bytes=seg)
                gathered = [torch.empty(s, dtype=dtype) for s in sizes]
                ring.all_gather(gathered, pieces[r], segment_bytes=seg)
                got.append((out, gathered))
            same.append(torch.equal(got[0][0], got[1][0]) and all(map(torch.equal, got[0][1], got[1][1])))
    for seg in (None, 1000):                                  # 1000 floats per chunk: 4 KB
        counter = C.TrafficCounter()
        ring.all_reduce(torch.ones(1000 * N), segment_bytes=seg, counter=counter)
        counts[seg] = (counter.messages_sent, counter.bytes_sent)
    return all(same), counts


@pytest.mark.parametrize("N", [2, 3, 5])
def test_segmented_ring_is_bitwise_the_unsegmented_ring(N):
    for ok, counts in launch(segmented_vs_unsegmented, N, quiet=True):
        assert ok
        # 4 segments of 1000 B per chunk: 4x the messages, the same bytes
        assert counts[None] == (2 * (N - 1), 2 * (N - 1) * 4000)
        assert counts[1000] == (2 * (N - 1) * 4, 2 * (N - 1) * 4000)


def test_contiguous_flat_writes_back_a_copy_and_yields_a_flat_tensor_as_it_is():
    """core.contiguous_flat: a non-contiguous tensor is worked on in a contiguous copy, written
    back on exit (not after an error); a 1-D contiguous tensor is yielded itself, others as a view."""
    from course_lib.collectives.core import contiguous_flat, contiguous_flats

    t = torch.arange(12.).reshape(3, 4).t()                     # not contiguous
    with contiguous_flat(t) as flat:
        assert flat.shape == (12,) and flat.is_contiguous()
        flat.mul_(2)
    assert torch.equal(t, torch.arange(12.).reshape(3, 4).t() * 2)
    with pytest.raises(RuntimeError), contiguous_flat(t) as flat:
        flat.zero_()
        raise RuntimeError("inside")
    assert torch.equal(t, torch.arange(12.).reshape(3, 4).t() * 2)   # the copy was not written back
    u, m = torch.arange(6.), torch.zeros(2, 3)
    with contiguous_flat(u) as flat, contiguous_flat(m) as flat_m:
        assert flat is u and flat_m.shape == (6,) and flat_m.data_ptr() == m.data_ptr()
    with contiguous_flats([t, u]) as flats:
        assert [f.shape for f in flats] == [(12,), (6,)]
