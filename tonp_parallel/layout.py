"""Which TP / EP degrees a model can be split by without changing its bits.

The chunk tree of CONTRACT.md cuts every reduction of K into C equal chunks; a row-parallel rank
of TP degree t computes C / t of them and the fixed-order all-reduce finishes the tree. That
needs t to divide C, and every sharded size (heads, intermediate sizes, vocabulary) to split
evenly. `validate_model_layout` checks all of it at once and names every violated rule.
"""
from __future__ import annotations

from typing import Any, List, Mapping


def _get(config: Any, name: str, default=None):
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def validate_model_layout(config: Any, tp: int = 1, ep: int = 1, expert_tp: int = 1) -> None:
    """Raise ValueError listing every rule the (tp, ep, expert_tp) split of `config` breaks.

    `config` is a Qwen3MoeConfig, an HF config or a dict with the HF field names
    (num_attention_heads, num_key_value_heads, head_dim, hidden_size, intermediate_size,
    moe_intermediate_size, num_experts, vocab_size) and tonp's `reduction_chunks` (C, default 8).
    Missing fields are not checked. Rules:
      * C is a power of two and TP divides C (each rank holds C / tp chunks of the tree);
      * TP divides the query heads; TP divides the KV heads or is a multiple of them (then each
        KV head is replicated on tp / kv_heads ranks);
      * TP divides intermediate_size and the vocabulary; expert_tp divides moe_intermediate_size;
      * C divides every row-parallel reduction size (heads x head_dim, intermediate_size,
        moe_intermediate_size) and the vocabulary (the log-softmax chunk tree);
      * EP divides the number of experts.
    """
    errors: List[str] = []
    for name, v in (("tp", tp), ("ep", ep), ("expert_tp", expert_tp)):
        if not isinstance(v, int) or v < 1:
            errors.append(f"{name} must be a positive int, got {v!r}")
    if errors:
        raise ValueError("tonp_parallel: bad layout: " + "; ".join(errors))

    C = _get(config, "reduction_chunks", 8)
    if not _power_of_two(C):
        errors.append(f"reduction_chunks C={C} must be a power of two")
    for name, t in (("tp", tp), ("expert_tp", expert_tp)):
        if C % t:
            errors.append(f"{name}={t} must divide the reduction chunks C={C} (each rank finishes "
                          f"C/{name} chunks of the fixed tree)")

    hq, hkv = _get(config, "num_attention_heads"), _get(config, "num_key_value_heads")
    hidden = _get(config, "hidden_size")
    head_dim = _get(config, "head_dim") or (hidden // hq if hidden and hq else None)
    if hq is not None:
        if hq % tp:
            errors.append(f"tp={tp} must divide the {hq} query heads")
        if head_dim and (hq * head_dim) % C:
            errors.append(f"C={C} must divide o_proj's reduction size {hq} heads x {head_dim}")
    if hkv is not None and hkv % tp and tp % hkv:
        errors.append(f"tp={tp} must divide the {hkv} KV heads or be a multiple of them "
                      f"(then KV heads are replicated)")
    if hidden is not None and hidden % C:
        errors.append(f"C={C} must divide hidden_size={hidden} (the reduction of every "
                      f"column-parallel linear)")

    inter = _get(config, "intermediate_size")
    if inter is not None:
        if inter % tp:
            errors.append(f"tp={tp} must divide intermediate_size={inter}")
        if inter % C:
            errors.append(f"C={C} must divide intermediate_size={inter} (down_proj's reduction)")
    moe_inter = _get(config, "moe_intermediate_size")
    if moe_inter is not None:
        if moe_inter % expert_tp:
            errors.append(f"expert_tp={expert_tp} must divide moe_intermediate_size={moe_inter}")
        if moe_inter % C:
            errors.append(f"C={C} must divide moe_intermediate_size={moe_inter} (the experts' "
                          f"down_proj reduction)")

    vocab = _get(config, "vocab_size")
    if vocab is not None:
        if vocab % tp:
            errors.append(f"tp={tp} must divide vocab_size={vocab} (vocab-parallel head)")
        if vocab % C:
            errors.append(f"C={C} must divide vocab_size={vocab} (the log-softmax chunk tree)")

    experts = _get(config, "num_experts")
    if experts is not None and experts % ep:
        errors.append(f"ep={ep} must divide the {experts} experts")

    if errors:
        raise ValueError(f"tonp_parallel: the model cannot be split with tp={tp}, ep={ep}, "
                         f"expert_tp={expert_tp}: " + "; ".join(errors))
