"""`Qwen3MoeForCausalLM`: one forward for the training pass and for decoding with a KV cache.

    logits = model(ids, cu_seqlens)                        # packed sequences  -> [T, V] fp32
    logits = model(ids_BL, attention_mask=mask_BL)         # padded batch      -> [B, L, V] fp32
    logits = model(ids, cu, kv=step)                       # extend cached sequences by new tokens
    lps = model.token_logprobs([seq0, seq1], temperature=1.0)
    out = model.forward_backward(seqs, loss_fn, micro_batches=4)   # a training step's F + B

Without a cache every sequence is whole (positions 0..n-1) and the forward is differentiable;
with one, `kv` (a CacheStep the scheduler's PageAllocator prepared: tonp_models.engine.pages)
names the positions and the pages of the new tokens. Nothing else differs: the same kernels see
the same rows, so a token's logits are the same bits either way. The model never allocates.

Parallel layouts (`groups`, a tonp_parallel.ParallelGroups) never change a bit:
* TP / EP: each layer holds its shard (`parameter_shards()` says which); TP ranks make the same
  calls with the same tokens, EP ranks the same calls with any tokens. `forward` gathers the
  vocab shards (exact); `token_logprobs` scores without gathering them.
* PP: this rank builds only its stage's layers (`self.stage`), the embedding on the first
  stage, the final norm and LM head on the last (qwen3_moe/pipeline.py runs the stages).
* CP: the training forward and scoring give each rank a zig-zag slice of every sequence
  (decode runs every row on every CP rank). SP: activations split along tokens over TP in the
  norm and residual regions. The ranks of one model replica (TP x CP x PP) make the same calls.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

import tonp_kernels as tk
from tonp_parallel import ParallelGroups, group_size, validate_model_layout
from tonp_parallel.context import ContextSplit, positions_of
from tonp_parallel.layout import stage_layers
from tonp_parallel.sequence import SequenceSplit
from tonp_parallel.sharding import Shard, parameter_shards

from ..checks import in_vocabulary
from ..layers import (Attention, CacheStep, DenseMLP, Embedding, ForwardBatch, LMHead,
                      PagedKVCache, RMSNorm, RotaryEmbedding, SparseMoeBlock)
from .config import Qwen3MoeConfig
from .inputs import bounds_of, int_tensor, mask_of, rows_of


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h)); x [T, H] -> [T, H] (under
    sequence parallelism this rank's [n, H] rows in and out)."""

    def __init__(self, config: Qwen3MoeConfig, layer_idx: int, dtype: torch.dtype, groups,
                 sequence_parallel: bool = False):
        super().__init__()
        c, tp, ep = config, groups.tp_group, groups.ep_group
        # Under SP each TP rank normalises other rows: the norm weights' gradients are summed.
        norm_group = tp if sequence_parallel else None
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, norm_group)
        self.self_attn = Attention(layer_idx, c.hidden_size, c.num_attention_heads,
                                   c.num_key_value_heads, c.head_dim, rms_norm_eps=c.rms_norm_eps,
                                   bias=c.attention_bias, chunks=c.reduction_chunks,
                                   block=c.attention_block, tp_group=tp, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, norm_group)
        if c.is_sparse_layer(layer_idx):
            self.mlp = SparseMoeBlock(c.hidden_size, c.moe_intermediate_size, c.num_experts,
                                      c.num_experts_per_tok, c.norm_topk_prob,
                                      chunks=c.reduction_chunks, ep_group=ep, tp_group=tp,
                                      dtype=dtype)
        else:
            self.mlp = DenseMLP(c.hidden_size, c.intermediate_size, chunks=c.reduction_chunks,
                                tp_group=tp, dtype=dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rotary) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), batch, rotary)
        return h + self.mlp(self.post_attention_layernorm(h), sp=batch.sp)


