"""Naive collectives: everything goes through one root, one rank at a time.

The obvious first version, and the baseline the ring and the tree are measured
against: the root's link carries (N-1) whole buffers in each direction while
every other link idles. Also the linear scatter and gather, which are what they
are: the root must send (or receive) every other rank's piece.
"""
from __future__ import annotations

import torch

from course_lib.collectives.core import (
    Comm, ReduceOp, _EXTRA, _NUMEL, agree, check_dtype, check_op, contiguous_flat, describe,
    finish_avg, reduce_, span)


def broadcast(tensor, src, group=None, *, validate=True, counter=None):
    """The root sends the whole buffer to every other rank in turn."""
    comm = Comm.of(group, counter)
    if comm is None:
        return None
    with span("naive broadcast"):
        root = comm.group_rank(src, "src")
        if validate:
            agree(comm, "naive broadcast", describe(tensor, root=root))
        check_dtype(tensor)
        with contiguous_flat(tensor) as flat:
            _broadcast(comm, flat, root)
    return None


def _broadcast(comm, flat, root):
    if comm.rank == root:
        for peer in range(comm.size):
            if peer != root:
                comm.send(flat, peer)
    else:
        comm.recv(flat, root)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, *, validate=True, counter=None):
    """The root receives every rank's whole buffer in turn and reduces it into its own."""
    comm = Comm.of(group, counter)
    if comm is None:
        return None
    with span("naive reduce"):
        root = comm.group_rank(dst, "dst")
        if validate:
            agree(comm, "naive reduce", describe(tensor, op, root=root))
        check_dtype(tensor)
        op = check_op(op, tensor.dtype)
        with contiguous_flat(tensor) as flat:
            _reduce(comm, flat, root, op)
    return None


def _reduce(comm, flat, root, op):
    if comm.rank != root:
        comm.send(flat, root)
        return
    incoming = torch.empty_like(flat)
    for peer in range(comm.size):
        if peer != root:
            comm.recv(incoming, peer)
            reduce_(flat, flat, incoming, op)
    finish_avg(flat, op, comm.size)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, *, validate=True, counter=None):
    """Reduce at group rank 0, then broadcast the result from there."""
    comm = Comm.of(group, counter)
    if comm is None:
        return None
    with span("naive all_reduce"):
        if validate:
            agree(comm, "naive all_reduce", describe(tensor, op))
        check_dtype(tensor)
        op = check_op(op, tensor.dtype)
        with contiguous_flat(tensor) as flat:
            _reduce(comm, flat, 0, op)
            _broadcast(comm, flat, 0)
    return tensor


def _list_sizes_row(comm, tensor, root, the_list, op=None):
    """Metadata row: my tensor, plus (on the root) the sizes of its list, so all ranks can check."""
    sizes = [t.numel() for t in the_list] if (comm.rank == root and the_list is not None) else []
    if comm.rank == root and len(sizes) != comm.size:
        sizes = [-1] * comm.size   # wrong length: reported below, on every rank
    return describe(tensor, op, root=root, extra=sizes or [0] * comm.size)


def _check_list(comm, name, what, rows, root):
    want = rows[root][_EXTRA:_EXTRA + comm.size]
    if want == [-1] * comm.size:
        raise ValueError(f"{name}: the root's {what} needs world_size ({comm.size}) tensors")
    have = [row[_NUMEL] for row in rows]
    if want != have:
        raise ValueError(f"{name}: the root's {what} sizes {want} do not match the ranks' tensors {have}")
    if len({row[0] for row in rows}) > 1:
        raise ValueError(f"{name}: ranks passed different dtypes")


