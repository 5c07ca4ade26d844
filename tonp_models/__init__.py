"""tonp_models: the Qwen3-MoE model (one forward for training and decode) and its generator."""
from .generation import GenerationOutput, GenerationStats, generate
from .qwen3_moe import PRESETS, Qwen3MoeConfig, Qwen3MoeForCausalLM

__all__ = ["PRESETS", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "GenerationOutput",
           "GenerationStats", "generate"]
