"""Pure-PyTorch references for the tonp ops: the numerical oracle of the tests.

Each function computes the op's mathematical definition with plain torch ops, upcasting to at
least fp32 (pass float64 inputs for a high-precision oracle). They are differentiable, and the
tests compare the kernels' gradients (C++ autograd, csrc/autograd.cpp) with theirs. They make no
promise of batch invariance: that is the kernels' job.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _up(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def linear(x, weight, bias=None, out_dtype=None):
    y = F.linear(_up(x), _up(weight), None if bias is None else _up(bias))
    return y.to(out_dtype or x.dtype)


def rms_norm(x, weight, eps):
    xf = _up(x)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (_up(weight) * _up(normed)).to(x.dtype)


def silu_mul(gate, up):
    g = _up(gate)
    return (F.silu(g) * _up(up)).to(gate.dtype)


def _causal_attention(q, k, v, scale, q_pos):
    """q [Tq, Hq, D] at positions q_pos; k, v [L, Hkv, D] at positions 0..L-1."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale  # (Hq, Tq, L)
    keep = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]  # (Tq, L)
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def attention_varlen(q, k, v, cu_seqlens, scale, block=64):
    """Causal attention over packed sequences: q [T, Hq, D], k/v [T, Hkv, D]."""
    out = torch.empty(q.shape, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                      device=q.device)
    cu = cu_seqlens.tolist()
    pieces = []
    for s, e in zip(cu[:-1], cu[1:]):
        pos = torch.arange(e - s, device=q.device)
        pieces.append(_causal_attention(_up(q[s:e]), _up(k[s:e]), _up(v[s:e]), scale, pos))
    out = torch.cat(pieces, 0) if pieces else out
    return out.to(q.dtype)


def attention_paged(q, k_cache, v_cache, page_table, q_seq, q_pos, scale):
    """Queries at (sequence q_seq[i], position q_pos[i]) against a paged cache
    k_cache/v_cache [P, B, Hkv, D]; page_table [S, max_pages] (int32)."""
    B = k_cache.shape[1]
    outs = []
    for i in range(q.shape[0]):
        s, t = int(q_seq[i]), int(q_pos[i])
        n_pages = t // B + 1
        pages = page_table[s, :n_pages].long()
        k = k_cache[pages].flatten(0, 1)[: t + 1]
        v = v_cache[pages].flatten(0, 1)[: t + 1]
        outs.append(_causal_attention(_up(q[i:i + 1]), _up(k), _up(v), scale,
                                      torch.tensor([t], device=q.device)))
    if not outs:
        return q.new_empty(q.shape)
    return torch.cat(outs, 0).to(q.dtype)


def rope(x, cos, sin, positions):
    """Rotate-half RoPE in x's dtype (the table rows rounded to it first, as transformers does)."""
    c = cos.index_select(0, positions.long()).to(x.dtype)[:, None, :]
    s = sin.index_select(0, positions.long()).to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


def log_softmax(logits, temperature=1.0):
    return torch.log_softmax(_up(logits) / temperature, dim=-1)


def logsumexp(logits, temperature=1.0):
    return torch.logsumexp(_up(logits) / temperature, dim=-1)


def token_logprobs(logits, targets, temperature=1.0):
    lp = log_softmax(logits, temperature)
    return lp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def argmax(logits):
    # torch.argmax returns the first maximal index on CPU; the reference relies on that.
    return torch.argmax(_up(logits), dim=-1)


def moe_route(router_logits, top_k, normalize):
    probs = torch.softmax(_up(router_logits), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1, sorted=True)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def moe_combine(weights, expert_out):
    """weights [M, K] fp32, expert_out [M, K, H] -> sum_k w_k * y_k in expert_out.dtype."""
    return (_up(weights).unsqueeze(-1) * _up(expert_out)).sum(1).to(expert_out.dtype)


def moe_experts(x, expert_ids, gate_up, down, first_expert=0):
    """y[m, k] = down_e(silu(gate_e(x[m])) * up_e(x[m])), e = expert_ids[m, k] - first_expert,
    rounded to x.dtype after each of the three steps (as three separate ops would)."""
    I = down.shape[2]
    y = torch.zeros(*expert_ids.shape, x.shape[1], dtype=x.dtype, device=x.device)
    for e in range(gate_up.shape[0]):
        m, k = (expert_ids == e + first_expert).nonzero(as_tuple=True)
        if m.numel():
            gu = linear(x[m], gate_up[e])
            y[m, k] = linear(silu_mul(gu[:, :I], gu[:, I:]), down[e])
    return y
