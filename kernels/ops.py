"""Public tonp ops. Each one dispatches on the kernel mode:

* "invariant": the order-locked C++ kernels (`torch.ops.tonp.*`), whose result for a row depends
  only on that row, the weights and the row's own sequence (see CONTRACT.md);
* "torch": stock torch ops (F.linear, SDPA, torch.softmax, torch.topk, ...), for comparison.

Shapes use: M rows (tokens), K reduction, N outputs, V vocabulary, H hidden, T packed tokens,
S sequences, Hq/Hkv query/key-value heads, D head_dim, P pages, B block (= page) size, E experts.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import _mode, stock
from ._library import C, require_built

DEFAULT_CHUNKS = 8
_FLOATS = (torch.float32, torch.bfloat16)


def _invariant() -> bool:
    return _mode.get_mode() == "invariant"


def _op(name: str):
    """The torch.ops.tonp overload, resolved once (or a stub that explains the missing build)."""
    if C is None:
        def missing(*args, **kwargs):
            require_built()
        return missing
    return getattr(torch.ops.tonp, name).default


def _check_cpu(name: str, *tensors: torch.Tensor) -> None:
    # The C++ ops check shapes and dtypes (with ValueError / TypeError); only a tensor on
    # another device would silently reach the fake (meta) implementation instead.
    for t in tensors:
        if not t.is_cpu:
            raise RuntimeError(f"tonp.{name}: the invariant kernels run on CPU tensors; got a "
                               f"tensor on {t.device} (use tonp_kernels.use('torch') elsewhere)")


def _check_float(name: str, *tensors: torch.Tensor) -> None:
    require_built()
    for t in tensors:
        if t.dtype not in _FLOATS:
            raise TypeError(f"tonp.{name}: expected float32 or bfloat16, got {t.dtype}")
        if t.device.type != "cpu":
            raise RuntimeError(f"tonp.{name}: the invariant kernels run on CPU tensors; got a "
                               f"tensor on {t.device} (use tonp_kernels.use('torch') elsewhere)")


def _call(op, *args):
    """Call a tonp op; when no input needs a gradient, dispatch below Autograd, skipping
    torch.library's Python autograd wrapper (~16 us a call: most of a decode step's overhead)."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
        return op(*args)  # traced graphs and autograd take the registered path
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _check_chunks(name: str, K: int, chunks: int) -> None:
    if chunks < 1 or chunks & (chunks - 1):
        raise ValueError(f"tonp.{name}: chunks must be a power of two, got {chunks}")
    if K % chunks:
        raise ValueError(f"tonp.{name}: the reduction size K={K} is not divisible by "
                         f"chunks={chunks} (the chunk tree needs C | K)")


