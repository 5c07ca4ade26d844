"""tonp's layers with megatron-core's construction and forward conventions.

Each class IS the tonp layer (a subclass: same parameters, kernels and bits) built from
megatron's arguments (`config: TransformerConfig`, `layer_number`, `pg_collection`, ...), with a
forward over megatron's `[s, b, h]` hidden states that returns what `TransformerLayer` expects:

    TonpRMSNorm          RMSNorm(config, hidden_size, eps)            [s, b, h] -> [s, b, h]
    TonpSelfAttention    Attention (q/k/v, QK-norm, RoPE, o_proj)     -> (out [s, b, h], None)
    TonpSparseMoE        SparseMoeBlock (router, top-k SwiGLU experts) -> (out [s, b, h], None)
    TonpDenseMLP         DenseMLP (SwiGLU)                             -> (out [s, b, h], None)
    tonp_bias_dropout_add  the residual add (megatron's unfused bias-dropout-add)

The accepted sequence layouts (causal [s, b, h], packed thd, StaticInferenceContext on a tonp
PagedKVCache), RoPE and the parallel layouts are described in docs/megatron.md.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from einops import rearrange

from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_unfused

from tonp_parallel.layout import validate_model_layout
from tonp_parallel.sharding import parameter_shards

from ..layers import (Attention, CacheStep, DenseMLP, ForwardBatch, PagedKVCache, RMSNorm,
                      RotaryEmbedding, SparseMoeBlock)
from .config import check_transformer_config


# ---------------------------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------------------------
def _groups(pg_collection, *names):
    """The named groups of a ProcessGroupCollection (megatron's parallel_state when None), each
    None when absent or of size 1 (tonp layers treat None as "this rank alone")."""
    if pg_collection is None:
        from megatron.core.process_groups_config import ProcessGroupCollection
        pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=list(names))
    out = []
    for n in names:
        g = getattr(pg_collection, n, None)
        if g is not None:
            import torch.distributed as dist
            if not dist.is_initialized() or dist.get_world_size(g) == 1:
                g = None
        out.append(g)
    return out


def single_process_groups():
    """A ProcessGroupCollection for one process without torch.distributed (every group None):
    pass it as `pg_collection=` to TransformerBlock / TransformerLayer and the tonp spec."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    return ProcessGroupCollection(tp=None, pp=None, cp=None, ep=None, expt_tp=None, tp_cp=None,
                                  dp=None, dp_cp=None, expt_dp=None, mp=None, embd=None,
                                  pos_embd=None, tp_ep=None, tp_ep_pp=None, tp_dp_cp=None)


def _init_weights(config, params, output_params=()) -> None:
    """Megatron's init: matrices by config.init_method, output projections by
    output_layer_init_method (norms stay 1). Per rank: load real weights for TP > 1."""
    if not config.perform_initialization:
        return
    with torch.no_grad():
        for p in params:
            config.init_method(p)
        for p in output_params:
            config.output_layer_init_method(p)


def _rank(pg_collection, name: str) -> int:
    """This rank's index in the named group (0 when the group is absent or of size 1)."""
    (g,) = _groups(pg_collection, name)
    if g is None:
        return 0
    import torch.distributed as dist
    return dist.get_rank(g)


def _check_layout(reduction_chunks: int, tp=None, ep=None, expert_tp=None, **fields):
    """The layer's sizes (`fields`, HF names) and its groups' degrees against tonp's one set of
    layout rules (`tonp_parallel.validate_model_layout`)."""
    import torch.distributed as dist

    def size(g):
        return 1 if g is None else dist.get_world_size(g)
    validate_model_layout(dict(fields, reduction_chunks=reduction_chunks), tp=size(tp),
                          ep=size(ep), expert_tp=size(expert_tp) if ep is not None else 1)


