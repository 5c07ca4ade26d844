"""ModuleSpecs that make a megatron-core TransformerLayer / TransformerBlock run tonp's layers.

    block = TransformerBlock(config, get_tonp_block_spec(config, rotary_base=1e6))
    layer_spec = get_tonp_layer_spec(moe=True, rotary_base=1e6)   # for your own block spec
    stage = TransformerBlock(config, get_tonp_block_spec(config, pp_rank=r), pre_process=r == 0,
                             post_process=r == pp - 1)            # pipeline stage r

The layer stays megatron's `TransformerLayer` (residuals, recompute, hooks); its norms,
attention, MLP and residual add are tonp's. Options TransformerConfig lacks travel in the spec:
rotary_base, max_position_embeddings, attention_block (B), reduction_chunks (C), and a
pg_collection for the MLP (TransformerLayer does not pass its groups to an MLP class it does
not know; without one the MLP takes parallel_state's groups).
"""
from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import (TransformerLayer,
                                                         TransformerLayerSubmodules)

from .config import check_transformer_config, moe_layer_pattern
from .modules import (TonpDenseMLP, TonpRMSNorm, TonpSelfAttention, TonpSparseMoE,
                      tonp_bias_dropout_add)


def get_tonp_layer_spec(moe: bool = True, *, rotary_base: float = 10000.0,
                        max_position_embeddings: int = 4096, attention_block: int = 64,
                        reduction_chunks: int = 8, pg_collection=None) -> ModuleSpec:
    """A TransformerLayer spec: TonpRMSNorm -> TonpSelfAttention -> residual -> TonpRMSNorm ->
    TonpSparseMoE (moe=True) or TonpDenseMLP -> residual."""
    attn = dict(rotary_base=rotary_base, max_position_embeddings=max_position_embeddings,
                attention_block=attention_block, reduction_chunks=reduction_chunks)
    mlp = dict(reduction_chunks=reduction_chunks)
    if pg_collection is not None:
        mlp["pg_collection"] = pg_collection
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=TonpRMSNorm,
            self_attention=ModuleSpec(module=TonpSelfAttention, params=attn),
            self_attn_bda=tonp_bias_dropout_add,
            pre_mlp_layernorm=TonpRMSNorm,
            mlp=ModuleSpec(module=TonpSparseMoE if moe else TonpDenseMLP, params=mlp),
            mlp_bda=tonp_bias_dropout_add,
        ),
    )


def get_tonp_block_spec(config, *, pp_rank=None, **options) -> TransformerBlockSubmodules:
    """A TransformerBlock spec for `config`: layer i is MoE where megatron's moe_layer_freq says
    so (dense layers use ffn_hidden_size), and the final norm is TonpRMSNorm. `options` are
    get_tonp_layer_spec's keywords. Refused TransformerConfig settings raise here.
    Under pipeline parallelism (config.pipeline_model_parallel_size > 1) the spec holds the
    layers of stage `pp_rank` (None: parallel_state's), split as megatron splits them
    (get_transformer_layer_offset / get_num_layers_to_build: even, or the first / last stage
    counts of the config); TransformerLayer gives each its global layer number."""
    check_transformer_config(config)
    specs = {m: get_tonp_layer_spec(moe=bool(m), **options) for m in (0, 1)}
    pattern = moe_layer_pattern(config)
    if config.pipeline_model_parallel_size > 1:
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
        offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
        pattern = pattern[offset:offset + get_num_layers_to_build(config, pp_rank=pp_rank)]
    return TransformerBlockSubmodules(layer_specs=[specs[m] for m in pattern],
                                      layer_norm=TonpRMSNorm)


__all__ = ["get_tonp_layer_spec", "get_tonp_block_spec"]
