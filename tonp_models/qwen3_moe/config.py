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
import math
import operator
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import torch

from tonp_parallel.layout import layout_problems

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
        _normalise(self)
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
        """Raise one ValueError naming every field that is mistyped, inconsistent or unsupported
        (the kernels' shape rules come from `tonp_parallel.layout_problems`)."""
        errs = _type_problems(self)
        if errs:
            raise ValueError("Qwen3MoeConfig: " + "; ".join(errs))
        if self.num_attention_heads % self.num_key_value_heads:
            errs.append(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                        f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts > 0 and not 1 <= self.num_experts_per_tok <= self.num_experts:
            errs.append(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                        f"[1, num_experts={self.num_experts}]")
        bad_layers = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad_layers:
            errs.append(f"mlp_only_layers {bad_layers} are not layer indices "
                        f"0..{self.num_hidden_layers - 1}")
        rope = self.rope_scaling or {}
        if set(rope) - {"rope_type", "type"} or \
                any(rope[k] != "default" for k in ("rope_type", "type") if k in rope):
            errs.append(f"rope_scaling={self.rope_scaling} is not supported (only plain RoPE: "
                        f"None or {{'rope_type': 'default'}}; anything else would be ignored)")
        if self.hidden_act != "silu":
            errs.append(f"hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        if self.torch_dtype not in _DTYPES:
            errs.append(f"torch_dtype={self.torch_dtype!r} must be one of {sorted(_DTYPES)}")
        if self.attention_dropout != 0:
            errs.append(f"attention_dropout={self.attention_dropout} is not supported (must be 0)")
        if self.use_sliding_window:
            errs.append("use_sliding_window=True is not supported")
        errs += layout_problems(self)
        if errs:
            raise ValueError("Qwen3MoeConfig: " + "; ".join(errs))

    # -- HF conversion --------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: Union[str, os.PathLike, Dict[str, Any]], **overrides
                ) -> "Qwen3MoeConfig":
        """Read an HF config: a checkpoint dir (its config.json), a json file, or a dict.

        Accepts both transformers 4 (`rope_theta`, `torch_dtype`, `num_experts`) and 5
        (`rope_parameters`, `dtype`, `num_local_experts`) spellings; a key it lacks takes
        transformers' default (not tonp's preset value). Unknown keys and bad values raise.
        """
        if isinstance(source, dict):
            d = dict(source)
        else:
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"Qwen3MoeConfig.from_hf: no config file at {path}")
            try:
                with open(path, encoding="utf-8") as f:
                    d = json.load(f)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                raise ValueError(f"Qwen3MoeConfig.from_hf: {path} is not valid JSON: {e}") from e
            if not isinstance(d, dict):
                raise ValueError(f"Qwen3MoeConfig.from_hf: {path} holds a JSON "
                                 f"{type(d).__name__}, not an object")
        d.update(overrides)
        return cls(**_hf_fields(d, {f.name for f in dataclasses.fields(cls)}))

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
            raise KeyError(f"Qwen3MoeConfig.preset: unknown preset {name!r}; have "
                           f"{sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


# transformers' defaults where tonp's field defaults (Qwen3-30B-A3B's values) differ: a key a
# config.json lacks means what transformers reads it as. head_dim defaults to hidden / heads.
_HF_DEFAULTS = {"num_hidden_layers": 24, "max_position_embeddings": 32768,
                "norm_topk_prob": False, "rope_theta": 10000.0}


def _hf_fields(d: Dict[str, Any], names) -> Dict[str, Any]:
    """An HF config dict (transformers 4 or 5 spelling) -> Qwen3MoeConfig keyword arguments."""
    def refuse(msg):
        raise ValueError(f"Qwen3MoeConfig.from_hf: {msg}")

    if d.get("model_type", "qwen3_moe") != "qwen3_moe":
        refuse(f"model_type={d['model_type']!r} is not 'qwen3_moe'")
    d = {k: v for k, v in d.items() if k not in _METADATA_KEYS}
    for old, new in (("num_local_experts", "num_experts"), ("dtype", "torch_dtype")):
        if old in d:
            v = d.pop(old)
            if v is not None and d.setdefault(new, v) not in (None, v):
                refuse(f"{new}={d[new]!r} and {old}={v!r} disagree")
            if v is not None:
                d[new] = v
    if d.get("torch_dtype") is None:
        d.pop("torch_dtype", None)
    rope = d.pop("rope_parameters", None)
    if rope is not None and not isinstance(rope, dict):
        refuse(f"rope_parameters={rope!r} must be a dict")
    if rope:
        rope = dict(rope)
        if "rope_theta" in rope:
            theta = rope.pop("rope_theta")
            if d.setdefault("rope_theta", theta) != theta:
                refuse(f"rope_theta={d['rope_theta']!r} and rope_parameters.rope_theta={theta!r} "
                       f"disagree")
        if rope.get("rope_type", "default") != "default" or set(rope) - {"rope_type"}:
            d["rope_scaling"] = {"rope_type": rope.get("rope_type", "default"), **rope}
    if d.get("mlp_only_layers") is None:
        d.pop("mlp_only_layers", None)
    unknown = sorted(set(d) - set(names))
    if unknown:
        refuse(f"unknown or unsupported keys {unknown} (tonp refuses settings it would "
               f"otherwise silently ignore)")
    for k, v in _HF_DEFAULTS.items():
        d.setdefault(k, v)
    if "head_dim" not in d:
        hidden = d.get("hidden_size", Qwen3MoeConfig.hidden_size)
        heads = d.get("num_attention_heads", Qwen3MoeConfig.num_attention_heads)
        if _is_int(hidden) and _is_int(heads) and heads > 0:
            d["head_dim"] = hidden // heads
    return d


_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "num_experts_per_tok", "decoder_sparse_step", "max_position_embeddings",
                  "attention_block", "reduction_chunks")
