"""`Qwen3MoeConfig`: the model's shape, with the field names and meanings of HF `config.json`.

    cfg = Qwen3MoeConfig.preset("tiny")                  # named presets (PRESETS)
    cfg = Qwen3MoeConfig.from_hf("path/to/checkpoint")   # a dir with config.json, a file, or a dict
    json_dict = cfg.to_hf()                              # what transformers' Qwen3MoeConfig reads

Settings tonp does not implement (rope scaling, sliding window, other activations, ...) raise a
ValueError that names them instead of being silently ignored. Two fields are tonp's own:
`attention_block` (B, the key block of the online softmax and the KV-cache page size) and
`reduction_chunks` (C, the chunk tree of every reduction over K; see CONTRACT.md).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import torch

# Keys HF writes that carry no numerics (bookkeeping, generation and training knobs).
_METADATA_KEYS = {
    "_name_or_path", "architectures", "model_type", "transformers_version", "use_cache",
    "id2label", "label2id", "return_dict", "output_attentions", "output_hidden_states",
    "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "pad_token_id",
    "max_window_layers", "tokenizer_class", "auto_map", "quantization_config_none",
    "torchscript", "pruned_heads", "tie_encoder_decoder", "add_cross_attention",
    "task_specific_params", "finetuning_task", "prefix", "sep_token_id",
    "decoder_start_token_id", "cross_attention_hidden_size", "is_decoder",
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Qwen3MoeConfig:
    """Shape and numerics of a Qwen3-MoE decoder (HF `config.json` names and meanings).

    A layer L is sparse (router + `num_experts` SwiGLU experts of width `moe_intermediate_size`,
    top `num_experts_per_tok`) unless L is in `mlp_only_layers` or (L + 1) % decoder_sparse_step
    != 0; otherwise it has a dense SwiGLU MLP of width `intermediate_size` (as in transformers).
    """
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    torch_dtype: str = "bfloat16"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, List[int]]] = None
    output_router_logits: bool = False      # accepted; tonp returns no aux loss
    router_aux_loss_coef: float = 0.001     # accepted; see output_router_logits
    attention_dropout: float = 0.0          # must be 0 (the forward has no dropout)
    use_sliding_window: bool = False        # must be False
    sliding_window: Optional[int] = None    # ignored unless use_sliding_window
    # tonp's own fields
    attention_block: int = 64
    reduction_chunks: int = 8

    def __post_init__(self):
        self.validate()

    # -- derived --------------------------------------------------------------------------------
    def is_sparse_layer(self, layer: int) -> bool:
        """True when layer `layer` has the MoE block (transformers' rule)."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    # -- validation -----------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise one ValueError listing every inconsistent or unsupported setting."""
        errs = []
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings",
                     "attention_block", "reduction_chunks", "decoder_sparse_step"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                errs.append(f"{name}={v!r} must be a positive integer")
        if errs:
            raise ValueError("Qwen3MoeConfig: " + "; ".join(errs))
        C = self.reduction_chunks
        if C & (C - 1):
            errs.append(f"reduction_chunks={C} must be a power of two (the chunk tree)")
        if self.num_attention_heads % self.num_key_value_heads:
            errs.append(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                        f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            errs.append(f"head_dim={self.head_dim} must be even (rotary halves)")
        sizes = {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                 "num_attention_heads*head_dim": self.num_attention_heads * self.head_dim}
        if any(not self.is_sparse_layer(i) for i in range(self.num_hidden_layers)):
            sizes["intermediate_size"] = self.intermediate_size
        if self.num_experts > 0:
            sizes["moe_intermediate_size"] = self.moe_intermediate_size
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                errs.append(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                            f"[1, num_experts={self.num_experts}]")
        elif self.num_experts < 0:
            errs.append(f"num_experts={self.num_experts} must be >= 0")
        for name, v in sizes.items():
            if not isinstance(v, int) or v < 1 or v % C:
                errs.append(f"{name}={v} is not a positive multiple of reduction_chunks={C} "
                            f"(every reduction over it is cut into C equal chunks)")
        bad_layers = [i for i in self.mlp_only_layers
                      if not (isinstance(i, int) and 0 <= i < self.num_hidden_layers)]
        if bad_layers:
            errs.append(f"mlp_only_layers {bad_layers} are not layer indices "
                        f"0..{self.num_hidden_layers - 1}")
        if self.rope_scaling not in (None, {}) and \
                dict(self.rope_scaling).get("rope_type", dict(self.rope_scaling).get("type")) \
                not in ("default", None):
            errs.append(f"rope_scaling={self.rope_scaling} is not supported (only plain RoPE)")
        if self.hidden_act != "silu":
            errs.append(f"hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        if self.torch_dtype not in _DTYPES:
            errs.append(f"torch_dtype={self.torch_dtype!r} must be one of {sorted(_DTYPES)}")
        if self.attention_dropout:
            errs.append(f"attention_dropout={self.attention_dropout} is not supported (must be 0)")
        if self.use_sliding_window:
            errs.append("use_sliding_window=True is not supported")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            errs.append("rms_norm_eps and rope_theta must be positive")
        if errs:
            raise ValueError("Qwen3MoeConfig: " + "; ".join(errs))

    # -- HF conversion --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: Union[str, os.PathLike, Dict[str, Any]], **overrides
                ) -> "Qwen3MoeConfig":
        """Read an HF config: a checkpoint dir (its config.json), a json file, or a dict.

        Accepts both transformers 4 (`rope_theta`, `torch_dtype`, `num_experts`) and 5
        (`rope_parameters`, `dtype`, `num_local_experts`) spellings. Unknown keys raise.
        """
        if isinstance(source, dict):
            d = dict(source)
        else:
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"Qwen3MoeConfig.from_hf: no config file at {path}")
            with open(path) as f:
                d = json.load(f)
        d.update(overrides)
        if d.get("model_type", "qwen3_moe") != "qwen3_moe":
            raise ValueError(f"Qwen3MoeConfig.from_hf: model_type={d['model_type']!r} is not "
                             f"'qwen3_moe'")
        for key in list(d):
            if key in _METADATA_KEYS:
                d.pop(key)
        if "num_local_experts" in d:
            n = d.pop("num_local_experts")
            if d.setdefault("num_experts", n) != n:
                raise ValueError(f"Qwen3MoeConfig.from_hf: num_experts={d['num_experts']} and "
                                 f"num_local_experts={n} disagree")
        if "dtype" in d:
            dt = d.pop("dtype")
            if dt is not None:
                d["torch_dtype"] = dt
        if d.get("torch_dtype") is None:
            d.pop("torch_dtype", None)
        rope = d.pop("rope_parameters", None)
        if rope:
            rope = dict(rope)
            if "rope_theta" in rope:
                d["rope_theta"] = rope.pop("rope_theta")
            if rope.get("rope_type", "default") != "default" or \
                    set(rope) - {"rope_type"}:
                d["rope_scaling"] = {"rope_type": rope.get("rope_type", "default"), **rope}
        if d.get("mlp_only_layers") is None:
            d.pop("mlp_only_layers", None)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"Qwen3MoeConfig.from_hf: unknown or unsupported keys {unknown} "
                             f"(tonp refuses settings it would otherwise silently ignore)")
        return cls(**d)

    def to_hf(self) -> Dict[str, Any]:
        """A config.json dict that transformers' Qwen3MoeConfig (4.x and 5.x) loads."""
        d = dataclasses.asdict(self)
        d.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", use_cache=True)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        d["dtype"] = self.torch_dtype
        return d

    # -- presets --------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides) -> "Qwen3MoeConfig":
        """A named configuration from PRESETS, with fields overridden by keyword."""
        if name not in PRESETS:
            raise KeyError(f"Qwen3MoeConfig.preset: unknown preset {name!r}; have {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: Dict[str, Dict[str, Any]] = {
    # Byte-level friendly (256 bytes + 64 specials), fast on 2 CPU cores.
    "tiny": dict(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                 max_position_embeddings=1024, rope_theta=10000.0, attention_block=16,
                 torch_dtype="float32", bos_token_id=256, eos_token_id=257),
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3_30b_a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1000000.0,
                          max_position_embeddings=40960, rms_norm_eps=1e-6,
                          torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645),
    # Qwen/Qwen3-235B-A22B config.json
    "qwen3_235b_a22b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            moe_intermediate_size=1536, num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                            rope_theta=1000000.0, max_position_embeddings=40960,
                            rms_norm_eps=1e-6, torch_dtype="bfloat16", bos_token_id=151643,
                            eos_token_id=151645),
}
