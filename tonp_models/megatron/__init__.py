"""tonp's layers for megatron-core projects (needs `megatron-core`; see docs/megatron.md).

    from tonp_models.megatron import get_tonp_block_spec, transformer_config_from_qwen3
    block = TransformerBlock(config, get_tonp_block_spec(config, rotary_base=1e6))

Modules: config.py (TransformerConfig mapping and refusals), modules.py (the megatron-facing
layers), specs.py (ModuleSpecs). Checkpoint conversion between megatron-core GPT, tonp and HF
state dicts lives with the model's name table: `tonp_models.qwen3_moe.megatron_convert`
(no megatron import needed).
"""
from .config import (check_transformer_config, moe_layer_pattern, qwen3_config_from_transformer,
                     transformer_config_from_qwen3)
from .modules import (TonpDenseMLP, TonpRMSNorm, TonpSelfAttention, TonpSparseMoE,
                      load_global_state_dict, single_process_groups,
                      tonp_bias_dropout_add)
from .specs import get_tonp_block_spec, get_tonp_layer_spec

__all__ = ["check_transformer_config", "moe_layer_pattern", "qwen3_config_from_transformer",
           "transformer_config_from_qwen3", "TonpDenseMLP", "TonpRMSNorm", "TonpSelfAttention",
           "TonpSparseMoE", "tonp_bias_dropout_add", "single_process_groups",
           "load_global_state_dict", "get_tonp_block_spec", "get_tonp_layer_spec"]
