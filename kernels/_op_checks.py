"""Each op's rules over all its tensors together (dtypes, ranks, shapes, index ranges), built from
_arg_checks.py's one-argument rules, for the backends that do not check their own arguments
(stock torch, the fast Triton kernels). The C++ ops check
the same rules for CPU tensors, with the same exception types; tests/test_kernels_fuzz.py holds
the two to it. Scalar arguments are checked once, before the dispatch (ops.py, vocab.py)."""
from __future__ import annotations

import torch

from . import _arg_checks as check


def linear(x, weight, bias, chunks, out_dtype):
    K = check.floats(x, op="linear", name="x", layout="[..., K]")[-1]
    N, Kw = check.floats(weight, op="linear", name="weight", dims=2, layout="[N, K]")
    if K != Kw:
        raise ValueError(f"tonp.linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do "
                         "not match: expected x [..., K] and weight [N, K]")
    if bias is not None and check.floats(bias, op="linear", name="bias", dims=1)[0] != N:
        raise ValueError(f"tonp.linear: bias must be [{N}], got {tuple(bias.shape)}")
    check.out_dtype(out_dtype, op="linear")
    if chunks is not None:
        check.chunks(K, chunks, op="linear")


def rms_norm(x, weight, eps):
    H = check.floats(x, op="rms_norm", name="x", layout="[..., H]")[-1]
    if check.floats(weight, op="rms_norm", name="weight", dims=1)[0] != H:
        raise ValueError(f"tonp.rms_norm: weight {tuple(weight.shape)} does not match x "
                         f"{tuple(x.shape)} (expected x [..., H] and weight [H])")


def silu_mul(gate, up):
    check.tensor(gate, op="silu_mul", name="gate")
    check.tensor(up, op="silu_mul", name="up")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"tonp.silu_mul: gate {tuple(gate.shape)}/{gate.dtype} and up "
                         f"{tuple(up.shape)}/{up.dtype} must match")
    check.floats(gate, op="silu_mul", name="gate", min_dims=0)


def _attention(op, q, k, v, kv_layout):
    """q [T, Hq, D] and k, v of kv_layout (..., Hkv, D), one float dtype; returns k's shape."""
    Hq, D = check.floats(q, op=op, name="q", dims=3, layout="[T, Hq, D]")[1:]
    dims = kv_layout.count(",") + 1
    ks = check.floats(k, op=op, name="k", dims=dims, layout=kv_layout)
    vs = check.floats(v, op=op, name="v", dims=dims, layout=kv_layout)
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"tonp.{op}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if ks[-1] != D or ks != vs:
        raise ValueError(f"tonp.{op}: head_dim mismatch: q {tuple(q.shape)}, k {tuple(ks)}, "
                         f"v {tuple(vs)}")
    if D < 8 or D % 8:
        raise ValueError(f"tonp.{op}: head_dim must be a positive multiple of 8, got {D}")
    Hkv = ks[-2]
    if Hkv < 1 or Hq < 1 or Hq % Hkv:
        raise ValueError(f"tonp.{op}: {Hq} query heads are not a multiple of {Hkv} key-value "
                         "heads")
    return ks


def attention_varlen(q, k, v, cu_seqlens, scale, block):
    op = "attention_varlen"
    _attention(op, q, k, v, "[T, Hkv, D]")
    T = q.shape[0]
    if k.shape[0] != T:
        raise ValueError(f"tonp.{op}: q has {T} tokens, k has {k.shape[0]}")
    check.integers(cu_seqlens, op=op, name="cu_seqlens", dims=1, layout="[S+1]")
    if cu_seqlens.is_meta:
        raise NotImplementedError(f"tonp.{op}: cu_seqlens on the meta device has no values")
    cu = cu_seqlens.tolist()
    if not cu or cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"tonp.{op}: cu_seqlens must run from 0 to T={T}, got "
                         f"{cu if len(cu) <= 12 else cu[:6] + ['...'] + cu[-5:]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"tonp.{op}: cu_seqlens must not decrease")


def attention_paged(q, k_cache, v_cache, page_table, q_seq, q_pos, scale):
    """The shapes, and the data: every page a query reads names a cache page."""
    op = "attention_paged"
    P, B = _attention(op, q, k_cache, v_cache, "[pages, block, kv_heads, head_dim]")[:2]
    if B < 1:
        raise ValueError(f"tonp.{op}: caches need a block size >= 1, got {tuple(k_cache.shape)}")
    S, max_pages = check.integers(page_table, op=op, name="page_table", dims=2,
                                  layout="[S, max_pages]")
    Tq = q.shape[0]
    if check.integers(q_seq, op=op, name="q_seq", dims=1)[0] != Tq or \
            check.integers(q_pos, op=op, name="q_pos", dims=1)[0] != Tq:
        raise ValueError(f"tonp.{op}: q_seq/q_pos must be [{Tq}], got {tuple(q_seq.shape)} and "
                         f"{tuple(q_pos.shape)}")
    if any(t.is_meta for t in (page_table, q_seq, q_pos)):
        return  # no values to check
    check.ids_in_range(q_seq, S, op=op, name="q_seq (the page table's sequences)")
    check.ids_in_range(q_pos, max_pages * B, op=op,
                       name="position (the page table's capacity exceeded)")
    for s in torch.unique(q_seq).tolist():
        n = (int(q_pos[q_seq == s].max()) + B) // B
        check.ids_in_range(page_table[s, :n], P, op=op, name="page id")


