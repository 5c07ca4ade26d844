"""Fast causal attention on tensor cores (FlashAttention-style), packed sequences and a paged cache.

The arithmetic of a query row (a query position t and one query head; docs/accelerators.md):
keys in blocks of B positions aligned to position 0 of its sequence (B = the page size), in
order; per block the scores s = (q . k) * scale * log2(e) by one tensor-core dot over head_dim,
keys after t selected to -inf; the block max m_new = max(m, max s); alpha = 1 when the max did
not move, else exp2(m - m_new); p = exp2(s - m_new) on valid keys, else 0; l = l * alpha + (sum
of p by a fixed pairwise tree over the block's B slots); o = o * alpha, then o += p . V by one
tensor-core dot over the block; at the end o / l (correctly rounded), + 0.0 (a -0 becomes +0).

One compiled kernel serves both entry points: a program owns a tile of up to BQ queries of one
sequence times the G query heads of one KV head (BQ * G rows, from the head shape only), and
the varlen / paged difference is a runtime flag that only changes where a block's keys are read.
A row sees the same operands in every tile: keys past its own position get p = 0 whatever they
hold, and a block past its own last one leaves m, l and o unchanged (alpha = 1, p = 0). So a
token's bits are the same in a training pass, a chunked prefill and a one-token decode step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _op_checks as opcheck
from . import numerics as nm
from ._launch import check_device
from .fast_common import INTERP, dot, dot_dtype, launch, pow2, to_out

LOG2E = 1.4426950408889634
ROWS = 64  # rows of a tile (queries x padded group): one wgmma height


@triton.jit(do_not_specialize=["maxp", "paged"])
def _fast_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tiles_ptr, pos_ptr, pt_ptr, Hq, Hkv,
                           maxp, qk_scale, paged, G: tl.constexpr, GP: tl.constexpr,
                           BQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                           B: tl.constexpr, BP: tl.constexpr, DOT: tl.constexpr,
                           INTERP: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    # tile table row: (first query row, queries, sequence key, keys needed = max position + 1);
    # the key is the sequence's first row (packed) or its page-table row (paged)
    row0 = tl.load(tiles_ptr + 4 * t).to(tl.int64)
    nq = tl.load(tiles_ptr + 4 * t + 1)
    key = tl.load(tiles_ptr + 4 * t + 2).to(tl.int64)
    kv_len = tl.load(tiles_ptr + 4 * t + 3)
    R: tl.constexpr = BQ * GP
    r = tl.arange(0, R)
    qi = r // GP
    g = r % GP
    rv = (qi < nq) & (g < G)
    qrow = row0 + qi
    pos = tl.load(pos_ptr + qrow, mask=qi < nq, other=-1)
    d = tl.arange(0, DP)
    dm = d < D
    q = tl.load(q_ptr + ((qrow * Hq + h * G + g) * D)[:, None] + d[None, :],
                mask=rv[:, None] & dm[None, :], other=0.0)  # [R, DP]
    j = tl.arange(0, BP)
    stride = Hkv * D  # between positions (packed) or page rows (paged)
    m = tl.full([R], float("-inf"), tl.float32)
    l = tl.full([R], 0, tl.float32)
    o = tl.full([R, DP], 0, tl.float32)
    for b in range((kv_len + B - 1) // B):
        page = tl.load(pt_ptr + key * maxp + b, mask=paged != 0, other=0).to(tl.int64)
        base = tl.where(paged != 0, page * B, key + b * B)  # row of the block's first key
        kpos = b * B + j
        kvalid = (j < B) & (kpos < kv_len)
        kv_off = (base + j).to(tl.int64) * stride + h * D
        kt = tl.load(k_ptr + kv_off[None, :] + d[:, None], mask=dm[:, None] & kvalid[None, :],
                     other=0.0)  # [DP, BP]
        s = dot(q, kt, tl.full([R, BP], 0, tl.float32), DOT, INTERP) * qk_scale
        valid = kvalid[None, :] & (kpos[None, :] <= pos[:, None])
        s = tl.where(valid, s, float("-inf"))
        mb = nm.row_max(s, R, BP)
        m_new = tl.where(mb > m, mb, m)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf: no NaN made
        alpha = tl.where(m_new == m, 1.0, tl.exp2(m - m_sub))
        p = tl.where(valid, tl.exp2(s - m_sub[:, None]), 0.0)
        l = l * alpha + nm._tree(p, R, BP, 2)
        vb = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=kvalid[:, None] & dm[None, :],
                     other=0.0)  # [BP, DP]
        o = dot(p.to(vb.dtype), vb, o * alpha[:, None], DOT, INTERP)
        m = m_new
    res = tl.div_rn(o, tl.where(rv, l, 1.0)[:, None]) + 0.0  # padding rows: no 0 / 0
    out = out_ptr + ((qrow * Hq + h * G + g) * D)[:, None] + d[None, :]
    tl.store(out, to_out(res, out_ptr), mask=rv[:, None] & dm[None, :])


def attention_config(num_heads: int, kv_heads: int, head_dim: int, block: int, dtype) -> dict:
    """The compiled shape of the attention kernel: from the head shape, the block and the dtype
    only (never from the number of queries, sequences or keys)."""
    G = num_heads // kv_heads
    GP = pow2(G)
    return dict(G=G, GP=GP, BQ=max(1, ROWS // GP), D=head_dim, DP=max(16, pow2(head_dim)),
                B=block, BP=max(16, pow2(block)), DOT=dot_dtype(dtype),
                num_warps=8 if dtype == torch.float32 and head_dim > 64 else 4, num_stages=2)


def _tiles(seq: torch.Tensor, pos: torch.Tensor, bq: int, keys: torch.Tensor) -> torch.Tensor:
    """int32 [T, 4] tile table: runs of consecutive queries of one sequence, cut every bq."""
    n = seq.numel()
    idx = torch.arange(n, device=seq.device)
    new = torch.ones(n, dtype=torch.bool, device=seq.device)
    new[1:] = seq[1:] != seq[:-1]
    run_start = torch.cummax(torch.where(new, idx, 0), 0).values
    first = ((idx - run_start) % bq) == 0
    row0 = first.nonzero().squeeze(1)
    nq = torch.diff(row0, append=torch.tensor([n], device=seq.device))
    tile = torch.cumsum(first.long(), 0) - 1
    kv_len = torch.zeros(row0.numel(), dtype=torch.int64, device=seq.device)
    kv_len = kv_len.scatter_reduce(0, tile, pos + 1, "amax", include_self=False)
    return torch.stack([row0, nq, keys[row0], kv_len], 1).to(torch.int32).contiguous()


def _run(q, k, v, seq, pos, keys, pt, block, scale, paged) -> torch.Tensor:
    T, Hq, D = q.shape
    Hkv = k.shape[-2]
    out = torch.empty_like(q)
    if T == 0:
        return out
    cfg = attention_config(Hq, Hkv, D, block, q.dtype)
    tiles = _tiles(seq, pos, cfg["BQ"], keys)
    launch(_fast_attention_kernel, (tiles.shape[0], Hkv), q.contiguous(), k, v, out, tiles,
           pos.to(torch.int32).contiguous(), pt, Hq, Hkv, pt.shape[1], float(scale) * LOG2E,
           int(paged), INTERP=INTERP, **cfg)
    return out


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float, block: int = 64) -> torch.Tensor:
    """Fast numerics of tonp_kernels.attention_varlen: q [T, Hq, D], k/v [T, Hkv, D],
    cu_seqlens [S+1]. Row t of a sequence equals attention_paged of that query with page size
    block."""
    opcheck.attention_varlen(q, k, v, cu_seqlens, scale, block)
    check_device("attention_varlen", q, k, v)
    T = q.shape[0]
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=q.device), lens,
                                  output_size=T)
    starts = cu[:-1][seq]
    pos = torch.arange(T, device=q.device) - starts
    dummy = torch.zeros(1, 1, dtype=torch.int32, device=q.device)
    return _run(q, k.contiguous(), v.contiguous(), seq, pos, starts, dummy, block, scale, False)


def attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Fast numerics of tonp_kernels.attention_paged: q [Tq, Hq, D], caches [P, B, Hkv, D],
    page_table [S, max_pages], q_seq/q_pos [Tq]. Consecutive queries of one sequence share a
    tile (a chunk of prefill); a query's bits do not depend on it."""
    opcheck.attention_paged(q, k_cache, v_cache, page_table, q_seq, q_pos, scale)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise RuntimeError("tonp.attention_paged: caches must be contiguous")
    check_device("attention_paged", q, k_cache, v_cache)
    pt = page_table.to(device=q.device, dtype=torch.int32).contiguous()
    seq = q_seq.to(device=q.device, dtype=torch.int64)
    pos = q_pos.to(device=q.device, dtype=torch.int64)
    return _run(q, k_cache, v_cache, seq, pos, seq, pt, k_cache.shape[1], scale, True)

