"""`Qwen3MoeForCausalLM`: one forward for the training pass and for decoding with a KV cache.

    logits = model(ids, cu_seqlens)                        # packed sequences  -> [T, V] fp32
    logits = model(ids_BL, attention_mask=mask_BL)         # padded batch      -> [B, L, V] fp32
    logits = model(ids, cu, cache=c, cache_slots=slots)    # extend cached sequences by new tokens
    lps = model.token_logprobs([seq0, seq1], temperature=1.0)

Without a cache every sequence is whole (positions 0..n-1) and the forward is differentiable;
with a cache, sequence i continues slot cache_slots[i] from cache.lengths[slot]. Nothing else
differs: the same kernels see the same rows, so a token's logits are the same bits either way.

Under TP / EP (`groups`, a tonp_parallel.ParallelGroups) each layer holds its shard
(`parameter_shards()` says which) and every output has the unsharded model's bits; TP ranks
make the same calls with the same tokens, EP ranks the same calls with any tokens.
`forward` gathers the vocab shards (exact); `token_logprobs` scores without gathering them.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

import tonp_kernels as tk
from tonp_parallel import group_size, validate_model_layout
from tonp_parallel.sharding import Shard, parameter_shards

from ..layers import (Attention, DenseMLP, Embedding, LMHead, PagedKVCache, RMSNorm,
                      RotaryEmbedding, SparseMoeBlock)
from .config import Qwen3MoeConfig


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h)); x [T, H] -> [T, H]."""

    def __init__(self, config: Qwen3MoeConfig, layer_idx: int, dtype: torch.dtype, groups):
        super().__init__()
        c, tp, ep = config, _group(groups, "tp_group"), _group(groups, "ep_group")
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Attention(layer_idx, c.hidden_size, c.num_attention_heads,
                                   c.num_key_value_heads, c.head_dim, rms_norm_eps=c.rms_norm_eps,
                                   bias=c.attention_bias, chunks=c.reduction_chunks,
                                   block=c.attention_block, tp_group=tp, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if c.is_sparse_layer(layer_idx):
            self.mlp = SparseMoeBlock(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                                      c.num_experts_per_tok, c.norm_topk_prob,
                                      chunks=c.reduction_chunks, ep_group=ep, tp_group=tp,
                                      dtype=dtype)
        else:
            self.mlp = DenseMLP(c.hidden_size, c.intermediate_size, chunks=c.reduction_chunks,
                                tp_group=tp, dtype=dtype)

    def forward(self, x, positions, rotary, **attn_kw):
        h = x + self.self_attn(self.input_layernorm(x), positions, rotary, **attn_kw)
        return h + self.mlp(self.post_attention_layernorm(h))


def _group(groups, name):
    return None if groups is None else getattr(groups, name, None)


class Qwen3MoeForCausalLM(nn.Module):
    """The Qwen3-MoE causal LM (transformers' architecture and numerics, tonp's kernels).

    Args:
        config: a Qwen3MoeConfig.
        dtype: parameter and activation dtype (float32 or bfloat16); logits are always fp32.
        groups: a tonp_parallel.ParallelGroups (or anything with tp_group / ep_group), or None.
    Weights are initialised from torch's global RNG (normal(0, initializer_range), norms 1), so
    `torch.manual_seed(s)` before construction fixes them.
    """

    def __init__(self, config: Qwen3MoeConfig, dtype: torch.dtype = torch.float32, groups=None):
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"Qwen3MoeForCausalLM: dtype must be float32 or bfloat16, got {dtype}")
        config.validate()
        c, tp = config, _group(groups, "tp_group")
        if groups is not None:  # the layout rules, before any weight is built
            validate_model_layout(c, tp=group_size(tp), ep=group_size(_group(groups, "ep_group")),
                                  expert_tp=getattr(groups, "expert_tp_size", 1))
        self.config, self.dtype, self.groups = config, dtype, groups
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype, tp_group=tp)
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype, groups)
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = LMHead(c.vocab_size, c.hidden_size, chunks=c.reduction_chunks,
                              tied=self.embed_tokens if c.tie_word_embeddings else None,
                              dtype=dtype, tp_group=tp)
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.max_position_embeddings)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """HF-like init: every matrix ~ normal(0, initializer_range), norms 1, biases 0.
        A sharded matrix draws the full tensor and keeps its shard, so the RNG stream (and
        every weight) is the unsharded model's. Draws come from the CPU generator whatever the
        device, so a model built on a GPU holds the CPU-built model's weights; parameters on the
        meta device (from_pretrained) draw nothing."""
        shards = self.parameter_shards()
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                elif not p.is_meta:
                    shard = shards.get(name)
                    full = torch.empty(shard.full_shape(p.shape) if shard else p.shape,
                                       dtype=p.dtype, device="cpu")
                    full.normal_(0.0, self.config.initializer_range)
                    p.copy_(shard.take(full) if shard else full)

    def parameter_shards(self) -> Dict[str, Shard]:
        """{parameter name: Shard(dim, start, length, full, group "tp" | "ep")} for every
        parameter this rank holds only a slice of: the one source of which parameter is
        sharded (init, checkpoints, gradient sync); the others are whole on every rank."""
        return parameter_shards(self)

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, *,
                attention_mask: Optional[torch.Tensor] = None, cache: Optional[PagedKVCache] = None,
                cache_slots: Optional[Sequence[int]] = None,
                logits_rows: Optional[torch.Tensor] = None, return_hidden: bool = False
                ) -> torch.Tensor:
        """Logits (fp32) of packed or padded sequences, optionally extending a paged KV cache.

        Args:
            input_ids: int64 [T] packed (with cu_seqlens int [S+1]; None = one sequence), or
                [B, L] padded (with attention_mask [B, L], 1 = token; each row's tokens, in order,
                are one sequence; padding is dropped before any kernel).
            cache, cache_slots: extend sequence i of the batch in cache slot cache_slots[i]
                from position cache.lengths[slot]; the cache is committed at the end.
            logits_rows: int64 [R] packed row indices: only those rows get logits.
            return_hidden: packed input only: return the final-normed hidden states [T|R, H]
                instead of logits (for `lm_head.token_logprobs` / `lm_head.argmax`).
        Returns: fp32 [T, V] (packed), [R, V] (logits_rows), or [B, L, V] (padded, pads 0).
        """
        dev = self.embed_tokens.weight.device       # index tensors follow the weights
        ids = _int_tensor(input_ids, "input_ids").to(dev)
        if ids.dim() == 2:
            if cu_seqlens is not None or logits_rows is not None or return_hidden:
                raise ValueError("Qwen3MoeForCausalLM: a padded [B, L] batch takes "
                                 "attention_mask, not cu_seqlens/logits_rows/return_hidden")
            mask = _mask_of(attention_mask, ids)
            counts = mask.sum(1)
            cu = torch.zeros(len(counts) + 1, dtype=torch.int32, device=dev)
            cu[1:] = torch.cumsum(counts, 0)
            packed = self.forward(ids[mask], cu, cache=cache, cache_slots=cache_slots)
            out = packed.new_zeros(*ids.shape, packed.shape[-1])
            out[mask] = packed
            return out
        if ids.dim() != 1:
            raise ValueError(f"Qwen3MoeForCausalLM: input_ids must be [T] (packed) or [B, L] "
                             f"(padded), got shape {tuple(ids.shape)}")
        if attention_mask is not None:
            raise ValueError("attention_mask is for padded [B, L] input_ids; packed input takes "
                             "cu_seqlens")
        ids = ids.long()
        T = ids.shape[0]
        cu, bounds = _bounds_of(cu_seqlens, T)
        cu = cu.to(dev)
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        self._check_ids(ids)
        if logits_rows is not None:
            logits_rows = _rows_of(logits_rows, T).to(dev)
        attn_kw, step = self._positions(cu, counts, cache, cache_slots)
        positions = attn_kw.pop("positions")

        h = self.embed_tokens(ids)                                                 # (T, H)
        for layer in self.layers:
            h = layer(h, positions, self.rotary, **attn_kw)
        if cache is not None:
            cache.commit(step)
        if logits_rows is not None:
            h = h.index_select(0, logits_rows)                                     # (R, H)
        h = self.norm(h)                                                           # (T|R, H)
        if return_hidden:
            return h
        return self.lm_head(h)                                                     # (T|R, V)

    def _check_ids(self, ids: torch.Tensor) -> None:
        V = self.config.vocab_size
        lo, hi = torch.aminmax(ids) if ids.numel() else (0, 0)
        if int(lo) < 0 or int(hi) >= V:
            bad = ids[(ids < 0) | (ids >= V)].unique()[:8].tolist()
            raise IndexError(f"Qwen3MoeForCausalLM: token ids {bad} are out of the vocabulary "
                             f"range [0, {V})")

    def _check_cache(self, cache) -> None:
        """A cache of this model's layers, KV heads, head_dim, dtype and page = attention block
        (another page size would split the keys into other blocks: other bits)."""
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"Qwen3MoeForCausalLM: cache must be a PagedKVCache (model.new_cache),"
                            f" got {type(cache).__name__}")
        c, attn = self.config, self.layers[0].self_attn
        want = (c.num_hidden_layers, c.attention_block, attn.local_kv_heads, c.head_dim, self.dtype)
        got = (len(cache.k), *cache.k[0].shape[1:], cache.k[0].dtype) if cache.k else None
        if got != want:
            raise ValueError(f"Qwen3MoeForCausalLM: the cache holds (layers, page size, KV heads, "
                             f"head_dim, dtype) {got}, this model needs {want}; build it with "
                             f"model.new_cache")

    def _positions(self, cu, counts, cache, cache_slots):
        """Positions of the packed rows (and the cache step): 0..n-1 per sequence without a
        cache, cache.lengths[slot]... with one. Checks the position limit before allocating."""
        limit = self.config.max_position_embeddings
        if cache is None:
            if cache_slots is not None:
                raise ValueError("cache_slots given without a cache")
            if max(counts, default=0) > limit:
                raise ValueError(f"a sequence of {max(counts)} tokens exceeds "
                                 f"max_position_embeddings={limit}")
            T, dev = sum(counts), cu.device
            starts = torch.repeat_interleave(cu[:-1].long(), torch.tensor(counts, device=dev),
                                             output_size=T)
            return dict(positions=torch.arange(T, device=dev) - starts, cu_seqlens=cu), None
        self._check_cache(cache)
        slots = list(range(len(counts))) if cache_slots is None else _slots_of(cache_slots, cache)
        if len(slots) != len(counts):
            raise ValueError(f"{len(counts)} sequences but {len(slots)} cache_slots")
        for s, n in zip(slots, counts):
            if cache.lengths[s] + n > limit:
                raise ValueError(f"cache slot {s} would reach {cache.lengths[s] + n} positions, "
                                 f"over max_position_embeddings={limit}")
        step = cache.prepare(slots, counts)
        return dict(positions=step.positions, cache=cache, step=step), step

    # -- cache and scoring ------------------------------------------------------------------------
    def new_cache(self, max_seqs: int, max_seq_len: int, num_pages: Optional[int] = None
                  ) -> PagedKVCache:
        """A PagedKVCache for this model (page = attention block; this rank's KV heads; the
        model's dtype). num_pages defaults to enough for every slot at max_seq_len."""
        c = self.config
        if max_seq_len > c.max_position_embeddings:
            raise ValueError(f"new_cache: max_seq_len={max_seq_len} exceeds "
                             f"max_position_embeddings={c.max_position_embeddings}")
        B = c.attention_block
        if num_pages is None:
            num_pages = max_seqs * -(-max_seq_len // B)
        attn = self.layers[0].self_attn
        return PagedKVCache(c.num_hidden_layers, attn.local_kv_heads, c.head_dim, page_size=B,
                            num_pages=num_pages, max_seqs=max_seqs, max_seq_len=max_seq_len,
                            dtype=self.dtype, device=self.embed_tokens.weight.device)

    def token_logprobs(self, sequences: Sequence[torch.Tensor], temperature: float = 1.0, *,
                       micro_batch_size: Optional[int] = None, packed: bool = True
                       ) -> List[torch.Tensor]:
        """Per-token log-probabilities by the training forward.

        sequences: 1-D integer token-id sequences (tensors, arrays or lists; ragged; each
        non-empty). Returns fp32 tensors, out[i][j] = log p(seq_i[j+1] | seq_i[:j+1]) under
        log_softmax(logits / temperature), len(seq_i) - 1 each. temperature: > 0, a normal number
        in fp32. Sequences are scored micro_batch_size (an int >= 1; None = all) at a time,
        packed (cu_seqlens) or padded (attention_mask). Differentiable when grad is enabled.
        Under TP every rank of the group must pass the same sequences and settings (checked:
        a mismatch raises RuntimeError on every rank, before any forward).
        """
        from ..checks import TPCheck, as_int, check_temperature, sequence_list, token_ids
        who, V, limit = "token_logprobs", self.config.vocab_size, \
            self.config.max_position_embeddings

        def check():
            T = check_temperature(who, temperature, greedy_ok=False)
            mb = None if micro_batch_size is None else \
                as_int(who, "micro_batch_size", micro_batch_size, 1)
            if not isinstance(packed, bool):
                raise TypeError(f"{who}: packed must be True or False, got {packed!r}")
            seqs = [token_ids(who, f"sequence {i}", s, V)
                    for i, s in enumerate(sequence_list(who, "sequences", sequences))]
            for i, s in enumerate(seqs):
                if not 0 < len(s) <= limit:
                    raise ValueError(f"{who}: sequence {i} has {len(s)} tokens; every sequence "
                                     f"needs at least one token and at most "
                                     f"max_position_embeddings={limit}")
            return seqs, T, mb or max(len(seqs), 1)

        seqs, temperature, mb = TPCheck.of(self, who).agreed(
            check, lambda v: (v[1:], packed, [len(s) for s in v[0]],
                              torch.cat(v[0]) if v[0] else None))
        out: List[torch.Tensor] = []
        for i in range(0, len(seqs), mb):
            out.extend(self._score(seqs[i:i + mb], temperature, packed))
        return out

    def _score(self, seqs, temperature, packed):
        lens = [len(s) for s in seqs]
        targets = torch.cat([s[1:] for s in seqs]) if seqs else torch.zeros(0, dtype=torch.long)
        targets = targets.to(self.embed_tokens.weight.device)
        if packed:
            cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(lens), 0)
            # Only rows that predict a token go through the final norm and LM head.
            rows = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1]) - 1)
                              for i in range(len(seqs))]) if seqs else targets
            h = self.forward(torch.cat(seqs), cu, logits_rows=rows, return_hidden=True)
            # The LM head scores its vocab shard and finishes the vocab tree across TP ranks.
            lp = self.lm_head.token_logprobs(h, targets, temperature=temperature)  # (R,)
        else:
            L = max(lens)
            ids = torch.zeros(len(seqs), L, dtype=torch.long)
            mask = torch.zeros(len(seqs), L, dtype=torch.bool)
            for i, s in enumerate(seqs):
                ids[i, :len(s)], mask[i, :len(s)] = s, True
            pred = mask.clone()
            pred[torch.arange(len(seqs)), torch.tensor(lens) - 1] = False
            logits = self.forward(ids, attention_mask=mask)[pred.to(targets.device)]  # (R, V)
            lp = tk.token_logprobs(logits, targets, temperature=temperature)
        return list(lp.split([n - 1 for n in lens]))

    # -- checkpoints ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, dtype: Optional[torch.dtype] = None, groups=None
                        ) -> "Qwen3MoeForCausalLM":
        """Load an HF checkpoint dir (config.json + safetensors, hub or fused-expert layout).
        dtype None = the config's dtype when it is float32/bfloat16, else float32."""
        from .checkpoint import load_checkpoint
        config = Qwen3MoeConfig.from_hf(path)
        if dtype is None:
            dtype = config.dtype if config.dtype in (torch.float32, torch.bfloat16) \
                else torch.float32
        with torch.device("meta"):
            model = cls(config, dtype=dtype, groups=groups)
        model.to_empty(device="cpu")
        model.rotary.reset_tables()
        load_checkpoint(model, path)
        return model

    def save_pretrained(self, path, max_shard_size: int = 5 * 2**30) -> None:
        """Write config.json and safetensors in the hub layout (sharded with an index when
        larger than max_shard_size bytes); transformers' from_pretrained reads it."""
        from .checkpoint import save_checkpoint
        save_checkpoint(self, path, max_shard_size=max_shard_size)


