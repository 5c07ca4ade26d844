"""The `fast` numerics backend: the ops that run on tensor cores, by the names and signatures of
the public tonp_kernels ops (stock.py's). Every other op keeps its exact kernel in fast mode.

    from tonp_kernels.accel import fast_ops
    fast_ops.OPS["linear"](x, w, None, 8, None)

docs/accelerators-fast.md is the design and what is verified where.
"""
from __future__ import annotations

from .fast_attention import attention_paged, attention_varlen
from .fast_linear import linear
from .fast_moe import moe_experts

# op name -> function, for the dispatch's registry of fast kernels
OPS = {"linear": linear, "attention_varlen": attention_varlen,
       "attention_paged": attention_paged, "moe_experts": moe_experts}

__all__ = ["OPS", "linear", "attention_varlen", "attention_paged", "moe_experts"]
