"""What a collective checks before it moves a byte: that the ranks agree, and its own rules.

* :func:`agree` is a cheap metadata all-gather (dtype, shape, op, root, ...)
  before the real work: ranks that disagree get a ValueError naming the ranks
  and their shapes instead of a hang or garbage. ``validate=False`` skips it.
* ``check_<collective>`` holds one torch collective's argument rules (sizes, dtypes,
  op, root), shared by every algorithm that implements it: an algorithm starts
  with one call and the rest of its code is the algorithm. Each returns what the
  algorithm needs (the checked op, the root as a group rank).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from course_lib import compat
from course_lib.collectives.core import (
    _DTYPE_CODE, _OP_CODE, SUPPORTED_DTYPES, Comm, check_dtype, check_op, op_name)

# ----------------------------------------------------------------------------- agreement

_MAX_DIMS = 8


def _shape_text(row) -> str:
    dtype_code, ndim = int(row[0]), int(row[1])
    dtype = str(SUPPORTED_DTYPES[dtype_code]).replace("torch.", "") if dtype_code >= 0 else "unsupported dtype"
    dims = [int(d) for d in row[2:2 + min(ndim, _MAX_DIMS)]]
    more = ", ..." if ndim > _MAX_DIMS else ""
    return f"{dtype} {tuple(dims) if not more else '(' + ', '.join(map(str, dims)) + more + ')'}"


def describe(tensor, op=None, root=-1, extra=()) -> list[int]:
    """This rank's metadata row: dtype code, ndim, dims, numel, op code, root, extras."""
    dims = list(tensor.shape)[:_MAX_DIMS]
    row = [_DTYPE_CODE.get(tensor.dtype, -1), tensor.dim(), *dims, *([0] * (_MAX_DIMS - len(dims))),
           tensor.numel(), -1 if op is None else _OP_CODE.get(getattr(op, "op", op), -2), root]
    return row + [int(e) for e in extra]


_NUMEL, _OP, _ROOT, _EXTRA = 2 + _MAX_DIMS, 3 + _MAX_DIMS, 4 + _MAX_DIMS, 5 + _MAX_DIMS


def agree(comm: Comm, name: str, row: list[int], same_shape: bool = True,
          extra_names=()) -> list[list[int]]:
    """All-gather every rank's metadata row; raise the same ValueError on every rank if they disagree.

    ``same_shape``: the collective needs identical shapes (all_reduce, broadcast, ...).
    Returns all rows, so a collective can check its own constraints (sizes of lists).
    """
    if comm.size == 1:
        rows = [row]
    else:
        mine = torch.tensor(row, dtype=torch.int64, device=comm.backend_device)
        everyone = mine.new_empty(comm.size * mine.numel())
        compat.all_gather_into_tensor(everyone, mine, group=comm.group)
        rows = everyone.view(comm.size, -1).tolist()
    key = (lambda r: r[:_NUMEL + 1] + r[_EXTRA:_EXTRA + len(extra_names)]) if same_shape else (lambda r: r[:1])

    def text(r):
        extras = ", ".join(f"{label} {v}" for label, v in zip(extra_names, r[_EXTRA:]))
        return _shape_text(r) + (f" ({extras})" if extras else "")

    _raise_if_split(name, rows, key, "tensors differ across ranks",
                    "every rank must pass a tensor of the same shape and dtype", text=text)
    _raise_if_split(name, rows, lambda r: r[_OP], "ranks passed different ReduceOps",
                    "every rank must pass the same op", text=lambda r: _op_text(r[_OP]))
    _raise_if_split(name, rows, lambda r: r[_ROOT], "ranks passed different roots",
                    "every rank must name the same src/dst", text=lambda r: f"root {r[_ROOT]}")
    return rows


def _op_text(code):
    for op, c in _OP_CODE.items():
        if c == code:
            return op_name(op)
    return "an unsupported op"


def _raise_if_split(name, rows, key, problem, rule, text=_shape_text):
    groups = defaultdict(list)
    for r, row in enumerate(rows):
        k = key(row)
        groups[tuple(k) if isinstance(k, list) else k].append(r)
    if len(groups) <= 1:
        return
    parts = []
    for ranks in sorted(groups.values()):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who}: {text(rows[ranks[0]])}")
    raise ValueError(f"{name}: {problem} ({'; '.join(parts)}); {rule}")


# ----------------------------------------------------------------------------- one tensor, same everywhere


