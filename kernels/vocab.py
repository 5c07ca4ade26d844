"""Public vocabulary reductions and seeded sampling: logsumexp / log_softmax / token_logprobs by
the vocab chunk tree, the vocab-shard pieces (lse_partial + lse_finish, max_with_index, argmax)
and `sample`. Each checks its scalar arguments, then runs what `_dispatch.impl` picks (the
backend checks the tensors).

A row whose softmax does not exist is refused, naming the row: logits / temperature reaching +inf
(an infinite logit or fp32 overflow), and for log_softmax / token_logprobs every logit -inf.
A NaN logit gives NaN (argmax and sample refuse it; max_with_index skips it). Shapes: M rows,
V vocabulary, P shards.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _arg_checks as check
from ._arg_checks import check_temperature
from ._dispatch import impl
from .ops import DEFAULT_CHUNKS


def logsumexp(logits: torch.Tensor, *, temperature: float = 1.0,
              chunks: int = DEFAULT_CHUNKS) -> torch.Tensor:
    """logsumexp(logits / temperature) over the last dim in fp32, by the vocab chunk tree.
    logits [..., V] -> [...]; a row of only -inf gives -inf."""
    T = check_temperature(temperature, op="logsumexp")
    chunks = check.integer(chunks, op="logsumexp", name="chunks")
    return impl("logsumexp", logits)(logits, T, chunks)


def lse_partial(logits: torch.Tensor, *, temperature: float = 1.0, chunks: int = DEFAULT_CHUNKS):
    """A vocab shard's subtree: (max, sum of exp(x/T - max)) fp32 [...], over `chunks` chunks."""
    T = check_temperature(temperature, op="lse_partial")
    chunks = check.integer(chunks, op="lse_partial", name="chunks")
    return impl("lse_partial", logits)(logits, T, chunks)


def lse_finish(maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Finish the tree over P shard partials [P, ...] in shard order -> logsumexp fp32 [...]."""
    return impl("lse_finish", maxes, sums)(maxes, sums)


def log_softmax(logits: torch.Tensor, *, temperature: float = 1.0,
                chunks: int = DEFAULT_CHUNKS) -> torch.Tensor:
    """log_softmax(logits / temperature) in fp32 [..., V]."""
    T = check_temperature(temperature, op="log_softmax")
    chunks = check.integer(chunks, op="log_softmax", name="chunks")
    return impl("log_softmax", logits)(logits, T, chunks)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   chunks: int = DEFAULT_CHUNKS) -> torch.Tensor:
    """log p(targets) under log_softmax(logits / temperature): logits [..., V], targets int
    [...] -> fp32 [...]. Without a gradient to track (the rollout) one fused op; with one
    (training) lse + gather + subtraction under autograd: the same bits."""
    T = check_temperature(temperature, op="token_logprobs")
    chunks = check.integer(chunks, op="token_logprobs", name="chunks")
    return impl("token_logprobs", logits, targets)(logits, targets, T, chunks)


def target_logit(logits: torch.Tensor, targets: torch.Tensor, *,
                 temperature: float = 1.0) -> torch.Tensor:
    """logits[..., target] / temperature in fp32 (the one division every path uses)."""
    T = check_temperature(temperature, op="target_logit")
    return impl("target_logit", logits, targets)(logits, targets, T)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of the maximum over the last dim; the lowest index wins ties; a row holding a NaN
    is refused. logits [..., V] -> int64 [...]."""
    return impl("argmax", logits)(logits)


def max_with_index(logits: torch.Tensor):
    """(max fp32, lowest index of the max int64) over the last dim; shards combine exactly.
    NaN entries are skipped (a shard's primitive; an all-NaN row gives (NaN, 0))."""
    return impl("max_with_index", logits)(logits)


def sample(logits: torch.Tensor, *, temperature: float, seed: int, request_ids: torch.Tensor,
           positions: torch.Tensor, top_k: Optional[int] = None,
           top_p: Optional[float] = None) -> torch.Tensor:
    """Seeded sampling from softmax(logits / temperature) restricted to top-k / top-p.

    The noise is a hash of (seed, request id, position, token id) only, so a row's draw never
    depends on the batch. logits [M, V]; request_ids, positions int [M] -> tokens int64 [M];
    seed in [0, 2**64). temperature == 0 means greedy (argmax, lowest index on ties). A row
    holding a NaN, or with no softmax (see the module docstring), is refused.
    """
    op = "sample"
    T = check_temperature(temperature, op=op, allow_zero=True)
    seed = check.check_seed(seed, op=op)
    if top_k is not None:
        top_k = check.integer(top_k, op=op, name="top_k", low=1)
    if top_p is not None:
        top_p = check.real(top_p, op=op, name="top_p")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"tonp.{op}: top_p must be in (0, 1], got {top_p!r}")
    return impl(op, logits, request_ids, positions)(logits, T, top_k, top_p, seed, request_ids,
                                                    positions)
