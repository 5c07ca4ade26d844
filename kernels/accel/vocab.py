"""Exact vocabulary reductions: lse_partial / lse_finish, token_logprobs, max_with_index, argmax.

The CPU kernels' arithmetic (kernels_impl.h lse_chunks, vocab_ops.cpp): the row's V logits in C
chunks; per chunk the max of x / T (NaN never wins; a -0 max is made +0, so the value is
order-free) and the sum of exp(x / T - max) in eight add lanes (the tail to lanes 0..) closed by
the hsum tree; a chunk whose max is -inf has sum 0, or NaN if it holds a NaN; the (max, sum) pairs
combined by the pairwise tree, (ma, sa) + (mb, sb) = (mx, sa * exp(ma - mx) + sb * exp(mb - mx))
(mx = -inf: sa + sb); logsumexp = m + log(s) with tonp's log (numerics.log = simd.h vlog).

Kernel 1 gives every (row tile, chunk) a program; kernel 2 runs the tree over a row's partials
in registers and finishes it (m + log(s), or the target's logit / T minus that).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import numerics as nm
from ._launch import check_device, float_dtype, launch, pow2, raise_row_issue
from .linear import check_chunks

@triton.jit
def _scaled(x_ptr, mask, temperature, BF16: tl.constexpr, SCALED: tl.constexpr):
    y = nm.load_f32(x_ptr, mask, BF16)
    if SCALED:
        y = tl.div_rn(y, temperature)
    return y


@triton.jit
def _lse_chunks_kernel(x_ptr, m_ptr, s_ptr, M, V, vc, temperature, CHUNKS: tl.constexpr,
                       BM: tl.constexpr, BV: tl.constexpr, BF16: tl.constexpr,
                       SCALED: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    c = tl.program_id(1)
    rm = (rows < M)[:, None]
    x_c = x_ptr + rows.to(tl.int64)[:, None] * V + c * vc  # the chunk's first logit
    # The chunk max: order-free (NaN skipped, -0 made +0); whether a NaN occurs.
    cols = tl.arange(0, BV)[None, :]
    mx = tl.full([BM], float("-inf"), tl.float32)
    nan = tl.full([BM], 0, tl.int32)
    for v0 in range(0, vc, BV):
        inside = v0 + cols < vc
        y = _scaled(x_c + v0 + cols, rm & inside, temperature, BF16, SCALED)
        top = nm.row_max(tl.where(inside & (y == y), y, float("-inf")), BM, BV)
        mx = tl.where(top > mx, top, mx)
        nan = nan | nm.row_max(tl.where(inside & (y != y), 1, 0), BM, BV)
    mx = mx + 0.0
    lane = tl.arange(0, 8)[None, :]
    acc = tl.full([BM, 8], 0, tl.float32)
    v8 = vc // 8 * 8
    for v0 in range(0, v8, 8):
        y = _scaled(x_c + v0 + lane, rm, temperature, BF16, SCALED)
        acc = acc + nm.exp(y - mx[:, None])
    tail = lane < vc - v8
    y = _scaled(x_c + v8 + lane, rm & tail, temperature, BF16, SCALED)
    acc = tl.where(tail, acc + nm.exp(y - mx[:, None]), acc)
    masked = tl.where(nan != 0, float("nan"), 0.0)  # every entry -inf or NaN
    s = tl.where(mx == float("-inf"), masked, nm.hsum8_2d(acc, BM))
    out = rows.to(tl.int64) * CHUNKS + c
    tl.store(m_ptr + out, mx, mask=rows < M)
    tl.store(s_ptr + out, s, mask=rows < M)


@triton.jit
def _lse_tree(m, s, BM: tl.constexpr, P: tl.constexpr, LOG2P: tl.constexpr):
    """[BM, P] (max, sum) partials -> [BM] by the pairwise tree (ops.cpp lse_tree)."""
    for lvl in tl.static_range(LOG2P):
        ma, mb = tl.split(tl.reshape(m, [BM, P >> (lvl + 1), 2]))
        sa, sb = tl.split(tl.reshape(s, [BM, P >> (lvl + 1), 2]))
        m = tl.where((ma > mb) | (ma != ma), ma, mb)  # a NaN max stays NaN
        s = tl.where(m == float("-inf"), sa + sb, sa * nm.exp(ma - m) + sb * nm.exp(mb - m))
    return tl.reshape(m, [BM]), tl.reshape(s, [BM])


@triton.jit
def _lse_finish_kernel(m_ptr, s_ptr, m_out, s_out, x_ptr, t_ptr, M, stride_p, stride_m, V,
                       temperature, BM: tl.constexpr, P: tl.constexpr, LOG2P: tl.constexpr,
                       MODE: tl.constexpr, BF16: tl.constexpr, SCALED: tl.constexpr):
    """MODE 0: the tree's (m, s); 1: logsumexp m + log(s); 2: logit[target] / T - logsumexp,
    and the row's issue in s_out (int8: 2 max +inf, 3 every logit -inf; vocab_ops row_issue)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = rows < M
    at = rows.to(tl.int64)[:, None] * stride_m + tl.arange(0, P)[None, :] * stride_p
    m = tl.load(m_ptr + at, mask=rm[:, None], other=0.0)
    s = tl.load(s_ptr + at, mask=rm[:, None], other=0.0)
    m, s = _lse_tree(m, s, BM, P, LOG2P)
    if MODE == 0:
        tl.store(m_out + rows, m, mask=rm)
        tl.store(s_out + rows, s, mask=rm)
    else:
        masked = (m == float("-inf")) & (s == 0.0)
        lse = tl.where(masked, float("-inf"), m + nm.log(s))
        if MODE == 2:
            t = tl.load(t_ptr + rows, mask=rm, other=0)
            lse = _scaled(x_ptr + rows.to(tl.int64) * V + t, rm, temperature, BF16, SCALED) - lse
            issue = tl.where(m == float("inf"), 2, tl.where(masked, 3, 0))
            tl.store(s_out + rows, issue.to(tl.int8), mask=rm)
        tl.store(m_out + rows, lse, mask=rm)


