"""A named device mesh: which ranks talk to which, for every parallel dimension.

    mesh = Mesh(dp=2, pp=2, cp=1, tp=2)          # inside launch(fn, 8): builds every group
    mesh.coord                                   # {'dp': 1, 'pp': 0, 'cp': 0, 'tp': 1} of this rank
    mesh.comm("tp").all_reduce(partial)          # one Comm per group (course_lib.collectives.comm)
    mesh.comm(("dp", "cp"))                      # flattened: the ranks that share (pp, tp)
    mesh.group("tp")                             # the torch ProcessGroup, for torch's own calls
    mesh.pp_prev, mesh.pp_next                   # pipeline neighbours (global ranks, None at the ends)

Ranks are laid out with TP innermost, then CP, then PP, then DP: the order of the
planner's :class:`~course_lib.planner.layout.Layout` and of the Llama 3 paper ([TP, CP, PP, DP]:
FSDP's gradient reduce-scatter and prefetch overlap compute, so DP tolerates the slowest links);
Megatron-LM and torchtitan put PP outermost instead (its point-to-point messages are the fewest
bytes). Either way the dimension that talks most sits on the fastest links:

    rank = ((dp_i * pp + pp_i) * cp + cp_i) * tp + tp_i

``order=`` numbers them in another order, outermost first (:func:`~course_lib.layout.rank_order`):
``Mesh(dp=2, pp=2, tp=2, order=("pp", "dp", "tp"))`` is DeepSpeed's
PipeModelDataParallelTopology (axes pipe, data, model), rank = (pp_i * dp + dp_i) * tp + tp_i.
The groups are the same sets of coordinates; which global ranks (so which nodes) hold them follows
the order. A flattened group's ranks are in the mesh's order too (its outermost named dim first).

The experts have a mesh of their own, folded over the same ranks (Megatron-Core's "MoE
parallel folding"): inside one pipeline stage, the dp x cp x tp ranks are also
etp x ep x edp (expert tensor parallel innermost, then expert parallel, then expert data
parallel). ``ep * etp`` must divide ``dp * cp * tp``. By default the fold takes its ranks
from DP first, then CP, then TP: the expert mesh lies on the shortest run of those dimensions
whose size ``ep * etp`` divides (``fold``: ("dp",) when it divides dp, as an EP inside DP),
so an "ep" group is ``ep`` consecutive indexes along the fold, numbered in rank order
(same pp, and the same cp and tp where the fold does not reach them). The ranks that hold the same experts are
"edp" and the dimensions outside the fold (:meth:`MeshShape.expert_replicas`).
``fold_order="tp_first"`` takes TP first, then CP, then DP, as Megatron-Core does (its
etp x ep x edp over the innermost ranks of a stage: with PP outermost, ``order=("pp", "dp",
"cp", "tp")``, an EP of 8 lies on one node's NVLink); DP first keeps an EP that fits inside DP
where the earlier chapters put it.

Every group, of every single dimension and of every combination of dimensions, is made
in the constructor, in the same order on every rank (``dist.new_group`` is collective:
a rank that made its groups in another order would hang). The same call builds the same
rank sets as ``torch.distributed.device_mesh.init_device_mesh`` on the shape
``(dp, pp, cp, tp)``; ``tests/test_mesh.py`` checks them side by side.
"""
from __future__ import annotations

import itertools

import torch.distributed as dist

from course_lib.collectives.comm import Comm
from course_lib.layout import FOLD_ORDER, FOLDS, MESH_ORDER, expert_fold, rank_order  # noqa: F401  (layout rules)
from course_lib.schedules import positive_int

DIMS = MESH_ORDER                  # outermost -> innermost, unless a mesh's ``order`` says otherwise
EXPERT_DIMS = ("ep", "etp", "edp")  # the expert mesh, folded over dp (x cp x tp) of one stage


