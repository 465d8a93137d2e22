"""All-to-all by pairwise exchange: rank r's piece i goes to rank i.

In round s (1 .. N-1) rank r sends its piece for r+s and receives rank r-s's
piece for it; every rank is busy sending and receiving in every round and no
pair meets twice. Each rank sends (N-1)/N of its buffer: the minimum.
Pieces may differ in size (expert parallelism routes uneven token counts).
"""
from __future__ import annotations

import torch

from course_lib.collectives.checks import check_all_to_all
from course_lib.collectives.core import Comm, check_dtype, collective, contiguous_flats


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


@collective("pairwise all_to_all")
def all_to_all(output_tensor_list, input_tensor_list, group=None, *, validate=True, counter=None):
    """``output_tensor_list[i]`` <- rank i's ``input_tensor_list[rank]`` (sizes may differ)."""
    comm = Comm(group, counter)
    check_all_to_all(comm, output_tensor_list, input_tensor_list, validate)
    ins = [t.reshape(-1).contiguous() for t in input_tensor_list]
    with contiguous_flats(output_tensor_list) as outs:
        _pairwise(comm, outs, ins)
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
