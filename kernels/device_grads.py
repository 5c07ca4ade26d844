"""The tonp backward ops (and moe_experts_train) in plain torch math, for every device.

The C++ backward ops (csrc/grad_kernels.cpp, moe_backward.cpp, attention_grad.cpp) run on CPU
tensors only. These functions have the same schemas and output semantics (dtypes, shapes, empty
outputs where output_mask says not wanted) and are registered by _register.py (from the op
table) as the ops' CUDA and PrivateUse1 kernels, so the C++ autograd above them runs on accelerator tensors too. The experts'
gradients run as grouped Triton GEMMs (accel/moe_grad.py) wherever Triton runs on the device;
moe_experts_grad here is their fallback (an NPU without triton-ascend) and their reference.
Gradients are correct (fp32 sums, the C++ ops' roundings), not order-locked (CONTRACT.md
"Gradients"). Offsets (cu_seqlens, expert counts) are read on the host; experts and sequences run in loops.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

f32 = torch.float32
_SCORES = 1 << 26  # attention: at most this many fp32 scores per query block


def _none(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(0)


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b in `dtype`, fp32 sums: bf16 x bf16 -> bf16 is one bf16 GEMM (fp32 accumulation,
    rounded once); anything else is an fp32 GEMM of the widened operands."""
    if a.dtype == b.dtype == dtype == torch.bfloat16:
        return a @ b
    return (a.to(f32) @ b.to(f32)).to(dtype)


# --- linear: y = x w^T + b -----------------------------------------------------------------------
def linear_backward(grad, x, weight, output_mask, bias_dtype):
    bf16 = x.dtype == weight.dtype == torch.bfloat16
    g = grad.to(torch.bfloat16) if bf16 and (output_mask[0] or output_mask[1]) else grad
    return (_mm(g, weight, x.dtype) if output_mask[0] else _none(x),
            _mm(g.t(), x, weight.dtype) if output_mask[1] else _none(weight),
            grad.to(f32).sum(0).to(bias_dtype or grad.dtype) if output_mask[2] else _none(grad))


# --- rms_norm: y = w * (x r), r = rsqrt(mean(x^2) + eps) -----------------------------------------
def rms_norm_backward(grad, x, weight, eps, output_mask):
    xf = x.to(f32)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    xh = xf * r
    g = grad.to(x.dtype).to(f32)
    gh = g * weight.to(f32)
    gx = (r * (gh - xh * (gh * xh).mean(-1, keepdim=True))).to(x.dtype) if output_mask[0] \
        else _none(x)
    gw = (g * xh).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype) if output_mask[1] \
        else _none(weight)
    return gx, gw


