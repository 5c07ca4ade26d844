"""Rollouts for an RL step when the rollout model and the trainer use different layouts.

    rollout = Qwen3MoeForCausalLM.from_pretrained(path, groups=init_parallel(tp=2))  # or meta
    copy_parameters(trainer.model, rollout)         # after each update: the same weights
    out = rollout_all(rollout, prompts, request_ids=range(k, k + len(prompts)), ...)
    mine = replica_share(len(prompts), train_groups)   # this training replica's requests

The prompts are the whole step's (every rank draws the same list). Ranks that must run each
forward together (a model replica: TP x CP x PP, and the EP groups that join replicas) form a
*lockstep unit*; each unit rolls out a contiguous share of the prompts, the units' results
are exchanged (token ids and logprobs, a few bytes a token), and every rank ends with every
rollout. Noise keys are the requests' global indices, so a rollout does not depend on which
unit ran it, on the rollout layout, or on the batch (CONTRACT.md): the trainer, at another
layout, scores them with logdiff 0.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

import tonp_parallel as tpar
from tonp_parallel.sharding import row_share

from ..generation import GenerationOutput, generate


def lockstep_units(groups) -> Tuple[int, int, bool]:
    """(this rank's unit, number of units, whether it is its unit's lowest rank). A unit is a
    connected set of model-replica groups (TP x CP x PP) and EP groups."""
    if groups.world_size == 1:
        return 0, 1, True
    layout = tpar.rank_layout(groups.world_size, groups.tp_size, groups.ep_size,
                              groups.expert_tp_size, pp=groups.pp_size, cp=groups.cp_size)
    parent = list(range(groups.world_size))

    def root(r):
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r
    for ranks in layout.model_groups + layout.ep_groups:
        for r in ranks[1:]:
            parent[root(r)] = root(ranks[0])
    roots = sorted({root(r) for r in range(groups.world_size)})
    mine = root(groups.rank)
    leader = min(r for r in range(groups.world_size) if root(r) == mine) == groups.rank
    return roots.index(mine), len(roots), leader


def replica_share(n: int, groups) -> range:
    """The contiguous share of n items that this rank's data-parallel replica trains on."""
    start, count = row_share(n, groups.dp_size, groups.dp_rank)
    return range(start, start + count)


@torch.no_grad()
def rollout_all(model, prompts: Sequence[Sequence[int]], *, request_ids: Sequence[int],
                **generate_kw) -> GenerationOutput:
    """`generate` over the whole step's prompts, split over the lockstep units of `model`'s
    layout; returns every rollout on every rank (stats: this unit's). request_ids: one distinct
    noise key a prompt (e.g. step * len(prompts) + index)."""
    groups = model.groups
    if groups is None or groups.world_size == 1:
        return generate(model, prompts, request_ids=list(request_ids), **generate_kw)
    unit, units, leader = lockstep_units(groups)
    start, count = row_share(len(prompts), units, unit)
    ids = list(request_ids)
    out = generate(model, list(prompts[start:start + count]),
                   request_ids=ids[start:start + count], **generate_kw)
    mine = (unit, [s.tolist() for s in out.sequences], [lp.tolist() for lp in out.logprobs],
            out.prompt_lengths, out.finish_reasons) if leader else None
    everyone: List = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    parts = sorted(p for p in everyone if p is not None)
    return GenerationOutput(
        sequences=[torch.tensor(s, dtype=torch.int64) for p in parts for s in p[1]],
        logprobs=[torch.tensor(lp, dtype=torch.float32) for p in parts for lp in p[2]],
        prompt_lengths=[n for p in parts for n in p[3]],
        finish_reasons=[f for p in parts for f in p[4]], stats=out.stats)


__all__ = ["lockstep_units", "replica_share", "rollout_all"]
