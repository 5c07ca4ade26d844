"""Qwen3-MoE: config (HF names), model (one forward), checkpoint (one name/shard table)."""
from .config import PRESETS, Qwen3MoeConfig
from .model import Qwen3MoeForCausalLM

__all__ = ["PRESETS", "Qwen3MoeConfig", "Qwen3MoeForCausalLM"]
