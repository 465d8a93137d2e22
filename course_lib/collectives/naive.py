"""Naive collectives: everything goes through one root, one rank at a time.

The obvious first version, and the baseline the ring and the tree are measured
against: the root's link carries (N-1) whole buffers in each direction while
every other link idles. Also the linear scatter and gather, which are what they
are: the root must send (or receive) every other rank's piece.
"""
from __future__ import annotations

import torch

from course_lib.collectives.checks import (
    check_all_gather_into_tensor, check_all_reduce, check_broadcast, check_gather, check_reduce,
    check_reduce_scatter_tensor, check_scatter)
from course_lib.collectives.core import Comm, ReduceOp, collective, contiguous_flat, finish_avg, reduce_


@collective("naive broadcast")
def broadcast(tensor, src, group=None, *, validate=True, counter=None):
    """The root sends the whole buffer to every other rank in turn."""
    comm = Comm(group, counter)
    root = check_broadcast(comm, "naive broadcast", tensor, src, validate)
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


@collective("naive reduce")
def reduce(tensor, dst, op=ReduceOp.SUM, group=None, *, validate=True, counter=None):
    """The root receives every rank's whole buffer in turn and reduces it into its own."""
    comm = Comm(group, counter)
    root, op = check_reduce(comm, "naive reduce", tensor, dst, op, validate)
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


@collective("naive all_reduce")
def all_reduce(tensor, op=ReduceOp.SUM, group=None, *, validate=True, counter=None):
    """Reduce at group rank 0, then broadcast the result from there."""
    comm = Comm(group, counter)
    op = check_all_reduce(comm, "naive all_reduce", tensor, op, validate)
    with contiguous_flat(tensor) as flat:
        _reduce(comm, flat, 0, op)
        _broadcast(comm, flat, 0)
    return tensor


@collective("linear scatter")
def scatter(tensor, scatter_list=None, src=0, group=None, *, validate=True, counter=None):
    """``tensor`` <- the root's ``scatter_list[rank]``; the root sends N-1 pieces in turn."""
    comm = Comm(group, counter)
    root = check_scatter(comm, tensor, scatter_list, src, validate)
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


@collective("linear gather")
def gather(tensor, gather_list=None, dst=0, group=None, *, validate=True, counter=None):
    """The root's ``gather_list[i]`` <- rank i's ``tensor``; the root receives N-1 pieces in turn."""
    comm = Comm(group, counter)
    root = check_gather(comm, tensor, gather_list, dst, validate)
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


@collective("naive all_gather")
def all_gather_into_tensor(output_tensor, input_tensor, group=None, *, validate=True, counter=None):
    """Gather every piece at rank 0, then send the whole output to everyone."""
    comm = Comm(group, counter)
    check_all_gather_into_tensor(comm, "naive all_gather_into_tensor", output_tensor, input_tensor, validate)
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


@collective("naive reduce_scatter")
def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, *, validate=True, counter=None):
    """Reduce whole buffers at rank 0, then send each rank its piece."""
    comm = Comm(group, counter)
    op = check_reduce_scatter_tensor(comm, "naive reduce_scatter_tensor", output, input, op, validate)
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
