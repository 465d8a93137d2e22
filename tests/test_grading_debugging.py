"""course_lib/grading/debugging.py: each chapter-11 grader fails the classic mistakes, a
hard-coded answer and a call to course_lib.debug (switched off), and passes a right answer
written differently from the solution; each find-and-fix grader (questions 6-9) refuses the
bug as given, the fixes that only silence its symptom and a hard-coded answer."""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from course_lib import tolerance
from course_lib.grading import debugging as G
from grading_answers import passed, refused


# ----------------------------------------------------------------------------- 1. merge
def _merge_zip_longest(calls):          # right, written differently
    out = {}
    groups = {c[0] for recs in calls.values() for c in recs}
    for g in groups:
        seqs = [[c[1:] for c in calls.get(m, ()) if c[0] == g] for m in g]
        for k, row in enumerate(itertools.zip_longest(*seqs), 1):
            if any(x != row[0] for x in row):
                out[g] = k
                break
    return out


def _merge_global_numbering(calls):     # the k-th call of every rank, whatever its group
    longest = max(len(v) for v in calls.values())
    for k in range(longest):
        here = {tuple(v[k][1:]) if k < len(v) else None for v in calls.values()}
        groups = {v[k][0] for v in calls.values() if k < len(v)}
        if len(here) > 1 or len(groups) > 1:
            return {min(groups): k + 1}
    return {}


def _merge_zip(calls):                   # zip stops at the shortest: "never reached" is missed
    out = {}
    for g in {c[0] for recs in calls.values() for c in recs}:
        seqs = [[c[1:] for c in calls.get(m, ()) if c[0] == g] for m in g]
        for k, row in enumerate(zip(*seqs), 1):
            if len(set(row)) > 1:
                out[g] = k
                break
    return out


def _merge_ops_only(calls):              # compares the op, not the shape
    return _merge_zip_longest({r: [(c[0], c[1], None) for c in v] for r, v in calls.items()})


def _merge_zero_based(calls):
    return {g: k - 1 for g, k in _merge_zip_longest(calls).items()}


def _merge_silent_members_ignored(calls):   # only ranks that recorded something
    out = {}
    for g in {c[0] for recs in calls.values() for c in recs}:
        seqs = [[c[1:] for c in calls[m] if c[0] == g] for m in g if calls.get(m)]
        for k, row in enumerate(itertools.zip_longest(*seqs), 1):
            if any(x != row[0] for x in row):
                out[g] = k
                break
    return out


def _merge_hard_coded(calls):
    return {}


def _merge_library(calls):
    from course_lib.debug.diagnosis import disagreements
    disagreements({})
    return {}


def test_merge(capsys):
    passed(capsys, G.check_divergence(_merge_zip_longest), "first_divergence: 9/9 cases passed")
    for wrong, hint in ((_merge_global_numbering, "expected"), (_merge_zip, "stopped after 3 calls"),
                        (_merge_ops_only, "another shape"), (_merge_zero_based, "from 1"),
                        (_merge_silent_members_ignored, "no record at all"), (_merge_hard_coded, "expected"),
                        (_merge_library, "write this yourself")):
        refused(capsys, "first_divergence", G.check_divergence(wrong), hint)


# ----------------------------------------------------------------------------- 2. fingerprint
def _fp_text(op, tensors):               # right, as one string
    dims = [list(t.shape)[1:] if op == "all_to_all_single" else list(t.shape) for t in tensors]
    return f"{op}|{dims}|{[t.dtype for t in tensors]}"


def _fp_values(op, tensors):             # the data itself: correct calls never agree
    return (op, tuple(float(t.sum()) for t in tensors))


def _fp_no_all_to_all_rule(op, tensors):
    return (op, tuple(tuple(t.shape) for t in tensors), tuple(t.dtype for t in tensors))


def _fp_no_dtype(op, tensors):
    return (op, tuple(tuple(t.shape)[1:] if op == "all_to_all_single" else tuple(t.shape) for t in tensors))


def _fp_no_op(op, tensors):
    return _fp_text(op, tensors).split("|", 1)[1]


def _fp_hard_coded(op, tensors):
    return 0


def _fp_library(op, tensors):
    from course_lib.debug.desync import fingerprint
    return fingerprint(op, tensors, "", "dp", [0, 1])


