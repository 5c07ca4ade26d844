"""tonp_models: the Qwen3-MoE model (one forward for training and decode) and its generator."""
from .qwen3_moe import PRESETS, Qwen3MoeConfig, Qwen3MoeForCausalLM

__all__ = ["PRESETS", "Qwen3MoeConfig", "Qwen3MoeForCausalLM"]

try:  # the generator is written separately; the model does not depend on it
    from .generation import GenerationOutput, generate  # noqa: F401
    __all__ += ["GenerationOutput", "generate"]
except ImportError:  # pragma: no cover
    pass
