"""Vocab-parallel token embedding and LM head.

At TP degree t rank r holds vocabulary rows [r V/t, (r+1) V/t) of the embedding and of the LM
head (tied or not). Both stay bitwise equal to TP 1:
* the embedding looks up its own rows, writes zeros for the others and sums over ranks by the
  fixed tree: exactly one rank contributes a non-zero, so the sum is exact;
* the LM head's local logits are whole columns of the full logits (each column is its own
  chunk-tree dot product). `forward` gathers them ([.., V], exact: bytes only, for the few decode
  rows the generator samples from); `token_logprobs` and `argmax` never gather the vocabulary:
  each rank's `lse_partial` over its C_v / t vocab chunks, an all_gather of the (max, sum)
  pairs and `lse_finish` in rank order finish the same vocab chunk tree as TP 1; the target
  logit comes from its owning rank; argmax combines (max, lowest global index) per shard.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

import tonp_kernels as tk

from .linear import Shard, _divide, _tp_rank, _tp_size
from .weight_groups import HoldsWeightGroups, dense_grouped

# The vocabulary's chunk tree (tonp_kernels.token_logprobs' default: what TP 1 scores with).
VOCAB_CHUNKS = tk.DEFAULT_CHUNKS


def _vocab_shard(vocab_size: int, tp_group) -> tuple:
    t = _tp_size(tp_group)
    local = _divide(vocab_size, t, "vocab_size")
    return t, _tp_rank(tp_group) * local, local


class Embedding(nn.Module):
    """ids int64 [...] -> weight[ids] [..., H]; weight [V / t, H] (this rank's vocab rows)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32,
                 tp_group=None):
        super().__init__()
        self.vocab_size, self.tp_group = vocab_size, tp_group
        self.tp_size, self.vocab_start, self.local_vocab = _vocab_shard(vocab_size, tp_group)
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden_size, dtype=dtype))
        self.shards: Dict[str, Shard] = {} if self.tp_size == 1 else \
            {"weight": Shard(0, self.vocab_start, self.local_vocab, vocab_size)}

    def forward(self, ids: torch.Tensor, sp=None) -> torch.Tensor:
        """ids int64 [...] -> [..., H]; under sequence parallelism (`sp`, ids [T]) this rank's
        rows [n, H] (the sum over vocab shards as a reduce-scatter: exact all the same)."""
        flat = ids.reshape(-1)
        if self.tp_size == 1:
            return select_rows(self.weight, flat).view(*ids.shape, self.weight.shape[-1])
        from tonp_parallel import reduce_from_region
        from .probe import probe
        local = flat - self.vocab_start
        foreign = (local < 0) | (local >= self.local_vocab)
        rows = select_rows(self.weight, local.clamp(0, self.local_vocab - 1))          # (N, H)
        rows = rows.masked_fill(foreign.unsqueeze(1), 0.0)
        # One non-zero addend per element: the fp32 sum is exact, then the cast is too.
        if sp is not None and sp.size > 1:
            return sp.reduce_scatter(rows.float()).to(self.weight.dtype)           # (n, H)
        y = reduce_from_region(rows.float(), self.tp_group)
        probe("reduce", y, kind="collective")
        return y.to(self.weight.dtype).view(*ids.shape, self.weight.shape[-1])


def select_rows(weight: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """weight.index_select(0, flat) (its bits: a copy); under autograd the gradient comes from
    tonp::embedding_backward (each row written once: no zero-filled buffer, no scatter; on
    accelerators a segment sum). The token embedding's lookup, and the scoring's choice of the
    predicting rows."""
    if torch.is_grad_enabled() and weight.requires_grad:
        return _Lookup.apply(weight, flat)
    return weight.index_select(0, flat)


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, flat):
        ctx.save_for_backward(flat)
        ctx.rows = weight.shape[0]
        return weight.index_select(0, flat)

    @staticmethod
    def backward(ctx, grad):
        flat, = ctx.saved_tensors
        return torch.ops.tonp.embedding_backward(grad, flat, ctx.rows), None


