"""Causal attention under context parallelism: local queries against every rank's keys.

    o = context_attention(q, k, v, split, scale=s, block=B)   # q/k/v: this rank's rows

Forward: the keys and values of all rows are gathered over the CP group (bytes only), laid
out as pages of B positions per sequence (`ContextSplit.key_pages`), and each local query at
position t reads positions 0..t of its sequence through `tonp_kernels.attention_paged` - the
kernel's contract is that this equals row t of `attention_varlen` over the whole sequence
with block B (blocks aligned to position 0, online softmax over them in order), so CP = C
gives CP = 1's bits.
Backward (correct, not invariant: CONTRACT.md, Gradients): torch math recomputed in blocks of
queries (fp32 SDPA with the causal mask of their positions), the gradients of the gathered
keys and values summed over the CP group (every rank's queries read every rank's keys), and
this rank's rows kept. Memory: one block's [heads, queries, keys] scores at a time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import tonp_kernels as tk

# Scores per backward block at most (heads x queries x keys, fp32): 16 MiB.
_BLOCK_SCORES = 1 << 22


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split, *,
                      scale: float, block: int) -> torch.Tensor:
    """q [T_local, Hq, D], k/v [T_local, Hkv, D] (the rows `split.rows`) -> o [T_local, Hq, D]."""
    return _ContextAttention.apply(q, k, v, split, float(scale), int(block))


def _pages(x_full: torch.Tensor, split, block: int) -> torch.Tensor:
    """[T, H, D] packed rows -> [pages, B, H, D] (zeros beyond each sequence's end)."""
    dest, _ = split.key_pages(block)
    flat = x_full.new_zeros((split.num_pages(block) * block, *x_full.shape[1:]))
    flat[dest] = x_full
    return flat.view(-1, block, *x_full.shape[1:])


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, split, scale, block):
        k_full, v_full = split.gather_raw(k), split.gather_raw(v)                # (T, Hkv, D)
        _, table = split.key_pages(block)
        rows = split.rows
        o = tk.attention_paged(q, _pages(k_full, split, block), _pages(v_full, split, block),
                               table, split.seq[rows].to(torch.int32), split.positions[rows],
                               scale=scale)
        ctx.save_for_backward(q, k_full, v_full)
        ctx.split, ctx.scale = split, scale
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k_full, v_full = ctx.saved_tensors
        split = ctx.split
        dq, dk, dv = _grads(q, k_full, v_full, grad, split, ctx.scale)
        if split.size > 1:
            import torch.distributed as dist
            both = torch.stack([dk, dv])
            dist.all_reduce(both, group=split.group)
            dk, dv = both[0], both[1]
        rows = split.rows
        return (dq.to(q.dtype), dk.index_select(0, rows).to(k_full.dtype),
                dv.index_select(0, rows).to(v_full.dtype), None, None, None)


def _grads(q, k_full, v_full, grad, split, scale):
    """(dq [T_local, Hq, D], dk, dv [T, Hkv, D]) in fp32 by blocked masked SDPA."""
    rows = split.rows
    seq, pos = split.seq[rows], split.positions[rows]
    dq = torch.zeros(q.shape, dtype=torch.float32)
    dk = torch.zeros(k_full.shape, dtype=torch.float32)
    dv = torch.zeros(v_full.shape, dtype=torch.float32)
    Hq = q.shape[1]
    for i, (a, b) in enumerate(zip(split.bounds, split.bounds[1:])):
        mine = (seq == i).nonzero().squeeze(1)                                     # local rows
        if not len(mine):
            continue
        kf = k_full[a:b].float().detach().requires_grad_(True)                     # (n, Hkv, D)
        vf = v_full[a:b].float().detach().requires_grad_(True)
        qb_rows = max(1, _BLOCK_SCORES // max(1, Hq * (b - a)))
        for s in range(0, len(mine), qb_rows):
            part = mine[s:s + qb_rows]
            p = pos.index_select(0, part)                                          # (m,)
            L = int(p.max()) + 1
            qf = q.index_select(0, part).float().detach().requires_grad_(True)     # (m, Hq, D)
            mask = torch.arange(L)[None, :] <= p[:, None]                          # (m, L)
            with torch.enable_grad():
                o = F.scaled_dot_product_attention(
                    qf.transpose(0, 1), kf[:L].transpose(0, 1), vf[:L].transpose(0, 1),
                    attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
                gq, gk, gv = torch.autograd.grad(o, (qf, kf, vf),
                                                 grad.index_select(0, part).float())
            dq.index_copy_(0, part, gq)
            dk[a:b] += gk
            dv[a:b] += gv
    return dq, dk, dv
