"""The one place that knows which model shapes tonp's kernels run and which TP / EP / PP / CP /
world layouts split a model without changing its bits.

    problems = layout_problems(config, tp=2, ep=4)        # [] or one readable line per rule
    validate_model_layout(config, tp=2, ep=4, pp=2)       # the same, raised as one ValueError
    validate_model_layout(None, tp=2, ep=2, world_size=8) # the rank-layout rules only
    stages = stage_layers(48, pp=4, pp_layers=(13, 12, 12, 11))   # [range(0, 13), ...]

Qwen3MoeConfig.validate (at TP = EP = 1), the model and the megatron modules (at their groups'
degrees) and `rank_layout` (the world) all call it; the layers only assert the local shapes
they allocate. Why each rule: CONTRACT.md (chunk tree, vocab tree) and docs/checkpoints.md.
"""
from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence

import tonp_kernels as tk

# The most reduction chunks a kernel takes (the C++ side's kMaxChunks, read from the extension).
MAX_CHUNKS = tk.MAX_CHUNKS
# The attention kernels' lane width: head_dim must be a multiple of it.
HEAD_DIM_MULTIPLE = 8
# The vocabulary's chunk tree (token_logprobs, the vocab-parallel LM head) is always this wide.
VOCAB_CHUNKS = tk.DEFAULT_CHUNKS


def _get(config: Any, name: str, default=None):
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def _layer_kinds(config) -> tuple:
    """(has a dense MLP layer, has a sparse MoE layer); both when the config cannot say."""
    n, is_sparse = _get(config, "num_hidden_layers"), getattr(config, "is_sparse_layer", None)
    if is_sparse is None or not _positive_int(n):
        return True, True
    kinds = [is_sparse(i) for i in range(n)]
    return not all(kinds), any(kinds)


def _degree_problems(tp, ep, expert_tp, world_size, pp=1, cp=1) -> List[str]:
    errors = [f"{name} must be a positive int, got {v!r}"
              for name, v in (("tp", tp), ("ep", ep), ("expert_tp", expert_tp), ("pp", pp),
                              ("cp", cp), ("world_size", world_size))
              if not (v is None and name == "world_size") and not _positive_int(v)]
    if errors or world_size is None:
        return errors
    def product(names, values):
        used = [(n, v) for n, v in zip(names, values) if v != 1 or n in ("tp", "ep")]
        return " x ".join(f"{n}" for n, _ in used) + " = " + " x ".join(
            str(v) for _, v in used) if len(used) > 1 else f"{used[0][0]}={used[0][1]}"
    if world_size % (tp * cp * pp):
        errors.append(f"world size {world_size} is not divisible by "
                      f"{product(('tp', 'cp', 'pp'), (tp, cp, pp))} (the dense layout is "
                      f"world = pp x dp x cp x tp)")
    if world_size % (pp * ep * expert_tp):
        errors.append(f"world size {world_size} is not divisible by "
                      f"{product(('ep', 'expert_tp', 'pp'), (ep, expert_tp, pp))} (the expert "
                      f"layout is world = pp x expert_dp x ep x expert_tp)")
    return errors


def _stage_problems(num_layers, pp, pp_layers) -> List[str]:
    """The rules of a pipeline split of `num_layers` layers over `pp` stages."""
    if pp_layers is None:
        if _positive_int(num_layers) and pp > num_layers:
            return [f"pp={pp} exceeds the {num_layers} layers (every stage needs at least one)"]
        return []
    layers = list(pp_layers) if isinstance(pp_layers, (list, tuple)) else None
    if layers is None or not all(_positive_int(n) for n in layers):
        return [f"pp_layers={pp_layers!r} must be a list of positive ints (layers per stage)"]
    errors = []
    if len(layers) != pp:
        errors.append(f"pp_layers={layers} has {len(layers)} entries; pp={pp} needs one per stage")
    if _positive_int(num_layers) and sum(layers) != num_layers:
        errors.append(f"pp_layers={layers} sums to {sum(layers)}, not to the {num_layers} layers")
    return errors


