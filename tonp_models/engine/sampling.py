"""The next token of each request that completed its context in a step, with its logprob.

Rows are grouped by their sampling settings (temperature, top_k, top_p, seed) and each group
goes through one `tonp_kernels.sample` / `argmax` and `token_logprobs` call: every row's result
depends on that row alone (the noise is a hash of (seed, request, position, token)), so neither
the grouping nor the batch changes a bit. Non-finite logits and logprobs that overflow fp32 are
reported per request, never returned.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

import tonp_kernels as tk
from tonp_kernels.stock import true_div

from .request import Request

Pick = Tuple[Optional[int], Optional[float], Optional[List[Tuple[int, float]]],
             Optional[Exception]]


def _index(values: List[int], like: torch.Tensor) -> torch.Tensor:
    """int64 values on `like`'s device (the logits'; the kernels take one device)."""
    return torch.tensor(values, dtype=torch.int64, device=like.device)


def non_finite_error(who: str, logits: torch.Tensor, rows: List[Request]
                     ) -> Optional[Tuple[int, Exception]]:
    """(row, RuntimeError naming the first non-finite logit) or None: one reduction when all
    are finite (a NaN reaches both the min and the max)."""
    lo, hi = torch.aminmax(logits)
    if math.isfinite(lo) and math.isfinite(hi):
        return None
    bad = ~torch.isfinite(logits)
    s, v = bad.nonzero()[0].tolist()
    r = rows[s]
    return s, RuntimeError(
        f"{who}: the model's logits are not finite (NaN or inf weights, or an overflow in the "
        f"forward): request {r.name}, position {len(r.tokens) - 1}, vocab id {v} is "
        f"{float(logits[s, v])} ({int(bad.sum())} non-finite logits in this step)")


def overflow_error(who: str, r: Request, logits_row: torch.Tensor) -> ValueError:
    """Finite logits give finite logprobs unless logits / temperature overflow fp32."""
    return ValueError(
        f"{who}: request {r.name}'s token at position {len(r.tokens)} cannot be scored at "
        f"temperature={r.params.temperature!r}: its logits (largest |logit| "
        f"{float(logits_row.abs().max()):.4g}) divided by the temperature overflow fp32; use a "
        f"larger temperature (or 0 for greedy)")


def pick(who: str, logits: torch.Tensor, rows: List[Request]) -> List[Pick]:
    """logits fp32 [S, V] of requests `rows` -> per row (token, logprob, top logprobs, error).

    A row with non-finite logits fails (error set) and so does every row of the step after the
    first such (the check is one reduction over the step, as generate always did)."""
    out: List[Pick] = [(None, None, None, None)] * len(rows)
    bad = non_finite_error(who, logits, rows)
    if bad is not None:
        finite = torch.isfinite(logits).all(-1).tolist()
        for i, ok in enumerate(finite):
            if not ok:
                out[i] = (None, None, None, bad[1] if i == bad[0] else RuntimeError(
                    f"{who}: the model's logits for request {rows[i].name} are not finite "
                    f"({bad[1]})"))
        keep = [i for i, ok in enumerate(finite) if ok]
    else:
        keep = list(range(len(rows)))
    groups: Dict[tuple, List[int]] = {}
    for i in keep:
        groups.setdefault(rows[i].params.draw, []).append(i)
    for (temperature, top_k, top_p, seed), idx in groups.items():
        if 0 < temperature < 1:  # logits / T may overflow fp32 (the kernels refuse such rows)
            idx = _drop_overflows(who, logits, rows, idx, temperature, out)
            if not idx:
                continue
        sub = logits if len(idx) == len(rows) else logits.index_select(0, _index(idx, logits))
        group = [rows[i] for i in idx]
        if temperature == 0:
            chosen = tk.argmax(sub)
        else:
            ids = _index([r.noise_key for r in group], sub)
            pos = _index([len(r.tokens) for r in group], sub)                      # new token's
            # top_k >= V restricts nothing: the kernel takes it as V (and V fits its int64).
            chosen = tk.sample(sub, temperature=temperature, seed=seed, request_ids=ids,
                               positions=pos, top_k=top_k and min(top_k, sub.shape[-1]),
                               top_p=top_p)
        T = temperature or 1.0
        lps = tk.token_logprobs(sub, chosen, temperature=T).tolist()
        tops = _top_logprobs(sub, group, T)
        for j, (i, tok, lp) in enumerate(zip(idx, chosen.tolist(), lps)):
            err = None if math.isfinite(lp) else overflow_error(who, rows[i], sub[j])
            out[i] = (None, None, None, err) if err else (tok, lp, tops[j], None)
    return out


def _drop_overflows(who: str, logits: torch.Tensor, rows: List[Request], idx: List[int],
                    temperature: float, out: List[Pick]) -> List[int]:
    """The rows of idx whose logits / temperature stay finite in fp32; the others get the
    overflow error (division is monotonic: a row overflows iff its largest |logit| does)."""
    sub = logits.index_select(0, _index(idx, logits))
    big = sub.abs().amax(-1)                                                       # (n,) fp32
    over = torch.isinf(true_div(big, temperature)).tolist()
    for j, i in enumerate(idx):
        if over[j]:
            out[i] = (None, None, None, overflow_error(who, rows[i], sub[j]))
    return [i for j, i in enumerate(idx) if not over[j]]


def _top_logprobs(logits: torch.Tensor, rows: List[Request], T: float
                  ) -> List[Optional[List[Tuple[int, float]]]]:
    """The k most likely (token, logprob) of each row asking for them (ties: lower id first),
    from the same log_softmax(logits / T) as the token logprobs."""
    k = max(r.params.top_logprobs for r in rows)
    if k == 0:
        return [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.top_logprobs]
    lsm = tk.log_softmax(logits.index_select(0, _index(want, logits)), temperature=T)
    ids, vals = ranked(lsm, k)
    out: List[Optional[List[Tuple[int, float]]]] = [None] * len(rows)
    for j, i in enumerate(want):
        n = rows[i].params.top_logprobs
        out[i] = list(zip(ids[j, :n].tolist(), vals[j, :n].tolist()))
    return out


def ranked(lsm: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of lsm fp32 [R, V] (ties: lower id first) -> (ids int64,
    values fp32), [R, min(k, V)] each: the first k of a stable descending sort of each row.

    Without sorting the vocabulary: topk finds each row's k-th largest value (a value, whichever
    of its ties topk picked), every entry at or above it is a candidate (the top k and any ties
    at the cut), and only the candidates are sorted, stable by value within their row, in id
    order. A row holding a NaN (topk and sort rank it first) takes the full sort. Against the
    full sort, 64 rows: 45 -> 1.9 ms at 16,384 logits, 544 -> 19 ms at 151,936 (2
    threads, AMD EPYC Zen 3)."""
    k = min(k, lsm.shape[-1])
    if k == 0 or lsm.shape[0] == 0:
        return (torch.zeros(lsm.shape[0], k, dtype=torch.int64, device=lsm.device),
                lsm.new_zeros(lsm.shape[0], k))
    cut = torch.topk(lsm, k, dim=-1).values
    if bool(torch.isnan(cut).any()):
        vals, ids = torch.sort(lsm, dim=-1, descending=True, stable=True)
        return ids[:, :k], vals[:, :k]
    rows, cols = (lsm >= cut[:, -1:]).nonzero(as_tuple=True)      # row-major: ids ascending
    vals = lsm[rows, cols]
    by_value = torch.sort(vals, descending=True, stable=True).indices
    order = by_value[torch.sort(rows[by_value], stable=True).indices]   # row, value, then id
    counts = torch.bincount(rows, minlength=lsm.shape[0])
    starts = torch.cumsum(counts, 0) - counts
    take = (starts[:, None] + torch.arange(k, device=lsm.device)[None, :]).reshape(-1)
    pick = order[take]
    return cols[pick].reshape(-1, k), vals[pick].reshape(-1, k)
