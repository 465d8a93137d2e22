"""The virtual GPU clock: run the real program, read its time on a modelled GPU cluster.

    from course_lib.virtual import VirtualCluster
    cluster = VirtualCluster("h100-sxm", gpus_per_node=8, dtype=torch.bfloat16)
    res = launch(fn, 4, clock=cluster)      # the same results, exact
    res.spans                               # trace.Span in virtual seconds, the same on every run
    print(cluster.describe())               # every constant the prices come from

Every rank runs the real computation and sends the real messages; only time is modelled,
from the planner's :class:`~course_lib.planner.presets.Hardware` (one source of truth):

* compute (:mod:`.compute`): each aten op the rank runs, forward, backward and the optimizer,
  is priced as the GPU runs it (:class:`course_lib.planner.kernel_cost.KernelModel`): GEMMs by
  shape (tiles and waves), fused attention, and every other kernel by the bytes it moves at
  its class's fraction of HBM bandwidth (reductions, broadcasting and plain elementwise,
  copies), never under a minimum per kernel; the host issues one op every
  ``launch_overhead`` seconds and a kernel cannot start before it is issued; torch's
  optimizers run their CUDA path (foreach); the constants are fitted on a recorded H100 run.
  Bytes at the virtual dtype (``dtype=None``: each tensor at its own, GEMMs at their dtype's
  rate, for a program that runs the GPU's dtypes for real); views and metadata are free; ops
  inside a communication call belong to its price;
* communication (:mod:`.clock`, :mod:`.links`): the backend's collectives (torch's) as NCCL
  would run them, by NCCL's own tuning model (ring or tree, LL / LL128 / Simple, whichever is
  fastest for the size); a collective built from ``send``/``recv`` (the course's, a
  learner's) from its own messages, each one NCCL's point-to-point time; bytes at the
  virtual dtype. Links fill: each GPU's NVLink and NIC have a send and a receive lane, a
  transfer holds the lanes it crosses for bytes / bandwidth, and transfers of different
  streams that want a lane at once share it (each slowed, none served whole before the other);
* streams: a compute stream per rank, one stream per communicator and one per peer for
  point-to-point, as NCCL's. A collective starts once every member issued it and its stream
  is free, slowed where its lanes are shared (the members exchange their ready times with a tiny
  all-reduce beside the real one); a message carries the time its bytes start, and its
  receive completes once they crossed the receiver's lane; ``wait()`` joins the streams.
  Waits, bubbles and overlap come from the program itself.

Nothing reads the wall clock, so the spans are identical on every run and every CPU.

At a published model's full shape, :func:`dry_run` (:mod:`.dry_run`) runs the same program on
the meta device, one rank per pipeline stage (the others do the same work), its messages and
collectives priced by the same code (:mod:`.priced`, :mod:`.replay`).
"""
from __future__ import annotations

import textwrap

import torch

from course_lib.planner.kernel_cost import ELEMENTWISE, GEMM, KernelModel
from course_lib.planner.presets import HARDWARE, Hardware, get_hardware
from course_lib.virtual import clock, compute, links  # noqa: F401  (the rooms: clock.RankClock, compute.op_time)