_BOOLS = ("norm_topk_prob", "tie_word_embeddings", "attention_bias", "output_router_logits",
          "use_sliding_window")
# (field, lower bound, bound included): finite real numbers.
_FLOATS = (("rms_norm_eps", 0.0, False), ("rope_theta", 0.0, False),
           ("initializer_range", 0.0, True), ("router_aux_loss_coef", None, True),
           ("attention_dropout", None, True))
_MAX_POSITIONS = 2**31 - 1  # positions and cu_seqlens are int32 in the kernels


def _as_int(v):
    """An integer-like value (int, numpy or 0-d torch integer) as an int; anything else as is."""
    if isinstance(v, (bool, float)):
        return v
    try:
        return operator.index(v)
    except TypeError:
        return v


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _normalise(c: "Qwen3MoeConfig") -> None:
    """Integer-likes to int, ints in float fields to float, tuples to lists (no value changes)."""
    for name in _POSITIVE_INTS + ("num_experts", "bos_token_id", "sliding_window"):
        setattr(c, name, _as_int(getattr(c, name)))
    if isinstance(c.eos_token_id, (list, tuple)):
        c.eos_token_id = [_as_int(v) for v in c.eos_token_id]
    else:
        c.eos_token_id = _as_int(c.eos_token_id)
    if isinstance(c.mlp_only_layers, tuple):
        c.mlp_only_layers = list(c.mlp_only_layers)
    if isinstance(c.mlp_only_layers, list):
        c.mlp_only_layers = [_as_int(v) for v in c.mlp_only_layers]
    for name, _, _ in _FLOATS:
        if _is_int(getattr(c, name)):
            setattr(c, name, float(getattr(c, name)))


def _type_problems(c: "Qwen3MoeConfig") -> List[str]:
    """One line per field whose type or range is wrong (before any rule that uses it)."""
    errs = [f"{n}={getattr(c, n)!r} must be a positive int" for n in _POSITIVE_INTS
            if not (_is_int(getattr(c, n)) and getattr(c, n) >= 1)]
    if not (_is_int(c.num_experts) and c.num_experts >= 0):
        errs.append(f"num_experts={c.num_experts!r} must be an int >= 0")
    errs += [f"{n}={getattr(c, n)!r} must be a bool (JSON true / false)" for n in _BOOLS
             if not isinstance(getattr(c, n), bool)]
    for n, low, closed in _FLOATS:
        v = getattr(c, n)
        ok = isinstance(v, float) and math.isfinite(v) and \
            (low is None or v > low or (closed and v == low))
        if not ok:
            rule = "a finite number" if low is None else \
                f"a finite number {'>=' if closed else '>'} {low}"
            errs.append(f"{n}={v!r} must be {rule}")
    if _is_int(c.max_position_embeddings) and c.max_position_embeddings > _MAX_POSITIONS:
        errs.append(f"max_position_embeddings={c.max_position_embeddings} exceeds {_MAX_POSITIONS} "
                    f"(positions are int32 in the kernels)")
    if not (isinstance(c.mlp_only_layers, list) and all(map(_is_int, c.mlp_only_layers))):
        errs.append(f"mlp_only_layers={c.mlp_only_layers!r} must be a list of layer indices")
    for n in ("bos_token_id", "eos_token_id"):
        v = getattr(c, n)
        ids = v if n == "eos_token_id" and isinstance(v, list) else [v]
        if v is not None and not (ids and all(_is_int(i) and i >= 0 for i in ids)):
            errs.append(f"{n}={v!r} must be a token id >= 0"
                        + (" or a list of them" if n == "eos_token_id" else ""))
    if c.sliding_window is not None and not _is_int(c.sliding_window):
        errs.append(f"sliding_window={c.sliding_window!r} must be an int or None")
    if c.rope_scaling is not None and not isinstance(c.rope_scaling, dict):
        errs.append(f"rope_scaling={c.rope_scaling!r} must be a dict or None")
    for n in ("hidden_act", "torch_dtype"):
        if not isinstance(getattr(c, n), str):
            errs.append(f"{n}={getattr(c, n)!r} must be a string")
    return errs


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
