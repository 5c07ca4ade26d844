"""Exact seeded sampling: the C++ `sample` (vocab_ops.cpp) bit for bit, CONTRACT.md "sample".

Per row, y = x / T. The kept set is a rank cut: token i ranks by the integer
R_i = (order key of y_i) << 32 | (2^32 - 1 - i), i.e. (y descending, id ascending); top-k keeps
the k highest R, top-p the shortest prefix of those (in R order) whose integer masses
q = trunc(exp(y - ymax) * 2^32) reach ceil(p24 * Q / 2^24). Both cuts are found by a bitwise
binary search over R (count, or integer mass, of the tokens at or above a candidate): integer
sums are associative, so this finds the C++ sort's cut exactly. The winner is the highest
y_i - log(E_i) among kept finite tokens (lowest id on ties), E_i the exponential variate built
from the 64-bit hash of (seed, request, position, i) with tonp's fp32 log.

A program owns BM rows and loops over the vocabulary in blocks; every reduction is order-free
(maxima, integer sums, the lowest index of a maximum).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import numerics as nm
from ._launch import check_device, float_dtype, launch, pow2, raise_row_issue
from .vocab import _max_rows

_M64 = 2 ** 64 - 1
_TOP = tl.constexpr(-2 ** 63)  # the sign bit: an unsigned pattern ^ _TOP orders as a signed int64


def splitmix64_int(z: int) -> int:
    """vocab_ops.cpp splitmix64 on a Python int (the per-call seed mix, done on the host)."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


