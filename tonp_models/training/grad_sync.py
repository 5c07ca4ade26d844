"""Gradient averaging over data-parallel replicas and global-norm clipping over model shards.

    sync = GradSync(model, master, groups)     # reads model.parameter_shards()
    sync.average()                              # after master.grads_to_master()
    norm = sync.clip(max_norm=1.0)              # the pre-clip norm of the whole model

Which parameter is sharded, and over which group, comes from `model.parameter_shards()` only
(name -> Shard with .group "tp" | "ep"); every other parameter of this pipeline stage is
replicated. Under CP each rank's gradient covers its slice of the tokens: they are summed over
the DP x CP group and divided by the DP degree. The norm adds up every pipeline stage's part
in the one-process order.
Every sum over ranks is `tonp_parallel.tree_all_reduce` (fixed order), so all replicas get the
same bits. See docs/training.md for how the expert-gradient divisor follows from the layout.
"""
from __future__ import annotations

from typing import Dict, List

import torch

import tonp_parallel as tpar

from .optim import MasterWeights


def expert_grad_divisor(dp_size: int, tp_size: int, ep_size: int) -> int:
    """What the sum of an expert's gradient over its expert-DP group is divided by to give the
    mean over the global batch. An expert sees each token of the EP groups that reach it once;
    when tp > ep, the tp / ep EP groups inside one TP group each see that TP group's whole batch
    (each holds a copy of the experts), so the sum counts every batch tp / ep times."""
    return dp_size * max(1, tp_size // ep_size)


class GradSync:
    """Averages the master gradients over DP and clips them by the global norm.

    Dense (and, at ep = 1, expert) parameters are replicated over `groups.dp_cp_group` (the DP
    replicas and the CP ranks, whose token slices add up to a replica's batch); EP-sharded
    experts over `groups.expert_dp_group`. The averages divide by the dense DP degree (the loss
    is a per-replica mean), see `expert_grad_divisor` for the experts.
    """

    def __init__(self, model: torch.nn.Module, master: MasterWeights, groups):
        self.master, self.groups = master, groups
        shards = model.parameter_shards() if groups.world_size > 1 else {}
        size = {"tp": groups.tp_size, "ep": groups.ep_size}
        self.kind: List[str] = []
        # A shard held by `copies` ranks of its group (KV heads when TP > KV heads) enters the
        # group's sum of squares once per copy: weight it by 1 / copies so it counts once.
        self.norm_weight: List[float] = []
        for name in master.names:
            shard = shards.get(name)
            kind = "rep" if shard is None else shard.group
            if kind not in ("rep", "tp", "ep"):
                raise ValueError(f"GradSync: {name} is sharded over group {kind!r}; only 'tp' "
                                 f"and 'ep' shards are supported")
            copies = 1
            if shard is not None:
                held = size[kind] * shard.length
                if held % shard.full:
                    raise ValueError(f"GradSync: {name}'s shards ({shard.length} of {shard.full} "
                                     f"on dim {shard.dim}) do not tile {kind}={size[kind]} ranks")
                copies = held // shard.full
            self.kind.append(kind)
            self.norm_weight.append(1.0 / copies)

    def average(self) -> None:
        """grad <- (sum over replicas of grad) / divisor, in the fixed tree order."""
        g = self.groups
        cp = getattr(g, "cp_size", 1)
        if g.dp_size * cp == 1:          # every replica of a parameter saw the same batch
            return
        dense = getattr(g, "dp_cp_group", None) if cp > 1 else g.dp_group
        plans = ((False, dense, g.dp_size),
                 (True, getattr(g, "expert_dp_group", None),
                  expert_grad_divisor(g.dp_size, g.tp_size, g.ep_size)))
        for expert, group, divisor in plans:
            ps = [m for m, k in zip(self.master.params, self.kind) if (k == "ep") == expert]
            if not ps:
                continue
            flat = torch.cat([m.grad.reshape(-1) for m in ps])
            flat = tpar.tree_all_reduce(flat, group) / divisor
            for m, part in zip(ps, flat.split([m.numel() for m in ps])):
                m.grad.copy_(part.view_as(m.grad))

    def norm(self) -> float:
        """The global L2 norm of the master gradients over every shard, each counted once.
        Under PP every stage's per-parameter sums are gathered and added in the one-process
        model's parameter order, so the norm has PP 1's bits."""
        parts = [m.grad.float().pow(2).sum() * w for m, w in zip(self.master.params,
                                                                  self.norm_weight)]
        kinds = list(self.kind)
        g = self.groups
        if getattr(g, "pp_size", 1) > 1:  # stages hold consecutive runs of the parameters
            import torch.distributed as dist
            stages: List = [None] * g.pp_size
            dist.all_gather_object(stages, (parts, kinds), group=g.pp_group)
            parts = [p for stage in stages for p in stage[0]]
            kinds = [k for stage in stages for k in stage[1]]
        sq: Dict[str, torch.Tensor] = {k: torch.zeros((), dtype=torch.float32)
                                       for k in ("rep", "tp", "ep")}
        for part, kind in zip(parts, kinds):
            sq[kind] = sq[kind] + part
        total = sq["rep"]
        for kind, group in (("tp", g.tp_group), ("ep", g.ep_group)):
            total = total + tpar.tree_all_reduce(sq[kind].reshape(1), group)[0]
        return float(total.sqrt())

    def clip(self, max_norm: float) -> float:
        """Scale the gradients so the global norm is <= max_norm (0 = no clipping); returns the
        norm before clipping."""
        if not max_norm >= 0:
            raise ValueError(f"GradSync.clip: max_norm must be >= 0 (0 = off), got {max_norm!r}")
        norm = self.norm()
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for m in self.master.params:
                m.grad.mul_(scale)
        return norm