# --- silu_mul: out = silu(g) u -------------------------------------------------------------------
def _swiglu_grad(d: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """(d/dgate, d/dup) of silu(gate) * up times d, in fp32."""
    g, u = gate.to(f32), up.to(f32)
    s = torch.sigmoid(g)
    return d * u * (s * (1 + g * (1 - s))), d * (g * s)


def silu_mul_backward(grad, gate, up):
    dg, du = _swiglu_grad(grad.to(gate.dtype).to(f32), gate, up.to(gate.dtype))
    return dg.to(gate.dtype), du.to(gate.dtype).to(up.dtype)


# --- rope: dx = g c + R^T(g s), R^T(y) = cat(y2, -y1) ---------------------------------------------
def rope_backward(grad, cos, sin, positions, dtype):
    pos = positions.to(device=cos.device, dtype=torch.long)
    c = cos.index_select(0, pos).to(dtype).to(f32)[:, None, :]
    s = sin.index_select(0, pos).to(dtype).to(f32)[:, None, :]
    g = grad.to(dtype).to(f32)
    gs, half = g * s, g.shape[-1] // 2
    return (g * c + torch.cat((gs[..., half:], -gs[..., :half]), -1)).to(dtype)


# --- moe_route: w = softmax(logits)[ids] (renormalised by their sum when normalize) ----------------
def moe_route_backward(grad_weights, router_logits, expert_ids, weights, normalize):
    p = torch.softmax(router_logits.to(f32), -1)
    gw, ids = grad_weights.to(f32), expert_ids.long()
    if normalize:  # w_k = p_k / S: dp_k = (gw_k - sum_j gw_j w_j) / S
        S = p.gather(1, ids).sum(1, keepdim=True)
        gw = (gw - (gw * weights.to(f32)).sum(1, keepdim=True)) / S
    dp = torch.zeros_like(p).scatter_add_(1, ids, gw)
    return (p * (dp - (dp * p).sum(1, keepdim=True))).to(router_logits.dtype)


# --- moe_combine: out = sum_k w_k y_k --------------------------------------------------------------
def moe_combine_backward(grad, weights, expert_out, output_mask):
    g = grad.to(expert_out.dtype).to(f32)
    gw = torch.einsum("mh,mkh->mk", g, expert_out.to(f32)).to(weights.dtype) if output_mask[0] \
        else _none(weights)
    gy = (weights.to(f32)[:, :, None] * g[:, None, :]).to(expert_out.dtype) if output_mask[1] \
        else _none(expert_out)
    return gw, gy


# --- moe experts ------------------------------------------------------------------------------------
def _groups(expert_ids: torch.Tensor, first_expert: int, E: int):
    """(order, starts): the flat (token * K + slot) rows sorted by expert (stable); expert e's
    rows are order[starts[e]:starts[e + 1]] (host ints)."""
    e = expert_ids.reshape(-1) - first_expert
    if e.numel() and not bool(((e >= 0) & (e < E)).all()):
        bad = int(expert_ids.reshape(-1)[(e < 0) | (e >= E)][0])
        raise IndexError(f"tonp.moe_experts: expert id {bad} is not one of this call's experts "
                         f"[{first_expert}, {first_expert + E})")
    order = torch.sort(e, stable=True).indices
    starts = [0] + torch.bincount(e, minlength=E).cumsum(0).tolist()
    return order, starts


def moe_experts_train(x, expert_ids, gate_up, down, first_expert, chunks):
    """(y, gate_up rows [R, 2I] in x's dtype, in expert-group order). y is the device's own
    tonp.moe_experts (bits as in rollout); the rows are its experts' tonp.linear on their rows,
    which the forward's grouped linear equals row by row."""
    y = torch.ops.tonp.moe_experts(x, expert_ids, gate_up, down, first_expert, chunks)
    K, E = expert_ids.shape[1], gate_up.shape[0]
    gub = x.new_empty((x.shape[0] * K, gate_up.shape[1]))
    if gub.numel():
        order, starts = _groups(expert_ids, first_expert, E)
        for e in range(E):
            a, b = starts[e], starts[e + 1]
            if b > a:
                gub[a:b] = torch.ops.tonp.linear(x[order[a:b] // K], gate_up[e], None, chunks, None)
    return y, gub


def experts_grad_rows(grad, x, expert_ids, gate_up, down, gate_up_out, first_expert, chunks):
    """moe_experts_grad's checks (grad [M, K, H]; gate_up_out [M K, 2I] in x's dtype, or None:
    recomputed) -> (gate_up_out, M, H, K, E, I)."""
    M, H = x.shape
    K, E, I = expert_ids.shape[1], gate_up.shape[0], down.shape[2]
    if tuple(grad.shape) != (M, K, H):
        raise ValueError(f"tonp.moe_experts_grad: grad must be [{M}, {K}, {H}], got "
                         f"{list(grad.shape)}")
    if gate_up_out is None:
        gate_up_out = moe_experts_train(x, expert_ids, gate_up, down, first_expert, chunks)[1]
    elif tuple(gate_up_out.shape) != (M * K, 2 * I) or gate_up_out.dtype != x.dtype:
        raise ValueError(f"tonp.moe_experts_grad: gate_up_out must be [{M * K}, {2 * I}] in x's "
                         f"dtype, got {list(gate_up_out.shape)} {gate_up_out.dtype}")
    return gate_up_out, M, H, K, E, I


def moe_experts_grad(grad, x, expert_ids, gate_up, down, gate_up_out, first_expert, chunks,
                     output_mask):
    """Per expert e with output gradients G, inputs x_e, gate/up rows g, u and h = silu(g) u:
    dH = G Wdn (fp32), dWdn = G^T h, dgu = swiglu'(dH) (x's dtype), dWgu = dgu^T x_e,
    dX rows = dgu Wgu (fp32), summed per token over its slots."""
    gate_up_out, M, H, K, E, I = experts_grad_rows(grad, x, expert_ids, gate_up, down, gate_up_out,
                                                   first_expert, chunks)
    R = M * K
    want_x, want_gu, want_dn = output_mask
    ggu = torch.zeros_like(gate_up) if want_gu else _none(gate_up)
    gdn = torch.zeros_like(down) if want_dn else _none(down)
    dxs = x.new_zeros((R, H), dtype=f32) if want_x else None  # dX rows in group order
    order, starts = _groups(expert_ids, first_expert, E) if R else (None, [0] * (E + 1))
    G = grad.reshape(R, H)
    for e in range(E):
        a, b = starts[e], starts[e + 1]
        if b == a:
            continue
        rows = order[a:b]
        Ge, gu_rows = G[rows], gate_up_out[a:b]
        gate, up = gu_rows[:, :I], gu_rows[:, I:]
        dH = _mm(Ge, down[e], f32)
        if want_dn:
            h = (torch.nn.functional.silu(gate.to(f32)) * up.to(f32)).to(x.dtype)
            gdn[e] = _mm(Ge.t(), h, down.dtype)
        dg, du = _swiglu_grad(dH, gate, up)
        dgu = torch.cat((dg, du), 1).to(x.dtype)
        if want_gu:
            ggu[e] = _mm(dgu.t(), x[rows // K], gate_up.dtype)
        if want_x:
            dxs[a:b] = _mm(dgu, gate_up[e], f32)
    if not want_x:
        return _none(x), ggu, gdn
    dx = torch.empty_like(dxs)
    if R:
        dx[order] = dxs
    return dx.view(M, K, H).sum(1).to(x.dtype), ggu, gdn


def moe_experts_backward(grad, x, expert_ids, gate_up, down, first_expert, output_mask):
    """The op autograd called before gate_up_out was kept: recomputes it (chunks 8, as in C++)."""
    return moe_experts_grad(grad, x, expert_ids, gate_up, down, None, first_expert, 8, output_mask)


# --- attention_varlen: causal attention over packed sequences -----------------------------------------
def _attention_seq(q, k, v, o, do, scale):
    """(dq, dk, dv) fp32 of one sequence; q, o, do [Hkv, G, L, D], k, v [Hkv, L, D] fp32. Query
    blocks bound the [Hkv, G, block, keys] scores."""
    Hkv, G, L, _ = q.shape
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (do * o).sum(-1, keepdim=True)  # rowsum(dO O)
    block = max(1, min(L, _SCORES // max(1, Hkv * G * L)))
    for q0 in range(0, L, block):
        q1 = min(L, q0 + block)
        kb, vb = k[:, None, :q1], v[:, None, :q1]  # keys 0..q1-1
        s = q[:, :, q0:q1] @ kb.transpose(-1, -2) * scale
        future = torch.arange(q1, device=q.device)[None, :] > \
            torch.arange(q0, q1, device=q.device)[:, None]
        p = torch.softmax(s.masked_fill(future, float("-inf")), -1)
        dob = do[:, :, q0:q1]
        dv[:, :q1] += (p.transpose(-1, -2) @ dob).sum(1)
        ds = p * (dob @ vb.transpose(-1, -2) - delta[:, :, q0:q1]) * scale
        dq[:, :, q0:q1] = ds @ kb
        dk[:, :q1] += (ds.transpose(-1, -2) @ q[:, :, q0:q1]).sum(1)
    return dq, dk, dv


def attention_varlen_backward(grad, q, k, v, out, cu_seqlens, scale):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if k.dim() != 3 or k.shape != v.shape or grad.shape != q.shape or out.shape != q.shape \
            or k.shape[0] != T or k.shape[2] != D or Hq % Hkv:
        raise ValueError("tonp.attention_varlen_backward: expected q, out, grad [T, Hq, D] and k, v "
                         f"[T, Hkv, D], got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}, "
                         f"{list(out.shape)}, {list(grad.shape)}")
    G = Hq // Hkv
    dq, dk, dv = (torch.zeros(t.shape, dtype=f32, device=t.device) for t in (q, k, v))
    cu = cu_seqlens.tolist()
    for t0, t1 in zip(cu[:-1], cu[1:]):
        if t1 == t0:
            continue
        L = t1 - t0

        def heads(t, grouped):  # [L, H, D] -> fp32 [Hkv, G, L, D] (grouped) or [Hkv, L, D]
            t = t[t0:t1].to(f32).transpose(0, 1)
            return t.reshape(Hkv, G, L, D) if grouped else t
        sq, sk, sv = _attention_seq(heads(q, True), heads(k, False), heads(v, False),
                                    heads(out, True), heads(grad, True), scale)
        dq[t0:t1] = sq.reshape(Hq, L, D).transpose(0, 1)
        dk[t0:t1] = sk.transpose(0, 1)
        dv[t0:t1] = sv.transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def embedding_backward(grad, ids, num_rows):
    """The rows' gradient [num_rows, H] in grad's dtype: per row the fp32 sum of its ids' grads
    in id order (a segment sum over the stably sorted ids: no atomics), zeros where unused."""
    H = grad.shape[-1]
    flat = ids.reshape(-1).long()
    if grad.numel() != flat.numel() * H:
        raise ValueError(f"tonp::embedding_backward: grad {tuple(grad.shape)} does not match ids "
                         f"{tuple(ids.shape)}")
    if flat.numel() and not bool(((flat >= 0) & (flat < num_rows)).all()):
        raise IndexError(f"tonp::embedding_backward: an id is outside [0, {num_rows})")
    order = torch.sort(flat, stable=True).indices
    rows = grad.reshape(-1, H).float().index_select(0, order)
    counts = torch.bincount(flat, minlength=num_rows)
    out = torch.segment_reduce(rows, "sum", lengths=counts, axis=0, unsafe=True)
    return out.to(grad.dtype)


# op -> its device-generic kernel (schema arguments in order, the C++ op's outputs).
KERNELS: Dict[str, Callable] = {fn.__name__: fn for fn in (
    linear_backward, rms_norm_backward, silu_mul_backward, rope_backward, moe_route_backward,
    moe_combine_backward, moe_experts_train, moe_experts_grad, moe_experts_backward,
    attention_varlen_backward, embedding_backward)}
