"""TP/EP layouts: capture per rank, gather to rank 0, merge into one trace comparable with TP 1.

Records line up by index across a TP group: sharded ones are concatenated on their shard dim,
partials stacked per rank, replicated ones kept from rank 0 (disagreements noted); EP expert
rows are named from their senders' dispatch records (docs/diagnose.md, "Rows, alignment,
layouts").
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

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
    spec.tp x spec.ep (tonp_parallel.init_parallel), run `spec`'s path on every rank (the same
    sequences on every data-parallel rank), and return the merged trace of rank 0's
    model-parallel group on rank 0 (None on other ranks)."""
    import torch.distributed as dist

    import tonp_parallel as tpar
    from ..qwen3_moe import Qwen3MoeForCausalLM
    groups = tpar.init_parallel(tp=spec.tp, ep=spec.ep)
    model_groups = groups if spec.tp * spec.ep > 1 else None
    model = Qwen3MoeForCausalLM.from_pretrained(spec.ckpt or ckpt, dtype=dtype,
                                                groups=model_groups)
    trace = run_path(model, sequences, spec.kind, mode=spec.mode, prompt_lens=prompt_lens,
                     label=label or spec.label, rank=groups.rank)
    ep_group = groups.ep_group if model_groups is not None else None
    trace.meta.update(rank=groups.rank, dp_rank=groups.dp_rank,
                      ep_ranks=dist.get_process_group_ranks(ep_group)
                      if ep_group is not None else [groups.rank],
                      experts_per_rank=model.config.num_experts // spec.ep)
    gathered = gather_traces(trace)
    if gathered is None:
        return None
    return merge_ranks(gathered, label or spec.label)


def compare_layouts(ckpt: str, sequences: Sequence[torch.Tensor], a, b, *,
                    dtype: Optional[torch.dtype] = None, prompt_lens=None,
                    out_dir: Optional[str] = None):
    """Collective: run path `a` and path `b` (PathSpec or text, e.g. "train" and "decode,ep=2")
    with run_layout and compare them -> Diagnosis on rank 0 (None elsewhere); also writes
    diagnosis.txt/.json to out_dir on rank 0 when given."""
    from .compare import compare_traces
    from .report import write_report
    specs = [PathSpec.parse(s) if isinstance(s, str) else s for s in (a, b)]
    labels = [s.label for s in specs]
    if labels[0] == labels[1]:
        labels = [labels[0] + " (A)", labels[1] + " (B)"]
    traces = [run_layout(ckpt, sequences, s, dtype=dtype, prompt_lens=prompt_lens, label=lab)
              for s, lab in zip(specs, labels)]
    if traces[0] is None:
        return None
    diag = compare_traces(*traces)
    if out_dir is not None:
        write_report(diag, out_dir)
    return diag


def _is_expert(r: Record) -> bool:
    return r.kind == "expert"


def _expert_slots(t: Trace) -> Dict[Optional[int], int]:
    """Layer -> how many of t's other (non-dispatch) records precede its first expert record."""
    slots: Dict[Optional[int], int] = {}
    n = 0
    for r in t.records:
        if _is_expert(r):
            slots.setdefault(r.layer, n)
        elif r.kind != "dispatch":
            n += 1
    return slots


def merge_ranks(traces: List[Trace], label: Optional[str] = None) -> Trace:
    """One trace equal in shape to a TP-1 trace, from every rank's trace (global rank order).
    Traces with meta["dp_rank"] != 0 only contribute the expert rows they ran for rank 0's
    group's tokens (EP); traces without layout metadata count as data-parallel rank 0."""
    if not traces:
        raise ValueError("merge_ranks: no traces")
    main = [t for t in traces if t.meta.get("dp_rank", 0) == 0]
    split = [[r for r in t.records if not _is_expert(r) and r.kind != "dispatch"] for t in main]
    counts = {len(s) for s in split}
    if len(counts) != 1:
        raise ValueError(f"merge_ranks: ranks captured different numbers of records {counts}; "
                         f"they did not run the same ops")
    experts = _expert_records(traces, main)
    slots = _expert_slots(main[0])  # a layer's expert rows go where rank 0 had its first
    where = {layer: slots.get(layer, len(split[0])) for layer in experts}
    merged = Trace(label or traces[0].label, meta=dict(main[0].meta, ranks=len(main)))
    mismatch = []
    for i, r0 in enumerate(split[0] + [None]):
        for layer in [k for k, at in where.items() if at == i]:
            merged.records.extend(experts[layer])
        if r0 is None:
            break
        group = [s[i] for s in split]
        if any((r.layer, r.op) != (r0.layer, r0.op) for r in group):
            raise ValueError(f"merge_ranks: record {i} is {[(r.layer, r.op) for r in group]} "
                             f"across ranks")
        keys = r0.keys
        if r0.shard_dim == 0:
            keys = torch.cat([r.keys for r in group])
            value = torch.cat([r.value for r in group])
        elif r0.shard_dim is not None:
            value = torch.cat([r.value for r in group], r0.shard_dim)
        elif r0.kind == "partial":
            value = torch.stack([r.value for r in group], 1)
        else:
            value = r0.value
            if any(not torch.equal(r.value, value) for r in group[1:]):
                mismatch.append(f"layer {r0.layer} {r0.op}")
        merged.records.append(Record(r0.layer, r0.op, keys, value, r0.kind, None, 0))
    if mismatch:
        merged.meta["rank_mismatch"] = sorted(set(mismatch))
    return merged


def _expert_records(traces: List[Trace], main: List[Trace]) -> Dict[Optional[int], List[Record]]:
    """Layer -> expert records with keys, for the tokens of the main (dp rank 0) traces."""
    out: Dict[Optional[int], List[Record]] = {}
    for t in main:  # without EP: computed where the token lives
        for r in t.records:
            if _is_expert(r) and r.recv_rows is None:
                out.setdefault(r.layer, []).append(r)
    if not any(r.recv_rows is not None for t in traces for r in t.records):
        return out
    by_rank = {t.meta.get("rank", i): t for i, t in enumerate(traces)}
    mine = {t.meta.get("rank", 0) for t in main}
    sent = {rank: _dispatches(t) for rank, t in by_rank.items()}
    for rank, t in by_rank.items():
        senders = t.meta.get("ep_ranks", [rank])
        per_rank = t.meta.get("experts_per_rank")
        if rank not in senders or per_rank is None or any(s not in sent for s in senders):
            raise ValueError(f"merge_ranks: rank {rank} ran experts under EP but its EP group "
                             f"{senders} was not captured, or its trace lacks "
                             f"meta['experts_per_rank'] (run_layout sets both)")
        me = senders.index(rank)
        calls: Dict[Optional[int], int] = {}
        for r in t.records:
            if r.kind == "dispatch":
                calls[r.layer] = calls.get(r.layer, 0) + 1
            if not _is_expert(r) or r.recv_rows is None:
                continue
            k = calls.get(r.layer, 0) - 1
            keys, source = [], []
            for s in senders:  # the rows this rank received in call k, by source rank
                d = sent[s].get(r.layer, [])
                if k < 0 or k >= len(d):
                    raise ValueError(f"merge_ranks: layer {r.layer} ran {len(d)} dispatches on "
                                     f"rank {s} but rank {rank} received call {k}")
                rows = d[k][d[k][:, 2] // per_rank == me]
                keys.append(rows)
                source.append(torch.full((rows.shape[0],), s, dtype=torch.int64))
            table, source = torch.cat(keys), torch.cat(source)
            if r.recv_rows.numel() and int(r.recv_rows.max()) >= table.shape[0]:
                raise ValueError(f"merge_ranks: layer {r.layer} {r.op} on rank {rank} indexes "
                                 f"received row {int(r.recv_rows.max())} of {table.shape[0]}")
            rk = table.index_select(0, r.recv_rows)
            if not torch.equal(rk[:, 2], r.keys[:, 2]):
                raise ValueError(f"merge_ranks: layer {r.layer} {r.op} on rank {rank}: the "
                                 f"senders' dispatch records do not match the received experts")
            keep = torch.isin(source.index_select(0, r.recv_rows),
                              torch.tensor(sorted(mine), dtype=torch.int64))
            out.setdefault(r.layer, []).append(Record(r.layer, r.op, rk[keep], r.value[keep],
                                                      r.kind, None, rank))
    return out


def _dispatches(t: Trace) -> Dict[Optional[int], List[torch.Tensor]]:
    """Layer -> the keys of each dispatch call's sent rows (in call order)."""
    d: Dict[Optional[int], List[torch.Tensor]] = {}
    for r in t.records:
        if r.kind == "dispatch":
            d.setdefault(r.layer, []).append(r.keys)
    return d


__all__ = ["gather_traces", "run_layout", "compare_layouts", "merge_ranks"]
