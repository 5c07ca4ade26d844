"""Public tonp ops: linear and the chunk tree, normalisation, attention, RoPE, MoE (vocabulary
reductions and sampling: vocab.py). Each checks its scalar arguments, then runs what
`_dispatch.impl` picks for the mode and the devices; that backend checks the tensors (C++ for
CPU, _op_checks.py otherwise). docs/kernels.md tells how they work.

Shapes use: M rows (tokens), K reduction, N outputs, H hidden, T packed tokens, S sequences,
Hq/Hkv query/key-value heads, D head_dim, P pages, B block (= page) size, E experts.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import _arg_checks as check
from ._dispatch import impl

DEFAULT_CHUNKS = 8


# ---------------------------------------------------------------------------------------------
# Linear and the chunk tree
# ---------------------------------------------------------------------------------------------
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           chunks: int = DEFAULT_CHUNKS, out_dtype: Optional[torch.dtype] = None,
           weight_groups: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ weight.T + bias. x [..., K], weight [N, K], bias [N] -> [..., N] (x.dtype or out_dtype).

    Invariant mode: K is cut into `chunks` equal chunks, each a sequential fp32 FMA chain over k,
    combined by the fixed pairwise tree; one rounding at the output.
    weight_groups: `pack_weight_groups(weight, chunks)`, a copy of the weight the caller keeps
    (and remakes whenever the weight changes): the CPU kernels read it where their table reads
    groups (fp32: the lane passes, which then transpose no weight per task; bf16 x bf16: the
    one-row tiles). The same bits with or without; a training forward (any tensor requiring
    grad) and other backends read the weight in place. (Where the table says so, Intel from 512
    rows, a large fp32 call given none packs a transient copy itself: kernels.h.)
    """
    chunks = check.integer(chunks, op="linear", name="chunks")
    fn = impl("linear", x, weight, bias)
    if weight_groups is None:
        return fn(x, weight, bias, chunks, out_dtype)
    return fn(x, weight, bias, chunks, out_dtype, weight_groups)


def linear_partial(x: torch.Tensor, weight: torch.Tensor, *, chunks: int) -> torch.Tensor:
    """The fp32 subtree of the chunk tree over this weight's K (a row-parallel rank's share).

    A rank of a TP-t row-parallel layer holds K/t columns = C/t chunks: calling this with
    chunks=C/t and finishing the t results with `tree_sum` (in rank order) equals
    `linear(x, full_weight, chunks=C)` bit for bit.
    """
    return linear(x, weight, None, chunks=chunks, out_dtype=torch.float32)


def tree_sum(partials: Sequence[torch.Tensor] | torch.Tensor, *,
             in_place: bool = False) -> torch.Tensor:
    """Sum p0..p(n-1) by the fixed pairwise tree, level by level, an odd last node carried up:
    ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)) for n = 8, (p0+p1)+p2 for n = 3. fp32 `+` only, so the
    bits never depend on the device or on how the elements are cut into messages.

    partials: a sequence of same-shape tensors, or a tensor stacked on dim 0. in_place=True
    accumulates into the left operands (`a.add_(b)` rounds like `a + b`): it overwrites the
    partials and saves the allocations (the large-message all-reduce).
    """
    parts = list(partials.unbind(0)) if isinstance(partials, torch.Tensor) else list(partials)
    if not parts:
        raise ValueError("tonp.tree_sum: no partials")
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor) or p.shape != parts[0].shape:
            got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise (ValueError if isinstance(p, torch.Tensor) else TypeError)(
                f"tonp.tree_sum: partial {i} is {got}; partial 0 is {tuple(parts[0].shape)} "
                "(the partials must be tensors of one shape)")
    while len(parts) > 1:
        pairs = range(0, len(parts) - 1, 2)
        nxt = ([parts[i].add_(parts[i + 1]) for i in pairs] if in_place
               else [parts[i] + parts[i + 1] for i in pairs])
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0]


# ---------------------------------------------------------------------------------------------
# Normalisation and elementwise
# ---------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> weight * (x * rsqrt(mean(x^2) + eps)) in x.dtype (HF rounding)."""
    eps = check.real(eps, op="rms_norm", name="eps", low=0.0)
    return impl("rms_norm", x, weight)(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise, with tonp's one exp (torch's vector and scalar tails differ)."""
    return impl("silu_mul", gate, up)(gate, up)


# ---------------------------------------------------------------------------------------------
# Attention and RoPE
# ---------------------------------------------------------------------------------------------
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     *, scale: float, block: int = 64) -> torch.Tensor:
    """Causal attention over packed sequences (training forward and prefill).

    q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens int [S+1] (sequence i is rows cu[i]:cu[i+1]).
    Keys are visited in blocks of `block` positions aligned to each sequence's position 0.
    """
    op = "attention_varlen"
    scale = check.real(scale, op=op, name="scale")
    block = check.integer(block, op=op, name="block", low=1)
    return impl(op, q, k, v, cu_seqlens)(q, k, v, cu_seqlens, scale, block)


def attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor, *,
                    scale: float) -> torch.Tensor:
    """Queries against a paged KV cache (decode, extend, chunked prefill).

    q [Tq, Hq, D]; k_cache/v_cache [P, B, Hkv, D] (page size B = the attention block);
    page_table int [S, max_pages]; query i belongs to sequence q_seq[i] at position q_pos[i] and
    sees cached positions 0..q_pos[i] (its own K/V must already be written). A query at position t
    gets the same bits as row t of `attention_varlen` over the whole sequence with block=B.
    """
    op = "attention_paged"
    scale = check.real(scale, op=op, name="scale")
    return impl(op, q, k_cache, v_cache, page_table, q_seq, q_pos)(
        q, k_cache, v_cache, page_table, q_seq, q_pos, scale)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos[p] + rotate_half(x) * sin[p] for each row's position p.

    x [T, heads, D]; cos/sin fp32 tables [max_positions, D]; positions int [T] -> x.dtype.
    The table rows are rounded to x.dtype, then each product and the sum, exactly as the same
    expression in torch ops rounds (elementwise: a row's bits depend only on the row and p).
    """
    return impl("rope", x, cos, sin, positions)(x, cos, sin, positions)


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------
def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool):
    """fp32 softmax over experts, stable top-k (ties to the lower id), optional renormalisation
    by a sum in slot order. router_logits [M, E] -> (ids int64 [M, k], weights fp32 [M, k])."""
    top_k = check.integer(top_k, op="moe_route", name="top_k")
    return impl("moe_route", router_logits)(router_logits, top_k, bool(normalize))


