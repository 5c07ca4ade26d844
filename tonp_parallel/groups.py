"""Process groups for tensor (TP), expert (EP) and data (DP) parallelism.

A `ParallelGroups` is handed to every layer at construction; layers never look groups up
themselves. Three ways to get one:

    groups = ParallelGroups.single()                 # one process, no torch.distributed
    groups = init_parallel(tp=2, ep=2)               # under torchrun (gloo / nccl / hccl)
    groups = ParallelGroups.from_megatron()          # adopt megatron.core.parallel_state

A group of size 1 may be `None`: every tonp_parallel collective treats `group=None` as "this
rank alone" (no communication), NOT as torch.distributed's WORLD.

Rank layout (the same as megatron-core's default order "tp-cp-ep-dp-pp" with pp = cp = 1):

* Dense (attention, dense MLP, embedding, LM head): world = dp x tp, TP fastest:
      global rank = dp_rank * tp + tp_rank
  TP groups are runs of `tp` consecutive ranks; DP groups take every tp-th rank.
* Experts: world = expert_dp x ep x expert_tp, expert TP fastest:
      global rank = expert_dp_rank * (ep * expert_tp) + ep_rank * expert_tp + expert_tp_rank
  so EP groups are sub-groups of the same DP x TP ranks (megatron's expert rank generator).
  With the default expert_tp = 1 (whole experts on each rank, as in DeepSeek-V3 and megatron's
  `--expert-tensor-parallel-size 1`), EP groups are runs of `ep` consecutive ranks: at world = tp
  = ep the EP group is the TP group, at ep = tp * dp it spans the whole world. With expert_tp =
  tp the EP groups take every tp-th rank and each expert is itself split over the TP group.

Example, world 4, tp=2, ep=2, expert_tp=1:  TP {0,1} {2,3}; DP {0,2} {1,3}; EP {0,1} {2,3}.
Example, world 4, tp=2, ep=2, expert_tp=2:  TP {0,1} {2,3}; DP {0,2} {1,3}; EP {0,2} {1,3}.

Within a group, ranks are numbered in ascending global rank (torch.distributed's convention),
and that is the order of the fixed-order reduction tree.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .collectives import group_device
from .layout import validate_model_layout

Ranks = Tuple[int, ...]


@dataclass(frozen=True)
class RankLayout:
    """The rank groups of a (world, tp, ep, expert_tp) layout, as tuples of global ranks."""

    world_size: int
    tp: int
    ep: int
    expert_tp: int
    tp_groups: List[Ranks]
    dp_groups: List[Ranks]
    ep_groups: List[Ranks]
    expert_tp_groups: List[Ranks]
    expert_dp_groups: List[Ranks]

    def group_of(self, kind: str, rank: int) -> Ranks:
        """The group of kind 'tp' | 'dp' | 'ep' | 'expert_tp' | 'expert_dp' holding `rank`."""
        for ranks in getattr(self, f"{kind}_groups"):
            if rank in ranks:
                return ranks
        raise ValueError(f"rank {rank} is outside the world of size {self.world_size}")


def check_layout(world_size: int, tp: int = 1, ep: int = 1, expert_tp: int = 1) -> None:
    """Raise ValueError unless tp, ep and expert_tp tile `world_size` ranks (the rules live in
    `tonp_parallel.layout`)."""
    validate_model_layout(None, tp, ep, expert_tp, world_size=world_size)


def rank_layout(world_size: int, tp: int = 1, ep: int = 1, expert_tp: int = 1) -> RankLayout:
    """Every TP / DP / EP / expert-TP / expert-DP group of the layout described in the module doc.

    Pure arithmetic (no torch.distributed), so it can be checked against megatron-core's
    `RankGenerator` and printed by launch scripts.
    """
    check_layout(world_size, tp, ep, expert_tp)
    dp = world_size // tp
    tp_groups = [tuple(range(d * tp, (d + 1) * tp)) for d in range(dp)]
    dp_groups = [tuple(range(t, world_size, tp)) for t in range(tp)]
    block = ep * expert_tp  # one expert-model-parallel replica
    edp = world_size // block
    ep_groups = [tuple(b * block + e * expert_tp + t for e in range(ep))
                 for b in range(edp) for t in range(expert_tp)]
    etp_groups = [tuple(b * block + e * expert_tp + t for t in range(expert_tp))
                  for b in range(edp) for e in range(ep)]
    edp_groups = [tuple(b * block + r for b in range(edp)) for r in range(block)]
    return RankLayout(world_size, tp, ep, expert_tp, tp_groups, dp_groups, ep_groups,
                      etp_groups, edp_groups)


@dataclass
class ParallelGroups:
    """The process groups and ranks a tonp model is built with.

    Fields (a group of size 1 may be None; see the module doc for the rank layout):
      tp_group, tp_rank, tp_size   tensor parallelism: attention heads, MLP columns, vocab shards
      ep_group, ep_rank, ep_size   expert parallelism: rank e owns experts
                                   [e * E / ep, (e + 1) * E / ep) (see `local_experts`)
      dp_group, dp_rank, dp_size   data parallelism of the dense layers (replicas of a TP shard)
      expert_tp_group/_rank/_size  tensor parallelism inside an expert (1 = whole experts)
      expert_dp_group/_rank/_size  the ranks holding the same experts (expert gradients are
                                   averaged over it; it spans the dense DP replicas and, when
                                   tp > ep, the TP ranks that hold a copy of the same experts)
      rank, world_size             global rank and world size (0 and 1 when single-process)
      device                       this rank's device: LOCAL_RANK's GPU / NPU under NCCL / HCCL,
                                   else the CPU (the model, its cache and collectives live there)
    """

    tp_group: Optional[dist.ProcessGroup] = None
    ep_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    expert_tp_group: Optional[dist.ProcessGroup] = None
    expert_tp_rank: int = 0
    expert_tp_size: int = 1
    expert_dp_group: Optional[dist.ProcessGroup] = None
    expert_dp_rank: int = 0
    expert_dp_size: int = 1
    rank: int = 0
    world_size: int = 1
    backend: Optional[str] = field(default=None, compare=False)
    device: torch.device = field(default=torch.device("cpu"), compare=False)

    @classmethod
    def single(cls) -> "ParallelGroups":
        """One process: every degree 1, every group None; needs no torch.distributed."""
        return cls()

    @classmethod
    def from_megatron(cls) -> "ParallelGroups":
        """Adopt the groups of an initialised `megatron.core.parallel_state`.

        tonp has no pipeline or context parallelism: those degrees must be 1.
        """
        try:
            from megatron.core import parallel_state as ps
        except ImportError as e:  # megatron-core is an optional dependency
            raise ImportError("ParallelGroups.from_megatron needs megatron-core "
                              "(pip install megatron-core)") from e
        if not ps.model_parallel_is_initialized():
            raise RuntimeError("ParallelGroups.from_megatron: megatron.core.parallel_state is not "
                               "initialised; call parallel_state.initialize_model_parallel(...) "
                               "first, or use tonp_parallel.init_parallel(tp=, ep=)")
        pp = ps.get_pipeline_model_parallel_world_size()
        cp = ps.get_context_parallel_world_size()
        if pp != 1 or cp != 1:
            raise ValueError(f"tonp_parallel: pipeline ({pp}) and context ({cp}) parallelism are "
                             f"not supported; initialise megatron with both sizes 1")
        return cls(
            tp_group=ps.get_tensor_model_parallel_group(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            ep_group=ps.get_expert_model_parallel_group(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            dp_group=ps.get_data_parallel_group(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            expert_tp_group=ps.get_expert_tensor_parallel_group(),
            expert_tp_rank=ps.get_expert_tensor_parallel_rank(),
            expert_tp_size=ps.get_expert_tensor_parallel_world_size(),
            expert_dp_group=ps.get_expert_data_parallel_group(),
            expert_dp_rank=ps.get_expert_data_parallel_rank(),
            expert_dp_size=ps.get_expert_data_parallel_world_size(),
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            backend=dist.get_backend(),
            device=group_device(dist.group.WORLD),
        )

    def local_experts(self, num_experts: int) -> range:
        """The contiguous expert ids this rank owns: [ep_rank * E / ep, (ep_rank + 1) * E / ep)."""
        if num_experts % self.ep_size:
            raise ValueError(f"tonp_parallel: {num_experts} experts cannot be split over "
                             f"ep={self.ep_size} ranks (EP must divide the number of experts)")
        n = num_experts // self.ep_size
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)


def default_backend() -> str:
    """nccl on CUDA, hccl on Ascend NPU (torch_npu), gloo on CPU."""
    if torch.cuda.is_available():
        return "nccl"
    if hasattr(torch, "npu") and torch.npu.is_available():  # registered by torch_npu
        return "hccl"
    return "gloo"


def _set_device(backend: str) -> None:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local)
    elif backend == "hccl":
        torch.npu.set_device(local)


_GROUP_CACHE: Dict[Ranks, Optional[dist.ProcessGroup]] = {}
_CACHE_WORLD: Optional[dist.ProcessGroup] = None


def init_parallel(tp: int = 1, ep: int = 1, *, expert_tp: int = 1, backend: Optional[str] = None,
                  timeout: Union[timedelta, float] = timedelta(minutes=10)) -> ParallelGroups:
    """Create the TP / EP / DP / expert-DP groups of the module-doc layout on every rank.

    Initialises torch.distributed from the environment (torchrun's RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT; LOCAL_RANK picks the device) unless it is already initialised.
    Collective: every rank must call it with the same arguments. Without torch.distributed and
    without torchrun's environment, tp = ep = 1 gives `ParallelGroups.single()`.
    timeout (a timedelta or seconds): how long a collective waits for a stalled peer before it
    raises, for the default group (when this call creates it) and every group made here.
    """
    timeout = _as_timeout(timeout)
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            if tp == ep == expert_tp == 1:
                return ParallelGroups.single()
            raise RuntimeError(f"tonp_parallel.init_parallel(tp={tp}, ep={ep}): torch.distributed "
                               f"is not initialised and WORLD_SIZE is unset; launch with "
                               f"torchrun --nproc-per-node N")
        backend = backend or default_backend()
        _set_device(backend)
        dist.init_process_group(backend, timeout=timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = rank_layout(world, tp, ep, expert_tp)

    # new_group is collective over the whole world: every rank creates every group, in the same
    # order. Groups with the same ranks (e.g. EP = TP, or an earlier init_parallel call) share
    # one communicator; the cache lives as long as the default process group.
    global _CACHE_WORLD
    if _CACHE_WORLD is not dist.group.WORLD:
        _GROUP_CACHE.clear()
        _CACHE_WORLD = dist.group.WORLD
    mine: Dict[str, Optional[dist.ProcessGroup]] = {}
    for kind in ("tp", "dp", "ep", "expert_tp", "expert_dp"):
        for ranks in getattr(layout, f"{kind}_groups"):
            if ranks not in _GROUP_CACHE:
                _GROUP_CACHE[ranks] = None if len(ranks) == 1 else dist.new_group(
                    list(ranks), timeout=timeout)
            if rank in ranks:
                mine[kind] = _GROUP_CACHE[ranks]

    def _pos(kind):
        ranks = layout.group_of(kind, rank)
        return ranks.index(rank), len(ranks)

    (tpr, tps), (dpr, dps), (epr, eps), (etr, ets), (edr, eds) = (
        _pos(k) for k in ("tp", "dp", "ep", "expert_tp", "expert_dp"))
    return ParallelGroups(tp_group=mine["tp"], ep_group=mine["ep"], dp_group=mine["dp"],
                          tp_rank=tpr, tp_size=tps, ep_rank=epr, ep_size=eps, dp_rank=dpr,
                          dp_size=dps, expert_tp_group=mine["expert_tp"], expert_tp_rank=etr,
                          expert_tp_size=ets, expert_dp_group=mine["expert_dp"],
                          expert_dp_rank=edr, expert_dp_size=eds, rank=rank, world_size=world,
                          backend=dist.get_backend(), device=group_device(dist.group.WORLD))


def _as_timeout(timeout: Union[timedelta, float]) -> timedelta:
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"tonp_parallel.init_parallel: timeout must be a positive number of "
                         f"seconds or a timedelta, got {timeout!r}")
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)
