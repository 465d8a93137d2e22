"""course_lib/grading/debugging_fixes.py: each find-and-fix grader refuses the bug as given,
the fixes that only silence its symptom and a hard-coded answer, and passes a right fix
written differently from the solution."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib.grading import debugging_fixes as G
from grading_answers import passed, refused


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
    for wrong, hint in ((_exchange_both_send, "deadlock or hang"), (_exchange_dropped, "got [0, 0"),
                        (_exchange_zeros_sent, "only moves it"), (_exchange_forward_only, "from stage s + 1"),
                        (_exchange_reference, "write this yourself")):
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
