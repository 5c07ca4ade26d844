"""TP/EP layouts: capture per rank, gather to rank 0, merge into one trace comparable with TP 1.

Every rank of a TP group runs the same ops in the same order, so the records line up by index:
* a record with `shard_dim` (column-parallel outputs, per-head q/k/attention) is concatenated
  over ranks on that dim (rank order = head / column order), giving the TP-1 tensor;
* a "partial" record (a rank's fp32 share of a row-parallel reduction) is stacked on a new dim 1
  ([R, ranks, ...]), so "every rank's partial equal" is one comparison;
* any other record is replicated: rank 0's copy is kept, and ranks that disagree are noted in
  `trace.meta["rank_mismatch"]` (a collective that does not give every rank the same bits);
* expert records ("expert.*", one row per (token, expert)) are rank-local under EP: the rows of
  all ranks are kept.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .capture import Record, Trace
from .paths import PathSpec, run_path


def gather_traces(trace, group=None) -> Optional[list]:
    """All ranks' traces (or any picklable objects) on rank 0 of `group` (None = the world), in
    rank order; other ranks get None."""
    import torch.distributed as dist
    rank = dist.get_rank(group) if group is not None else dist.get_rank()
    world = dist.get_world_size(group)
    out = [None] * world if rank == 0 else None
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dist.gather_object(trace, out, dst=dst, group=group)
    return out


def run_layout(ckpt: str, sequences: Sequence[torch.Tensor], spec: PathSpec, *,
               dtype: Optional[torch.dtype] = None, prompt_lens=None,
               label: Optional[str] = None) -> Optional[Trace]:
    """Collective (every rank calls it): load checkpoint `spec.ckpt or ckpt` in the layout
    spec.tp x spec.ep (tonp_parallel.init_parallel), run `spec`'s path on every rank, and return
    the merged trace of rank 0's model-parallel group on rank 0 (None on other ranks)."""
    import tonp_parallel as tpar
    from ..qwen3_moe import Qwen3MoeForCausalLM
    if spec.tp > 1 and spec.ep > 1:
        raise NotImplementedError("diagnose: merging captures of TP x EP layouts (both > 1) is "
                                  "not supported; compare tp=N and ep=N separately")
    groups = tpar.init_parallel(tp=spec.tp, ep=spec.ep)
    model_groups = groups if spec.tp * spec.ep > 1 else None
    model = Qwen3MoeForCausalLM.from_pretrained(spec.ckpt or ckpt, dtype=dtype,
                                                groups=model_groups)
    trace = run_path(model, sequences, spec.kind, mode=spec.mode, prompt_lens=prompt_lens,
                     label=label or spec.label, rank=groups.rank)
    gathered = gather_traces((groups.dp_rank, trace))
    if gathered is None:
        return None
    return merge_ranks([t for dp, t in gathered if dp == 0], label or spec.label)


def merge_ranks(traces: List[Trace], label: Optional[str] = None) -> Trace:
    """One trace equal in shape to a TP-1 trace, from the per-rank traces (rank order)."""
    if not traces:
        raise ValueError("merge_ranks: no traces")
    split = [([r for r in t.records if not r.op.startswith("expert.")],
              [r for r in t.records if r.op.startswith("expert.")]) for t in traces]
    counts = {len(s[0]) for s in split}
    if len(counts) != 1:
        raise ValueError(f"merge_ranks: ranks captured different numbers of records {counts}; "
                         f"they did not run the same ops")
    merged = Trace(label or traces[0].label, meta=dict(traces[0].meta, ranks=len(traces)))
    mismatch, experts_done = [], set()
    for i, r0 in enumerate(split[0][0]):
        group = [s[0][i] for s in split]
        if any((r.layer, r.op) != (r0.layer, r0.op) for r in group):
            raise ValueError(f"merge_ranks: record {i} is {[(r.layer, r.op) for r in group]} "
                             f"across ranks")
        if r0.shard_dim is not None:
            value = torch.cat([r.value for r in group], r0.shard_dim)
        elif r0.kind == "partial":
            value = torch.stack([r.value for r in group], 1)
        else:
            value = r0.value
            if any(not torch.equal(r.value, value) for r in group[1:]):
                mismatch.append(f"layer {r0.layer} {r0.op}")
        merged.records.append(Record(r0.layer, r0.op, r0.keys, value, r0.kind, None, 0))
        if r0.op == "route.weights" and r0.layer not in experts_done:
            experts_done.add(r0.layer)  # this layer's expert rows follow its routing
            for s in split:
                merged.records.extend(r for r in s[1] if r.layer == r0.layer)
    if mismatch:
        merged.meta["rank_mismatch"] = sorted(set(mismatch))
    return merged


__all__ = ["gather_traces", "merge_ranks"]