# -- argument checks ------------------------------------------------------------------------------
def _int_tensor(x, name: str) -> torch.Tensor:
    """x as an integer tensor (a list of ints too); floats and bools are refused by name."""
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"Qwen3MoeForCausalLM: {name} must be an integer tensor, got "
                            f"{type(x).__name__}") from e
        if x.numel() == 0:
            x = x.long()
    if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
        raise TypeError(f"Qwen3MoeForCausalLM: {name} must be an integer tensor, got {x.dtype}")
    return x


def _mask_of(attention_mask, ids: torch.Tensor) -> torch.Tensor:
    """The bool mask of a padded batch: None = every position; else 0 / 1 values of ids' shape."""
    if attention_mask is None:
        return torch.ones_like(ids, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
    if attention_mask.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids "
                         f"{tuple(ids.shape)}")
    mask = attention_mask.bool()
    if attention_mask.dtype != torch.bool and not bool((attention_mask == mask).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    return mask


def _bounds_of(cu_seqlens, T: int):
    """(cu_seqlens as int32 [S+1], its values as a list), checked to rise from 0 to T. One read
    of the values (each tensor op is ~2 us of a decode step)."""
    if cu_seqlens is None:
        return torch.tensor([0, T], dtype=torch.int32), [0, T]
    cu = _int_tensor(cu_seqlens, "cu_seqlens")
    bounds = cu.tolist()              # the values as given: no int32 wrap-around before the check
    if cu.dim() != 1 or not bounds or bounds[0] != 0 or bounds[-1] != T or \
            any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must be 1-D, rise from 0 to T={T} and never fall; got "
                         f"{bounds if len(bounds) < 20 else str(bounds[:20]) + '...'}")
    return (cu if cu.dtype == torch.int32 else torch.tensor(bounds, dtype=torch.int32)), bounds


def _rows_of(logits_rows, T: int) -> torch.Tensor:
    rows = _int_tensor(logits_rows, "logits_rows")
    if rows.dim() != 1:
        raise ValueError(f"logits_rows must be 1-D, got shape {tuple(rows.shape)}")
    if rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < T:
        raise IndexError(f"logits_rows {rows.tolist()[:8]} must index the {T} packed rows "
                         f"[0, {T})")
    return rows.long()


def _slots_of(cache_slots, cache: PagedKVCache) -> List[int]:
    """Distinct integer slots of the cache (integer-likes accepted; 1.5, True, -1 refused)."""
    slots = _int_tensor(cache_slots, "cache_slots").reshape(-1).tolist()
    n = len(cache.lengths)
    bad = [s for s in slots if not 0 <= s < n]
    if bad or len(set(slots)) != len(slots):
        raise ValueError(f"cache_slots {slots[:8]} must be distinct slots of the cache, in "
                         f"[0, {n})")
    return slots

