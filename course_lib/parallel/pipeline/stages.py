"""The tiny GPT cut into pipeline stages: layers in contiguous, balanced runs (or the counts
``stage_layers`` gives), one stage (or v) per pp rank; stage 0 also embeds, the last stage also
holds the norm, the head and the loss (Llama 3: each alone in a stage of no layer).

    stages = split_stages(model, mesh, v=1)     # {virtual stage: GPTStage} of this pp rank
    stages = split_stages(model, mesh, schedule="zb-v")   # two, in V order: {r: .., 2p-1-r: ..}

A tied embedding whose first and last stage live on one rank stays one parameter
(:func:`tie_embeddings`). :class:`MLPStage`: layers of a course_lib ``MLP``, chapter 6's first cut.
"""
from __future__ import annotations

import copy

import torch.nn as nn
import torch.nn.functional as F

from course_lib.parallel.pipeline.rules import partition_layers
from course_lib.schedules import chunks, placement_of, rank_stage_ids


class GPTStage(nn.Module):
    """Stage ``stage`` of ``n_stages`` of a TinyGPT: a copy that keeps only its blocks (and
    the embedding on the first stage, the final norm + head on the last). Its methods are
    the model's own (``embed``, ``blocks``, ``head``), so the arithmetic is the same.
    ``stage_layers``: each stage's count (:func:`~.rules.partition_layers`); () balanced."""

    def __init__(self, model, stage: int, n_stages: int, stage_layers=()):
        super().__init__()
        layers = partition_layers(len(model.blocks), n_stages, stage_layers)[stage]
        self.first, self.last = stage == 0, stage == n_stages - 1
        part = copy.deepcopy(model)             # a tied lm_head stays tied to tok_emb inside it
        part.blocks = nn.ModuleList(part.blocks[i] for i in layers)
        if not self.first:
            part.tok_emb = None
            if hasattr(part, "pos_emb"):
                part.pos_emb = None
        if not self.last:
            part.norm = part.lm_head = None
        self.part, self.layers = part, layers

    positions = None    # context parallelism: this rank's tokens' positions, set per step
    doc_ids = None      # packed documents: the whole sequence's document ids (s,), set per step

    def forward(self, x):  # first: idx (b, s) int64, else (b, s, h) -> (b, s, h); last: logits
        if self.first:
            x = self.part.embed(x, self.positions)
        for block in self.part.blocks:
            x = block(x, self.positions, self.doc_ids)
        return self.part.head(x) if self.last else x.contiguous()    # sent as is: buffers are dense

    def loss(self, logits, targets, n_tokens):
        return self.part.loss(logits, targets, n_tokens)

    def model_name(self, local: str) -> str:
        """A name in this stage -> its name in the whole model (``blocks.j`` renumbered)."""
        if local.startswith("blocks."):
            _, j, rest = local.split(".", 2)
            return f"blocks.{self.layers[int(j)]}.{rest}"
        return local

    def named_in_model(self) -> dict:
        """{name in the whole model: parameter}."""
        return {self.model_name(n): q for n, q in self.part.named_parameters(remove_duplicate=False)}


def gpt_stage(model, stage: int, n_stages: int, stage_layers=()) -> GPTStage:
    return GPTStage(model, stage, n_stages, stage_layers)


def rank_stages(model, rank: int, p: int, v: int = 1, placement: str = "loop", stage_layers=()) -> dict:
    """{virtual stage: GPTStage} of pp rank ``rank``: of p * v stages, those ``placement`` puts
    there (``course_lib.schedules.stage_rank``): "loop", stages rank, rank + p, ...; "v" (v = 2),
    stages rank and 2p - 1 - rank. Each is a copy of the model, so where the first and the last
    stage both live on this rank (p = 1 with v > 1 chunks; rank 0 of a V), a tied embedding /
    LM head would become two matrices training apart: they are made one parameter again, as in
    the model (autograd adds both stages' gradients). ``stage_layers``: :class:`GPTStage`'s."""
    n_stages = p * v
    ids = rank_stage_ids(rank, p, v, placement)
    return tie_embeddings({s: GPTStage(model, s, n_stages, stage_layers) for s in ids}, n_stages)


def tie_embeddings(stages, n_stages=None):
    """Where this rank holds the first and the last stage of a tied model: the last stage's head
    becomes the first stage's embedding again (call it again after a dimension replaced them)."""
    first = [st for st in stages.values() if st.first]
    last = [st for st in stages.values() if st.last]
    if first and last and first[0] is not last[0] and first[0].part.config.tie_embeddings:
        last[0].part.lm_head.weight = first[0].part.tok_emb.weight
    return stages


def split_stages(model, mesh, v: int = 1, schedule=None, stage_layers=()) -> dict:
    """PP: this rank's stages of ``model`` cut into pp * v (:func:`rank_stages`); ``schedule``
    (a name or an action list) says how many chunks and where: the V schedules two, in V order;
    ``stage_layers`` how many layers each (() balanced)."""
    p = mesh.sizes["pp"]
    if schedule is not None:
        v, placement = chunks(schedule, v), placement_of(schedule, p, chunks(schedule, v))
    else:
        placement = "loop"
    return rank_stages(model, mesh.coord["pp"], p, v, placement, stage_layers)


class MLPStage(nn.Module):
    """Layers [a, b) of a course_lib ``MLP``. The model applies ReLU after every layer but
    its last, so a stage that ends inside the model must END with a ReLU: a split that
    drops it at the cut computes another function (one of the course's source notes does)."""

    def __init__(self, mlp, layers: range, keep_relu_at_cut: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(copy.deepcopy(mlp.layers[i]) for i in layers)
        self.relu_after = [i < len(mlp.layers) - 1 for i in layers]
        if not keep_relu_at_cut:                    # the bug, kept to show what it changes
            self.relu_after[-1] = False

    def forward(self, x):  # (batch, in) -> (batch, out)
        for layer, relu in zip(self.layers, self.relu_after):
            x = layer(x)
            x = F.relu(x) if relu else x
        return x


__all__ = ["GPTStage", "gpt_stage", "rank_stages", "tie_embeddings", "split_stages", "MLPStage"]
