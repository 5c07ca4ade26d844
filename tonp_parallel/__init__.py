"""tonp_parallel: TP / EP / PP / CP / SP / DP process groups and fixed-order, autograd-aware
collectives.

    import tonp_parallel as tpar
    groups = tpar.init_parallel(tp=2, ep=2, pp=2, sp=True)   # under torchrun; or .single()
    tpar.validate_model_layout(config, tp=2, ep=2, pp=2)  # clear errors before any weight is built
    x = tpar.copy_to_region(x, groups.tp_group)       # column-parallel entry
    y = tpar.reduce_from_region(partial_fp32, groups.tp_group)  # row-parallel exit, fixed tree

The sum over ranks is always the contract's fixed pairwise tree in group-rank order (see
collectives.py), so a row-parallel layer at TP = t gives the bits of the TP = 1 kernel.
Modules: groups.py (rank layout, ParallelGroups, init_parallel, destroy_parallel), layout.py
(the layout rules, stage_layers), collectives.py (tree all-reduce / reduce-scatter), regions.py
(autograd pairs), sharding.py (Shard, parameter_shards), sequence.py (SequenceSplit: SP),
context.py (ContextSplit: CP), pipeline.py (PipeComm, the 1F1B and forward-only schedules),
launch.py (spawned local worlds). The design and its measurements: docs/parallelism.md.
"""
from .collectives import (ALGORITHMS, SMALL_MESSAGE_BYTES, all_gather_along, all_gather_stacked,
                          clear_workspace, group_device, group_rank, group_size, tree_all_reduce,
                          tree_order_sum, tree_reduce_scatter)
from .groups import (ParallelGroups, RankLayout, check_layout, default_backend, destroy_parallel,
                     init_parallel, rank_layout)
from .context import ContextSplit
from .layout import stage_layers, validate_model_layout
from .pipeline import PipeComm, StageFailed, run_1f1b, run_forward
from .sequence import SequenceSplit, enter_tp_region
from .regions import (all_gather_to_region, all_to_all, copy_to_region, gather_from_region,
                      gather_partials, reduce_from_region, reduce_scatter_to_region,
                      scatter_to_region)

__all__ = [
    "ParallelGroups", "RankLayout", "init_parallel", "destroy_parallel", "rank_layout",
    "check_layout", "default_backend", "validate_model_layout", "stage_layers",
    "ContextSplit", "SequenceSplit", "enter_tp_region", "PipeComm", "StageFailed", "run_1f1b",
    "run_forward",
    "tree_all_reduce", "tree_reduce_scatter", "tree_order_sum", "all_gather_stacked",
    "all_gather_along", "group_size", "group_rank", "group_device", "SMALL_MESSAGE_BYTES",
    "ALGORITHMS",
    "clear_workspace",
    "copy_to_region", "reduce_from_region", "gather_from_region", "scatter_to_region",
    "reduce_scatter_to_region", "all_gather_to_region", "gather_partials", "all_to_all",
]