def test_fingerprint(capsys):
    passed(capsys, G.check_fingerprint(_fp_text), "fingerprint: 9/9 cases passed")
    for wrong, hint in ((_fp_values, "values"), (_fp_no_all_to_all_rule, "uneven all-to-all"),
                        (_fp_no_dtype, "another dtype"), (_fp_no_op, "another op"),
                        (_fp_hard_coded, "may not run together"), (_fp_library, "write this yourself")):
        refused(capsys, "fingerprint", G.check_fingerprint(wrong), hint)


# ----------------------------------------------------------------------------- 3. which reduction
def _groups(sizes):
    dp, cp = sizes["dp"], sizes["cp"]
    return {"cp": [[d * cp + c for c in range(cp)] for d in range(dp)],
            "dp": [[d * cp + c for d in range(dp)] for c in range(cp)]}


def _which_ratio(grads, reference, sizes, close=lambda a, b: bool(tolerance.compare(a, b))):
    """Right, written differently: a median ratio for the scale."""
    if all(close(g, reference) for g in grads.values()):
        return ("ok", None)
    for dim, sets in _groups(sizes).items():
        if any(not close(grads[s[0]], grads[m]) for s in sets for m in s) and \
                all(close(sum(grads[m] for m in s), reference) for s in sets):
            return ("missing", dim)
    ratios = torch.cat([(g.double() / reference.double()).flatten() for g in grads.values()])
    return ("scaled", float(ratios.median()))


def _which_exact(grads, reference, sizes):   # == instead of a rounding bound
    return _which_ratio(grads, reference, sizes, close=torch.equal)


def _which_no_replica_check(grads, reference, sizes):   # equal replicas of G/2 summed over dp: "missing"
    close = lambda a, b: bool(tolerance.compare(a, b))  # noqa: E731
    if all(close(g, reference) for g in grads.values()):
        return ("ok", None)
    for dim, sets in _groups(sizes).items():
        if all(close(sum(grads[m] for m in s), reference) for s in sets):
            return ("missing", dim)
    return _which_ratio(grads, reference, sizes)


def _which_groups_swapped(grads, reference, sizes):     # rank = cp_index * dp + dp_index: the wrong order
    swapped = {"dp": sizes["cp"], "cp": sizes["dp"]}
    got = _which_ratio(grads, reference, swapped)
    return got if got[0] != "missing" else ("missing", {"dp": "cp", "cp": "dp"}[got[1]])


def _which_hard_coded(grads, reference, sizes):
    return ("missing", "cp")


def _which_library(grads, reference, sizes):
    from course_lib.debug.bisect import explain
    explain({}, {}, None)


def test_which_reduction(capsys):
    passed(capsys, G.check_which_reduction(_which_ratio), "which_reduction: 14/14 cases passed")
    for wrong, hint in ((_which_exact, "ok"), (_which_no_replica_check, "0.5"),
                        (_which_groups_swapped, "missing"), (_which_hard_coded, "expected"),
                        (_which_library, "write this yourself")):
        refused(capsys, "which_reduction", G.check_which_reduction(wrong), hint)


# ----------------------------------------------------------------------------- 4. the first NaN
def _nan_pre_hooks(model, x):            # right, written differently: inputs seen on entry, outputs on exit
    entered, order = {}, []

    def pre(name):
        def hook(module, inputs):
            entered[name] = any(isinstance(t, torch.Tensor) and t.isnan().any() for t in inputs)
        return hook

    def post(name):
        def hook(module, inputs, output):
            if not entered[name] and output.isnan().any():
                order.append(name)
        return hook

    handles = [h for n, m in model.named_modules()
               for h in (m.register_forward_pre_hook(pre(n)), m.register_forward_hook(post(n)))]
    model(x)
    for h in handles:
        h.remove()
    return order[0] if order else None


def _nan_outputs_only(model, x):         # the first module whose output has a NaN, inputs unchecked
    order = []
    handles = [m.register_forward_hook(lambda mod, i, o, n=n: order.append(n) if o.isnan().any() else None)
               for n, m in model.named_modules()]
    model(x)
    for h in handles:
        h.remove()
    return order[0] if order else None


