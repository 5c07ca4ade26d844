"""Megatron-core `TransformerConfig` <-> tonp: which fields map, which are refused.

    check_transformer_config(config)                 # one ValueError listing everything refused
    tc = transformer_config_from_qwen3(qwen3_cfg)    # a TransformerConfig for tonp's layers
    cfg = qwen3_config_from_transformer(tc, vocab_size=..., rope_theta=...)

The field mapping (and why moe_router_pre_softmax False is norm_topk_prob True) and the list
of refused settings are in docs/megatron.md; `_problems` is the code of that list.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

import tonp_kernels as tk

from ..qwen3_moe.config import Qwen3MoeConfig

# Load-balancing types that only add an auxiliary loss (inert with a zero coefficient);
# "sinkhorn" changes the routing itself.
_AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


def _is_silu(fn) -> bool:
    return fn is F.silu or fn is torch.nn.functional.silu or getattr(fn, "__name__", "") == "silu"


def _falsy(v) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_falsy(x) for x in v)
    return not v


def moe_layer_pattern(config) -> List[int]:
    """Megatron's 0/1 pattern of dense/MoE layers (as `get_gpt_decoder_layer_specs` reads it)."""
    if not config.num_moe_experts:
        return [0] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    pattern = list(freq)
    if len(pattern) != config.num_layers or any(p not in (0, 1) for p in pattern):
        raise ValueError(f"moe_layer_freq={freq} must be an int or a 0/1 list of num_layers="
                         f"{config.num_layers} entries")
    return pattern


def _problems(c) -> List[str]:
    """Every TransformerConfig setting tonp's layers cannot honour, as readable lines."""
    p = []

    def need(ok: bool, msg: str):
        if not ok:
            p.append(msg)

    need(c.normalization == "RMSNorm", f"normalization={c.normalization!r} (tonp: 'RMSNorm')")
    need(not c.layernorm_zero_centered_gamma, "layernorm_zero_centered_gamma=True")
    need(c.gated_linear_unit and _is_silu(c.activation_func),
         "the MLP must be SwiGLU: gated_linear_unit=True and activation_func=F.silu")
    need(not getattr(c, "glu_linear_offset", 0.0), f"glu_linear_offset={c.glu_linear_offset}")
    need(getattr(c, "activation_func_clamp_value", None) is None, "activation_func_clamp_value")
    need(not c.add_bias_linear, "add_bias_linear=True (tonp's layers have no linear biases)")
    need(not c.add_qkv_bias, "add_qkv_bias=True (tonp's layers have no linear biases)")
    need(c.qk_layernorm, "qk_layernorm=False (tonp's attention always RMS-normalises q and k)")
    need(not c.qk_l2_norm, "qk_l2_norm=True")
    need(not c.attention_dropout, f"attention_dropout={c.attention_dropout} (must be 0)")
    kv = c.kv_channels or c.hidden_size // max(c.num_attention_heads, 1)
    need(c.softmax_scale is None or c.softmax_scale == kv ** -0.5,
         f"softmax_scale={c.softmax_scale} (tonp: kv_channels ** -0.5)")
    need(not c.apply_query_key_layer_scaling, "apply_query_key_layer_scaling=True")
    need(getattr(c, "softmax_type", "vanilla") == "vanilla", f"softmax_type={c.softmax_type!r}")
    need(c.window_size is None, f"window_size={c.window_size} (no sliding window)")
    need(not c.rotary_interleaved, "rotary_interleaved=True (tonp rotates halves, HF style)")
    need(_falsy(c.no_rope_freq), "no_rope_freq (every tonp layer applies RoPE)")
    need(not c.multi_latent_attention, "multi_latent_attention=True")
    need(not c.attention_output_gate, "attention_output_gate=True")
    need(getattr(c, "experimental_attention_variant", None) is None,
         "experimental_attention_variant")
    need(getattr(c, "linear_attention_freq", None) is None, "linear_attention_freq")
    need(not c.fp32_residual_connection, "fp32_residual_connection=True")
    need(not c.apply_residual_connection_post_layernorm,
         "apply_residual_connection_post_layernorm=True")
    need(not c.fp8 and not getattr(c, "fp4", None), "fp8/fp4 (tonp computes in fp32/bf16)")
    need(c.params_dtype in tk.FLOAT_DTYPES,
         f"params_dtype={c.params_dtype} (float32 or bfloat16)")
    need(not c.sequence_parallel, "sequence_parallel=True (the megatron modules keep whole "
         "activations per TP rank; tonp's own model has SP)")
    need(c.context_parallel_size == 1, f"context_parallel_size={c.context_parallel_size} (the "
         f"megatron modules attend over whole sequences; tonp's own model has CP)")
    need(c.virtual_pipeline_model_parallel_size is None,
         f"virtual_pipeline_model_parallel_size={c.virtual_pipeline_model_parallel_size} "
         f"(get_tonp_block_spec slices one stage per rank)")
    need(c.mtp_num_layers is None, "mtp_num_layers (multi-token prediction)")
    need(not c.heterogeneous_block_specs, "heterogeneous_block_specs=True")
    if c.num_query_groups and c.num_attention_heads % c.num_query_groups:
        p.append(f"num_attention_heads={c.num_attention_heads} is not a multiple of "
                 f"num_query_groups={c.num_query_groups}")
    if c.num_moe_experts:
        need(c.moe_router_score_function == "softmax",
             f"moe_router_score_function={c.moe_router_score_function!r} (tonp: 'softmax')")
        need(c.moe_router_topk_scaling_factor in (None, 1.0),
             f"moe_router_topk_scaling_factor={c.moe_router_topk_scaling_factor}")
        need(c.moe_router_num_groups is None and c.moe_router_group_topk is None,
             "group-limited routing (moe_router_num_groups / moe_router_group_topk)")
        need(c.moe_router_topk_limited_devices is None, "moe_router_topk_limited_devices")
        need(not c.moe_router_enable_expert_bias, "moe_router_enable_expert_bias=True")
        need(c.moe_shared_expert_intermediate_size is None, "shared experts "
             "(moe_shared_expert_intermediate_size)")
        need(c.moe_input_jitter_eps is None, "moe_input_jitter_eps")
        need(c.moe_expert_capacity_factor is None and not c.moe_token_dropping and
             not c.moe_pad_expert_input_to_capacity, "token dropping / expert capacity")
        types = c.moe_router_load_balancing_type
        types = types if isinstance(types, list) else [types]
        need(all(t in _AUX_LOSS_TYPES for t in types),
             f"moe_router_load_balancing_type={c.moe_router_load_balancing_type!r}")
        need(_falsy(c.moe_aux_loss_coeff) and _falsy(c.moe_z_loss_coeff),
             "moe_aux_loss_coeff / moe_z_loss_coeff != 0 (tonp's MoE returns no auxiliary loss)")
        need(c.moe_router_dtype in (None, "fp32"),
             f"moe_router_dtype={c.moe_router_dtype!r} (tonp routes in fp32)")
        need(not c.moe_apply_probs_on_input, "moe_apply_probs_on_input=True")
        need(getattr(c, "moe_latent_size", None) is None, "moe_latent_size")
        need(not c.moe_router_force_load_balancing, "moe_router_force_load_balancing=True")
        need(c.moe_ffn_hidden_size is not None, "moe_ffn_hidden_size is unset")
    return p


