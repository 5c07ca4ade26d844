"""Exact causal attention, packed sequences (varlen) and a paged KV cache.

The CPU kernel's arithmetic (kernels_impl.h attention_t), per query position t and query head:
keys 0..t of its own sequence in blocks of B positions aligned to position 0; per block, each
score is an 8-lane FMA chain over head_dim (lane l: d = l, l + 8, ...) closed by the hsum tree,
times scale; the block max is a scan in key order; p = exp(s - m_new) with tonp's exp; the
running sum l * alpha + p_0 + p_1 + ... and the output o * alpha then an FMA chain over the
block's keys in order; one division at the end.

A program owns one (query, KV head) pair and its G query heads. Per block it computes the
[G, B] scores at once (each step an FMA per chain), writes the probabilities to a private
scratch row, and then runs the running sum and the P.V chains key by key: a chain over keys
needs its p one key at a time, which registers cannot index. The block max needs no order: for
finite or infinite scores every scan order finds the same value (a NaN is handled as the scan
does), and the sign of a zero maximum never reaches an output (exp(+-0) = 1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import numerics as nm
from ._launch import check_device, float_dtype, launch, pow2


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, p_ptr, start_ptr, pos_ptr, seq_ptr, pt_ptr,
                      Hq, Hkv, maxp, scale, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                      DP: tl.constexpr, BLOCK: tl.constexpr, BP: tl.constexpr,
                      PAGED: tl.constexpr, BF16: tl.constexpr):
    i = tl.program_id(0)  # query
    h = tl.program_id(1)  # KV head
    pos = tl.load(pos_ptr + i).to(tl.int64)
    g = tl.arange(0, GP)
    gm = g < G
    j = tl.arange(0, BP)
    d = tl.arange(0, DP)
    dm = d < D
    lane = tl.arange(0, 8)
    pos_stride = Hkv * D
    q_rows = q_ptr + (i.to(tl.int64) * Hq + h * G + g) * D  # [GP]
    p_g = p_ptr + (i.to(tl.int64) * Hkv + h) * (GP * BP) + g * BP  # [GP]: this program's scratch
    if PAGED:
        pages = pt_ptr + tl.load(seq_ptr + i).to(tl.int64) * maxp
    else:
        first = (tl.load(start_ptr + i).to(tl.int64) * Hkv + h) * D  # position 0 of the sequence
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.full([GP], 0, tl.float32)
    o = tl.full([GP, DP], 0, tl.float32)
    for b in range(pos // BLOCK + 1):
        n = tl.minimum(pos + 1 - b * BLOCK, BLOCK)
        if PAGED:
            off = tl.load(pages + b).to(tl.int64) * (BLOCK * pos_stride) + h * D
        else:
            off = first + b * (BLOCK * pos_stride)
        jm = j < n
        # Scores [GP, BP]: per key an 8-lane FMA chain over d, the hsum tree, times scale.
        acc = tl.full([GP, BP, 8], 0, tl.float32)
        for s in range(D // 8):
            qv = nm.load_f32(q_rows[:, None] + s * 8 + lane[None, :], gm[:, None], BF16)
            kv = nm.load_f32(k_ptr + off + j[:, None] * pos_stride + s * 8 + lane[None, :],
                             jm[:, None], BF16)
            acc = tl.fma(qv[:, None, :], kv[None, :, :], acc)
        sc = nm.hsum8_3d(acc, GP, BP) * scale
        # The scan max from s[0]: a NaN s[0] stays; later NaNs never win.
        s0 = nm.take(sc, j[None, :] == 0, GP, BP)
        mb = nm.row_max(tl.where(jm[None, :] & (sc == sc), sc, float("-inf")), GP, BP)
        mb = tl.where(s0 != s0, s0, mb)
        m_new = tl.where(mb > m, mb, m)
        alpha = tl.where(m == float("-inf"), 0.0, nm.exp(m - m_new))
        tl.debug_barrier()  # the previous block's p are read by now
        tl.store(p_g[:, None] + j[None, :], nm.exp(sc - m_new[:, None]))
        tl.debug_barrier()
        lsum = l * alpha
        o = o * alpha[:, None]
        for jj in range(n):
            pj = tl.load(p_g + jj)  # [GP]: p of key jj
            vj = nm.load_f32(v_ptr + off + jj * pos_stride + d, dm, BF16)
            lsum = lsum + pj
            o = tl.fma(pj[:, None], vj[None, :], o)
        l = lsum
        m = m_new
    out = out_ptr + (i.to(tl.int64) * Hq + h * G + g)[:, None] * D + d[None, :]
    nm.store_f32(out, tl.div_rn(o, l[:, None]), gm[:, None] & dm[None, :], BF16)


def _check(op, q, k, v):
    float_dtype(q, op, "q")
    float_dtype(k, op, "k")
    float_dtype(v, op, "v")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"tonp.{op}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if q.dim() != 3:
        raise ValueError(f"tonp.{op}: q must be [T, Hq, D], got {tuple(q.shape)}")
    D = q.shape[2]
    if k.shape[-1] != D or v.shape != k.shape:
        raise ValueError(f"tonp.{op}: head_dim mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if D % 8 or D <= 0:
        raise ValueError(f"tonp.{op}: head_dim must be a positive multiple of 8, got {D}")
    if q.shape[1] % k.shape[-2]:
        raise ValueError(f"tonp.{op}: {q.shape[1]} query heads are not a multiple of "
                         f"{k.shape[-2]} key-value heads")


def _run(q, k, v, starts, pos, seq, pt, block, scale, paged):
    T, Hq, D = q.shape
    Hkv = k.shape[-2]
    G = Hq // Hkv
    out = torch.empty_like(q)
    if T == 0:
        return out
    GP, BP = pow2(G), pow2(block)
    scratch = torch.empty(T * Hkv * GP * BP, dtype=torch.float32, device=q.device)
    maxp = pt.shape[1] if paged else 0
    launch(_attention_kernel, (T, Hkv), q.contiguous(), k, v, out, scratch, starts, pos, seq, pt,
           Hq, Hkv, maxp, float(scale), G=G, GP=GP, D=D, DP=pow2(D), BLOCK=block, BP=BP,
           PAGED=paged, BF16=q.dtype == torch.bfloat16)
    return out


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float, block: int = 64) -> torch.Tensor:
    """torch.ops.tonp.attention_varlen's bits: q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [S+1]."""
    _check("attention_varlen", q, k, v)
    if k.dim() != 3 or k.shape[0] != q.shape[0]:
        raise ValueError(f"tonp.attention_varlen: k must be [T, Hkv, D] with T = {q.shape[0]}")
    if block <= 0:
        raise ValueError(f"tonp.attention_varlen: block must be positive, got {block}")
    check_device("attention_varlen", q, k, v)
    T = q.shape[0]
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != T:
        raise ValueError(f"tonp.attention_varlen: cu_seqlens must run from 0 to T={T}")
    lens = cu[1:] - cu[:-1]
    if bool((lens < 0).any()):
        raise ValueError("tonp.attention_varlen: cu_seqlens must not decrease")
    starts = torch.repeat_interleave(cu[:-1], lens, output_size=T)
    pos = torch.arange(T, device=q.device) - starts
    return _run(q, k.contiguous(), v.contiguous(), starts, pos, pos, pos, block, scale, False)


def attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """torch.ops.tonp.attention_paged's bits: q [Tq, Hq, D], caches [P, B, Hkv, D], page_table
    [S, max_pages], q_seq/q_pos [Tq] (query i sees positions 0..q_pos[i] of sequence q_seq[i])."""
    op = "attention_paged"
    _check(op, q, k_cache, v_cache)
    if k_cache.dim() != 4:
        raise ValueError(f"tonp.{op}: caches must be [pages, block, kv_heads, head_dim], got "
                         f"{tuple(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise RuntimeError(f"tonp.{op}: caches must be contiguous")
    check_device(op, q, k_cache, v_cache)
    Tq = q.shape[0]
    P, B = k_cache.shape[:2]
    pt = page_table.to(device=q.device, dtype=torch.int32).contiguous()
    seq = q_seq.to(device=q.device, dtype=torch.int64).contiguous()
    pos = q_pos.to(device=q.device, dtype=torch.int64).contiguous()
    if seq.dim() != 1 or pos.dim() != 1 or seq.numel() != Tq or pos.numel() != Tq:
        raise ValueError(f"tonp.{op}: q_seq/q_pos must be [{Tq}], got {tuple(q_seq.shape)} and "
                         f"{tuple(q_pos.shape)}")
    S, maxp = pt.shape
    if Tq:
        bad = (seq < 0) | (seq >= S)
        if bool(bad.any()):
            raise IndexError(f"tonp.{op}: q_seq {int(seq[bad][0])} out of the page table's range "
                             f"[0, {S})")
        bad = (pos < 0) | (pos // B >= maxp)
        if bool(bad.any()):
            p = int(pos[bad][0])
            raise IndexError(f"tonp.{op}: position {p} needs {p // B + 1} pages but the page "
                             f"table holds {maxp} (cache capacity exceeded)")
        used = torch.arange(maxp, device=q.device)[None, :] <= (pos // B)[:, None]
        ids = pt[seq][used]
        bad = (ids < 0) | (ids >= P)
        if bool(bad.any()):
            raise IndexError(f"tonp.{op}: page id {int(ids[bad][0])} outside [0, {P})")
    return _run(q, k_cache, v_cache, pos, pos, seq, pt, B, scale, True)
