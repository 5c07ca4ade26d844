"""tonp's model layers: built with explicit local shapes and process groups; every numeric op
goes through `tonp_kernels`, so `tonp_kernels.use("torch")` switches them all at once."""
from .attention import Attention
from .batch import ForwardBatch
from .embedding import Embedding, LMHead
from .kv_cache import CacheFullError, CacheStep, PagedKVCache
from .linear import ColumnParallelLinear, RowParallelLinear
from .mlp import DenseMLP
from .moe import SparseMoeBlock
from .norm import RMSNorm
from .rotary import RotaryEmbedding

__all__ = ["Attention", "ForwardBatch", "Embedding", "LMHead", "CacheFullError", "CacheStep",
           "PagedKVCache", "ColumnParallelLinear", "RowParallelLinear", "DenseMLP",
           "SparseMoeBlock", "RMSNorm", "RotaryEmbedding"]