def _mark_shards(module, pg_collection) -> None:
    """Tag sharded weights as megatron's parallel layers do, from the layer's own Shards: TP
    shards get tensor_model_parallel / partition_dim (megatron's grad-norm clipping counts an
    untagged parameter on TP rank 0 only, wrong for a shard); EP shards get allreduce=False
    (megatron's DDP then reduces them over the expert-data-parallel group). Also notes the
    replica ranks `sharded_state_dict` needs."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    for name, shard in parameter_shards(module).items():
        param = module.get_parameter(name)
        if shard.group == "tp":
            set_tensor_model_parallel_attributes(param, True, shard.dim, 1)
        elif shard.group == "ep":
            param.allreduce = False
    module._replica_ranks = {k: _rank(pg_collection, k) for k in ("tp", "dp_cp", "expt_dp")}


def load_global_state_dict(module, state_dict, strict: bool = True):
    """Load global (TP = EP = 1) tensors into `module` built on any TP/EP rank: each sharded
    parameter takes its slice by the layer's own Shard (TP heads, replicated KV heads, EP
    expert ranges). Keys as in module.state_dict(); returns load_state_dict's result."""
    shards = parameter_shards(module)
    local = {k: shards[k].take(v) if k in shards else v for k, v in state_dict.items()}
    return module.load_state_dict(local, strict=strict)


def _sharded_state_dict(module, prefix="", sharded_offsets=(), metadata=None):
    """megatron dist-checkpointing entries from the layer's own Shards: a TP or EP shard is its
    slice of the global tensor (KV-head copies included), the rest is replicated. Exactly one
    rank holds replica id (0, 0, 0) of each slice: it writes it."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
    shards, ranks = parameter_shards(module), module._replica_ranks
    n, out = len(sharded_offsets), {}
    for name, t in module.state_dict(prefix="", keep_vars=True).items():
        key = f"{prefix}{name}"
        if name.endswith("_extra_state"):
            out[key] = make_sharded_object_for_checkpoint(
                t, key, sharded_offsets, replica_id=(0, ranks["tp"], ranks["dp_cp"]))
            continue
        s = shards.get(name)
        if s is None:        # replicated over TP and DP
            offsets, replica = (), (0, ranks["tp"], ranks["dp_cp"])
        else:                # copies: the ranks holding the same slice (KV heads at TP > heads)
            copies = (ranks["tp"] % (getattr(module.get_submodule(name.rpartition(".")[0]),
                                             "copies", 1))) if s.group == "tp" else 0
            dp = ranks["dp_cp"] if s.group == "tp" else ranks["expt_dp"]
            offsets = ((s.dim + n, s.start // s.length, s.full // s.length),)
            replica = (0, copies, dp)
        out[key] = ShardedTensor.from_rank_offsets(key, t, *sharded_offsets, *offsets,
                                                   replica_id=replica, prepend_axis_num=n)
    return out


def tonp_bias_dropout_add(training: bool, fused: bool):
    """The `self_attn_bda` / `mlp_bda` of the tonp spec: residual + dropout(x + bias).

    Always megatron's unfused function: its "fused" variant is `torch.compile`d (a C++ compile
    on CPU) and buys nothing here. With hidden_dropout=0 it is `residual + x`, the add of tonp's
    own decoder layer (IEEE addition commutes, so the bits match)."""
    return bias_dropout_add_unfused(training)


# ---------------------------------------------------------------------------------------------
# Norm and MLPs
# ---------------------------------------------------------------------------------------------
class TonpRMSNorm(RMSNorm):
    """tonp's RMSNorm built like megatron's norms: (config, hidden_size, eps).
    [..., h] -> [..., h]."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps, config.params_dtype)
        self.config = config


class _PerToken:
    """forward([s, b, h], padding_mask=None) -> ([s, b, h], None) over tonp's (tokens, h) rows.
    Tokens are independent (CONTRACT.md: a row never depends on its batch), so the (s b) order
    needs no transpose; padding_mask only weights megatron's auxiliary losses (tonp has none)."""

    def forward(self, hidden_states: torch.Tensor, padding_mask=None):
        y = super().forward(rearrange(hidden_states, "s b h -> (s b) h"))
        return rearrange(y, "(s b) h -> s b h", b=hidden_states.shape[1]), None


