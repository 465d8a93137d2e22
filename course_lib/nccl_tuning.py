"""NCCL's tuning constants (``src/graph/tuning.cc``, NCCL 2.19-2.21): the published numbers NCCL
uses to choose an algorithm and a protocol per collective, ``latency + bytes / bandwidth``.

Data only, read by both models of time: the virtual clock's pricing
(:func:`course_lib.virtual.links.nccl_collective`) and the planner's own arithmetic
(:func:`course_lib.planner.communication.nccl_time`), which do not share code. Microseconds;
[algorithm][protocol] in the order of :data:`PROTOCOLS`.
"""
from __future__ import annotations

PROTOCOLS = ("LL", "LL128", "Simple")
BASE_LATENCY = {"tree": (6.8, 14.0, 0.0), "ring": (6.6, 14.0, 8.4)}                 # baseLat
HW_LATENCY = {"nvlink": {"tree": (0.6, 1.25, 28.0), "ring": (0.6, 1.9, 3.4)},       # hwLat
              "net": {"tree": (5.0, 8.5, 28.0), "ring": (2.7, 4.0, 14.0)}}
# hwLat[.][RING][SIMPLE]: what a preset's alpha (``Hardware.nvlink_latency`` / ``network_latency``)
# stands for; the other latencies scale with it
PRESET_ALPHA_IS = {"nvlink": HW_LATENCY["nvlink"]["ring"][2] * 1e-6, "net": HW_LATENCY["net"]["ring"][2] * 1e-6}
LL_MAX_BW = {1: 87.7e9, 2: 39.0e9, 4: 20.4e9}   # llMaxBws: Hopper/Ampere one node; Intel CPUs 2, 4+ nodes
NET_OVERHEAD = 1e-6                               # getNetOverhead: x86 Intel, x3 for Simple
P2P_LL_THRESHOLD = 16 << 10                       # NCCL_P2P_LL_THRESHOLD: LL for messages up to 16 KiB
RING_PLATEAU = 1.9                                # ncclTopoGetAlgoTime: "plateau effect of ring"
# bus bandwidth factors of the protocols (tuning.cc's model refinements)
RING_LL = (0.25, 1 / 3)             # LL on a ring: across nodes or an all-reduce, else
RING_LL128 = (0.7, 0.92)            # LL128 on a ring: one GPU per node (ppn < 2), else
TREE_BUS, TREE_LL, TREE_LL128 = 0.92, 1 / 3.8, (7 / 9, 120 / 128)   # a tree's; LL128 one node, else

__all__ = ["PROTOCOLS", "BASE_LATENCY", "HW_LATENCY", "PRESET_ALPHA_IS", "LL_MAX_BW", "NET_OVERHEAD",
           "P2P_LL_THRESHOLD", "RING_PLATEAU", "RING_LL", "RING_LL128", "TREE_BUS", "TREE_LL", "TREE_LL128"]