def check_transformer_config(config) -> None:
    """Raise one ValueError listing every TransformerConfig setting tonp's layers refuse."""
    problems = _problems(config)
    if problems:
        raise ValueError("tonp's megatron layers cannot honour these TransformerConfig settings:\n"
                         + "\n".join(f"  - {m}" for m in problems))


def transformer_config_from_qwen3(cfg: Qwen3MoeConfig, dtype: Optional[torch.dtype] = None,
                                  **overrides):
    """A megatron-core TransformerConfig with `cfg`'s shapes and numerics (TP/EP sizes and
    other megatron knobs via `overrides`, e.g. tensor_model_parallel_size=2)."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    dtype = dtype or (cfg.dtype if cfg.dtype in tk.FLOAT_DTYPES else torch.float32)
    n = cfg.num_hidden_layers
    sparse = [1 if cfg.is_sparse_layer(i) else 0 for i in range(n)]
    kw = dict(
        num_layers=n, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.intermediate_size, layernorm_epsilon=cfg.rms_norm_eps,
        normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0,
        attention_dropout=0.0, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, bias_dropout_fusion=False,
        init_method_std=cfg.initializer_range)
    if any(sparse):
        kw.update(num_moe_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
                  moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_layer_freq=sparse,
                  moe_router_pre_softmax=not cfg.norm_topk_prob, moe_aux_loss_coeff=0.0,
                  moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather")
    kw.update(overrides)
    return TransformerConfig(**kw)


def qwen3_config_from_transformer(config, *, vocab_size: int, rope_theta: float = 10000.0,
                                  max_position_embeddings: int = 4096,
                                  tie_word_embeddings: bool = False, attention_block: int = 64,
                                  reduction_chunks: int = 8, **overrides) -> Qwen3MoeConfig:
    """The Qwen3MoeConfig of a megatron GPT model with this TransformerConfig (the GPTModel
    arguments vocab_size, rotary_base -> rope_theta, max_sequence_length ->
    max_position_embeddings and share_embeddings_and_output_weights -> tie_word_embeddings
    are not in TransformerConfig, so they are passed here). Refused settings raise."""
    check_transformer_config(config)
    pattern = moe_layer_pattern(config)
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[config.params_dtype]
    kw = dict(vocab_size=vocab_size, hidden_size=config.hidden_size,
              intermediate_size=config.ffn_hidden_size,
              moe_intermediate_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
              num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
              num_key_value_heads=config.num_query_groups or config.num_attention_heads,
              head_dim=config.kv_channels, num_experts=config.num_moe_experts or 0,
              num_experts_per_tok=config.moe_router_topk if config.num_moe_experts else 1,
              norm_topk_prob=not config.moe_router_pre_softmax, decoder_sparse_step=1,
              mlp_only_layers=[i for i, s in enumerate(pattern) if not s],
              rms_norm_eps=config.layernorm_epsilon, rope_theta=float(rope_theta),
              max_position_embeddings=max_position_embeddings,
              tie_word_embeddings=tie_word_embeddings, torch_dtype=dtype,
              initializer_range=config.init_method_std, attention_block=attention_block,
              reduction_chunks=reduction_chunks)
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


__all__ = ["check_transformer_config", "transformer_config_from_qwen3",
           "qwen3_config_from_transformer", "moe_layer_pattern"]