class TonpSparseMoE(_PerToken, SparseMoeBlock):
    """tonp's SparseMoeBlock as megatron's `mlp` of an MoE layer.

    Args: config (num_moe_experts, moe_router_topk, moe_ffn_hidden_size, moe_router_pre_softmax),
    pg_collection (`ep` holds the experts, each whole on its rank; `tp` ranks share the tokens
    and split the expert dispatch under EP; at EP 1 every TP rank runs all experts),
    reduction_chunks (C). forward([s, b, h], padding_mask=None) -> (out [s, b, h], None).
    """

    def __init__(self, config, submodules=None, pg_collection=None, *, reduction_chunks: int = 8,
                 **_unused):
        check_transformer_config(config)
        ep, tp, etp = _groups(pg_collection, "ep", "tp", "expt_tp")
        _check_layout(reduction_chunks, tp=tp, ep=ep, expert_tp=etp,
                      hidden_size=config.hidden_size,
                      moe_intermediate_size=config.moe_ffn_hidden_size,
                      num_experts=config.num_moe_experts)
        super().__init__(config.hidden_size, config.moe_ffn_hidden_size, config.num_moe_experts,
                         config.moe_router_topk, not config.moe_router_pre_softmax,
                         chunks=reduction_chunks, ep_group=ep, tp_group=tp,
                         dtype=config.params_dtype)
        self.config = config
        _init_weights(config, [self.gate, self.gate_up_proj], [self.down_proj])
        _mark_shards(self, pg_collection)

    sharded_state_dict = _sharded_state_dict


class TonpDenseMLP(_PerToken, DenseMLP):
    """tonp's DenseMLP (SwiGLU, gate/up column-parallel, down row-parallel over `pg_collection.tp`)
    as megatron's `mlp` of a dense layer. forward([s, b, h]) -> (out [s, b, h], None)."""

    def __init__(self, config, submodules=None, pg_collection=None, tp_group=None, *,
                 reduction_chunks: int = 8, **_unused):
        check_transformer_config(config)
        if tp_group is None:
            (tp_group,) = _groups(pg_collection, "tp")
        _check_layout(reduction_chunks, tp=tp_group, hidden_size=config.hidden_size,
                      intermediate_size=config.ffn_hidden_size)
        super().__init__(config.hidden_size, config.ffn_hidden_size, chunks=reduction_chunks,
                         tp_group=tp_group, dtype=config.params_dtype)
        self.config = config
        _init_weights(config, [self.gate_proj.weight, self.up_proj.weight],
                      [self.down_proj.weight])
        _mark_shards(self, pg_collection)

    sharded_state_dict = _sharded_state_dict


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _shared_rotary(head_dim: int, theta: float, max_positions: int) -> RotaryEmbedding:
    """One table per shape for all layers (48 private 40k x 128 tables would cost GBs)."""
    return RotaryEmbedding(head_dim, theta, max_positions)