def _agree_on_tensor(comm, name, tensor, validate, op=None, root=-1):
    if validate:
        agree(comm, name, describe(tensor, op, root=root))
    check_dtype(tensor)


def check_all_reduce(comm, name, tensor, op, validate=True):
    """Same shape, dtype and op on every rank; returns the op, checked against the dtype."""
    _agree_on_tensor(comm, name, tensor, validate, op)
    return check_op(op, tensor.dtype)


def check_broadcast(comm, name, tensor, src, validate=True) -> int:
    """Same shape, dtype and src on every rank; returns src (a global rank) as a group rank."""
    root = comm.group_rank(src, "src")
    _agree_on_tensor(comm, name, tensor, validate, root=root)
    return root


def check_reduce(comm, name, tensor, dst, op, validate=True):
    """Same shape, dtype, op and dst on every rank; returns (dst as a group rank, checked op)."""
    root = comm.group_rank(dst, "dst")
    _agree_on_tensor(comm, name, tensor, validate, op, root)
    return root, check_op(op, tensor.dtype)


# ----------------------------------------------------------------------------- one input, one output


def _agree_in_out(comm, name, input, output, validate, op=None, names=("input", "output")):
    """Inputs agree across ranks, and so do the outputs' sizes (sent along as an extra)."""
    check_dtype(output, names[1])
    if validate:
        agree(comm, name, describe(input, op, extra=[output.numel()]), extra_names=["output numel"])
    check_dtype(input, names[0])


def check_all_gather_into_tensor(comm, name, output_tensor, input_tensor, validate=True):
    """``output_tensor`` holds world_size x ``input_tensor``'s elements, of its dtype."""
    _agree_in_out(comm, name, input_tensor, output_tensor, validate, names=("input_tensor", "output_tensor"))
    if output_tensor.numel() != comm.size * input_tensor.numel() or output_tensor.dtype != input_tensor.dtype:
        raise ValueError(f"all_gather_into_tensor: output must hold world_size ({comm.size}) x input "
                         f"elements of input's dtype; got output {output_tensor.dtype} "
                         f"{tuple(output_tensor.shape)}, input {input_tensor.dtype} {tuple(input_tensor.shape)}")


def check_reduce_scatter_tensor(comm, name, output, input, op, validate=True):
    """``input`` holds world_size x ``output``'s elements, of its dtype; returns the checked op."""
    _agree_in_out(comm, name, input, output, validate, op)
    op = check_op(op, input.dtype)
    if input.numel() != comm.size * output.numel() or input.dtype != output.dtype:
        raise ValueError(f"reduce_scatter_tensor: input must hold world_size ({comm.size}) x output "
                         f"elements of output's dtype; got input {input.dtype} {tuple(input.shape)}, "
                         f"output {output.dtype} {tuple(output.shape)}")
    return op


# ----------------------------------------------------------------------------- lists of pieces


def _agree_on_split(comm, name, short, what, mine, sizes, validate, op=None):
    """Every rank must pass the same list of sizes, and rank i's own tensor must match entry i."""
    if not validate:
        return
    rows = agree(comm, name, describe(mine, op, extra=[hash(tuple(sizes))]), same_shape=False)
    if len({row[_EXTRA] for row in rows}) > 1:
        raise ValueError(f"{short}: ranks passed {what}s of different sizes; every rank must pass the same "
                         f"list of sizes (entry i = rank i's part)")
    if len(sizes) != comm.size:
        raise ValueError(f"{short}: {what} needs world_size ({comm.size}) tensors, got {len(sizes)}")
    own = [row[_NUMEL] for row in rows]  # numel of each rank's own tensor
    bad = [i for i in range(comm.size) if own[i] != sizes[i]]
    if bad:
        raise ValueError(f"{short}: {what} entry sizes {sizes} do not match the tensors the ranks hold "
                         f"({own}) at ranks {bad}")
    if len({row[0] for row in rows}) > 1:
        raise ValueError(f"{short}: ranks passed different dtypes; every rank must use the same dtype")


def check_reduce_scatter(comm, name, output, input_list, op, validate=True):
    """``input_list``: world_size tensors, entry ``rank`` sized like ``output``; returns the checked op."""
    check_dtype(output, "output")
    sizes = [t.numel() for t in input_list]
    _agree_on_split(comm, name, "reduce_scatter", "input_list", output, sizes, validate, op)
    if len(input_list) != comm.size or output.numel() != sizes[comm.rank]:
        raise ValueError(f"reduce_scatter: input_list needs world_size ({comm.size}) tensors and "
                         f"output as many elements as input_list[rank]; got {len(input_list)} tensors, "
                         f"sizes {sizes}, output {tuple(output.shape)}")
    op = check_op(op, output.dtype)
    for t in input_list:
        check_dtype(t, "input_list entry")
    return op