class Qwen3MoeForCausalLM(nn.Module):
    """The Qwen3-MoE causal LM (transformers' architecture and numerics, tonp's kernels).

    Args:
        config: a Qwen3MoeConfig.
        dtype: parameter and activation dtype (float32 or bfloat16); logits are always fp32.
        groups: a tonp_parallel.ParallelGroups (None = ParallelGroups.single(): one process).
    Weights are initialised from torch's global RNG (normal(0, initializer_range), norms 1), so
    `torch.manual_seed(s)` before construction fixes them, in every layout.
    Attributes: stage (range of this rank's layers; `layers[i]` is None outside it), is_first,
    is_last, sequence_parallel, pipeline_micro_batches (how many micro-batches a pipelined
    `forward` splits its sequences into, default the PP degree).
    """

    def __init__(self, config: Qwen3MoeConfig, dtype: torch.dtype = torch.float32, groups=None):
        super().__init__()
        if dtype not in tk.FLOAT_DTYPES:
            raise TypeError(f"Qwen3MoeForCausalLM: dtype must be float32 or bfloat16, got {dtype}")
        config.validate()
        groups = ParallelGroups.single() if groups is None else groups
        if not isinstance(groups, ParallelGroups):
            raise TypeError(f"Qwen3MoeForCausalLM: groups must be a tonp_parallel.ParallelGroups "
                            f"or None, got {type(groups).__name__}")
        c, tp, pp = config, groups.tp_group, groups.pp_size
        # the layout rules, before any weight is built
        validate_model_layout(c, tp=group_size(tp), ep=group_size(groups.ep_group),
                              expert_tp=groups.expert_tp_size, pp=pp, cp=groups.cp_size,
                              pp_layers=groups.pp_layers)
        self.config, self.dtype, self.groups = config, dtype, groups
        stages = stage_layers(c.num_hidden_layers, pp, groups.pp_layers)
        self.stage = stages[groups.pp_rank]
        self.is_first, self.is_last = self.stage.start == 0, self.stage.stop == c.num_hidden_layers
        self.pipeline_micro_batches = pp
        sp = bool(groups.sequence_parallel) and group_size(tp) > 1
        self.sequence_parallel = sp
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, dtype, tp_group=tp) \
            if self.is_first else None
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype, groups, sp) if i in self.stage
                                    else None for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype) if self.is_last else None
        self.lm_head = LMHead(c.vocab_size, c.hidden_size, chunks=c.reduction_chunks,
                              tied=self.embed_tokens if c.tie_word_embeddings else None,
                              dtype=dtype, tp_group=tp) if self.is_last else None
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.max_position_embeddings)
        self.reset_parameters()
        self.weights_to_huge_pages()

    @property
    def pipelined(self) -> bool:
        return self.groups.pp_size > 1

    @property
    def device(self) -> torch.device:
        """Where this rank's weights live; the index tensors of a forward follow them."""
        return next(self.parameters()).device

    def weights_to_huge_pages(self) -> None:
        """Move every CPU weight of 4 MB or more into memory on 2 MB pages (tk.on_huge_pages: the
        same values, the same Parameter objects, new storage). Each decode step streams the
        weights whole, and on 4 KB pages it walks a page-table entry every 4 KB; the gain is
        small (docs/performance.md: the fp32 decode step 1.02-1.07x on the AMD EPYC's slow bus,
        bf16 level). The constructor and from_pretrained call it; a model whose weights were
        swapped for new tensors may call it again."""
        with torch.no_grad():
            for p in self.parameters():
                p.data = tk.on_huge_pages(p.data)

    def reset_parameters(self) -> None:
        """HF-like init: every matrix ~ normal(0, initializer_range), norms 1, biases 0.
        A sharded matrix draws the full tensor and keeps its shard, and a pipeline stage draws
        (and drops) the other stages' tensors in their turn, so the RNG stream (and every
        weight) is the one-process model's. Draws come from the CPU generator whatever the
        device, so a model built on a GPU holds the CPU-built model's weights; a model on the
        meta device (from_pretrained) draws nothing."""
        shards, mine = self.parameter_shards(), dict(self.named_parameters())
        draw = not self.device.type == "meta"
        with torch.no_grad():
            for name, shape in self._full_shapes():
                p = mine.get(name)
                if name.endswith("norm.weight") or name.endswith("bias"):
                    if p is not None:
                        p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
                elif draw:
                    full = torch.empty(shape, dtype=self.dtype if p is None else p.dtype)
                    full.normal_(0.0, self.config.initializer_range)
                    if p is not None:
                        p.copy_(shards[name].take(full) if name in shards else full)

    def _full_shapes(self):
        """[(name, full shape)] of the one-process model's parameters, in its order."""
        if not self.pipelined:
            shards = self.parameter_shards()
            return [(n, shards[n].full_shape(p.shape) if n in shards else p.shape)
                    for n, p in self.named_parameters()]
        with torch.device("meta"):
            twin = Qwen3MoeForCausalLM(self.config, dtype=self.dtype)
        return [(n, p.shape) for n, p in twin.named_parameters()]

    def parameter_shards(self) -> Dict[str, Shard]:
        """{parameter name: Shard(dim, start, length, full, group "tp" | "ep")} for every
        parameter this rank holds only a slice of: the one source of which parameter is
        sharded (init, checkpoints, gradient sync); the others are whole on every rank
        (of this stage, under PP: a stage holds only its own parameters, under their names)."""
        return parameter_shards(self)

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, *,
                attention_mask: Optional[torch.Tensor] = None, kv: Optional[CacheStep] = None,
                logits_rows: Optional[torch.Tensor] = None, return_hidden: bool = False
                ) -> torch.Tensor:
        """Logits (fp32) of packed or padded sequences, optionally extending a paged KV cache.

        Args:
            input_ids: int64 [T] packed (with cu_seqlens int [S+1]; None = one sequence), or
                [B, L] padded (with attention_mask [B, L], 1 = token; each row's tokens, in order,
                are one sequence; padding is dropped before any kernel).
            kv: a CacheStep for these tokens (PageAllocator.prepare: sequence i continues its
                slot; the caller commits it after the forward).
            logits_rows: int64 [R] packed row indices: only those rows get logits.
            return_hidden: packed input only: return the final-normed hidden states [T|R, H]
                instead of logits (for `lm_head.token_logprobs` / `lm_head.argmax`).
        Returns: fp32 [T, V] (packed), [R, V] (logits_rows), or [B, L, V] (padded, pads 0).
        Under PP every stage returns the last stage's result (the sequences are split into
        `pipeline_micro_batches` micro-batches that are in flight together); there, autograd
        does not cross stages: run it under torch.no_grad() and train with forward_backward.
        """
        dev = self.device                           # index tensors follow the weights
        ids = int_tensor(input_ids, "input_ids").to(dev)
        if ids.dim() == 2:
            if cu_seqlens is not None or logits_rows is not None or return_hidden:
                raise ValueError("Qwen3MoeForCausalLM: a padded [B, L] batch takes "
                                 "attention_mask, not cu_seqlens/logits_rows/return_hidden")
            mask = mask_of(attention_mask, ids).to(dev)
            counts = mask.sum(1)
            cu = torch.zeros(len(counts) + 1, dtype=torch.int32, device=dev)
            cu[1:] = torch.cumsum(counts, 0)
            packed = self.forward(ids[mask], cu, kv=kv)
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
        cu, bounds = bounds_of(cu_seqlens, T)
        # The embedding's index bound (TP shards would zero a foreign id silently).
        in_vocabulary("Qwen3MoeForCausalLM", "input_ids", ids, self.config.vocab_size)
        if logits_rows is not None:
            logits_rows = rows_of(logits_rows, T).to(dev)
        if kv is not None:
            self._check_kv(kv, bounds)
        else:
            self._check_positions(bounds)
        if self.pipelined:
            from .pipeline import forward_pipelined
            return forward_pipelined(self, ids, bounds, kv, logits_rows, return_hidden)
        batch = self.batch(ids, bounds, kv)
        h = self.stage_forward(None, batch)
        h = self.head_hidden(h, batch, logits_rows)                                # (T|R, H)
        return h if return_hidden else self.lm_head(h)                             # (T|R, V)

    def batch(self, ids: torch.Tensor, bounds: List[int], kv: Optional[CacheStep] = None
              ) -> ForwardBatch:
        """The ForwardBatch this rank's stage runs for the packed sequences `ids` (bounds:
        cu_seqlens as a list): its rows (ids, positions), how attention reads keys (the cache
        step `kv`, the CP split, or cu_seqlens) and the SP split."""
        dev, cp, cu, sp = ids.device, None, None, None
        if kv is not None:
            rows, positions = ids, kv.positions
        elif self.groups.cp_size > 1:
            cp = ContextSplit(bounds, self.groups.cp_group)
            mine = cp.rows.to(dev)
            rows, positions = ids.index_select(0, mine), cp.positions.to(dev)[mine]
        else:
            cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
            rows, positions = ids, positions_of(bounds).to(dev)
        if self.sequence_parallel:
            sp = SequenceSplit(self.groups.tp_group, len(rows))
        return ForwardBatch(positions, rows, bounds, cu, kv, cp, sp)

    def stage_forward(self, h: Optional[torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
        """This stage's part of the forward: embed (first stage; h None) and its layers (which
        write the batch's cache pages, if any). -> [batch.hidden_rows, H]."""
        if self.is_first:
            h = self.embed_tokens(batch.ids, sp=batch.sp)                          # (T, H)
        for i in self.stage:
            h = self.layers[i](h, batch, self.rotary)
        return h

    def head_hidden(self, h: torch.Tensor, batch: ForwardBatch,
                    rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Last stage: the final-normed hidden states [T|R, H] of every packed row (or `rows`),
        from this rank's part of them (gathered over SP and CP: bytes only)."""
        if batch.sp is not None:
            h = batch.sp.gather(h, sum_grads=False)                                # (T_cp, H)
        if batch.cp is not None:
            h = batch.cp.gather(h)                                                 # (T, H)
        if rows is not None:
            h = h.index_select(0, rows)                                            # (R, H)
        return self.norm(h)

    def _check_kv(self, kv, bounds) -> None:
        """A step over a cache of this model's layers, KV heads, head_dim, dtype and page =
        attention block (another page size would split the keys into other blocks: other bits),
        for these tokens."""
        if not isinstance(kv, CacheStep) or not isinstance(kv.cache, PagedKVCache):
            raise TypeError(f"Qwen3MoeForCausalLM: kv must be a CacheStep over a PagedKVCache "
                            f"(PageAllocator.prepare over model.new_cache), got "
                            f"{type(kv).__name__}")
        cache, c, first = kv.cache, self.config, self.stage.start
        attn = self.layers[first].self_attn
        want = (c.num_hidden_layers, c.attention_block, attn.local_kv_heads, c.head_dim, self.dtype)
        got = (len(cache.k), *cache.k[first].shape[1:], cache.k[first].dtype) \
            if len(cache.k) > first else None
        if got != want or not set(self.stage) <= set(cache.layers):
            raise ValueError(f"Qwen3MoeForCausalLM: the cache holds (layers, page size, KV heads, "
                             f"head_dim, dtype) {got}, this model needs {want} with pages for "
                             f"layers {self.stage.start}..{self.stage.stop - 1}; build it with "
                             f"model.new_cache")
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        if kv.counts != counts:
            raise ValueError(f"Qwen3MoeForCausalLM: the kv step holds {kv.counts[:8]} new tokens "
                             f"a sequence, cu_seqlens {counts[:8]}")

    def _check_positions(self, bounds) -> None:
        """No sequence may pass max_position_embeddings (the rotary table's rows)."""
        limit = self.config.max_position_embeddings
        longest = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
        if longest > limit:
            raise ValueError(f"a sequence of {longest} tokens exceeds "
                             f"max_position_embeddings={limit}")

    # -- cache and scoring ------------------------------------------------------------------------
    def new_cache(self, max_seqs: int, max_seq_len: int, num_pages: Optional[int] = None
                  ) -> PagedKVCache:
        """A PagedKVCache for this model (page = attention block; this rank's KV heads and,
        under PP, pages for this stage's layers only; the model's dtype). num_pages defaults
        to enough for every slot at max_seq_len."""
        c = self.config
        if max_seq_len > c.max_position_embeddings:
            raise ValueError(f"new_cache: max_seq_len={max_seq_len} exceeds "
                             f"max_position_embeddings={c.max_position_embeddings}")
        B = c.attention_block
        if num_pages is None:
            num_pages = max_seqs * -(-max_seq_len // B)
        attn = self.layers[self.stage.start].self_attn
        return PagedKVCache(c.num_hidden_layers, attn.local_kv_heads, c.head_dim, page_size=B,
                            num_pages=num_pages, max_seqs=max_seqs, max_seq_len=max_seq_len,
                            dtype=self.dtype, device=next(self.parameters()).device,
                            layers=self.stage)

    def drop_weight_groups(self) -> None:
        """Free the column-group copies of the expert weights that rollout engines made
        (layers/moe.py; the next engine step packs them again)."""
        for m in self.modules():
            if hasattr(m, "drop_weight_groups") and m is not self:
                m.drop_weight_groups()

    def token_logprobs(self, sequences: Sequence[torch.Tensor], temperature: float = 1.0, *,
                       micro_batch_size: Optional[int] = None, packed: bool = True
                       ) -> List[torch.Tensor]:
        """Per-token log-probabilities by the training forward.

        sequences: 1-D integer token-id sequences (tensors, arrays or lists; ragged; each
        non-empty). Returns fp32 tensors, out[i][j] = log p(seq_i[j+1] | seq_i[:j+1]) under
        log_softmax(logits / temperature), len(seq_i) - 1 each. temperature: > 0, a normal number
        in fp32. Sequences are scored micro_batch_size (an int >= 1; None = all, or under PP
        one micro-batch a stage) at a time, packed (cu_seqlens) or padded (attention_mask; PP = CP
        = 1 only). Differentiable when grad is enabled, except under PP (use forward_backward).
        Every rank of a model replica (TP x CP x PP) must pass the same sequences and settings
        (checked: a mismatch raises RuntimeError on every rank, before any forward).
        """
        from .scoring import token_logprobs
        return token_logprobs(self, sequences, temperature, micro_batch_size, packed)

    def forward_backward(self, sequences: Sequence[torch.Tensor], loss_fn, *,
                         micro_batches: int = 1, temperature: float = 1.0):
        """One training step's forward and backward over `sequences` in `micro_batches`
        micro-batches (1F1B under PP, gradient accumulation at PP 1): see
        `qwen3_moe.scoring.forward_backward`. Returns a StepResult (loss, logprobs)."""
        from .scoring import forward_backward
        return forward_backward(self, sequences, loss_fn, micro_batches=micro_batches,
                                temperature=temperature)

    # -- checkpoints ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, dtype: Optional[torch.dtype] = None, groups=None
                        ) -> "Qwen3MoeForCausalLM":
        """Load an HF checkpoint dir (config.json + safetensors, hub or fused-expert layout);
        each rank reads only its shards of its stage's tensors.
        dtype None = the config's dtype when it is float32/bfloat16, else float32."""
        from .checkpoint import load_checkpoint
        config = Qwen3MoeConfig.from_hf(path)
        if dtype is None:
            dtype = config.dtype if config.dtype in tk.FLOAT_DTYPES else torch.float32
        with torch.device("meta"):
            model = cls(config, dtype=dtype, groups=groups)
        model.to_empty(device="cpu")
        model.weights_to_huge_pages()
        model.rotary.reset_tables()
        load_checkpoint(model, path)
        return model

    def save_pretrained(self, path, max_shard_size: int = 5 * 2**30) -> None:
        """Write config.json and safetensors in the hub layout (sharded with an index when
        larger than max_shard_size bytes); transformers' from_pretrained reads it. Under
        TP / EP / PP every rank calls it: the shards and stages are gathered."""
        from .checkpoint import save_checkpoint
        save_checkpoint(self, path, max_shard_size=max_shard_size)