@triton.jit
def _lsr(z, n: tl.constexpr):
    """Logical right shift of int64 bits (Triton's >> on signed integers is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


@triton.jit
def splitmix64(z):
    """splitmix64 of 64-bit patterns held in int64 (wrapping multiplies, logical shifts; only
    signed integers, which every Triton backend documents)."""
    z = z + -0x61C8864680B583EB                  # 0x9E3779B97F4A7C15
    z = (z ^ _lsr(z, 30)) * -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
    z = (z ^ _lsr(z, 27)) * -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB
    return z ^ _lsr(z, 31)


@triton.jit
def _rank(y, idx):
    """(y descending, id ascending) as an int64, larger = earlier: vocab_ops rank_key's unsigned
    integer with its top bit flipped, so signed comparisons order it (-0 read as +0)."""
    b = (y + 0.0).to(tl.int32, bitcast=True)
    v = tl.where(b < 0, b ^ 0x7FFFFFFF, b)      # signed order = the value's order
    return (v.to(tl.int64) << 32) | (idx.to(tl.int64) ^ 0xFFFFFFFF)


@triton.jit
def _mass(y, ymax):
    """trunc(exp(y - ymax) * 2^32) as int64 (vocab_ops top_p_mass)."""
    return (nm.exp(y - ymax[:, None]) * 4294967296.0).to(tl.int64)


@triton.jit
def _at_or_above(y_rows, rm, V, cand, floor, ymax, MASS: tl.constexpr, BM: tl.constexpr,
                 BV: tl.constexpr):
    """Per row: how many tokens (MASS: their integer mass) rank at or above max(cand, floor)."""
    cols = tl.arange(0, BV)[None, :]
    total = tl.full([BM], 0, tl.int64)
    for v0 in range(0, V, BV):
        inside = rm[:, None] & (v0 + cols < V)
        y = tl.load(y_rows[:, None] + v0 + cols, mask=inside, other=0.0)
        r = _rank(y, v0 + cols)
        hit = inside & (r >= cand[:, None]) & (r >= floor[:, None])
        if MASS:
            total += nm._tree(tl.where(hit, _mass(y, ymax), 0), BM, BV, 2)
        else:
            total += nm._tree(tl.where(hit, 1, 0).to(tl.int64), BM, BV, 2)
    return total


@triton.jit
def _cut(y_rows, rm, V, need, floor, ymax, idx_bits, MASS: tl.constexpr, BM: tl.constexpr,
         BV: tl.constexpr):
    """The largest rank R with at_or_above(R) >= need, bit by bit from the top of R's unsigned
    pattern (ans; ranks compare as ans ^ 2^63): the 32 bits of the value, then the id's idx_bits
    low bits (the id part of every rank, 2^32 - 1 - id with id < 2^idx_bits, has all the bits
    above them set: they start set)."""
    ans = tl.full([BM], 0xFFFFFFFF, tl.int64) ^ ((tl.full([BM], 1, tl.int64) << idx_bits) - 1)
    for bit in range(32 + idx_bits):
        shift = tl.where(bit < 32, 63 - bit, idx_bits + 31 - bit) + tl.full([BM], 0, tl.int64)
        cand = ans | (tl.full([BM], 1, tl.int64) << shift)
        ok = _at_or_above(y_rows, rm, V, cand ^ _TOP, floor, ymax, MASS, BM, BV) >= need
        ans = tl.where(ok, cand, ans)
    return ans ^ _TOP


@triton.jit
def _log_exponential(h):
    """log(E) of the exponential variate E = -log(1 - U) of hash h (vocab_ops gumbel_scores):
    w = (float(hi31) 2^-31 + float(lo31 | 1) 2^-62) / 2 in [2^-63, 1/2]; the hash's top bit
    says whether U = w (E = -log1p(-w), Goldberg's formula) or 1 - U = w (E = -log(w))."""
    hi = ((h >> 32) & 0x7FFFFFFF).to(tl.int32).to(tl.float32)
    lo = (((h >> 1) & 0x7FFFFFFF) | 1).to(tl.int32).to(tl.float32)
    w = (hi * 4.656612873077393e-10 + lo * 2.168404344971009e-19) * 0.5  # 2^-31, 2^-62
    upper = h < 0  # the top bit
    a = tl.where(upper, w, 1.0 - w)
    la = nm.log(a)
    e = tl.where(upper, 0.0 - la, tl.where(a == 1.0, w, tl.div_rn(la * w, a - 1.0)))
    return nm.log(e)


@triton.jit
def _sample_kernel(x_ptr, y_ptr, req_ptr, pos_ptr, out_ptr, issue_ptr, M, V, temperature, seed_mix,
                   top_k, p24, idx_bits, BM: tl.constexpr, BV: tl.constexpr, BF16: tl.constexpr,
                   TOPK: tl.constexpr, TOPP: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rm = rows < M
    x_rows = x_ptr + rows.to(tl.int64) * V
    y_rows = y_ptr + rows.to(tl.int64) * V
    cols = tl.arange(0, BV)[None, :]
    # Pass 1: y = x / T (kept for the searches), its max (NaN skipped) and whether a NaN occurs.
    ymax = tl.full([BM], float("-inf"), tl.float32)
    nan = tl.full([BM], 0, tl.int32)
    for v0 in range(0, V, BV):
        inside = rm[:, None] & (v0 + cols < V)
        y = tl.div_rn(nm.load_f32(x_rows[:, None] + v0 + cols, inside, BF16), temperature)
        if TOPK or TOPP:
            tl.store(y_rows[:, None] + v0 + cols, y, mask=inside)
        top = nm.row_max(tl.where(inside & (y == y), y, float("-inf")), BM, BV)
        ymax = tl.where(top > ymax, top, ymax)
        nan = nan | nm.row_max(tl.where(inside & (y != y), 1, 0), BM, BV)
    issue = tl.where(nan != 0, 1, tl.where(ymax == float("inf"), 2,
                                           tl.where(ymax == float("-inf"), 3, 0)))
    tl.store(issue_ptr + rows, issue.to(tl.int8), mask=rm)
    rm = rm & (issue == 0)
    ymax = tl.where(rm, ymax, 0.0)
    if TOPK or TOPP:
        tl.debug_barrier()  # y is written by now
    cut = tl.full([BM], _TOP, tl.int64)  # every rank is at or above it
    if TOPK:
        k = tl.full([BM], 0, tl.int64) + top_k
        cut = _cut(y_rows, rm, V, k, cut, ymax, idx_bits, False, BM, BV)
    if TOPP:
        Q = _at_or_above(y_rows, rm, V, cut, cut, ymax, True, BM, BV)
        need = p24 * (Q >> 24) + ((p24 * (Q & 0xFFFFFF) + 0xFFFFFF) >> 24)
        cut = _cut(y_rows, rm, V, need, cut, ymax, idx_bits, True, BM, BV)
    # The noise key of each row, then Gumbel-max over the kept tokens.
    req = tl.load(req_ptr + rows, mask=rm, other=0)
    pos = tl.load(pos_ptr + rows, mask=rm, other=0)
    base = splitmix64(seed_mix.to(tl.int64) ^ splitmix64(req + 0x5851F42D4C957F2D))
    key = splitmix64(base ^ splitmix64(pos * 0x2545F4914F6CDD1D))
    best_s = tl.full([BM], float("-inf"), tl.float32)
    best_i = tl.full([BM], 0, tl.int64)
    for v0 in range(0, V, BV):
        idx = v0 + cols
        inside = rm[:, None] & (idx < V)
        y = tl.div_rn(nm.load_f32(x_rows[:, None] + idx, inside, BF16), temperature)
        keep = inside & (y != float("-inf"))
        if TOPK or TOPP:
            keep = keep & (_rank(y, idx) >= cut[:, None])
        h = splitmix64(key[:, None] ^ idx.to(tl.int64))
        score = y - _log_exponential(h)
        top = nm.row_max(tl.where(keep, score, float("-inf")), BM, BV)
        at = nm.row_min(tl.where(keep & (score == top[:, None]), cols, BV), BM, BV)
        upd = (at < BV) & (top > best_s)  # strictly greater: the earlier block's id wins ties
        best_s = tl.where(upd, top, best_s)
        best_i = tl.where(upd, v0 + at, best_i)
    tl.store(out_ptr + rows, best_i, mask=rm)


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int,
           request_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """torch.ops.tonp.sample's draws: logits [M, V], request_ids / positions int [M] -> int64
    [M]. top_k 0 = none, top_p 1.0 = none, seed the int64 of the 64-bit seed, temperature 0 =
    greedy. A row holding a NaN, reaching +inf, or of only -inf is refused, naming it."""
    op = "sample"
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"tonp.{op}: logits must be [M, V] with V > 0, got {tuple(logits.shape)}")
    bf16 = float_dtype(logits, op, "logits")
    M, V = logits.shape
    for name, t in (("request_ids", request_ids), ("positions", positions)):
        if t.is_floating_point() or t.dtype == torch.bool:
            raise TypeError(f"tonp.{op}: {name} must be an integer tensor, got {t.dtype}")
        if t.dim() != 1 or t.shape[0] != M:
            raise ValueError(f"tonp.{op}: request_ids and positions must be [{M}], got "
                             f"{tuple(request_ids.shape)} and {tuple(positions.shape)}")
    if V >= 2 ** 31:
        raise ValueError(f"tonp.{op}: the vocabulary must be below 2**31 tokens, got {V}")
    check_device(op, logits, request_ids, positions)
    if temperature == 0.0:
        _, idx, nan = _max_rows(logits, op)
        raise_row_issue(op, nan, temperature)
        return idx
    out = torch.empty(M, dtype=torch.int64, device=logits.device)
    issue = torch.zeros(M, dtype=torch.int8, device=logits.device)
    if M == 0:
        return out
    topk, topp = 0 < top_k < V, top_p < 1.0
    y = torch.empty(M, V, dtype=torch.float32, device=logits.device) if topk or topp else out
    T = torch.tensor(temperature, dtype=torch.float32).item()  # the kernel's fp32 temperature
    mix = splitmix64_int(seed & _M64)
    BM = 4
    launch(_sample_kernel, (triton.cdiv(M, BM),), logits.contiguous(), y,
           request_ids.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous(), out,
           issue, M, V, T, mix - 2 ** 64 if mix >= 2 ** 63 else mix, int(top_k),
           int(math.ceil(top_p * 16777216.0)), max(1, (V - 1).bit_length()), BM=BM,
           BV=min(pow2(V), 512), BF16=bf16, TOPK=topk, TOPP=topp)
    raise_row_issue(op, issue, temperature)
    return out
