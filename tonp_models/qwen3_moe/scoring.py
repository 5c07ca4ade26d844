"""Scoring and training steps by the training forward, in every layout:

    lps = token_logprobs(model, seqs, temperature)            # model.token_logprobs
    out = forward_backward(model, seqs, loss_fn, micro_batches=4)   # model.forward_backward
    out.loss, out.logprobs                                    # the same on every rank

A micro-batch is a group of whole sequences, packed (cu_seqlens). Each rank of a model replica
runs its part: its stage's layers (PP), its zig-zag slice of the tokens (CP), its rows of the
norm and residual regions (SP), its heads and experts (TP, EP); the last stage scores the
rows that predict a token. Under PP the micro-batches go through tonp_parallel.pipeline's
schedules (forward-only for scoring, 1F1B for a training step); at PP 1 the same code runs
them one after the other (gradient accumulation). Logprobs travel from the last stage to the
others as bytes, so every rank returns the same bits, and the bits of the one-process model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence

import torch

import tonp_kernels as tk
from tonp_parallel.context import positions_of
from tonp_parallel.pipeline import PipeComm, micro_batch_bounds, run_1f1b, run_forward

from ..layers.embedding import select_rows


@dataclass
class StepResult:
    """What `forward_backward` returns on every rank: loss (fp32 scalar, the sum of the
    micro-batches' losses in order), logprobs (fp32 [len - 1] per sequence, detached) and
    wait_s (seconds this rank waited for its pipeline neighbours: the bubble, plus transfers)."""
    loss: torch.Tensor
    logprobs: List[torch.Tensor]
    wait_s: float = 0.0


def _checked(model, who: str, sequences, temperature, extra=lambda: (), key=()):
    """(sequences as int64 tensors, temperature) once every rank of the replica agrees."""
    from ..checks import TPCheck, check_temperature, sequence_list, token_ids
    V, limit = model.config.vocab_size, model.config.max_position_embeddings

    def check():
        T = check_temperature(who, temperature, greedy_ok=False)
        extra()
        seqs = [token_ids(who, f"sequence {i}", s, V)
                for i, s in enumerate(sequence_list(who, "sequences", sequences))]
        for i, s in enumerate(seqs):
            if not 0 < len(s) <= limit:
                raise ValueError(f"{who}: sequence {i} has {len(s)} tokens; every sequence needs "
                                 f"at least one token and at most max_position_embeddings="
                                 f"{limit}")
        return seqs, T

    return TPCheck.of(model, who).agreed(
        check, lambda v: (v[1], *key, [len(s) for s in v[0]],
                          torch.cat(v[0]) if v[0] else None))


class _Plan:
    """One micro-batch of whole sequences as this rank runs it: the model's ForwardBatch (its
    rows, positions, attention and SP layout) and the rows that predict a token."""

    def __init__(self, model, seqs: Sequence[torch.Tensor]):
        self.lens = [len(s) for s in seqs]
        bounds = [0]
        for n in self.lens:
            bounds.append(bounds[-1] + n)
        ids = torch.cat(seqs).cpu() if seqs else torch.zeros(0, dtype=torch.long)
        self.batch = model.batch(ids.to(model.device), bounds)  # bookkeeping stays on the host
        split = self.batch.cp
        rows = split.rows if split is not None else torch.arange(len(ids))       # (T_loc,)
        seq = torch.repeat_interleave(torch.arange(len(self.lens)), torch.tensor(
            self.lens, dtype=torch.long), output_size=len(ids))
        ends = torch.tensor(bounds[1:], dtype=torch.long)
        predicts = rows + 1 < ends[seq[rows]] if len(rows) else rows.bool()
        self.pred = predicts.nonzero().squeeze(1)                                  # local rows
        self.targets = ids.index_select(0, rows.index_select(0, self.pred) + 1)
        self.split, self.rows_local = split, len(rows)
        if split is not None:  # the predicting rows of the whole micro-batch, in packed order
            every = positions_of(bounds) < (ends - torch.tensor(bounds[:-1]))[seq] - 1
            self.pred_global = every.nonzero().squeeze(1).to(model.device)
        self.pred, self.targets = self.pred.to(model.device), self.targets.to(model.device)
        self.shape = ((self.batch.hidden_rows, model.config.hidden_size), model.dtype)

    def score(self, model, h: torch.Tensor, temperature: float) -> torch.Tensor:
        """Last stage: fp32 [R] logprobs of the micro-batch's predicting rows, packed order."""
        sp = self.batch.sp
        if sp is not None:
            h = sp.gather(h, sum_grads=False)                                      # (T_loc, H)
        h = model.norm(select_rows(h, self.pred))                                  # (R_loc, H)
        # The LM head scores its vocab shard and finishes the vocab tree across TP ranks.
        lp = model.lm_head.token_logprobs(h, self.targets, temperature=temperature)
        if self.split is None:
            return lp
        full = lp.new_zeros(self.rows_local).index_copy(0, self.pred, lp)         # (T_loc,)
        return self.split.gather(full).index_select(0, self.pred_global)           # (R,)

    def split_rows(self, lp: torch.Tensor) -> List[torch.Tensor]:
        return list(lp.split([n - 1 for n in self.lens]))


def _groups(seqs, micro_batch_size, default_parts: int) -> List[range]:
    if micro_batch_size is not None:
        return [range(i, min(i + micro_batch_size, len(seqs)))
                for i in range(0, len(seqs), micro_batch_size)]
    return micro_batch_bounds([len(s) for s in seqs], min(default_parts, max(len(seqs), 1)))


def _comm(model) -> PipeComm:
    return PipeComm(model.groups.pp_group if model.pipelined else None,
                    next(model.parameters()).device)


