"""`Qwen3MoeForCausalLM.forward` under pipeline parallelism: the call's sequences are cut into
micro-batches that are in flight together, and every stage returns the last stage's result.

    logits = model(ids, cu, kv=step, logits_rows=last)   # a decode step

The generator (or any caller) needs nothing PP-specific: a decode step of S sequences becomes
`model.pipeline_micro_batches` groups of whole sequences (about equal tokens each); stage s
runs group m while stage s + 1 runs group m - 1 (tonp_parallel.pipeline.run_forward), each
stage writes its own layers' pages of the step (its allocator, stepped by the same scheduler on
every stage, prepared the same pages for the whole step before the forward), and the last
stage's logits (or final hidden states) travel back to every stage as bytes. A row's logits
depend only on its own sequence, so the split never changes a bit. The bubble of one call is
the pipeline's fill and drain: (P - 1) / (M + P - 1) of the stage time with M micro-batches.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from tonp_parallel.pipeline import PipeComm, micro_batch_bounds, run_forward


def forward_pipelined(model, ids: torch.Tensor, bounds: List[int], kv,
                      logits_rows: Optional[torch.Tensor], return_hidden: bool) -> torch.Tensor:
    """`model.forward` of packed sequences (checked by it) on a pipeline stage -> the last
    stage's logits [R, V] fp32 (or final hidden states [R, H]) on every stage."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
        raise ValueError("Qwen3MoeForCausalLM: under pipeline parallelism autograd does not "
                         "cross stages; call forward under torch.no_grad() (generate does) and "
                         "train with model.forward_backward(sequences, loss_fn)")
    S, T = len(bounds) - 1, bounds[-1]
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    groups = micro_batch_bounds(counts, min(model.pipeline_micro_batches, max(S, 1)))
    rows = torch.arange(T) if logits_rows is None else logits_rows.cpu()  # host bookkeeping
    starts = torch.tensor([bounds[g.start] for g in groups[1:]], dtype=torch.int64)
    part = torch.bucketize(rows, starts, right=True)                    # micro-batch of each row
    order = torch.argsort(part, stable=True)
    parts = [(rows.index_select(0, order[part.index_select(0, order) == m]) - bounds[g.start])
             .to(model.device) for m, g in enumerate(groups)]
    batches: dict = {}

    def batch(m):
        if m not in batches:
            g = groups[m]
            a, b = bounds[g.start], bounds[g.stop]
            local = [x - a for x in bounds[g.start:g.stop + 1]]
            batches[m] = model.batch(ids[a:b], local,
                                     None if kv is None else kv.tokens(a, b, slice(g.start,
                                                                                   g.stop)))
        return batches[m]

    def shape(m):
        return (batch(m).hidden_rows, model.config.hidden_size), model.dtype

    def forward(m, x):
        h = model.stage_forward(x, batch(m))
        if not model.is_last:
            return h
        h = model.head_hidden(h, batch(m), parts[m])
        return h if return_hidden else model.lm_head(h)

    comm = PipeComm(model.groups.pp_group, next(model.parameters()).device)
    outs = run_forward(comm, len(groups), forward, shape)
    width, dtype = (model.config.hidden_size, model.dtype) if return_hidden else \
        (model.config.vocab_size, torch.float32)
    out = None
    if comm.is_last:
        out = torch.empty((len(rows), width), dtype=dtype, device=outs[0].device)
        out[order.to(out.device)] = torch.cat(outs)
    return comm.from_last(out, (len(rows), width), dtype)


__all__ = ["forward_pipelined"]