_BM = 16


def _chunks(x, temperature, chunks):
    """Kernel 1: per-chunk (max, sum) [M, C] of contiguous logits x [M, V]."""
    M, V = x.shape
    m = torch.empty(M, chunks, dtype=torch.float32, device=x.device)
    s = torch.empty_like(m)
    T = torch.tensor(temperature, dtype=torch.float32).item()  # the kernel's fp32 temperature
    launch(_lse_chunks_kernel, (triton.cdiv(M, _BM), chunks), x, m, s, M, V, V // chunks, T,
           CHUNKS=chunks, BM=_BM, BV=min(pow2(V // chunks), 256), BF16=x.dtype == torch.bfloat16,
           SCALED=T != 1.0)
    return m, s


def _finish(m, s, stride_p, stride_m, P, mode, x=None, targets=None, temperature=1.0):
    M = m.numel() // P
    out = torch.empty(M, dtype=torch.float32, device=m.device)
    s_out = torch.empty_like(out) if mode == 0 else \
        torch.empty(M, dtype=torch.int8, device=m.device) if mode == 2 else out
    T = torch.tensor(temperature, dtype=torch.float32).item()
    if M:
        launch(_lse_finish_kernel, (triton.cdiv(M, _BM),), m, s, out, s_out,
               x if x is not None else m, targets if targets is not None else m, M, stride_p,
               stride_m, x.shape[1] if x is not None else 0, T, BM=_BM, P=P,
               LOG2P=P.bit_length() - 1, MODE=mode,
               BF16=x is not None and x.dtype == torch.bfloat16, SCALED=T != 1.0)
    return (out, s_out) if mode != 1 else out


def _check_logits(op, x, temperature, chunks):
    if x.dim() != 2:
        raise ValueError(f"tonp.{op}: logits must be [M, V], got {tuple(x.shape)}")
    float_dtype(x, op, "logits")
    if not temperature > 0:
        raise ValueError(f"tonp.{op}: temperature must be positive, got {temperature}")
    check_chunks(op, x.shape[1], chunks)
    check_device(op, x)


def lse_partial(logits: torch.Tensor, temperature: float = 1.0, chunks: int = 8):
    """torch.ops.tonp.lse_partial's bits: logits [M, V] -> (max, sum) fp32 [M] of x / T."""
    _check_logits("lse_partial", logits, temperature, chunks)
    if logits.shape[1] == 0:
        raise ValueError("tonp.lse_partial: empty vocabulary")
    m, s = _chunks(logits.contiguous(), temperature, chunks)
    return _finish(m, s, 1, chunks, chunks, 0)


def lse_finish(maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """The tree over P shard partials (maxes/sums fp32 [P, M]) -> logsumexp fp32 [M]."""
    if maxes.dim() != 2 or maxes.shape != sums.shape or maxes.dtype != torch.float32 or \
            sums.dtype != torch.float32:
        raise ValueError("tonp.lse_finish: expected fp32 [P, M] maxes and sums")
    P, M = maxes.shape
    if P < 1 or P & (P - 1):
        raise ValueError(f"tonp.lse_finish: the number of partials must be a power of two, got {P}")
    check_device("lse_finish", maxes, sums)
    return _finish(maxes.contiguous(), sums.contiguous(), M, 1, P, 1)


def lse_tree(maxes: torch.Tensor, sums: torch.Tensor):
    """The tree alone over P partials [P, M] -> (max, sum) [M] (no log: bits of the C++ tree)."""
    P, M = maxes.shape
    return _finish(maxes.contiguous(), sums.contiguous(), M, 1, P, 0)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunks: int = 8) -> torch.Tensor:
    """log p(target) per row: logits [M, V], targets [M] -> fp32 [M]. A row with no softmax
    (logits / T reach +inf, or every logit is -inf) is refused, naming the lowest such row."""
    if logits.dim() != 2 or targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
        raise ValueError(f"tonp.token_logprobs: expected logits [M, V] and targets [M], got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise TypeError(f"tonp.token_logprobs: targets must be integer token ids, got "
                        f"{targets.dtype}")
    _check_logits("token_logprobs", logits, temperature, chunks)
    M, V = logits.shape
    if V == 0 and M:
        raise ValueError("tonp.token_logprobs: empty vocabulary")
    t = targets.to(device=logits.device, dtype=torch.int64).contiguous()
    bad = (t < 0) | (t >= V)
    if bool(bad.any()):
        raise IndexError(f"tonp.token_logprobs: target id out of range [0, {V}): {int(t[bad][0])}")
    if M == 0:
        return torch.empty(0, dtype=torch.float32, device=logits.device)
    x = logits.contiguous()
    m, s = _chunks(x, temperature, chunks)
    out, issue = _finish(m, s, 1, chunks, chunks, 2, x, t, temperature)
    raise_row_issue("token_logprobs", issue, temperature)
    return out


@triton.jit
def _max_with_index_kernel(x_ptr, val_ptr, idx_ptr, nan_ptr, M, V, BM: tl.constexpr,
                           BV: tl.constexpr, BF16: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = rows < M
    x_rows = x_ptr + rows.to(tl.int64) * V
    cols = tl.arange(0, BV)[None, :]
    best_v = tl.full([BM], float("-inf"), tl.float32)
    best_i = tl.full([BM], -1, tl.int64)  # -1: no non-NaN value yet
    nan = tl.full([BM], 0, tl.int32)
    for v0 in range(0, V, BV):
        y = nm.load_f32(x_rows[:, None] + v0 + cols, rm[:, None] & (v0 + cols < V), BF16)
        ok = (v0 + cols < V) & (y == y)
        # order-free reductions (flags; a maximum whose zero sign is never used: the value is
        # reloaded at the index; the lowest index), by the compiler's tree
        nan = nan | nm.row_max_free(tl.where((v0 + cols < V) & (y != y), 1, 0))
        top = nm.row_max_free(tl.where(ok, y, float("-inf")))
        at = nm.row_min_free(tl.where(ok & (y == top[:, None]), cols, BV))
        upd = (at < BV) & ((best_i < 0) | (top > best_v))  # strictly greater: lowest index wins
        best_v = tl.where(upd, top, best_v)
        best_i = tl.where(upd, v0 + at, best_i)
    best_i = tl.where(best_i < 0, 0, best_i)  # all NaN: index 0, as the scan
    tl.store(val_ptr + rows, nm.load_f32(x_rows + best_i, rm, BF16), mask=rm)
    tl.store(idx_ptr + rows, best_i, mask=rm)
    tl.store(nan_ptr + rows, nan.to(tl.int8), mask=rm)


def _max_rows(logits: torch.Tensor, op: str):
    """(max fp32 [M], lowest index int64 [M], holds-a-NaN int8 [M]) of logits [M, V]."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"tonp.{op}: logits must be [M, V] with V > 0, got {tuple(logits.shape)}")
    bf16 = float_dtype(logits, op, "logits")
    check_device(op, logits)
    M, V = logits.shape
    val = torch.empty(M, dtype=torch.float32, device=logits.device)
    idx = torch.empty(M, dtype=torch.int64, device=logits.device)
    nan = torch.zeros(M, dtype=torch.int8, device=logits.device)
    if M:
        launch(_max_with_index_kernel, (triton.cdiv(M, _BM),), logits.contiguous(), val, idx, nan,
               M, V, BM=_BM, BV=min(pow2(V), 1024), BF16=bf16)
    return val, idx, nan


def max_with_index(logits: torch.Tensor):
    """torch.ops.tonp.max_with_index's bits: logits [M, V] -> (max fp32 [M], lowest index int64
    [M]); NaN is skipped unless the row is all NaN (then index 0)."""
    return _max_rows(logits, "max_with_index")[:2]


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of the maximum of each row of logits [M, V] (lowest index on ties) -> int64 [M];
    a row holding a NaN is refused, as the C++ op refuses it."""
    _, idx, nan = _max_rows(logits, "argmax")
    raise_row_issue("argmax", nan, 1.0)
    return idx