class VirtualCluster:
    """A modelled cluster: ``hardware`` (a planner preset name or a Hardware), ``gpus_per_node``
    (NVLink inside a node, the network across), ``dtype`` (the precision the GPUs would
    compute and communicate in; the CPU run keeps its own dtype and results).

    ``dtype=None``: each tensor at its OWN dtype, for a program that runs the GPU's dtypes for
    real (a bf16 model under ``Layout.precision``, its fp32 master weights, moments and reduced
    gradients): its bytes at its element size, in kernels and on the wire, and a GEMM or fused
    attention at its dtype's rate (``Hardware.peak_flops_for``: bf16's peak, fp32's without
    TF32). The default (bf16) prices every floating tensor at 2 bytes and every GEMM at bf16's
    rate: a CPU float32 program standing for a bf16 GPU one, as the chapters run."""

    def __init__(self, hardware="h100-sxm", gpus_per_node: int | None = None, dtype=torch.bfloat16):
        if not isinstance(hardware, Hardware) and hardware not in HARDWARE:
            raise ValueError(f"unknown hardware {hardware!r}: choose one of {sorted(HARDWARE)} "
                             f"(planner.HARDWARE) or pass a planner Hardware")
        self.hw = get_hardware(hardware)
        gpn = self.hw.gpus_per_node if gpus_per_node is None else gpus_per_node
        if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
            raise ValueError(f"gpus_per_node must be an integer >= 1, got {gpus_per_node!r}")
        self.gpus_per_node = gpn
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype (e.g. torch.bfloat16) or None (each tensor at its "
                             f"own dtype), got {dtype!r}")
        self.dtype = dtype
        self._models = {}                                              # dtype -> its KernelModel (own dtypes)
        self.kernels = self.kernels_for(torch.bfloat16 if dtype is None else dtype)   # every kernel's device time
        self.peak_flops = self.kernels.peak
        self.flops_rate = self.kernels.flops_rate[GEMM]                # FLOP/s a large GEMM sustains
        self.bytes_rate = self.kernels.bytes_rate[ELEMENTWISE]         # B/s a plain elementwise kernel streams
        self.launch_overhead = self.hw.launch_overhead                 # the host issues one op every ... s
        self.kernel_floor = self.hw.kernel_floor                       # the least a kernel takes on the device

    def kernels_for(self, dtype: torch.dtype) -> KernelModel:
        """The kernel model of a kernel computing in ``dtype``: the cluster's own under a fixed
        ``dtype``; else the dtype's (its GEMM and attention rate; a ValueError naming a dtype
        the hardware has no FLOP rate for)."""
        key = dtype if self.dtype is None else self.dtype
        model = self._models.get(key)
        if model is None:
            name = str(key).removeprefix("torch.")
            if self.hw.peak_flops_for(name) is None:
                known = ["bfloat16"] + [d for d, _ in self.hw.dtype_flops]
                raise ValueError(f"dtype {key} has no FLOP rate on {self.hw.name}: the preset knows {known}")
            model = self._models[key] = KernelModel(self.hw, name)
        return model

    def check(self, world_size: int) -> None:
        """ValueError unless ``world_size`` GPUs fill whole nodes (before any rank starts)."""
        if world_size > self.gpus_per_node and world_size % self.gpus_per_node:
            raise ValueError(f"gpus_per_node={self.gpus_per_node} does not divide the world size {world_size}: "
                             f"a virtual cluster is whole nodes")

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link(self, ranks) -> tuple[float, float]:
        """(alpha seconds, bandwidth B/s) of a group of global ranks: NVLink inside one node,
        the network when it spans nodes (the planner's ``Hardware.link``)."""
        ranks = list(ranks)
        return self.hw.link(all(self.node(r) == self.node(ranks[0]) for r in ranks))

    def itemsize(self, t: torch.Tensor) -> int:
        """Bytes per element on the virtual GPU: floating tensors at the virtual dtype (None:
        every tensor at its own)."""
        return self.dtype.itemsize if self.dtype is not None and t.is_floating_point() else t.element_size()

    def kernel_time(self, flops: float, nbytes: float, cls: str = ELEMENTWISE, detail=None) -> float:
        """Seconds one kernel of class ``cls`` runs on the device (:class:`KernelModel`; a GEMM's
        ``detail`` is its (M, N, K, batch)); the host's issue interval is the stream's, not in it."""
        return self.kernels.seconds(flops, nbytes, cls, detail)

    def start(self, rank: int, world_size: int, recorder):
        """The clock of one rank (the launcher calls this in each rank, then enters it)."""
        return clock.RankClock(self, rank, world_size, recorder)

    def describe(self) -> str:
        """Every constant the prices come from, one line each, its source below it (76 columns)."""
        hw = self.hw
        dt = "each tensor at its own dtype" if self.dtype is None else str(self.dtype).removeprefix("torch.")
        eff, sources = self.kernels.efficiency, dict(hw.sources)
        gemm = (f"tiles x waves on {hw.sm_count} SMs, " if hw.sm_count else "") + f"{eff['gemm']:g} of peak"
        rows = [
            (f"virtual cluster: {hw.name}, {self.gpus_per_node} GPUs per node, {dt}", None),
            (f"  compute: {self.peak_flops / 1e12:g} TFLOP/s "
             f"{'bfloat16 (each GEMM at its dtype)' if self.dtype is None else dt} peak", None),
            (f"    GEMM {gemm} = {self.flops_rate / 1e12:.4g} TFLOP/s",
             sources.get("gemm", "matmul_efficiency: assumed")),
            (f"    fused attention {eff['attention']:g} of peak" + (
                f" a CTA, tiles x waves on {hw.sm_count} SMs" if hw.sm_count else ""), sources.get("attention", "assumed")),
            ]
        if hw.sm_count:
            k0f, k0b = hw.attention_tile_overhead
            rows.append((f"      backward {hw.attention_backward_efficiency or eff['attention']:g}; a CTA's "
                         f"fixed cost {k0f:g} / {k0b:g} rows, softmax {hw.attention_head_overhead:g} dims",
                         sources.get("attention_tile")))
        rows += [
            (f"  memory:  {hw.hbm_bandwidth / 1e12:g} TB/s HBM; a kernel streams at its class's share:", None)]
        stated = ("foreach",) if "foreach" in dict(hw.kernel_efficiency) else ()
        for cls in ("elementwise", "broadcast", "reduction", "copy") + stated:
            rows.append((f"    {cls:11s} {eff[cls]:5.3f} = {hw.hbm_bandwidth * eff[cls] / 1e12:.3g} TB/s",
                         sources.get(cls, "hbm_efficiency: assumed")))
        rows.append(("    (copy: strided copies; a contiguous copy, cast or fill: elementwise)", None))
        rows += [(f"  host: issues one op every {hw.launch_overhead * 1e6:.3g} us",
                  sources.get("launch_overhead", "assumed")),
                 (f"  device: at least {hw.kernel_floor * 1e6:.3g} us a kernel", sources.get("kernel_floor", "assumed"))]
        lines = []
        for line, source in rows:
            lines.append(line)
            if source:
                lines += textwrap.wrap(source, 76, initial_indent="      [", subsequent_indent="       ")
                lines[-1] += "]"
        return "\n".join(lines + links.describe(hw))

    def __repr__(self):
        return (f"VirtualCluster({self.hw.name!r}, gpus_per_node={self.gpus_per_node}, "
                f"dtype={self.dtype})")


from course_lib.virtual.dry_run import DryRun, dry_run  # noqa: E402  (it builds VirtualClusters)

__all__ = ["VirtualCluster", "dry_run", "DryRun"]