class TonpSelfAttention(Attention):
    """tonp's Attention as megatron's `self_attention`.

    Args:
        config: TransformerConfig (hidden_size, num_attention_heads, num_query_groups,
            kv_channels, layernorm_epsilon for the q/k norms, params_dtype, num_layers).
        layer_number: megatron's 1-based global layer number (cache layer = layer_number - 1).
        pg_collection: its `tp` group shards the heads (None: megatron's parallel_state).
        rotary_base, max_position_embeddings: tonp's RoPE table (set them in the spec).
        attention_block (B, also the KV page size), reduction_chunks (C).
    forward(hidden_states [s, b, h], attention_mask=None, ..., inference_context=None,
            rotary_pos_emb=None, packed_seq_params=None) -> (out [s, b, h], None)
    """

    def __init__(self, config, submodules=None, layer_number: int = 1, attn_mask_type=None,
                 cp_comm_type=None, pg_collection=None, *, rotary_base: float = 10000.0,
                 max_position_embeddings: int = 4096, attention_block: int = 64,
                 reduction_chunks: int = 8, **_unused):
        check_transformer_config(config)
        if attn_mask_type is not None and getattr(attn_mask_type, "name", "causal") != "causal":
            raise ValueError(f"TonpSelfAttention: attn_mask_type={attn_mask_type} (tonp's "
                             f"attention is causal)")
        (tp,) = _groups(pg_collection, "tp")
        heads, groups = config.num_attention_heads, config.num_query_groups or \
            config.num_attention_heads
        _check_layout(reduction_chunks, tp=tp, hidden_size=config.hidden_size,
                      num_attention_heads=heads, num_key_value_heads=groups,
                      head_dim=config.kv_channels)
        super().__init__(layer_number - 1, config.hidden_size, heads, groups, config.kv_channels,
                         rms_norm_eps=config.layernorm_epsilon, chunks=reduction_chunks,
                         block=attention_block, tp_group=tp, dtype=config.params_dtype)
        self.config, self.layer_number, self.rotary_base = config, layer_number, rotary_base
        # A plain list keeps the shared table out of this module's children and state dict.
        self._rotary = [_shared_rotary(config.kv_channels, float(rotary_base),
                                       max_position_embeddings)]
        self._rope_checked = False
        _init_weights(config, [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight],
                      [self.o_proj.weight])
        _mark_shards(self, pg_collection)

    sharded_state_dict = _sharded_state_dict

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        inference_context = inference_context if inference_context is not None \
            else inference_params
        unsupported = [n for n, v in (("key_value_states", key_value_states),
                                      ("rotary_pos_cos/sin", rotary_pos_cos),
                                      ("rotary_pos_cos_sin", rotary_pos_cos_sin),
                                      ("attention_bias", attention_bias)) if v is not None]
        if unsupported:
            raise ValueError(f"TonpSelfAttention: {unsupported} are not supported (causal self-"
                             f"attention with tonp's own RoPE tables)")
        self._check_rope(rotary_pos_emb)
        s, b, _ = hidden_states.shape
        rotary = self._rotary[0]
        if inference_context is not None:
            if packed_seq_params is not None:
                raise ValueError("TonpSelfAttention: packed_seq_params with an inference_context "
                                 "is not supported")
            x = rearrange(hidden_states, "s b h -> (b s) h")      # b sequences, packed
            step = _static_cache_step(inference_context, self, b, s, x.dtype, x.device)
            y = super().forward(x, ForwardBatch(step.positions, kv=step), rotary)
            return rearrange(y, "(b s) h -> s b h", b=b).contiguous(), None
        if packed_seq_params is not None:
            x, cu = _thd(hidden_states, packed_seq_params)                         # (T, h)
            y = super().forward(x, ForwardBatch(_positions(cu), cu_seqlens=cu), rotary)
            return y.unsqueeze(1), None
        _check_causal_mask(attention_mask, s)
        x = rearrange(hidden_states, "s b h -> (b s) h")          # b sequences, packed
        cu = torch.arange(0, b * s + 1, s, dtype=torch.int32)
        y = super().forward(x, ForwardBatch(torch.arange(s).repeat(b), cu_seqlens=cu), rotary)
        return rearrange(y, "(b s) h -> s b h", b=b).contiguous(), None

    def _check_rope(self, emb) -> None:
        """Catch a GPTModel whose rotary_base / rotary_percent differ from the spec's (once)."""
        if emb is None or self._rope_checked:
            return
        emb = emb[0] if isinstance(emb, tuple) else emb
        D = self.head_dim
        if emb.shape[-1] != D:
            raise ValueError(f"TonpSelfAttention: rotary_pos_emb has {emb.shape[-1]} dims, tonp "
                             f"rotates all head_dim={D} (rotary_percent must be 1.0)")
        if emb.shape[0] >= 2:
            got = (emb[1] - emb[0]).reshape(-1)[: D // 2].float().cpu()
            want = 1.0 / (self.rotary_base ** (torch.arange(0, D, 2).float() / D))
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-6):
                raise ValueError(f"TonpSelfAttention: megatron's rotary_pos_emb does not use "
                                 f"rotary_base={self.rotary_base} of the tonp spec; build the "
                                 f"spec with the GPTModel's rotary_base")
        self._rope_checked = True


def _positions(cu: torch.Tensor) -> torch.Tensor:
    """Positions 0..n-1 within each packed sequence: cu int32 [S+1] -> int64 [T]."""
    counts = (cu[1:] - cu[:-1]).long()
    T = int(cu[-1])
    return torch.arange(T) - torch.repeat_interleave(cu[:-1].long(), counts, output_size=T)


