"""Process groups for tensor (TP), expert (EP), pipeline (PP), context (CP) and data (DP)
parallelism, plus the sequence-parallel switch (SP) and the pipeline's layer split.

A `ParallelGroups` is handed to every layer at construction; layers never look groups up
themselves. Three ways to get one:

    groups = ParallelGroups.single()                 # one process, no torch.distributed
    groups = init_parallel(tp=2, ep=2, pp=2, cp=1, sp=True)   # under torchrun (gloo / nccl / hccl)
    groups = ParallelGroups.from_megatron()          # adopt megatron.core.parallel_state

A group of size 1 may be `None`: every tonp_parallel collective treats `group=None` as "this
rank alone" (no communication), NOT as torch.distributed's WORLD.

Rank layout: megatron-core's default order "tp-cp-ep-dp-pp" (checked against its RankGenerator
in tests/test_pipeline.py):

* Dense (attention, dense MLP, embedding, LM head): world = pp x dp x cp x tp, TP fastest:
      global rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
  TP groups are runs of `tp` consecutive ranks; CP groups take every tp-th rank inside a run of
  tp x cp; DP groups every (tp x cp)-th rank inside a stage; PP groups every (W / pp)-th rank.
  `dp_cp_group` is megatron's data-parallel group with context parallelism (gradients of the
  replicated parameters are summed over it).
* Experts: inside each stage (a block of W / pp ranks), expert_dp x ep x expert_tp, expert TP
  fastest:
      global rank = pp_rank * W / pp + (expert_dp_rank * ep + ep_rank) * expert_tp + expert_tp_rank
  so EP groups are sub-groups of the same stage's DP x CP x TP ranks (megatron's expert rank
  generator). With the default expert_tp = 1 (whole experts on each rank, as in DeepSeek-V3 and
  megatron's `--expert-tensor-parallel-size 1`), EP groups are runs of `ep` consecutive ranks.
  With expert_tp = tp the EP groups take every tp-th rank and each expert is split over TP.

Example, world 4, tp=2, ep=2, expert_tp=1:  TP {0,1} {2,3}; DP {0,2} {1,3}; EP {0,1} {2,3}.
Example, world 4, tp=2, pp=2:               TP {0,1} {2,3}; PP {0,2} {1,3}; DP {0} {1} {2} {3}.
Example, world 4, cp=2, tp=2:               TP {0,1} {2,3}; CP {0,2} {1,3}.

Within a group, ranks are numbered in ascending global rank (torch.distributed's convention),
and that is the order of the fixed-order reduction tree and of the pipeline's stages.
"""
from __future__ import annotations

import gc
import math
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .collectives import group_device
from .layout import validate_model_layout

Ranks = Tuple[int, ...]


KINDS = ("tp", "dp", "ep", "expert_tp", "expert_dp", "pp", "cp", "dp_cp", "model")


@dataclass(frozen=True)
class RankLayout:
    """The rank groups of a (world, tp, ep, expert_tp, pp, cp) layout, as tuples of global ranks.
    `model_groups`: the ranks that hold one model replica together (TP x CP x PP); they must
    make the same calls with the same tokens."""

    world_size: int
    tp: int
    ep: int
    expert_tp: int
    tp_groups: List[Ranks]
    dp_groups: List[Ranks]
    ep_groups: List[Ranks]
    expert_tp_groups: List[Ranks]
    expert_dp_groups: List[Ranks]
    pp: int = 1
    cp: int = 1
    pp_groups: List[Ranks] = field(default_factory=list)
    cp_groups: List[Ranks] = field(default_factory=list)
    dp_cp_groups: List[Ranks] = field(default_factory=list)
    model_groups: List[Ranks] = field(default_factory=list)

    def group_of(self, kind: str, rank: int) -> Ranks:
        """The group of kind 'tp' | 'dp' | 'ep' | 'expert_tp' | 'expert_dp' | 'pp' | 'cp' |
        'dp_cp' | 'model' holding `rank`."""
        for ranks in getattr(self, f"{kind}_groups"):
            if rank in ranks:
                return ranks
        raise ValueError(f"rank {rank} is outside the world of size {self.world_size}")


def check_layout(world_size: int, tp: int = 1, ep: int = 1, expert_tp: int = 1, *,
                 pp: int = 1, cp: int = 1) -> None:
    """Raise ValueError unless tp, ep, expert_tp, pp and cp tile `world_size` ranks (the rules
    live in `tonp_parallel.layout`)."""
    validate_model_layout(None, tp, ep, expert_tp, world_size=world_size, pp=pp, cp=cp)


