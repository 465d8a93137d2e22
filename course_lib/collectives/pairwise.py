"""All-to-all by pairwise exchange: rank r's piece i goes to rank i.

In round s (1 .. N-1) rank r sends its piece for r+s and receives rank r-s's
piece for it; every rank is busy sending and receiving in every round and no
pair meets twice. Each rank sends (N-1)/N of its buffer: the minimum.
Pieces may differ in size (expert parallelism routes uneven token counts).
"""
from __future__ import annotations

import torch

from course_lib.collectives.core import _EXTRA, Comm, agree, check_dtype, describe, span


def _pairwise(comm, outs, ins):
    """outs, ins: N contiguous 1-D tensors each; outs[i] <- rank i's ins[rank].

    All receives are posted first (round order), then the sends in round order:
    no round waits for the previous one, and nothing can deadlock.
    """
    N, r = comm.size, comm.rank
    outs[r].copy_(ins[r])
    recvs = [comm.post_recv(outs[(r - s) % N], (r - s) % N) for s in range(1, N)]
    sends = [comm.post_send(ins[(r + s) % N], (r + s) % N) for s in range(1, N)]
    comm.wait(*recvs, *sends)


def _check_sizes(comm, name, rows):
    """rows[i] extras: rank i's N input sizes then N output sizes; out[j][i] must equal in[i][j]."""
    N = comm.size
    ins = [row[_EXTRA:_EXTRA + N] for row in rows]
    outs = [row[_EXTRA + N:_EXTRA + 2 * N] for row in rows]
    if len({row[0] for row in rows}) > 1:
        raise ValueError(f"{name}: ranks passed different dtypes; all must use the same dtype")
    bad = [(i, j) for i in range(N) for j in range(N) if ins[i][j] != outs[j][i]]
    if bad:
        i, j = bad[0]
        raise ValueError(f"{name}: rank {i} sends {ins[i][j]} elements to rank {j}, which expects "
                         f"{outs[j][i]}; output piece i on rank j must match input piece j on rank i "
                         f"({len(bad)} mismatched pair(s))")


def all_to_all(output_tensor_list, input_tensor_list, group=None, *, validate=True, counter=None):
    """``output_tensor_list[i]`` <- rank i's ``input_tensor_list[rank]`` (sizes may differ)."""
    comm = Comm.of(group, counter)
    if comm is None:
        return None
    with span("pairwise all_to_all"):
        N = comm.size
        if len(output_tensor_list) != N or len(input_tensor_list) != N:
            raise ValueError(f"all_to_all: both lists need world_size ({N}) tensors, got "
                             f"{len(output_tensor_list)} outputs and {len(input_tensor_list)} inputs")
        for t in list(input_tensor_list) + list(output_tensor_list):
            check_dtype(t, "all_to_all list entry")
        if validate:
            sizes = [t.numel() for t in input_tensor_list] + [t.numel() for t in output_tensor_list]
            rows = agree(comm, "all_to_all", describe(input_tensor_list[0], extra=sizes), same_shape=False)
            _check_sizes(comm, "all_to_all", rows)
        ins = [t.reshape(-1).contiguous() for t in input_tensor_list]
        outs = [t.view(-1) if t.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype)
                for t in output_tensor_list]
        _pairwise(comm, outs, ins)
        for t, o in zip(output_tensor_list, outs):
            if not t.is_contiguous():
                t.copy_(o.view(t.shape))
    return output_tensor_list


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, *,
                      validate=True, counter=None):
    """Like ``torch.distributed.all_to_all_single``: pieces are row blocks (dim 0) of one tensor.

    Without split sizes, dim 0 is cut into world_size equal blocks (it must divide).
    """
    comm = Comm.of(group, counter)
    if comm is None:
        return None
    N = comm.size
    check_dtype(input, "input")
    check_dtype(output, "output")

    def split(t, sizes, what):
        rows = t.shape[0] if t.dim() else 1
        if sizes is None:
            if rows % N:
                raise ValueError(f"all_to_all_single: {what} has {rows} rows, not divisible by world_size "
                                 f"({N}); pass {what}_split_sizes")
            sizes = [rows // N] * N
        sizes = [int(s) for s in sizes]
        if len(sizes) != N or sum(sizes) != rows or min(sizes) < 0:
            raise ValueError(f"all_to_all_single: {what}_split_sizes {sizes} must be {N} non-negative "
                             f"numbers summing to dim 0 of {what} ({rows})")
        return list(torch.split(t, sizes, dim=0)) if t.dim() else [t.view(1)]

    outs = split(output, output_split_sizes, "output")
    ins = split(input, input_split_sizes, "input")
    return all_to_all(outs, ins, group, validate=validate, counter=counter) and output