# ---------------------------------------------------------------------------------------------
# Linear and the chunk tree
# ---------------------------------------------------------------------------------------------
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           chunks: int = DEFAULT_CHUNKS, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """y = x @ weight.T + bias. x [..., K], weight [N, K], bias [N] -> [..., N] (x.dtype or out_dtype).

    Invariant mode: K is cut into `chunks` equal chunks, each a sequential fp32 FMA chain over k,
    combined by the fixed pairwise tree; one rounding at the output.
    """
    if _mode._mode != "invariant":
        return stock.linear(x, weight, bias, out_dtype)
    _check_cpu("linear", x, weight)
    if x.dim() == 2:  # the decode / training shape: no reshapes (each costs ~3 us)
        return _LINEAR(x, weight, bias, chunks, out_dtype)
    y = _LINEAR(x.reshape(-1, x.shape[-1]), weight, bias, chunks, out_dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def linear_partial(x: torch.Tensor, weight: torch.Tensor, *, chunks: int) -> torch.Tensor:
    """The fp32 subtree of the chunk tree over this weight's K (a row-parallel rank's share).

    A rank of a TP-t row-parallel layer holds K/t columns = C/t chunks: calling this with
    chunks=C/t and finishing the t results with `tree_sum` (in rank order) equals
    `linear(x, full_weight, chunks=C)` bit for bit.
    """
    return linear(x, weight, None, chunks=chunks, out_dtype=torch.float32)


def tree_sum(partials: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Sum partials p0..p(n-1) by the fixed pairwise tree ((p0+p1)+(p2+p3))+... (n a power of 2)."""
    parts = list(partials.unbind(0)) if isinstance(partials, torch.Tensor) else list(partials)
    n = len(parts)
    if n == 0 or n & (n - 1):
        raise ValueError(f"tonp.tree_sum: need a power-of-two number of partials, got {n}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


# ---------------------------------------------------------------------------------------------
# Normalisation and elementwise
# ---------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> weight * (x * rsqrt(mean(x^2) + eps)) in x.dtype (HF rounding)."""
    if _mode._mode != "invariant":
        return stock.rms_norm(x, weight, eps)
    _check_cpu("rms_norm", x, weight)
    return _RMS_NORM(x, weight, eps)  # any leading dims: rows are the last dim


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise, with tonp's one exp (torch's vector and scalar tails differ)."""
    if _mode._mode != "invariant":
        return stock.silu_mul(gate, up)
    _check_cpu("silu_mul", gate, up)
    return _SILU_MUL(gate, up)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------
def _check_attention(name, q, k, v):
    _check_float(name, q, k, v)
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"tonp.{name}: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if q.shape[-1] != k.shape[-1] or k.shape != v.shape:
        raise ValueError(f"tonp.{name}: head_dim mismatch: q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(f"tonp.{name}: {q.shape[-2]} query heads are not a multiple of "
                         f"{k.shape[-2]} key-value heads")


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     *, scale: float, block: int = 64) -> torch.Tensor:
    """Causal attention over packed sequences (training forward and prefill).

    q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens int [S+1] (sequence i is rows cu[i]:cu[i+1]).
    Keys are visited in blocks of `block` positions aligned to each sequence's position 0.
    """
    if not _invariant():
        return stock.attention_varlen(q, k, v, cu_seqlens, scale)
    _check_attention("attention_varlen", q, k, v)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"tonp.attention_varlen: q has {q.shape[0]} tokens, k has {k.shape[0]}")
    cu = cu_seqlens.to(torch.int32)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != q.shape[0] or \
            bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"tonp.attention_varlen: cu_seqlens must rise from 0 to T={q.shape[0]}; "
                         f"got {cu.tolist()}")
    return _call(torch.ops.tonp.attention_varlen, q, k, v, cu, float(scale), int(block))


def attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor, *,
                    scale: float) -> torch.Tensor:
    """Queries against a paged KV cache (decode, extend, chunked prefill).

    q [Tq, Hq, D]; k_cache/v_cache [P, B, Hkv, D] (page size B = the attention block);
    page_table int [S, max_pages]; query i belongs to sequence q_seq[i] at position q_pos[i] and
    sees cached positions 0..q_pos[i] (its own K/V must already be written). A query at position t
    gets the same bits as row t of `attention_varlen` over the whole sequence with block=B.
    """
    if _mode._mode != "invariant":
        return stock.attention_paged(q, k_cache, v_cache, page_table, q_seq, q_pos, scale)
    _check_cpu("attention_paged", q, k_cache, v_cache)  # the C++ op checks the rest
    return _ATTENTION_PAGED(q, k_cache, v_cache, page_table, q_seq, q_pos, float(scale))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos[p] + rotate_half(x) * sin[p] for each row's position p.

    x [T, heads, D]; cos/sin fp32 tables [max_positions, D]; positions int [T] -> x.dtype.
    The table rows are rounded to x.dtype, then each product and the sum, exactly as the same
    expression in torch ops rounds (elementwise: a row's bits depend only on the row and p).
    """
    if _mode._mode != "invariant":
        return stock.rope(x, cos, sin, positions)
    _check_cpu("rope", x, cos, sin)
    return _ROPE(x, cos, sin, positions)


# ---------------------------------------------------------------------------------------------
# Vocabulary reductions
# ---------------------------------------------------------------------------------------------
def _check_logits(name, logits, chunks):
    _check_float(name, logits)
    _check_chunks(name, logits.shape[-1], chunks)


def logsumexp(logits: torch.Tensor, *, temperature: float = 1.0,
              chunks: int = DEFAULT_CHUNKS) -> torch.Tensor:
    """logsumexp(logits / temperature) over the last dim in fp32, by the vocab chunk tree."""
    if not _invariant():
        return stock.logsumexp(logits, temperature)
    _check_logits("logsumexp", logits, chunks)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LogSumExp.apply(logits, float(temperature), chunks)
    m, s = lse_partial(logits, temperature=temperature, chunks=chunks)  # no autograd node
    return lse_finish(m.unsqueeze(0), s.unsqueeze(0))


class _LogSumExp(torch.autograd.Function):
    """Forward: the chunk-tree kernel. Backward: d lse / dx = softmax(x / T) / T (torch math)."""

    @staticmethod
    def forward(ctx, logits, temperature, chunks):
        ctx.save_for_backward(logits)
        ctx.temperature = temperature
        m, s = lse_partial(logits, temperature=temperature, chunks=chunks)
        return lse_finish(m.unsqueeze(0), s.unsqueeze(0))

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        p = torch.softmax(logits.float() / ctx.temperature, dim=-1) / ctx.temperature
        return (grad.unsqueeze(-1) * p).to(logits.dtype), None, None


def lse_partial(logits: torch.Tensor, *, temperature: float = 1.0, chunks: int = DEFAULT_CHUNKS):
    """A vocab shard's subtree: (max, sum of exp(x/T - max)) fp32 [...], over `chunks` chunks."""
    _check_logits("lse_partial", logits, chunks)
    lead = logits.shape[:-1]
    m, s = torch.ops.tonp.lse_partial(logits.reshape(-1, logits.shape[-1]), float(temperature),
                                      chunks)
    return m.reshape(lead), s.reshape(lead)


def lse_finish(maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Finish the tree over P shard partials [P, ...] in shard order -> logsumexp fp32 [...]."""
    lead = maxes.shape[1:]
    out = torch.ops.tonp.lse_finish(maxes.reshape(maxes.shape[0], -1).float().contiguous(),
                                    sums.reshape(sums.shape[0], -1).float().contiguous())
    return out.reshape(lead)


def log_softmax(logits: torch.Tensor, *, temperature: float = 1.0,
                chunks: int = DEFAULT_CHUNKS) -> torch.Tensor:
    """log_softmax(logits / temperature) in fp32 [..., V]."""
    if not _invariant():
        return stock.log_softmax(logits, temperature)
    lse = logsumexp(logits, temperature=temperature, chunks=chunks)
    x = logits.float()
    # Elementwise IEEE ops round the same in torch's vector and scalar loops: invariant.
    return (x / temperature if temperature != 1.0 else x) - lse.unsqueeze(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   chunks: int = DEFAULT_CHUNKS) -> torch.Tensor:
    """log p(targets) under log_softmax(logits / temperature): logits [..., V], targets [...] -> fp32."""
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"tonp.token_logprobs: targets {tuple(targets.shape)} do not match "
                         f"logits {tuple(logits.shape)}")
    V = logits.shape[-1]
    if _mode._mode == "invariant" and not (logits.requires_grad and torch.is_grad_enabled()) \
            and not torch.compiler.is_compiling():
        # One op, the same lse and subtraction fused (the rollout's pick); the C++ op checks
        # dtype, chunks and target range.
        _check_cpu("token_logprobs", logits)
        if logits.dim() == 2:
            return _TOKEN_LOGPROBS(logits, targets, float(temperature), chunks)
        out = _TOKEN_LOGPROBS(logits.reshape(-1, V), targets.reshape(-1), float(temperature),
                              chunks)
        return out.reshape(targets.shape)
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= V):
        raise IndexError(f"tonp.token_logprobs: target id out of range [0, {V})")
    if not _invariant():
        return stock.token_logprobs(logits, targets, temperature)
    lse = logsumexp(logits, temperature=temperature, chunks=chunks)
    return target_logit(logits, targets, temperature=temperature) - lse


def target_logit(logits: torch.Tensor, targets: torch.Tensor, *,
                 temperature: float = 1.0) -> torch.Tensor:
    """logits[..., target] / temperature in fp32 (the one division every path uses)."""
    x = logits.float().gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return x / temperature if temperature != 1.0 else x


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of the maximum over the last dim; the lowest index wins ties. -> int64 [...]."""
    if _mode._mode != "invariant":
        return stock.argmax(logits)
    if logits.dim() == 2:  # the generator's [S, V]: one op call (it checks the dtype)
        _check_cpu("argmax", logits)
        return _MAX_WITH_INDEX(logits)[1]
    return max_with_index(logits)[1]


def max_with_index(logits: torch.Tensor):
    """(max fp32, lowest index of the max int64) over the last dim; shards combine exactly."""
    _check_float("max_with_index", logits)
    lead = logits.shape[:-1]
    v, i = torch.ops.tonp.max_with_index(logits.reshape(-1, logits.shape[-1]))
    return v.reshape(lead), i.reshape(lead)


def sample(logits: torch.Tensor, *, temperature: float, seed: int, request_ids: torch.Tensor,
           positions: torch.Tensor, top_k: Optional[int] = None,
           top_p: Optional[float] = None) -> torch.Tensor:
    """Seeded sampling from softmax(logits / temperature) restricted to top-k / top-p.

    The noise is a hash of (seed, request id, position, token id) only, so a row's draw never
    depends on the batch. logits [M, V]; request_ids, positions int [M] -> tokens int64 [M].
    temperature == 0 means greedy (argmax, lowest index on ties).
    """
    _check_float("sample", logits)
    if logits.dim() != 2:
        raise ValueError("tonp.sample: logits must be [M, V]")
    if temperature < 0 or (top_p is not None and not 0.0 < top_p <= 1.0) or \
            (top_k is not None and top_k < 1):
        raise ValueError(f"tonp.sample: bad settings temperature={temperature} top_k={top_k} "
                         f"top_p={top_p}")
    if temperature == 0:
        return argmax(logits)
    return torch.ops.tonp.sample(logits, float(temperature), int(top_k or 0), float(top_p or 1.0),
                                 int(seed) & 0xFFFFFFFFFFFF, request_ids.to(torch.int64),
                                 positions.to(torch.int64))


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------
def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool):
    """fp32 softmax over experts, stable top-k (ties to the lower id), optional renormalisation
    by a sum in slot order. router_logits [M, E] -> (ids int64 [M, k], weights fp32 [M, k])."""
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"tonp.moe_route: top_k={top_k} must be in [1, {router_logits.shape[-1]}]")
    if _mode._mode != "invariant":
        return stock.moe_route(router_logits, top_k, normalize)
    _check_cpu("moe_route", router_logits)
    if router_logits.dim() != 2:
        router_logits = router_logits.reshape(-1, router_logits.shape[-1])
    return _MOE_ROUTE(router_logits, top_k, bool(normalize))


