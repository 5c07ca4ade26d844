"""The "torch" kernel mode: every op as stock PyTorch computes it (F.linear, SDPA, torch.softmax,
torch.topk, ...), in the input dtype. These are what tonp is measured against; they are correct
but their reduction order depends on the batch, the thread count and the code path. Each op
first checks its tensors by the rules of its C++ twin (_op_checks.py), so both modes refuse the
same input alike; `chunks` and `block` are checked, then ignored (None skips the check)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _arg_checks as check, _op_checks as opcheck


def linear(x, weight, bias=None, chunks=None, out_dtype=None, weight_groups=None):
    """F.linear in x's dtype (the CPU kernels' column groups are not read here)."""
    opcheck.linear(x, weight, bias, chunks, out_dtype)
    if weight.dtype != x.dtype:  # the kernels accept mixed float32 / bfloat16; F.linear does not
        weight = weight.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def rms_norm(x, weight, eps):
    opcheck.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate, up):
    opcheck.silu_mul(gate, up)
    return F.silu(gate) * up


def attention_varlen(q, k, v, cu_seqlens, scale, block=None):
    """Per-sequence causal SDPA over packed rows. q [T, Hq, D], k/v [T, Hkv, D]."""
    opcheck.attention_varlen(q, k, v, cu_seqlens, scale, block)
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        if e > s:
            out[s:e] = F.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
    return out


def attention_paged(q, k_cache, v_cache, page_table, q_seq, q_pos, scale):
    """Gather each sequence's cached K/V and run SDPA for its queries (decode/extend)."""
    opcheck.attention_paged(q, k_cache, v_cache, page_table, q_seq, q_pos, scale)
    B = k_cache.shape[1]
    out = torch.empty_like(q)
    for s in torch.unique(q_seq).tolist():
        rows = (q_seq == s).nonzero().squeeze(1)
        pos = q_pos[rows].long()
        L = int(pos.max()) + 1
        pages = page_table[s, : (L + B - 1) // B].long()
        k = k_cache[pages].flatten(0, 1)[:L].transpose(0, 1)  # (Hkv, L, D)
        v = v_cache[pages].flatten(0, 1)[:L].transpose(0, 1)
        mask = torch.arange(L, device=q.device)[None, :] <= pos.to(q.device)[:, None]  # (Tq, L)
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k, v, attn_mask=mask, scale=scale,
            enable_gqa=True).transpose(0, 1)
    return out


def rope(x, cos, sin, positions):
    """x [T, heads, D] rotated at its rows' positions (transformers' apply_rotary_pos_emb)."""
    opcheck.rope(x, cos, sin, positions)
    c = cos.index_select(0, positions).to(x.dtype)[:, None, :]
    s = sin.index_select(0, positions).to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


def _scaled(op, logits, temperature, softmax):
    x = logits.float() / temperature
    if x.numel():
        check.row_maxima(x.amax(-1), temperature, op=op, softmax=softmax)
    return x


def log_softmax(logits, temperature=1.0, chunks=None):
    opcheck.vocab("log_softmax", logits, chunks)
    return torch.log_softmax(_scaled("log_softmax", logits, temperature, True), dim=-1)


def logsumexp(logits, temperature=1.0, chunks=None):
    opcheck.vocab("logsumexp", logits, chunks)
    return torch.logsumexp(_scaled("logsumexp", logits, temperature, False), dim=-1)


def token_logprobs(logits, targets, temperature=1.0, chunks=None):
    opcheck.vocab("token_logprobs", logits, chunks)
    opcheck.targets("token_logprobs", logits, targets)
    lp = torch.log_softmax(_scaled("token_logprobs", logits, temperature, True), dim=-1)
    return lp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def target_logit(logits, targets, temperature=1.0):
    """logits[..., target] / temperature in fp32 (the same ops in every mode)."""
    opcheck.vocab("target_logit", logits, None)
    opcheck.targets("target_logit", logits, targets)
    return gather_logit(logits, targets, temperature)


def gather_logit(logits, targets, temperature):
    x = logits.float().gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return true_div(x, temperature)


def true_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor correctly rounded (IEEE), as the C++ and Triton kernels divide, on every
    device. torch's CUDA division by a Python number computes x * (1 / divisor) instead
    (aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu: "may lose one bit of precision"), which
    differs from x / T in the last bit for some x: the first GPU check found training logprobs
    at T = 0.9 one ulp off the rollout's. A 0-dim tensor on x's device takes the true division."""
    if divisor == 1.0:
        return x
    if x.device.type == "cpu":
        return x / divisor
    return x / torch.tensor(divisor, dtype=x.dtype, device=x.device)


def argmax(logits):
    opcheck.vocab("argmax", logits, None)
    nan = logits.isnan().reshape(-1, logits.shape[-1]).any(-1)
    if not nan.is_meta and bool(nan.any()):
        raise ValueError(f"tonp.argmax: row {int(nan.nonzero()[0])} holds a NaN logit")
    return torch.argmax(logits, dim=-1)


def moe_route(router_logits, top_k, normalize):
    opcheck.moe_route(router_logits, top_k, normalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def moe_combine(weights, expert_out):
    opcheck.moe_combine(weights, expert_out)
    return (weights.to(expert_out.dtype).unsqueeze(-1) * expert_out).sum(1)


def moe_experts(x, expert_ids, gate_up, down, first_expert=0, chunks=None, gate_up_groups=None,
                down_groups=None):
    """Per expert: F.linear -> silu * up -> F.linear on the rows routed to it (as transformers).
    The column groups (the CPU kernels' copy of the weights) are not read here."""
    opcheck.moe_experts(x, expert_ids, gate_up, down, first_expert, chunks)
    gate_up, down = gate_up.to(x.dtype), down.to(x.dtype)  # mixed dtypes, as the kernels take
    M, K = expert_ids.shape
    I = down.shape[2]
    flat = expert_ids.reshape(-1) - first_expert
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    outs, start = [], 0
    for e, (w_gu, w_dn) in enumerate(zip(gate_up.unbind(0), down.unbind(0))):
        n = counts[e]
        if n:
            gu = F.linear(x.index_select(0, order[start:start + n] // K), w_gu)
            outs.append(F.linear(F.silu(gu[:, :I]) * gu[:, I:], w_dn))
            start += n
    if not outs:  # no rows: keep the graph connected to x
        return x.unsqueeze(1).expand(M, K, x.shape[1])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return torch.cat(outs, 0).index_select(0, inverse).view(M, K, x.shape[1])