class MeshShape:
    """The pure arithmetic of a mesh (no process group): coordinates and rank sets."""

    def __init__(self, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, etp: int = 1, *,
                 order=None, fold_order: str = "dp_first"):
        for name, value in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp), ("ep", ep), ("etp", etp)):
            positive_int(f"mesh dimension {name}", value)
        self.sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        self.order = rank_order(order, self.sizes)      # outermost -> innermost
        self.ep, self.etp, self.fold_order = ep, etp, fold_order
        self.fold = expert_fold(self.sizes, ep, etp, fold_order)
        self.world_size = dp * pp * cp * tp

    @property
    def expert_sizes(self) -> dict:
        """{'ep', 'etp', 'edp'}: the expert mesh's sizes (edp: the fold's ranks / (ep * etp))."""
        folded = 1
        for d in self.fold:
            folded *= self.sizes[d]
        return {"ep": self.ep, "etp": self.etp, "edp": folded // (self.ep * self.etp)}

    def expert_replicas(self) -> tuple:
        """The dims an expert's gradient is summed over: "edp" and the stage dims outside the
        fold (the ranks holding the same experts, each with tokens of its own)."""
        return ("edp",) + tuple(d for d in FOLDS[self.fold_order] if d not in self.fold)

    def size(self, dims) -> int:
        """Number of ranks along ``dims`` (a name or a tuple of names)."""
        names = _names(dims)
        self._check(names)
        out, sizes = 1, {**self.sizes, **self.expert_sizes}
        for d in names:
            out *= sizes[d]
        return out

    def coords(self, rank: int) -> dict:
        """{'dp': i, 'pp': j, 'cp': k, 'tp': l} of a global rank (plus 'ep', 'etp', 'edp')."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the mesh (world size {self.world_size})")
        out = {}
        for d in reversed(self.order):
            rank, out[d] = divmod(rank, self.sizes[d])
        out = {d: out[d] for d in DIMS}
        folded = 0                                # this rank's index along the fold, in rank order
        for d in self._fold_in_order():           # (innermost fastest): a group's ranks sorted = by coordinate
            folded = folded * self.sizes[d] + out[d]
        folded, out["etp"] = divmod(folded, self.etp)
        out["edp"], out["ep"] = divmod(folded, self.ep)
        return out

    def _fold_in_order(self) -> tuple:
        """The fold's dims in the mesh's order, outermost first."""
        return tuple(d for d in self.order if d in self.fold)

    def _invalid(self, names) -> str:
        problem = _invalid(names)
        mixed = [d for d in names if d in self.fold] if set(EXPERT_DIMS) & set(names) else []
        if not problem and mixed:
            problem = (f"{names}: the expert dims are folded over {self.fold}: do not combine them with "
                       f"{mixed}")
        return problem

    def _check(self, names):
        problem = self._invalid(names)
        if problem:
            raise ValueError(problem)

    def _covered(self, names) -> set:
        """The coordinates a group along ``names`` varies: the named ones, the fold's dims
        with an expert dim, the expert dims with a dim of the fold."""
        named = set(names)
        return named | (set(self.fold) if named & set(EXPERT_DIMS) else set()) | \
            (set(EXPERT_DIMS) if named & set(self.fold) else set())

    def rank_of(self, **coords) -> int:
        """The global rank at these coordinates (missing dimensions: 0)."""
        unknown = set(coords) - set(DIMS)
        if unknown:
            raise ValueError(f"unknown mesh dimension(s) {sorted(unknown)}; the mesh has {DIMS}")
        rank = 0
        for d in self.order:
            i = coords.get(d, 0)
            if not 0 <= i < self.sizes[d]:
                raise ValueError(f"{d}={i} is outside the mesh ({d} has size {self.sizes[d]})")
            rank = rank * self.sizes[d] + i
        return rank

    def rank_sets(self, dims) -> list[list[int]]:
        """Every group along ``dims``: lists of global ranks that differ only in ``dims``,
        each in group-rank order (the mesh's order: its outermost named dimension outermost, so
        the ranks ascending, as ``dist.new_group`` numbers them), sorted by first rank."""
        names = _names(dims)
        self._check(names)
        covered, groups = self._covered(names), {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(c[d] for d in DIMS + EXPERT_DIMS if d not in covered)
            order = tuple(c[d] for d in self.order + ("edp", "ep", "etp") if d in names)
            groups.setdefault(key, []).append((order, rank))
        return sorted([r for _, r in sorted(members)] for members in groups.values())

    def describe(self) -> str:
        dims = " x ".join(f"{d}={self.sizes[d]}" for d in self.order)
        experts = ""
        if self.ep * self.etp > 1:
            inside = " x ".join(self.fold)
            experts = f" (ep={self.ep}" + (f" x etp={self.etp}" if self.etp > 1 else "") + f" inside {inside}" + \
                ("" if self.fold_order == "dp_first" else f", {self.fold_order.replace('_', ' ')}") + ")"
        ordered = "" if self.order == MESH_ORDER else f", ranks in order {' > '.join(self.order)}"
        return dims + experts + f": {self.world_size} ranks" + ordered


def _names(dims) -> tuple:
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    if not names:
        raise ValueError("name at least one mesh dimension")
    return names


def _invalid(names) -> str:
    """Why ``names`` is not a set of mesh dimensions ("" if it is)."""
    unknown = [d for d in names if d not in DIMS + EXPERT_DIMS]
    if unknown:
        return f"unknown mesh dimension(s) {unknown}; the mesh has {DIMS + EXPERT_DIMS}"
    if len(set(names)) != len(names):
        return f"a mesh dimension is named twice in {names}"
    if {"ep", "edp"} <= set(names):
        return f"'ep' and 'edp' together are the dims they fold over: name those ({names})"
    return ""


class Mesh(MeshShape):
    """A :class:`MeshShape` inside a launch: every group made once, one :class:`Comm` per group.

    ``impl``: who runs the collectives of every Comm ("torch", "course" or a dict of
    functions, see :class:`~course_lib.collectives.comm.Comm`); ``mesh.comm(dims, impl=...)``
    overrides it for one group. ``order``: the dims outermost first (every rank the same one).
    """

    def __init__(self, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, etp: int = 1, *,
                 impl="torch", order=None, fold_order: str = "dp_first"):
        super().__init__(dp, pp, cp, tp, ep, etp, order=order, fold_order=fold_order)
        if not dist.is_initialized():
            raise RuntimeError("Mesh builds process groups: run it inside course_lib.launch(fn, world_size)")
        world = dist.get_world_size()
        if world != self.world_size:
            raise ValueError(f"mesh {self.describe()} needs dp*pp*cp*tp = world size, "
                             f"but the world has {world} ranks")
        self.impl, self.rank = impl, dist.get_rank()
        self.coord = self.coords(self.rank)
        self._groups, self._comms, self._made = {}, {}, {}
        for names in self._all_dim_sets():  # the same order on every rank: new_group is collective
            self._groups[names] = self._make_group(self.rank_sets(names))
        # Megatron's embedding group: the first and last stage of every pipeline, which both
        # hold a tied embedding / LM-head matrix and sum its gradient
        self._embedding_group = self._make_group(sorted({(s[0], s[-1]) for s in self.rank_sets("pp")}))

    @classmethod
    def from_layout(cls, layout, **kw) -> "Mesh":
        """The mesh of a :class:`~course_lib.layout.Layout` (dp, pp, cp, tp, ep, etp, order,
        fold_order)."""
        return cls(dp=layout.dp, pp=layout.pp, cp=layout.cp, tp=layout.tp, ep=layout.ep,
                   etp=getattr(layout, "etp", 1), order=getattr(layout, "order", None),
                   fold_order=getattr(layout, "fold_order", "dp_first"), **kw)

    def _all_dim_sets(self):
        """Every valid combination of dimensions, in one fixed order."""
        singles = DIMS + EXPERT_DIMS
        for k in range(1, len(singles) + 1):
            for names in itertools.combinations(singles, k):
                if not self._invalid(names):
                    yield names

    def _make_group(self, sets):
        sets = [sorted(set(ranks)) for ranks in sets]
        if len(sets) == 1 and sets[0] == list(range(self.world_size)):
            return None  # the whole world in rank order: the default group
        key = tuple(map(tuple, sets))
        if key not in self._made:  # the same rank sets under another name: one group
            mine = None
            for ranks in sets:
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    mine = group
            self._made[key] = mine
        return self._made[key]

    def _key(self, dims):
        names = _names(dims)
        self._check(names)
        return tuple(sorted(names, key=(DIMS + EXPERT_DIMS).index))

    def group(self, dims):
        """The torch ProcessGroup of this rank along ``dims`` (None = the default group)."""
        return self._groups[self._key(dims)]

    def comm(self, dims, impl=None) -> Comm:
        """This rank's :class:`Comm` along ``dims``: group ranks, traced calls tagged ``dims``."""
        key = self._key(dims)
        impl = self.impl if impl is None else impl
        cache = (key, impl if isinstance(impl, str) else id(impl))
        if cache not in self._comms:
            self._comms[cache] = Comm(self.group(key), dim="+".join(key), impl=impl)
        return self._comms[cache]

    def comm_of_sets(self, sets, dim: str, impl=None) -> Comm:
        """This rank's Comm of the rank ``sets`` (lists of global ranks that cut the world or
        part of it: HSDP's shard and replicate groups, a reshard block): one process group
        per set, made on every rank in the same order (collective), once per distinct sets."""
        impl = self.impl if impl is None else impl
        key = ("sets", tuple(tuple(sorted(r)) for r in sets), dim, impl if isinstance(impl, str) else id(impl))
        if key not in self._comms:
            group = self._make_group([list(r) for r in sets])
            self._comms[key] = Comm(group, dim=dim, impl=impl)
        return self._comms[key]

    def embedding_comm(self):
        """A Comm over this pipeline's first and last stage ranks (Megatron's embedding group),
        on those two ranks; None on the stages between. (With pp = 1: this rank alone.)"""
        if self.coord["pp"] not in (0, self.sizes["pp"] - 1):
            return None
        if "embedding" not in self._comms:
            self._comms["embedding"] = Comm(self._embedding_group, dim="pp", impl=self.impl)
        return self._comms["embedding"]

    def ranks(self, dims) -> list[int]:
        """Global ranks of this rank's group along ``dims``, in group-rank order."""
        return next(s for s in self.rank_sets(dims) if self.rank in s)

    def peer(self, dim: str, offset: int, wrap: bool = False):
        """Global rank ``offset`` steps along ``dim`` (None past the ends unless ``wrap``)."""
        i = self.coord[dim] + offset
        n = self.sizes[dim]
        if wrap:
            i %= n
        elif not 0 <= i < n:
            return None
        return self.rank_of(**{**{d: self.coord[d] for d in DIMS}, dim: i})

    # ---------------------------------------------------- torch's DeviceMesh spelling
    # init_device_mesh("cpu", sizes in mesh.order, mesh_dim_names=mesh.order) has our groups
    mesh_dim_names = property(lambda self: self.order)

    def get_group(self, mesh_dim: str):
        """As ``DeviceMesh.get_group``: the ProcessGroup along one dimension (the world's group
        object where that dimension spans the world, where :meth:`group` says None)."""
        group = self.group(mesh_dim)
        return dist.group.WORLD if group is None else group

    def get_local_rank(self, mesh_dim: str) -> int:
        """As ``DeviceMesh.get_local_rank``: this rank's index along ``mesh_dim``."""
        self._check(_names(mesh_dim))
        return self.coord[mesh_dim] if mesh_dim in self.coord else dist.get_rank(self.group(mesh_dim))

    def size(self, mesh_dim: str | None = None) -> int:
        """As ``DeviceMesh.size``: the number of ranks along ``mesh_dim`` (None: all of them)."""
        return self.world_size if mesh_dim is None else len(self.ranks(mesh_dim))

    def get_coordinate(self) -> list[int]:
        """As ``DeviceMesh.get_coordinate``: this rank's index along each dim, in the mesh's order."""
        return [self.coord[d] for d in self.order]

    pp_prev = property(lambda self: self.peer("pp", -1), doc="previous pipeline stage's rank (None on stage 0)")
    pp_next = property(lambda self: self.peer("pp", +1), doc="next pipeline stage's rank (None on the last)")

    def __repr__(self):
        return f"Mesh({self.describe()}, rank {self.rank} at {self.coord})"


class GroupMesh:
    """A one-dimensional stand-in for a :class:`Mesh`: one process group (None = the world)
    named ``dim``. What a wrapper given ``group=`` instead of ``mesh=`` talks through."""

    def __init__(self, group=None, dim: str = "dp", impl="torch"):
        self.dim, self.impl = dim, impl
        self._comm = Comm(group, dim=dim, impl=impl) if not isinstance(group, Comm) else group
        self.sizes = {dim: self._comm.size}

    def size(self, dims) -> int:
        return self.comm(dims).size

    def comm(self, dims, impl=None) -> Comm:
        names = _names(dims)
        if names != (self.dim,):
            raise ValueError(f"a parameter's gradient is reduced over {names}, but this wrapper was given "
                             f"one process group ({self.dim!r}); pass mesh=Mesh(...) instead of group=")
        return self._comm

    def group(self, dims):
        return self.comm(dims).group


def as_mesh(mesh=None, group=None, dim: str = "dp"):
    """What a parallel wrapper talks through: ``mesh`` if given, else ``group`` (a ProcessGroup,
    None for the world, or a Comm) as a one-dimensional mesh named ``dim``."""
    if mesh is not None and group is not None:
        raise ValueError("pass mesh= or group=, not both")
    return mesh if mesh is not None else GroupMesh(group, dim)


# ------------------------------------------------------------------ which dims reduce a gradient
# A parameter replicated along a mesh dimension, whose copies see different data there, has a
# partial gradient on each copy: it must be summed over that dimension. So each parameter
# carries the dimensions its gradient is reduced over (UvA DL notebooks' ``sync_gradients``):
# data-parallel wrappers default to their own data dims; tensor parallelism marks a
# sequence-parallel norm weight ("dp", "tp"); expert parallelism marks an expert ("edp",).

def set_reduce_dims(params, dims):
    """Mark ``params`` (a tensor, an iterable of them, or a module's parameters): their
    gradients are reduced (summed) over mesh dimensions ``dims``; () = never reduced."""
    names = () if dims in ((), None) else _names(dims)
    problem = _invalid(names) if names else ""
    if problem:
        raise ValueError(problem)
    if hasattr(params, "parameters"):
        params = params.parameters()
    elif hasattr(params, "shape"):
        params = [params]
    for p in params:
        p.reduce_dims = names
    return names


def get_reduce_dims(param, default=("dp",)) -> tuple:
    """The mesh dimensions ``param``'s gradient is reduced over (``default`` if unmarked)."""
    return getattr(param, "reduce_dims", tuple(default))


__all__ = ["DIMS", "EXPERT_DIMS", "FOLD_ORDER", "expert_fold", "MeshShape", "Mesh", "GroupMesh", "as_mesh", "set_reduce_dims",
           "get_reduce_dims"]