def moe_combine(weights: torch.Tensor, expert_out: torch.Tensor) -> torch.Tensor:
    """Token-owned combine: sum_k w_k * y_k in slot order, fp32 FMA chain.
    weights [M, K] fp32, expert_out [M, K, H] -> [M, H] in expert_out.dtype."""
    if _mode._mode != "invariant":
        return stock.moe_combine(weights, expert_out)
    _check_cpu("moe_combine", weights, expert_out)
    return _MOE_COMBINE(weights.float(), expert_out)


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, *, first_expert: int = 0,
                chunks: int = DEFAULT_CHUNKS) -> torch.Tensor:
    """Every (token, slot) through its SwiGLU expert, all experts in one call.

    x [M, H]; expert_ids int64 [M, K] (global ids, all in [first_expert, first_expert + E));
    gate_up [E, 2I, H] (gate rows first); down [E, H, I] -> y [M, K, H] in x.dtype with
    y[m, k] = down_e(silu(gate_e(x[m])) * up_e(x[m])), e = expert_ids[m, k] - first_expert.
    Invariant mode: bit for bit what `linear`, `silu_mul` and `linear` give for that row alone,
    so a row's output never depends on how many rows its expert received.
    """
    if _mode._mode != "invariant":
        return stock.moe_experts(x, expert_ids, gate_up, down, first_expert)
    _check_cpu("moe_experts", x, gate_up, down)
    return _MOE_EXPERTS(x, expert_ids, gate_up, down, int(first_expert), chunks)


_LINEAR, _RMS_NORM, _SILU_MUL = _op("linear"), _op("rms_norm"), _op("silu_mul")
_MOE_ROUTE, _MOE_COMBINE, _MOE_EXPERTS = _op("moe_route"), _op("moe_combine"), _op("moe_experts")
_ATTENTION_PAGED, _ROPE = _op("attention_paged"), _op("rope")
_TOKEN_LOGPROBS, _MAX_WITH_INDEX = _op("token_logprobs"), _op("max_with_index")

__all__ = [
    "DEFAULT_CHUNKS", "linear", "linear_partial", "tree_sum", "rms_norm", "silu_mul",
    "attention_varlen", "attention_paged", "rope", "logsumexp", "lse_partial", "lse_finish",
    "log_softmax", "token_logprobs", "target_logit", "argmax", "max_with_index", "sample",
    "moe_route", "moe_combine", "moe_experts",
]
