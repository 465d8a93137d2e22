"""A mixture of experts on the dry run (:mod:`.dry_run`) under tensor and context parallelism.

A routing group (one micro-batch of one DP rank) spans the cp x tp ranks of a stage: each
routes the group's tokens in the single-device order, after all-gathering every member's token
places (:meth:`~course_lib.parallel.expert_parallel.ExpertParallelMoE.route`). The dry run
runs every cp rank and folds the tp members, whose gathers send nothing: it gives each member's
places itself (:func:`fold_token_places`, the index each member's plan sets,
:func:`token_places`). A folded rank then sends what its running twin sends only if every
member sends each expert as many tokens as the others (balanced routing: round robin over
the group's places); :func:`check_balanced_folding` refuses the layouts where it would not, before
anything runs.
"""
from __future__ import annotations

import torch

from course_lib.gpt import GPTConfig
from course_lib.layout import Layout
from course_lib.meta import round_robin
from course_lib.parallel.cp_layouts import shard_positions
from course_lib.parallel.expert_parallel import token_index


def token_places(cfg: GPTConfig, layout: Layout, coords: dict, doc_ids=None) -> torch.Tensor:
    """(micro_batch * s / (cp * tp),) where the MoE tokens of the rank at ``coords`` sit in their
    routing group (one micro-batch; the index the plan sets, :meth:`NDParallel.token_index`):
    its CP positions (the layout's split; ``doc_ids``: the packing, :func:`.dry_run.document_ids`),
    then its sequence-parallel chunk of them."""
    s, cp = cfg.seq_len, layout.cp
    pos = torch.arange(s) if cp == 1 else \
        shard_positions(s, cp, coords["cp"], layout.cp_layout, "cpu", doc_ids)
    tp = layout.tp if layout.sp else 1
    return token_index(layout.micro_batch, s, pos, tp, coords["tp"] if tp > 1 else 0)


def fold_token_places(net, cfg: GPTConfig, layout: Layout, mesh, doc_ids=None) -> None:
    """On the dry run: an MoE's routing group spans the cp x tp ranks, and their token places
    are all-gathered (:meth:`~course_lib.parallel.expert_parallel.ExpertParallelMoE.route`);
    the members it folds send nothing, so each member's places are the dry run's to give
    (:attr:`~.priced.PricedComm.folded_values`): the ones that member's plan sets."""
    for st in net.stages.values():
        for block in st.part.blocks:
            comm = getattr(getattr(getattr(block, "mlp", None), "moe", None), "token_comm", None)
            if comm is None or getattr(comm, "moves_data", True):
                continue
            places = [token_places(cfg, layout, mesh.coords(r), doc_ids) for r in comm.ranks]
            comm.folded_values["routing: token places"] = places.__getitem__


def check_balanced_folding(cfg: GPTConfig, layout: Layout, doc_ids=None) -> None:
    """The dry run folds the tp members of a routing group (and its ep, etp peers): a folded
    rank must send what its running twin sends. Under balanced routing (round robin over the
    group's places) that holds when every member of the group (cp x tp ranks) sends each expert
    as many tokens as the others do: NotImplementedError otherwise, naming the counts. (Where
    E does not divide a member's T k, round robin serves the first experts one token more: the
    running rank, ep rank 0, is the busiest of its ep peers.)"""
    if not cfg.n_experts or layout.cp * layout.tp == 1:
        return
    counts = {}
    for cp in range(layout.cp):
        for tp in range(layout.tp if layout.sp else 1):
            places = token_places(cfg, layout, {"cp": cp, "tp": tp}, doc_ids)
            choice = round_robin(layout.micro_batch * cfg.seq_len, cfg.n_experts, cfg.top_k)[places]
            counts[cp, tp] = torch.bincount(choice.flatten(), minlength=cfg.n_experts).tolist()
    if len({tuple(c) for c in counts.values()}) > 1:
        raise NotImplementedError(f"dry run: the members of an MoE's routing group send unequal tokens to the "
                                  f"experts under balanced routing ((cp, tp): tokens per expert {counts}): a "
                                  f"folded member would not send what its running twin sends")


__all__ = ["token_places", "fold_token_places", "check_balanced_folding"]