def _orthogonal(sizes: Dict[str, int], members: Tuple[str, ...]) -> List[Ranks]:
    """The groups spanning the dimensions `members` of a row-major rank grid whose dimensions
    (fastest first) are `sizes`: megatron's generate_masked_orthogonal_rank_groups."""
    names = list(sizes)
    strides = {n: math.prod(sizes[m] for m in names[:i]) for i, n in enumerate(names)}
    outer = [n for n in names if n not in members]
    groups = []
    for fixed in _grid([sizes[n] for n in outer]):
        base = sum(i * strides[n] for i, n in zip(fixed, outer))
        groups.append(tuple(sorted(base + sum(i * strides[n] for i, n in zip(idx, members))
                                   for idx in _grid([sizes[n] for n in members]))))
    return sorted(groups)


def _grid(dims: List[int]) -> List[Tuple[int, ...]]:
    out: List[Tuple[int, ...]] = [()]
    for d in dims:
        out = [t + (i,) for t in out for i in range(d)]
    return out


def rank_layout(world_size: int, tp: int = 1, ep: int = 1, expert_tp: int = 1, *,
                pp: int = 1, cp: int = 1) -> RankLayout:
    """Every TP / DP / EP / expert-TP / expert-DP / PP / CP group of the layout described in the
    module doc.

    Pure arithmetic (no torch.distributed), so it can be checked against megatron-core's
    `RankGenerator` and printed by launch scripts.
    """
    check_layout(world_size, tp, ep, expert_tp, pp=pp, cp=cp)
    dense = {"tp": tp, "cp": cp, "dp": world_size // (tp * cp * pp), "pp": pp}
    expert = {"tp": expert_tp, "ep": ep, "dp": world_size // (expert_tp * ep * pp), "pp": pp}
    return RankLayout(
        world_size, tp, ep, expert_tp,
        tp_groups=_orthogonal(dense, ("tp",)), dp_groups=_orthogonal(dense, ("dp",)),
        ep_groups=_orthogonal(expert, ("ep",)), expert_tp_groups=_orthogonal(expert, ("tp",)),
        expert_dp_groups=_orthogonal(expert, ("dp",)), pp=pp, cp=cp,
        pp_groups=_orthogonal(dense, ("pp",)), cp_groups=_orthogonal(dense, ("cp",)),
        dp_cp_groups=_orthogonal(dense, ("cp", "dp")),
        model_groups=_orthogonal(dense, ("tp", "cp", "pp")))


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
                                   averaged over it; it spans the dense DP replicas, the CP
                                   ranks and, when tp > ep, the TP ranks that hold a copy of
                                   the same experts)
      pp_group, pp_rank, pp_size   pipeline parallelism: stage pp_rank holds the layers
                                   `stage_layers(L, pp_size, pp_layers)[pp_rank]`
      cp_group, cp_rank, cp_size   context parallelism: each rank holds a zig-zag slice of every
                                   sequence's tokens in the training forward
      dp_cp_group/_rank/_size      the DP x CP ranks holding the same parameters (replicated
                                   gradients are summed over it, divided by dp_size)
      model_group                  the TP x CP x PP ranks of one model replica (they make the
                                   same calls with the same tokens)
      sequence_parallel            Megatron's SP: activations split along tokens over the TP
                                   group in the norm and residual regions (no-op at tp 1)
      pp_layers                    layers per stage (None: as even as possible)
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
    pp_group: Optional[dist.ProcessGroup] = None
    pp_rank: int = 0
    pp_size: int = 1
    cp_group: Optional[dist.ProcessGroup] = None
    cp_rank: int = 0
    cp_size: int = 1
    dp_cp_group: Optional[dist.ProcessGroup] = None
    dp_cp_rank: int = 0
    dp_cp_size: int = 1
    model_group: Optional[dist.ProcessGroup] = None
    sequence_parallel: bool = False
    pp_layers: Optional[Tuple[int, ...]] = None
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
        """Adopt the groups of an initialised `megatron.core.parallel_state` (TP, EP, DP, PP,
        CP; sequence_parallel and pp_layers are not parallel_state's: set them on the result,
        e.g. `dataclasses.replace(groups, sequence_parallel=True)`)."""
        try:
            from megatron.core import parallel_state as ps
        except ImportError as e:  # megatron-core is an optional dependency
            raise ImportError("ParallelGroups.from_megatron needs megatron-core "
                              "(pip install megatron-core)") from e
        if not ps.model_parallel_is_initialized():
            raise RuntimeError("ParallelGroups.from_megatron: megatron.core.parallel_state is not "
                               "initialised; call parallel_state.initialize_model_parallel(...) "
                               "first, or use tonp_parallel.init_parallel(tp=, ep=)")
        # megatron's model-parallel group is TP x PP; with CP there is no TP x CP x PP group.
        mp = ps.get_model_parallel_group() if ps.get_context_parallel_world_size() == 1 else None
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
            pp_group=ps.get_pipeline_model_parallel_group(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            cp_group=ps.get_context_parallel_group(),
            cp_rank=ps.get_context_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(),
            dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
            dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            dp_cp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
            model_group=mp,
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


_GROUP_CACHE: Dict[tuple, Optional[dist.ProcessGroup]] = {}
_CACHE_WORLD: Optional[dist.ProcessGroup] = None


def init_parallel(tp: int = 1, ep: int = 1, *, pp: int = 1, cp: int = 1, sp: bool = False,
                  pp_layers: Optional[Sequence[int]] = None, expert_tp: int = 1,
                  backend: Optional[str] = None,
                  timeout: Union[timedelta, float] = timedelta(minutes=10)) -> ParallelGroups:
    """Create the TP / EP / DP / expert-DP / PP / CP groups of the module-doc layout on every rank.

    Initialises torch.distributed from the environment (torchrun's RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT; LOCAL_RANK picks the device) unless it is already initialised.
    Collective: every rank must call it with the same arguments. Without torch.distributed and
    without torchrun's environment, all degrees 1 give `ParallelGroups.single()` (with `sp`).
    sp: sequence parallelism over the TP group; pp_layers: layers per pipeline stage (checked
    against the model when it is built). timeout (a timedelta or seconds): how long a
    collective or a pipeline receive waits for a stalled peer before it raises, for the default
    group (when this call creates it) and every group made here.
    """
    timeout = _as_timeout(timeout)
    if not isinstance(sp, bool):
        raise TypeError(f"tonp_parallel.init_parallel: sp must be True or False, got {sp!r}")
    layers = None if pp_layers is None else tuple(pp_layers)
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            if tp == ep == expert_tp == pp == cp == 1:
                check_layout(1)
                return ParallelGroups(sequence_parallel=sp, pp_layers=layers)
            raise RuntimeError(f"tonp_parallel.init_parallel(tp={tp}, ep={ep}, pp={pp}, cp={cp}): "
                               f"torch.distributed is not initialised and WORLD_SIZE is unset; "
                               f"launch with torchrun --nproc-per-node N")
        backend = backend or default_backend()
        _set_device(backend)
        dist.init_process_group(backend, timeout=timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = rank_layout(world, tp, ep, expert_tp, pp=pp, cp=cp)
    if layers is not None:
        validate_model_layout(None, pp=pp, pp_layers=layers)

    # new_group is collective over the whole world: every rank creates every group, in the same
    # order. Groups with the same ranks (e.g. EP = TP, or an earlier init_parallel call) share
    # one communicator; the cache lives as long as the default process group. Pipeline groups
    # carry point-to-point traffic and get communicators of their own.
    global _CACHE_WORLD
    if _CACHE_WORLD is not dist.group.WORLD:
        _GROUP_CACHE.clear()
        _CACHE_WORLD = dist.group.WORLD
    mine: Dict[str, Optional[dist.ProcessGroup]] = {}
    pos: Dict[str, Tuple[int, int]] = {}
    for kind in KINDS:
        for ranks in getattr(layout, f"{kind}_groups"):
            key = ("p2p", *ranks) if kind == "pp" else ranks
            if key not in _GROUP_CACHE:
                _GROUP_CACHE[key] = None if len(ranks) == 1 else dist.new_group(
                    list(ranks), timeout=timeout)
            if rank in ranks:
                mine[kind] = _GROUP_CACHE[key]
                pos[kind] = (ranks.index(rank), len(ranks))
    kw = {}
    for kind in ("tp", "ep", "dp", "expert_tp", "expert_dp", "pp", "cp", "dp_cp"):
        kw.update({f"{kind}_group": mine[kind], f"{kind}_rank": pos[kind][0],
                   f"{kind}_size": pos[kind][1]})
    return ParallelGroups(**kw, model_group=mine["model"], sequence_parallel=sp,
                          pp_layers=layers, rank=rank, world_size=world,
                          backend=dist.get_backend(), device=group_device(dist.group.WORLD))


def destroy_parallel() -> None:
    """End torch.distributed and every group `init_parallel` made, here, while the interpreter is
    fully alive (call it as a rank's last step; a no-op when nothing is initialised).

    `dist.destroy_process_group()` alone leaves a gloo group's worker threads running for as long
    as anything refers to the group, and init_parallel's cache does: they were then torn down in
    the interpreter's finalisation, where a rank can abort with "terminate called without an
    active exception" (gloo work still holding tensors; pytorch/pytorch#179291). Drop your own
    references (ParallelGroups, models built on them) before calling it: the collection at the
    end frees what only cycles still hold."""
    global _CACHE_WORLD
    _GROUP_CACHE.clear()
    _CACHE_WORLD = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _as_timeout(timeout: Union[timedelta, float]) -> timedelta:
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"tonp_parallel.init_parallel: timeout must be a positive number of "
                         f"seconds or a timedelta, got {timeout!r}")
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)