def rope(x, cos, sin, positions):
    T, _, D = check.floats(x, op="rope", name="x", dims=3, layout="[T, heads, head_dim]")
    if D % 2:
        raise ValueError(f"tonp.rope: x must be [T, heads, head_dim] with an even head_dim, got "
                         f"{tuple(x.shape)}")
    cs, ss = check.tensor(cos, op="rope", name="cos"), check.tensor(sin, op="rope", name="sin")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"tonp.rope: cos/sin tables must be float32, got {cos.dtype} and "
                        f"{sin.dtype}")
    if len(cs) != 2 or cs[1] != D or ss != cs:
        raise ValueError(f"tonp.rope: cos/sin tables must be [positions, {D}], got {tuple(cs)} "
                         f"and {tuple(ss)}")
    if check.integers(positions, op="rope", name="positions", dims=1)[0] != T:
        raise ValueError(f"tonp.rope: positions must be [{T}], got {tuple(positions.shape)}")
    check.ids_in_range(positions, cs[0], op="rope", name="position (outside the table)")


def moe_route(router_logits, top_k, normalize):
    E = check.floats(router_logits, op="moe_route", name="router_logits", dims=2,
                     layout="[M, E]")[1]
    if not 1 <= top_k <= E:
        raise ValueError(f"tonp.moe_route: top_k={top_k} outside [1, {E}]")


def moe_combine(weights, expert_out):
    check.floats(weights, op="moe_combine", name="weights", dims=2, layout="[M, K]")
    check.floats(expert_out, op="moe_combine", name="expert_out", dims=3, layout="[M, K, H]")
    if weights.shape != expert_out.shape[:2]:
        raise ValueError(f"tonp.moe_combine: expected weights [M, K] and expert_out [M, K, H], "
                         f"got {tuple(weights.shape)} and {tuple(expert_out.shape)}")


def moe_experts(x, expert_ids, gate_up, down, first_expert, chunks):
    op = "moe_experts"
    M, H = check.floats(x, op=op, name="x", dims=2, layout="[M, H]")
    check.tensor(expert_ids, op=op, name="expert ids", dims=2, layout="[M, K]")
    if expert_ids.dtype != torch.int64:
        raise TypeError(f"tonp.{op}: expert ids must be int64, got {expert_ids.dtype}")
    if expert_ids.shape[0] != M:
        raise ValueError(f"tonp.{op}: expert ids must be [M, K] with M = {M}, got "
                         f"{tuple(expert_ids.shape)}")
    E, I2, Hg = check.floats(gate_up, op=op, name="gate_up", dims=3, layout="[E, 2I, H]")
    Ed, Hd, I = check.floats(down, op=op, name="down", dims=3, layout="[E, H, I]")
    if Hg != H or (Ed, Hd) != (E, H) or I2 != 2 * I:
        raise ValueError(f"tonp.{op}: expected gate_up [E, 2I, H] and down [E, H, I] with "
                         f"H = {H}, got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    if down.dtype != gate_up.dtype:
        raise TypeError(f"tonp.{op}: gate_up and down dtypes differ ({gate_up.dtype}, "
                        f"{down.dtype})")
    if chunks is not None:
        check.chunks(H, chunks, op=op)
        check.chunks(I, chunks, op=op)
    check.ids_in_range(expert_ids, first_expert + E, low=first_expert, op=op,
                       name="expert id (not one of this call's experts)")


def vocab(op, logits, chunks):
    """logits [..., V] float, V >= 1 cut into `chunks` chunks (None: not cut)."""
    V = check.floats(logits, op=op, name="logits", layout="[..., V]")[-1]
    if V < 1:
        raise ValueError(f"tonp.{op}: empty vocabulary (logits {tuple(logits.shape)})")
    if chunks is not None:
        check.chunks(V, chunks, op=op)


def targets(op, logits, targets):
    """Integer target ids [...] for logits [..., V], each in [0, V)."""
    check.integers(targets, op=op, name="targets")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"tonp.{op}: targets {tuple(targets.shape)} do not match logits "
                         f"{tuple(logits.shape)}")
    check.ids_in_range(targets, logits.shape[-1], op=op, name="target id")