def scatter(tensor, scatter_list=None, src=0, group=None, *, validate=True, counter=None):
    """``tensor`` <- the root's ``scatter_list[rank]``; the root sends N-1 pieces in turn."""
    comm = Comm.of(group, counter)
    if comm is None:
        return None
    with span("linear scatter"):
        root = comm.group_rank(src, "src")
        check_dtype(tensor)
        if validate:
            rows = agree(comm, "scatter", _list_sizes_row(comm, tensor, root, scatter_list), same_shape=False)
            _check_list(comm, "scatter", "scatter_list", rows, root)
        with contiguous_flat(tensor) as flat:
            if comm.rank == root:
                for peer in range(comm.size):
                    piece = scatter_list[peer].reshape(-1).contiguous()
                    if peer == root:
                        flat.copy_(piece)
                    else:
                        comm.send(piece, peer)
            else:
                comm.recv(flat, root)
    return None


def gather(tensor, gather_list=None, dst=0, group=None, *, validate=True, counter=None):
    """The root's ``gather_list[i]`` <- rank i's ``tensor``; the root receives N-1 pieces in turn."""
    comm = Comm.of(group, counter)
    if comm is None:
        return None
    with span("linear gather"):
        root = comm.group_rank(dst, "dst")
        check_dtype(tensor)
        if validate:
            rows = agree(comm, "gather", _list_sizes_row(comm, tensor, root, gather_list), same_shape=False)
            _check_list(comm, "gather", "gather_list", rows, root)
        mine = tensor.reshape(-1).contiguous()
        if comm.rank != root:
            comm.send(mine, root)
            return None
        for peer in range(comm.size):
            with contiguous_flat(gather_list[peer]) as out:
                if peer == root:
                    out.copy_(mine)
                else:
                    comm.recv(out, peer)
    return None


def all_gather_into_tensor(output_tensor, input_tensor, group=None, *, validate=True, counter=None):
    """Gather every piece at rank 0, then send the whole output to everyone."""
    comm = Comm.of(group, counter)
    if comm is None:
        return None
    with span("naive all_gather"):
        check_dtype(output_tensor, "output_tensor")
        if validate:
            agree(comm, "naive all_gather_into_tensor", describe(input_tensor, extra=[output_tensor.numel()]),
                  extra_names=["output numel"])
        check_dtype(input_tensor, "input_tensor")
        if output_tensor.numel() != comm.size * input_tensor.numel() or output_tensor.dtype != input_tensor.dtype:
            raise ValueError(f"all_gather_into_tensor: output must hold world_size ({comm.size}) x input "
                             f"elements of input's dtype; got output {output_tensor.dtype} "
                             f"{tuple(output_tensor.shape)}, input {input_tensor.dtype} {tuple(input_tensor.shape)}")
        with contiguous_flat(output_tensor) as out:
            pieces = list(out.view(comm.size, -1))
            pieces[comm.rank].copy_(input_tensor.reshape(-1))
            if comm.rank == 0:
                for peer in range(1, comm.size):
                    comm.recv(pieces[peer], peer)
            else:
                comm.send(pieces[comm.rank], 0)
            _broadcast(comm, out, 0)
    return output_tensor


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, *, validate=True, counter=None):
    """Reduce whole buffers at rank 0, then send each rank its piece."""
    comm = Comm.of(group, counter)
    if comm is None:
        return None
    with span("naive reduce_scatter"):
        check_dtype(output, "output")
        if validate:
            agree(comm, "naive reduce_scatter_tensor", describe(input, op, extra=[output.numel()]),
                  extra_names=["output numel"])
        check_dtype(input, "input")
        op = check_op(op, input.dtype)
        if input.numel() != comm.size * output.numel() or input.dtype != output.dtype:
            raise ValueError(f"reduce_scatter_tensor: input must hold world_size ({comm.size}) x output "
                             f"elements of output's dtype; got input {input.dtype} {tuple(input.shape)}, "
                             f"output {output.dtype} {tuple(output.shape)}")
        work = input.reshape(-1).clone()            # (n,) the root reduces into it
        _reduce(comm, work, 0, op)
        pieces = list(work.view(comm.size, -1))
        with contiguous_flat(output) as out:
            if comm.rank == 0:
                for peer in range(1, comm.size):
                    comm.send(pieces[peer], peer)
                out.copy_(pieces[0])
            else:
                comm.recv(out, 0)
    return output