def moe_combine(weights: torch.Tensor, expert_out: torch.Tensor) -> torch.Tensor:
    """Token-owned combine: sum_k w_k * y_k in slot order, fp32 FMA chain.
    weights [M, K] fp32, expert_out [M, K, H] -> [M, H] in expert_out.dtype."""
    return impl("moe_combine", weights, expert_out)(weights, expert_out)


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, *, first_expert: int = 0,
                chunks: int = DEFAULT_CHUNKS, gate_up_groups: Optional[torch.Tensor] = None,
                down_groups: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every (token, slot) through its SwiGLU expert, all experts in one call.

    x [M, H]; expert_ids int64 [M, K] (global ids, all in [first_expert, first_expert + E));
    gate_up [E, 2I, H] (gate rows first); down [E, H, I] -> y [M, K, H] in x.dtype with
    y[m, k] = down_e(silu(gate_e(x[m])) * up_e(x[m])), e = expert_ids[m, k] - first_expert.
    Invariant mode: bit for bit what `linear`, `silu_mul` and `linear` give for that row alone,
    so a row's output never depends on how many rows its expert received.
    gate_up_groups / down_groups: `pack_weight_groups(gate_up / down, chunks)`, a copy of these
    weights the caller keeps (and remakes whenever the weights change): the CPU kernels' one-row
    tiles read it as one stream. The same bits with or without; other backends ignore it.
    """
    op = "moe_experts"
    first_expert = check.integer(first_expert, op=op, name="first_expert")
    chunks = check.integer(chunks, op=op, name="chunks")
    fn = impl(op, x, expert_ids, gate_up, down)
    if gate_up_groups is None and down_groups is None:
        return fn(x, expert_ids, gate_up, down, first_expert, chunks)
    return fn(x, expert_ids, gate_up, down, first_expert, chunks, gate_up_groups, down_groups)


def pack_weight_groups(weight: torch.Tensor, chunks: int = DEFAULT_CHUNKS
                       ) -> Optional[torch.Tensor]:
    """A weight [..., N, K] (an expert stack [E, N, K] too; bf16 or fp32) copied into column
    groups laid out the way the CPU kernels read it (linear's weight_groups, moe_experts'
    gate_up_groups / down_groups),
    or None where this process's kernels read none (the AVX512-BF16 build reads both dtypes,
    the AVX2 build fp32 from four rows a task, the portable build none) or the
    weight is not on the CPU: then nothing is gained, and no memory spent. An exact copy of the
    bytes in the weight's dtype, the same size as the weight: bf16, whole groups of 8 columns for
    the one-row tiles, chunks zero padded to 16 elements, shaped [..., N // 8, chunks, 8 * padded
    chunk]; fp32, whole panels of 16 columns in the lane tiles' order (kernels.h), shaped
    [..., N // 16, chunks, 16 * chunk]. The caller owns it and must remake it when the weight
    changes (the kernels refuse a copy of another shape, dtype or chunks, but cannot tell a stale
    one).
    """
    chunks = check.integer(chunks, op="pack_weight_groups", name="chunks")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"tonp.pack_weight_groups: expected a tensor, got {type(weight).__name__}")
    if weight.device.type != "cpu":
        return None  # the column groups serve the CPU kernels only
    with torch.no_grad():
        g = torch.ops.tonp.pack_weight_groups(weight.detach(), chunks)
    return g if g.numel() else None


HUGE_PAGE_MIN_BYTES = 4 << 20   # smaller tensors stay where they are (big_alloc.cpp: empty_huge)


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """t's values (the same bits, contiguous) in memory on 2 MB transparent huge pages, where the
    kernel grants them: for weights that every decode step streams whole, one TLB entry per 2 MB
    instead of 512 (the column groups of pack_weight_groups are made there too). t itself when it
    is under 4 MB, not on the CPU, or already a contiguous tensor at a 2 MB boundary (such a copy:
    calling again copies nothing); a plain copy under TONP_HUGE_PAGES=0 or where the system has
    transparent huge pages off. The caller swaps it in (`param.data = on_huge_pages(...)`).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tonp.on_huge_pages: expected a tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.numel() * t.element_size() < HUGE_PAGE_MIN_BYTES:
        return t
    if t.is_contiguous() and t.data_ptr() % (2 << 20) == 0:
        return t
    with torch.no_grad():
        return torch.ops.tonp.huge_pages_copy(t.detach())
