"""Grouped-query self-attention with QK-norm (Qwen3), over packed sequences or a paged cache.

Per token: q/k/v projections (column-parallel: this rank's heads) -> per-head RMSNorm of q and
k -> RoPE at the token's position -> attention -> o_proj (row-parallel). Without a cache the
attention is `tonp_kernels.attention_varlen` over whole packed sequences; with one (a
ForwardBatch's `kv`: the pages the scheduler allocated) the step's K/V are written into them
first and the queries read positions 0..t through `tonp_kernels.attention_paged`; under
context parallelism (`cp`, a ContextSplit: this rank holds a slice of each sequence) the keys
and values of every rank are gathered into pages and the local queries read them the same way (layers/context_attention.py). All visit keys in
blocks of `block` positions aligned to position 0, so a token gets the same bits in every
path (CONTRACT.md, Attention). Under sequence parallelism (`sp`) the input rows are gathered
at the entry and o_proj reduce-scatters them back.

Under TP degree t a rank holds num_heads / t query heads. If t divides the KV heads it holds
num_kv_heads / t of them; if t is a multiple of the KV heads, t / num_kv_heads consecutive ranks
hold the one KV head their query heads read (its weights are replicated, their gradients summed
over the copies). The q/k norms are replicated but see only this rank's heads, so their weight
gradients are summed over the TP group.
"""
from __future__ import annotations

import torch
from torch import nn

import tonp_kernels as tk

from .batch import ForwardBatch
from .context_attention import context_attention
from .linear import ColumnParallelLinear, RowParallelLinear, _divide, _tp_size
from .norm import RMSNorm
from .probe import probe, probing
from .rotary import RotaryEmbedding


class Attention(nn.Module):
    """Qwen3 attention of one layer.

    Args:
        layer_idx: this layer's index (its K/V pages in the cache).
        hidden_size, num_heads, num_kv_heads, head_dim: global shapes; a TP rank holds
            num_heads / t query heads and num_kv_heads / t key-value heads.
        rms_norm_eps, bias, chunks (reduction chunk count C), block (attention block B).
    """

    def __init__(self, layer_idx: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, *, rms_norm_eps: float, bias: bool = False,
                 chunks: int = tk.DEFAULT_CHUNKS, block: int = 64, tp_group=None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        t = _tp_size(tp_group)
        self.layer_idx, self.head_dim, self.block = layer_idx, head_dim, block
        self.local_heads = _divide(num_heads, t, "num_attention_heads")
        if num_kv_heads % t == 0:
            kv_copies = 1
        elif t % num_kv_heads == 0:
            kv_copies = t // num_kv_heads     # ranks sharing one KV head
        else:
            raise ValueError(f"num_key_value_heads={num_kv_heads} must be divisible by the "
                             f"tensor-parallel degree {t} or divide it (then KV heads are "
                             f"replicated)")
        self.local_kv_heads = num_kv_heads * kv_copies // t
        self.scale = head_dim ** -0.5
        kw = dict(bias=bias, chunks=chunks, tp_group=tp_group, dtype=dtype)
        col = dict(kw, entered=True)   # forward enters the TP region once for q, k and v
        self.q_proj = ColumnParallelLinear(hidden_size, num_heads * head_dim, **col)
        self.k_proj = ColumnParallelLinear(hidden_size, num_kv_heads * head_dim, copies=kv_copies,
                                           **col)
        self.v_proj = ColumnParallelLinear(hidden_size, num_kv_heads * head_dim, copies=kv_copies,
                                           **col)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, **kw)
        # Replicated weights, but each TP rank normalises its own heads: gradients summed.
        head_group = tp_group if t > 1 else None
        self.q_norm = RMSNorm(head_dim, rms_norm_eps, dtype, head_group)
        self.k_norm = RMSNorm(head_dim, rms_norm_eps, dtype, head_group)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rotary: RotaryEmbedding
                ) -> torch.Tensor:
        """x [T, H] packed tokens (under `batch.sp`: this rank's [n, H] of them) at
        batch.positions int64 [T], keys read by one of batch.cu_seqlens (whole sequences),
        batch.kv (the step's cache pages) or batch.cp (x holds the split's rows). -> like x."""
        from tonp_parallel.sequence import enter_tp_region
        sp, kv = batch.sp, batch.kv
        x = enter_tp_region(x, self.tp_group, sp)                                  # (T, H)
        T, D = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x).view(T, self.local_heads, D))               # (T, Hq, D)
        k = self.k_norm(self.k_proj(x).view(T, self.local_kv_heads, D))            # (T, Hkv, D)
        v = self.v_proj(x).view(T, self.local_kv_heads, D)                         # (T, Hkv, D)
        q, k = rotary(q, k, batch.positions)
        if batch.cp is not None:
            o = context_attention(q, k, v, batch.cp, scale=self.scale, block=self.block)
        elif kv is None:
            o = tk.attention_varlen(q, k, v, batch.cu_seqlens, scale=self.scale,
                                    block=self.block)
        else:
            kv.cache.write(self.layer_idx, kv, k, v)
            o = tk.attention_paged(q, kv.cache.k[self.layer_idx], kv.cache.v[self.layer_idx],
                                   kv.page_table, kv.q_seq, kv.positions, scale=self.scale)
        if probing():
            self._probe(k, v, o, kv)
        o = o.reshape(T, self.local_heads * D)                                     # (T, Hq*D)
        return self.o_proj(o) if sp is None else self.o_proj(o, sp=sp)             # (T|n, H)

    def _probe(self, k, v, o, kv) -> None:
        """Report the K/V rows of these tokens as the kernel read them (from the pages under a
        cache) and the attention output, all per head (split over TP ranks on dim 1)."""
        shard = 1 if self.q_proj.tp_size > 1 else None
        if kv is not None:
            B, pos, cache = kv.cache.page_size, kv.positions, kv.cache
            rows = kv.page_table.long()[kv.q_seq.long(), pos // B] * B + pos % B   # (T,)
            k = cache.k[self.layer_idx].flatten(0, 1).index_select(0, rows)        # (T, Hkv, D)
            v = cache.v[self.layer_idx].flatten(0, 1).index_select(0, rows)
        probe("k", k, shard_dim=shard)
        probe("v", v, shard_dim=shard)
        probe("attention", o, shard_dim=shard)