def _nan_isfinite(model, x):             # -inf counted as a NaN
    order = []
    handles = [m.register_forward_hook(
        lambda mod, i, o, n=n: order.append(n) if (not torch.isfinite(o).all()
                                                   and all(torch.isfinite(t).all() for t in i)) else None)
        for n, m in model.named_modules()]
    model(x)
    for h in handles:
        h.remove()
    return order[0] if order else None


def _nan_last(model, x):                 # where the symptom shows: the model's output
    return "" if model(x).isnan().any() else None


def _nan_library(model, x):
    from course_lib.debug.nonfinite import NonFiniteTracer
    with NonFiniteTracer():
        model(x)


def test_first_nan(capsys):
    passed(capsys, G.check_first_nan(_nan_pre_hooks), "first_nan_module: 4/4 cases passed")
    for wrong, hint in ((_nan_outputs_only, "1.inner.proj"), (_nan_isfinite, "got '1'"),
                        (_nan_last, "got ''"), (_nan_library, "write this yourself")):
        refused(capsys, "first_nan_module", G.check_first_nan(wrong), hint)


# ----------------------------------------------------------------------------- 5. find and fix
def _sync_flat(net, mesh):              # right, written differently: one flat buffer, one call
    grads = [p.grad for p in net.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    mesh.comm(("dp", "cp")).all_reduce(flat)
    for g, new in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(new.view_as(g))


def _sync_dp_only(net, mesh):           # the planted bug: the cp sum forgotten
    for p in net.parameters():
        mesh.comm("dp").all_reduce(p.grad)


def _sync_dp_then_barrier(net, mesh):   # the symptom silenced: nothing hangs, nothing is summed over cp
    import torch.distributed as dist
    _sync_dp_only(net, mesh)
    dist.barrier()


def _sync_world(net, mesh):             # every rank: summed over tp too (tp ranks hold the same rows)
    import torch.distributed as dist
    for p in net.parameters():
        dist.all_reduce(p.grad)


def _sync_mean(net, mesh):              # a mean where the loss is already divided by all rows
    for p in net.parameters():
        mesh.comm(("dp", "cp")).all_reduce(p.grad)
        p.grad /= mesh.size(("dp", "cp"))


def _sync_library(net, mesh):
    from course_lib.parallel.grad_sync import GradSync
    GradSync(net.parameters(), mesh, default_dims=("dp", "cp")).finish()


def test_sync_fix(capsys):
    passed(capsys, G.check_sync_fix(_sync_flat), "sync_gradients: 3/3 cases passed")
    for wrong, hint in ((_sync_dp_only, "dp=2, cp=2"), (_sync_dp_then_barrier, "sum over every rank"),
                        (_sync_world, "cp=2, tp=2"), (_sync_mean, "dp=2, cp=2"),
                        (_sync_library, "write this yourself")):
        refused(capsys, "sync_gradients", G.check_sync_fix(wrong), hint)


# ----------------------------------------------------------------------------- 6. pipeline exchange
def _exchange_twice(comm, output, input_grad):     # right, written differently: one ring step per direction
    r, last = comm.rank, comm.size - 1
    got_input = torch.empty_like(output) if r > 0 else None
    got_grad = torch.empty_like(output) if r < last else None
    comm.exchange(output if r < last else None, r + 1, got_input, r - 1)       # forward
    comm.exchange(input_grad if r > 0 else None, r - 1, got_grad, r + 1)      # backward
    return got_input, got_grad


def _exchange_both_send(comm, output, input_grad):  # the bug as given
    r, last = comm.rank, comm.size - 1
    got_input = got_grad = None
    if r < last:
        comm.send(output, r + 1)
    if r > 0:
        comm.send(input_grad, r - 1)
        got_input = torch.empty_like(output)
        comm.recv(got_input, r - 1)
    if r < last:
        got_grad = torch.empty_like(output)
        comm.recv(got_grad, r + 1)
    return got_input, got_grad


def _exchange_dropped(comm, output, input_grad):    # no message, no hang: zeros in their place
    r, last = comm.rank, comm.size - 1
    return (torch.zeros_like(output) if r > 0 else None), (torch.zeros_like(output) if r < last else None)


def _exchange_zeros_sent(comm, output, input_grad):  # the pattern kept, zeros on the wire
    return _exchange_twice(comm, torch.zeros_like(output), torch.zeros_like(input_grad))


def _exchange_forward_only(comm, output, input_grad):  # the backward message dropped, its own gradient kept
    got_input, _ = _exchange_twice(comm, output, input_grad)
    return got_input, (input_grad.clone() if comm.rank < comm.size - 1 else None)


def _exchange_reference(comm, output, input_grad):  # one device's tensors from the grader's reference
    acts, grads = G._boundaries(comm.size)
    r, last = comm.rank, comm.size - 1
    return (acts[r] if r > 0 else None), (grads[r + 1] if r < last else None)


def test_pipeline_exchange(capsys):
    passed(capsys, G.check_pipeline_exchange(_exchange_twice), "exchange_boundaries: 2/2 cases passed")
    # the deadlock waits out the timeout: 3 s is plenty for a case that takes well under one
    refused(capsys, "exchange_boundaries", G.check_pipeline_exchange(_exchange_both_send, timeout=3),
            "deadlock or hang")
    for wrong, hint in ((_exchange_dropped, "got [0, 0"), (_exchange_zeros_sent, "only moves it"),
                        (_exchange_forward_only, "from stage s + 1"), (_exchange_reference, "write this yourself")):
        refused(capsys, "exchange_boundaries", G.check_pipeline_exchange(wrong), hint)


# ----------------------------------------------------------------------------- 7. the wrong group
def _gather_list(mesh, partial):                 # right, written differently: list all-gather via torch
    import torch.distributed as dist
    y = partial.clone()
    dist.all_reduce(y, group=mesh.group("tp"))
    parts = [torch.empty_like(y) for _ in range(mesh.sizes["dp"])]
    dist.all_gather(parts, y, group=mesh.group("dp"))
    return torch.cat(parts)


def _gather_on_tp(mesh, partial):                # the bug as given
    y = partial.clone()
    mesh.comm("tp").all_reduce(y)
    out = y.new_empty(mesh.sizes["dp"] * len(y), y.shape[1])
    mesh.comm("tp").all_gather_into_tensor(out, y)
    return out


def _gather_local_copy(mesh, partial):           # the collective replaced by a copy of my rows
    y = partial.clone()
    mesh.comm("tp").all_reduce(y)
    return torch.cat([y] * mesh.sizes["dp"])


def _gather_sized_for_tp(mesh, partial):         # the output resized to the wrong group: no error
    y = partial.clone()
    mesh.comm("tp").all_reduce(y)
    out = y.new_empty(mesh.sizes["tp"] * len(y), y.shape[1])
    mesh.comm("tp").all_gather_into_tensor(out, y)
    return out


def _gather_no_tp_sum(mesh, partial):            # gathered over dp, the tp partials never summed
    out = partial.new_empty(mesh.sizes["dp"] * len(partial), partial.shape[1])
    mesh.comm("dp").all_gather_into_tensor(out, partial)
    return out


def _gather_reference(mesh, partial):            # the answer computed again, not gathered
    return G._linear(mesh.sizes["dp"])[3]


def test_gather_group(capsys):
    passed(capsys, G.check_gather_group(_gather_list), "gather_outputs: 2/2 cases passed")
    for wrong, hint in ((_gather_on_tp, "dp=2 x tp=2"), (_gather_local_copy, "gathered output"),
                        (_gather_sized_for_tp, "dp=2 x tp=2"), (_gather_no_tp_sum, "dp=2 x tp=2"),
                        (_gather_reference, "write this yourself")):
        refused(capsys, "gather_outputs", G.check_gather_group(wrong), hint)


# ----------------------------------------------------------------------------- 8. tokens
def _token_sum_then_scale(net, x, y, keep, comm):  # right, written differently: sum, sync, then divide
    err = F.mse_loss(net(x), y, reduction="none").sum(-1)
    (err * keep).sum().backward()
    count = keep.sum().double()
    comm.all_reduce(count)
    for p in net.parameters():
        comm.all_reduce(p.grad)
        p.grad /= count


def _token_local(net, x, y, keep, comm):          # the bug as given
    err = ((net(x) - y) ** 2).sum(-1)
    (err[keep].sum() / keep.sum()).backward()
    for p in net.parameters():
        comm.all_reduce(p.grad)


def _token_world_mean(net, x, y, keep, comm):     # local mean, then a mean over ranks: a mean of means
    err = ((net(x) - y) ** 2).sum(-1)
    (err[keep].sum() / keep.sum().clamp(min=1)).backward()
    for p in net.parameters():
        comm.all_reduce(p.grad)
        p.grad /= comm.size


def _token_padding_counted(net, x, y, keep, comm):  # divided by every row, padding included
    err = ((net(x) - y) ** 2).sum(-1)
    (err[keep].sum() / (len(x) * comm.size)).backward()
    for p in net.parameters():
        comm.all_reduce(p.grad)


def _token_hard_coded(net, x, y, keep, comm):     # the first case's 9 real tokens, written in
    err = ((net(x) - y) ** 2).sum(-1)
    (err[keep].sum() / 9).backward()
    for p in net.parameters():
        comm.all_reduce(p.grad)


def test_token_loss(capsys):
    passed(capsys, G.check_token_loss(_token_sum_then_scale), "token_step: 1/1 cases passed")
    for wrong, hint in ((_token_local, "(5, 1, 3)"), (_token_world_mean, "(5, 1, 3)"),
                        (_token_padding_counted, "every rank's real tokens"), (_token_hard_coded, "[0, 4, 6]")):
        refused(capsys, "token_step", G.check_token_loss(wrong), hint)


# ----------------------------------------------------------------------------- 9. uneven shards
def _rows_object(mine, comm):                    # right, written differently: counts first, list all-gather
    import torch.distributed as dist
    counts = torch.zeros(comm.size, dtype=torch.int64)
    counts[comm.rank] = len(mine)
    comm.all_reduce(counts)
    most = int(counts.max())
    padded = torch.cat([mine, mine.new_full((most - len(mine), mine.shape[1]), float("nan"))])
    parts = [torch.empty_like(padded) for _ in range(comm.size)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:int(k)] for p, k in zip(parts, counts)])