class LMHead(HoldsWeightGroups, nn.Module):
    """h [..., H] -> fp32 logits [..., V] = h @ W.T, with W [V / t, H] its own or the embedding's
    (tied). Logits are fp32 in every dtype so rollout and training score from the same bits."""

    def __init__(self, vocab_size: int, hidden_size: int, *, chunks: int = tk.DEFAULT_CHUNKS,
                 tied: Optional[Embedding] = None, dtype: torch.dtype = torch.float32,
                 tp_group=None):
        super().__init__()
        self.chunks, self.vocab_size, self.tp_group = chunks, vocab_size, tp_group
        self.tp_size, self.vocab_start, self.local_vocab = _vocab_shard(vocab_size, tp_group)
        if self.tp_size > 1:
            _divide(VOCAB_CHUNKS, self.tp_size, "the vocabulary's reduction chunks")
        # A plain attribute list keeps the tied module out of this module's parameters.
        self._tied = [tied] if tied is not None else None
        self.weight = None if tied is not None else \
            nn.Parameter(torch.empty(self.local_vocab, hidden_size, dtype=dtype))
        self.shards: Dict[str, Shard] = {} if self.tp_size == 1 or tied is not None else \
            {"weight": Shard(0, self.vocab_start, self.local_vocab, vocab_size)}

    def _weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied is not None else self.weight

    def local_logits(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's vocab columns: fp32 [..., V / t] (the whole [..., V] at TP 1)."""
        if self.tp_size > 1:
            from tonp_parallel import copy_to_region
            h = copy_to_region(h, self.tp_group)
        return tk.linear(h, self._weight(), chunks=self.chunks, out_dtype=torch.float32,
                         weight_groups=self._read_group())

    def _grouped_weights(self):
        return (dense_grouped(self._weight()),)   # the tied embedding's too: the same tensor

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [..., V] on every rank (under TP the shards are gathered: exact)."""
        logits = self.local_logits(h)
        if self.tp_size == 1:
            return logits
        from tonp_parallel import gather_from_region
        return gather_from_region(logits, self.tp_group, -1)

    def token_logprobs(self, h: torch.Tensor, targets: torch.Tensor, *,
                       temperature: float = 1.0) -> torch.Tensor:
        """log_softmax(logits / T)[target] fp32 [...] for h [..., H], targets int [...]; the bits
        of `tonp_kernels.token_logprobs(self(h), targets)` at any TP degree. Differentiable."""
        if self.tp_size == 1 or tk.get_mode() == "torch":
            return tk.token_logprobs(self(h), targets, temperature=temperature)
        if targets.shape != h.shape[:-1]:
            raise ValueError(f"LMHead.token_logprobs: targets {tuple(targets.shape)} do not match "
                             f"h {tuple(h.shape)}")
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= self.vocab_size):
            raise IndexError(f"LMHead.token_logprobs: target id out of range "
                             f"[0, {self.vocab_size})")
        return _VocabParallelLogprobs.apply(self.local_logits(h), targets.long(), self,
                                            float(temperature))

    @torch.no_grad()
    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy token int64 [...] for h [..., H]: `tonp_kernels.argmax(self(h))` at any TP
        degree (lowest index on ties), without gathering the vocabulary."""
        if self.tp_size == 1 or tk.get_mode() == "torch":
            return tk.argmax(self(h))
        from tonp_parallel import all_gather_stacked
        value, index = tk.max_with_index(self.local_logits(h))
        values = all_gather_stacked(value, self.tp_group)                        # (t, ...)
        indices = all_gather_stacked(index + self.vocab_start, self.tp_group)    # (t, ...)
        best = values.max(0).values
        masked = torch.where(values == best, indices, torch.iinfo(torch.int64).max)
        return masked.min(0).values

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size} (local {self.vocab_start}.."
                f"{self.vocab_start + self.local_vocab - 1}), tp={self.tp_size}, "
                f"tied={self._tied is not None}")


class _VocabParallelLogprobs(torch.autograd.Function):
    """Forward: the vocab chunk tree finished across ranks (see the module doc).
    Backward (torch math): d lp / d x_v = ([v == target] - softmax(x / T)_v) / T."""

    @staticmethod
    def forward(ctx, local, targets, head, temperature):
        from tonp_parallel import all_gather_stacked, tree_all_reduce
        group, start, n = head.tp_group, head.vocab_start, head.local_vocab
        m, s = tk.lse_partial(local, temperature=temperature,
                              chunks=VOCAB_CHUNKS // head.tp_size)                 # (...) x2
        ms = all_gather_stacked(torch.stack([m, s]), group)                      # (t, 2, ...)
        lse = tk.lse_finish(ms[:, 0], ms[:, 1])                                  # (...)
        idx = targets - start
        owned = (idx >= 0) & (idx < n)
        tl = tk.target_logit(local, idx.clamp(0, n - 1), temperature=temperature)
        # Only the owning rank's addend is non-zero: the tree sum is exact.
        tl = tree_all_reduce(torch.where(owned, tl, torch.zeros_like(tl)), group)
        ctx.save_for_backward(local, lse, idx, owned)
        ctx.temperature = temperature
        return tl - lse

    @staticmethod
    def backward(ctx, grad):
        local, lse, idx, owned = ctx.saved_tensors
        T = ctx.temperature
        p = torch.exp(local.float() / T - lse.unsqueeze(-1))                      # (..., V/t)
        g = -(grad.unsqueeze(-1) * p) / T
        hit = torch.zeros_like(g).scatter_(-1, idx.clamp(0, local.shape[-1] - 1).unsqueeze(-1),
                                           (grad * owned.float() / T).unsqueeze(-1))
        return (g + hit).to(local.dtype), None, None, None