def _thd(hidden: torch.Tensor, p):
    """hidden [T, 1, h] + PackedSeqParams(thd) -> (x [T, h], cu_seqlens int32 [S+1])."""
    if p.qkv_format not in (None, "thd"):
        raise ValueError(f"TonpSelfAttention: packed_seq_params.qkv_format={p.qkv_format!r} "
                         f"(only 'thd')")
    if hidden.shape[1] != 1:
        raise ValueError(f"TonpSelfAttention: packed (thd) hidden states must be [T, 1, h], got "
                         f"{tuple(hidden.shape)}")
    cu = p.cu_seqlens_q.to("cpu", torch.int32)
    for name in ("cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        other = getattr(p, name, None)
        if other is not None and not torch.equal(other.to("cpu", torch.int32), cu):
            raise ValueError(f"TonpSelfAttention: {name} differs from cu_seqlens_q (padded or "
                             f"cross-length packing is not supported)")
    if int(cu[-1]) != hidden.shape[0]:
        raise ValueError(f"TonpSelfAttention: cu_seqlens_q ends at {int(cu[-1])} but there are "
                         f"{hidden.shape[0]} tokens")
    return hidden[:, 0], cu


def _check_causal_mask(mask, s: int) -> None:
    """Accept None or megatron's causal mask ([.., s, s], True = masked): anything else
    (padding, documents) must come as packed_seq_params, never as a mask."""
    if mask is None:
        return
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).triu(1)
    if mask.shape[-2:] != (s, s) or not bool((mask.bool() == causal).all()):
        raise ValueError("TonpSelfAttention: attention_mask must be None or the causal mask; "
                         "pass ragged or padded sequences as packed_seq_params (thd)")


def _static_cache_step(ctx, attn: TonpSelfAttention, b: int, s: int, dtype, device) -> CacheStep:
    """Map a StaticInferenceContext onto tonp's paged cache with a fixed page table: batch row
    i is slot i and owns pages [i * P, (i + 1) * P) (P pages of B positions hold
    max_sequence_length), so nothing is allocated. The first layer of a forward makes the step
    (positions, rows) and advances the slots' lengths; the other layers find it by
    (sequence_len_offset, batch_size_offset, b, s). A batch at offset 0 starts its slots over."""
    if not getattr(ctx, "is_static_batching", lambda: False)():
        raise NotImplementedError("TonpSelfAttention: only megatron's StaticInferenceContext is "
                                  "supported (DynamicInferenceContext needs CUDA/flash-attn)")
    cache: Optional[PagedKVCache] = getattr(ctx, "tonp_cache", None)
    shape = (attn.block, attn.local_kv_heads, attn.head_dim)
    B, seqs, L = attn.block, ctx.max_batch_size, ctx.max_sequence_length
    P = -(-L // B)
    if cache is None:
        cache = PagedKVCache(attn.config.num_layers, attn.local_kv_heads, attn.head_dim,
                             page_size=B, num_pages=seqs * P, max_seqs=seqs, max_seq_len=L,
                             dtype=dtype, device=device)
        ctx.tonp_cache, ctx.tonp_step, ctx.tonp_lengths = cache, (None, None), [0] * seqs
    elif tuple(cache.k[0].shape[1:]) != shape or cache.k[0].dtype != dtype:
        raise ValueError("TonpSelfAttention: the inference context's tonp cache belongs to a "
                         "model of another shape or dtype")
    off, boff = int(ctx.sequence_len_offset), int(ctx.batch_size_offset)
    key = (off, boff, b, s)
    if ctx.tonp_step[0] != key:
        slots, lengths = list(range(boff, boff + b)), ctx.tonp_lengths
        if slots[-1] >= seqs or off + s > L:
            raise ValueError(f"TonpSelfAttention: batch rows {slots} at positions "
                             f"{off}..{off + s - 1} exceed max_batch_size={seqs} or "
                             f"max_sequence_length={L}")
        for slot in slots:
            if lengths[slot] != off and off != 0:
                raise RuntimeError(f"TonpSelfAttention: cache slot {slot} holds "
                                   f"{lengths[slot]} positions but the context says "
                                   f"sequence_len_offset={off}")
            lengths[slot] = off + s
        pos = torch.arange(off, off + s).repeat(b)                        # (b s): batch-major
        seq = torch.tensor(slots).repeat_interleave(s)
        table = torch.arange(seqs * P, dtype=torch.int32).view(seqs, P)
        ctx.tonp_step = (key, CacheStep(cache, slots, [s] * b, pos.to(device),
                                        seq.to(device, torch.int32),
                                        (seq * P * B + pos).to(device), table.to(device)))
    return ctx.tonp_step[1]


__all__ = ["single_process_groups", "load_global_state_dict", "TonpRMSNorm", "TonpSelfAttention",
           "TonpSparseMoE", "TonpDenseMLP", "tonp_bias_dropout_add"]