def stage_layers(num_layers: int, pp: int = 1, pp_layers: Optional[Sequence[int]] = None
                 ) -> List[range]:
    """The layers of each pipeline stage: `pp_layers` (layers per stage, first stage first) or,
    when None, as even as possible with the first `num_layers % pp` stages one layer longer.
    Raises ValueError naming the rule a split breaks."""
    errors = _stage_problems(num_layers, pp, pp_layers)
    if errors:
        raise ValueError("tonp_parallel: cannot split the layers: " + "; ".join(errors))
    if pp_layers is None:
        base, extra = divmod(num_layers, pp)
        pp_layers = [base + (s < extra) for s in range(pp)]
    starts = [sum(pp_layers[:s]) for s in range(pp + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def _size_problems(config, tp: int) -> List[str]:
    """The kernels' shape rules and the TP rules (C = reduction_chunks)."""
    errors: List[str] = []
    C = _get(config, "reduction_chunks", tk.DEFAULT_CHUNKS)
    if not _positive_int(C) or not _power_of_two(C) or C > MAX_CHUNKS:
        return [f"reduction_chunks={C!r} must be a power of two in [1, {MAX_CHUNKS}] (the chunk "
                f"tree; {MAX_CHUNKS} is the kernels' limit)"]
    if C % tp:
        errors.append(f"tp={tp} must divide the reduction chunks C={C} (each rank finishes "
                      f"C/tp chunks of the fixed tree)")
    sizes = {k: _get(config, k) for k in ("hidden_size", "num_attention_heads",
                                          "num_key_value_heads", "head_dim", "intermediate_size",
                                          "moe_intermediate_size", "vocab_size", "num_experts")}
    bad = [k for k, v in sizes.items() if v is not None and not _positive_int(v)
           and not (k == "num_experts" and v == 0)]
    if bad:
        return errors + [f"{k}={sizes[k]!r} must be a positive int" for k in bad]
    hidden, hq = sizes["hidden_size"], sizes["num_attention_heads"]
    hkv = sizes["num_key_value_heads"]
    head_dim = sizes["head_dim"] or (hidden // hq if hidden and hq else None)

    def chunked(name, value, why):
        if value is not None and value % C:
            errors.append(f"{name}={value} is not a multiple of reduction_chunks={C} ({why})")

    chunked("hidden_size", hidden, "every column-parallel linear reduces over it in C chunks")
    if head_dim is not None and head_dim % HEAD_DIM_MULTIPLE:
        errors.append(f"head_dim={head_dim} must be a multiple of {HEAD_DIM_MULTIPLE} (the "
                      f"attention kernels' lanes)")
    if hq is not None:
        if head_dim:
            chunked("num_attention_heads*head_dim", hq * head_dim, "o_proj's reduction")
        if hq % tp:
            errors.append(f"tp={tp} must divide the {hq} query heads")
    if hkv is not None and hkv % tp and tp % hkv:
        errors.append(f"tp={tp} must divide the {hkv} KV heads or be a multiple of them "
                      f"(then KV heads are replicated)")
    dense, sparse = _layer_kinds(config)
    inter = sizes["intermediate_size"] if dense else None
    chunked("intermediate_size", inter, "the dense down_proj's reduction")
    if inter is not None and inter % tp:
        errors.append(f"tp={tp} must divide intermediate_size={inter}")
    if sparse and sizes["num_experts"] != 0:
        chunked("moe_intermediate_size", sizes["moe_intermediate_size"],
                "the experts' down_proj reduction")
    vocab = sizes["vocab_size"]
    if vocab is not None:
        if vocab % VOCAB_CHUNKS:
            errors.append(f"vocab_size={vocab} is not a multiple of {VOCAB_CHUNKS} (the "
                          f"log-softmax chunk tree over the vocabulary)")
        if vocab % tp:
            errors.append(f"tp={tp} must divide vocab_size={vocab} (vocab-parallel head)")
        if VOCAB_CHUNKS % tp:
            errors.append(f"tp={tp} must divide the {VOCAB_CHUNKS} vocabulary chunks (each "
                          f"rank scores {VOCAB_CHUNKS}/tp of them)")
    return errors


def layout_problems(config: Any = None, tp: int = 1, ep: int = 1, expert_tp: int = 1, *,
                    world_size: Optional[int] = None, pp: int = 1, cp: int = 1,
                    pp_layers: Optional[Sequence[int]] = None) -> List[str]:
    """Every rule the (tp, ep, expert_tp, pp, cp) split of `config` on `world_size` ranks breaks.

    `config`: a Qwen3MoeConfig, an HF config or a dict with the HF field names (hidden_size,
    num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
    moe_intermediate_size, num_experts, vocab_size) and tonp's `reduction_chunks` (C, default 8);
    missing fields are not checked; None checks only the degrees and the world. Rules:
      * C is a power of two <= MAX_CHUNKS, and C divides hidden_size, heads x head_dim and the
        intermediate sizes in use; head_dim is a multiple of 8; VOCAB_CHUNKS divides the vocab;
      * TP divides C, VOCAB_CHUNKS, the query heads, intermediate_size and the vocabulary, and
        divides the KV heads or is a multiple of them (KV heads replicated);
      * EP divides the experts; TP and EP (both > 1) divide one another; expert_tp is 1
        (experts are whole on each rank);
      * PP stages hold at least one layer each (`pp_layers`, if given: one positive count a
        stage, summing to num_hidden_layers); tied embeddings are refused at pp > 1 (the first
        stage holds the embedding, the last the LM head); CP and sequence parallelism split
        tokens and have no shape rule;
      * world_size is a multiple of tp x cp x pp and of pp x ep x expert_tp.
    """
    errors = _degree_problems(tp, ep, expert_tp, world_size, pp, cp)
    if errors:
        return errors
    if pp > 1 or pp_layers is not None:
        errors += _stage_problems(_get(config, "num_hidden_layers"), pp, pp_layers)
    if config is None:
        return errors
    if pp > 1 and _get(config, "tie_word_embeddings", False):
        errors.append(f"tie_word_embeddings=True with pp={pp}: the first stage holds the "
                      f"embedding and the last the LM head, and tonp does not keep two copies "
                      f"of one weight in sync; untie them or use pp=1")
    errors += _size_problems(config, tp)
    if expert_tp != 1:
        errors.append(f"expert_tp={expert_tp}: tonp keeps each expert whole on its rank "
                      f"(expert tensor parallelism must be 1)")
    experts = _get(config, "num_experts")
    if _positive_int(experts) and experts % ep:
        errors.append(f"ep={ep} must divide the {experts} experts")
    if tp > 1 and ep > 1 and tp % ep and ep % tp:
        errors.append(f"tp={tp} and ep={ep} must divide one another (TP ranks split the "
                      f"expert dispatch)")
    return errors


def validate_model_layout(config: Any = None, tp: int = 1, ep: int = 1, expert_tp: int = 1, *,
                          world_size: Optional[int] = None, pp: int = 1, cp: int = 1,
                          pp_layers: Optional[Sequence[int]] = None) -> None:
    """Raise one ValueError listing every rule of `layout_problems` the layout breaks."""
    errors = layout_problems(config, tp, ep, expert_tp, world_size=world_size, pp=pp, cp=cp,
                             pp_layers=pp_layers)
    if errors:
        where = f" on {world_size} ranks" if world_size is not None else ""
        more = "".join(f", {k}={v}" for k, v in (("pp", pp), ("cp", cp)) if v != 1)
        raise ValueError(f"tonp_parallel: cannot lay out tp={tp}, ep={ep}, expert_tp="
                         f"{expert_tp}{more}{where}: " + "; ".join(errors))


__all__ = ["MAX_CHUNKS", "HEAD_DIM_MULTIPLE", "VOCAB_CHUNKS", "layout_problems",
           "validate_model_layout", "stage_layers"]