def check_all_gather(comm, name, tensor_list, tensor, validate=True):
    """``tensor_list``: world_size tensors of ``tensor``'s dtype, entry ``rank`` sized like ``tensor``."""
    check_dtype(tensor)
    sizes = [t.numel() for t in tensor_list]
    _agree_on_split(comm, name, "all_gather", "tensor_list", tensor, sizes, validate)
    if len(tensor_list) != comm.size or sizes[comm.rank] != tensor.numel():
        raise ValueError(f"all_gather: tensor_list needs world_size ({comm.size}) tensors, entry rank "
                         f"sized like tensor; got {len(tensor_list)} tensors, sizes {sizes}, "
                         f"tensor {tuple(tensor.shape)}")
    for t in tensor_list:
        if t.dtype != tensor.dtype:
            raise ValueError(f"all_gather: tensor_list has dtype {t.dtype}, tensor {tensor.dtype}")


def _check_rooted_list(comm, name, tensor, the_list, what, root, root_name, validate):
    """The root's list holds world_size tensors, entry i sized like rank i's ``tensor``."""
    root = comm.group_rank(root, root_name)
    check_dtype(tensor)
    if not validate:
        return root
    # my tensor, plus (on the root) the sizes of its list, so all ranks can check
    sizes = [t.numel() for t in the_list] if (comm.rank == root and the_list is not None) else []
    if comm.rank == root and len(sizes) != comm.size:
        sizes = [-1] * comm.size   # wrong length: reported below, on every rank
    rows = agree(comm, name, describe(tensor, root=root, extra=sizes or [0] * comm.size), same_shape=False)
    want = rows[root][_EXTRA:_EXTRA + comm.size]
    if want == [-1] * comm.size:
        raise ValueError(f"{name}: the root's {what} needs world_size ({comm.size}) tensors")
    have = [row[_NUMEL] for row in rows]
    if want != have:
        raise ValueError(f"{name}: the root's {what} sizes {want} do not match the ranks' tensors {have}")
    if len({row[0] for row in rows}) > 1:
        raise ValueError(f"{name}: ranks passed different dtypes")
    return root


def check_scatter(comm, tensor, scatter_list, src, validate=True) -> int:
    """Returns src (a global rank) as a group rank."""
    return _check_rooted_list(comm, "scatter", tensor, scatter_list, "scatter_list", src, "src", validate)


def check_gather(comm, tensor, gather_list, dst, validate=True) -> int:
    """Returns dst (a global rank) as a group rank."""
    return _check_rooted_list(comm, "gather", tensor, gather_list, "gather_list", dst, "dst", validate)


def check_all_to_all(comm, output_tensor_list, input_tensor_list, validate=True):
    """world_size pieces each way; output piece i on rank j must match input piece j on rank i."""
    N = comm.size
    if len(output_tensor_list) != N or len(input_tensor_list) != N:
        raise ValueError(f"all_to_all: both lists need world_size ({N}) tensors, got "
                         f"{len(output_tensor_list)} outputs and {len(input_tensor_list)} inputs")
    for t in list(input_tensor_list) + list(output_tensor_list):
        check_dtype(t, "all_to_all list entry")
    if not validate:
        return
    sizes = [t.numel() for t in input_tensor_list] + [t.numel() for t in output_tensor_list]
    rows = agree(comm, "all_to_all", describe(input_tensor_list[0], extra=sizes), same_shape=False)
    ins = [row[_EXTRA:_EXTRA + N] for row in rows]            # rank i's N input sizes
    outs = [row[_EXTRA + N:_EXTRA + 2 * N] for row in rows]   # rank i's N output sizes
    if len({row[0] for row in rows}) > 1:
        raise ValueError("all_to_all: ranks passed different dtypes; all must use the same dtype")
    bad = [(i, j) for i in range(N) for j in range(N) if ins[i][j] != outs[j][i]]
    if bad:
        i, j = bad[0]
        raise ValueError(f"all_to_all: rank {i} sends {ins[i][j]} elements to rank {j}, which expects "
                         f"{outs[j][i]}; output piece i on rank j must match input piece j on rank i "
                         f"({len(bad)} mismatched pair(s))")