def token_logprobs(model, sequences, temperature, micro_batch_size, packed) -> List[torch.Tensor]:
    """`Qwen3MoeForCausalLM.token_logprobs` (see its docstring)."""
    from ..checks import as_int
    who = "token_logprobs"

    def extra():
        if micro_batch_size is not None:
            as_int(who, "micro_batch_size", micro_batch_size, 1)
        if not isinstance(packed, bool):
            raise TypeError(f"{who}: packed must be True or False, got {packed!r}")
        if not packed and (model.pipelined or model.groups.cp_size > 1):
            raise ValueError(f"{who}: packed=False (padded scoring) runs at PP = CP = 1 only")
        if model.pipelined and torch.is_grad_enabled() and \
                any(p.requires_grad for p in model.parameters()):
            raise ValueError(f"{who}: under pipeline parallelism autograd does not cross stages; "
                             f"score under torch.no_grad() and train with "
                             f"model.forward_backward(sequences, loss_fn)")

    seqs, temperature = _checked(model, who, sequences, temperature, extra,
                                 key=(packed, micro_batch_size))
    if not packed:
        out: List[torch.Tensor] = []
        mb = micro_batch_size or max(len(seqs), 1)
        for i in range(0, len(seqs), mb):
            out.extend(_score_padded(model, seqs[i:i + mb], temperature))
        return out
    groups = _groups(seqs, micro_batch_size, model.pipeline_micro_batches)
    plans = [_Plan(model, [seqs[i] for i in g]) for g in groups]
    comm = _comm(model)

    def forward(m, x):
        h = model.stage_forward(x, plans[m].batch)
        return plans[m].score(model, h, temperature) if model.is_last else h

    outs = run_forward(comm, len(plans), forward, lambda m: plans[m].shape)
    if comm.stages > 1:
        total = sum(len(s) - 1 for s in seqs)
        flat = comm.from_last(torch.cat(outs) if outs else None, (total,), torch.float32)
        outs = list(flat.split([sum(p.lens) - len(p.lens) for p in plans]))
    return [lp for p, o in zip(plans, outs) for lp in p.split_rows(o)]


def _score_padded(model, seqs, temperature) -> List[torch.Tensor]:
    """The padded path (attention_mask), PP = CP = 1: the same bits as the packed one."""
    lens = [len(s) for s in seqs]
    targets = torch.cat([s[1:] for s in seqs]) if seqs else torch.zeros(0, dtype=torch.long)
    L = max(lens)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, True
    pred = mask.clone()
    pred[torch.arange(len(seqs)), torch.tensor(lens) - 1] = False
    logits = model(ids, attention_mask=mask)[pred.to(model.device)]                # (R, V)
    targets = targets.to(model.device)
    lp = tk.token_logprobs(logits, targets, temperature=temperature)
    return list(lp.split([n - 1 for n in lens]))


def forward_backward(model, sequences, loss_fn: Callable[[List[torch.Tensor], range],
                                                          torch.Tensor], *,
                     micro_batches: int = 1, temperature: float = 1.0) -> StepResult:
    """One training step's forward and backward: gradients accumulate into the parameters'
    .grad (zero them first).

    sequences: as token_logprobs'. They are cut into `micro_batches` contiguous groups of about
    equal tokens (at most one group a sequence). loss_fn(logprobs, index) -> this micro-batch's
    share of the loss, a differentiable scalar: logprobs are its sequences' per-token logprobs
    (as token_logprobs gives them), index the range of their positions in `sequences`; the
    step's loss is the sum of the shares (e.g. -sum(logprobs) / total tokens for a mean).
    It runs on the last stage only. Under PP the micro-batches run the 1F1B schedule; at PP 1
    one after the other. Every rank of the replica passes the same sequences and settings.
    """
    from ..checks import as_int
    who = "forward_backward"
    if not callable(loss_fn):
        raise TypeError(f"{who}: loss_fn must be callable (logprobs, index) -> scalar loss, got "
                        f"{type(loss_fn).__name__}")
    seqs, temperature = _checked(
        model, who, sequences, temperature,
        lambda: as_int(who, "micro_batches", micro_batches, 1), key=(micro_batches,))
    groups = micro_batch_bounds([len(s) for s in seqs], min(micro_batches, max(len(seqs), 1)))
    plans = [_Plan(model, [seqs[i] for i in g]) for g in groups]
    losses: List[torch.Tensor] = []
    lps: List[torch.Tensor] = []

    def forward(m, x):
        h = model.stage_forward(x, plans[m].batch)
        if not model.is_last:
            return h
        lp = plans[m].score(model, h, temperature)
        loss = loss_fn(plans[m].split_rows(lp), groups[m])
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"{who}: loss_fn must return a scalar tensor, got "
                            f"{loss.shape if isinstance(loss, torch.Tensor) else type(loss)}")
        losses.append(loss.detach().float().reshape(()))
        lps.append(lp.detach())
        return loss.reshape(())

    comm = _comm(model)
    with torch.enable_grad():
        run_1f1b(comm, len(plans), forward, lambda m: plans[m].shape, lambda m: plans[m].shape)
    n, total = len(plans), sum(len(s) - 1 for s in seqs)
    loss_vec = comm.from_last(torch.stack(losses) if losses else None, (n,), torch.float32)
    flat = comm.from_last(torch.cat(lps) if lps else None, (total,), torch.float32)
    loss = loss_vec[0] if n else torch.zeros(())
    for v in loss_vec[1:]:
        loss = loss + v
    return StepResult(loss, [lp for p, o in zip(plans, flat.split(
        [sum(p.lens) - len(p.lens) for p in plans])) for lp in p.split_rows(o)], comm.wait_s)


__all__ = ["StepResult", "token_logprobs", "forward_backward"]