def _rows_as_given(mine, comm):                  # the bug as given
    out = mine.new_empty(comm.size * len(mine), mine.shape[1])
    comm.all_gather_into_tensor(out, mine)
    return out


def _rows_padding_kept(mine, comm):              # padded to a guess, the garbage gathered and kept
    pad = torch.cat([mine, mine.new_zeros(5 - len(mine), mine.shape[1])])
    out = pad.new_empty(comm.size * 5, mine.shape[1])
    comm.all_gather_into_tensor(out, pad)
    return out


def _rows_truncated(mine, comm):                 # every shard cut to the shortest
    k = torch.tensor([len(mine)])
    comm.all_reduce(k, op=torch.distributed.ReduceOp.MIN)
    out = mine.new_empty(comm.size * int(k), mine.shape[1])
    comm.all_gather_into_tensor(out, mine[:int(k)].contiguous())
    return out


def _rows_even_chunks(mine, comm):               # stripped as if every shard were total // size rows
    n = torch.tensor([len(mine)])
    comm.all_reduce(n)
    most = -(-int(n) // comm.size)
    pad = torch.cat([mine, mine.new_zeros(max(most - len(mine), 0), mine.shape[1])])[:most]
    out = pad.new_empty(comm.size * most, mine.shape[1])
    comm.all_gather_into_tensor(out, pad.contiguous())
    return out[:int(n)]


def _rows_counts_written_in(mine, comm):        # the first case's rows per rank, written in
    counts = [3, 1, 4]
    pad = torch.cat([mine, mine.new_zeros(max(4 - len(mine), 0), mine.shape[1])])[:4]
    out = pad.new_empty(comm.size * 4, mine.shape[1])
    comm.all_gather_into_tensor(out, pad.contiguous())
    return torch.cat([part[:k] for part, k in zip(out.chunk(comm.size), counts)])


def test_uneven_gather(capsys):
    passed(capsys, G.check_uneven_gather(_rows_object), "gather_rows: 1/1 cases passed")
    for wrong, hint in ((_rows_as_given, "gather_rows: FAILED"), (_rows_padding_kept, "shape"),
                        (_rows_truncated, "shape"), (_rows_even_chunks, "rows per rank [3, 1, 4]"),
                        (_rows_counts_written_in, "rows per rank [0, 5, 2]")):
        refused(capsys, "gather_rows", G.check_uneven_gather(wrong), hint)
