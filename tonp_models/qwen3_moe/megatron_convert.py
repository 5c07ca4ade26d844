"""Checkpoint conversion between megatron-core GPT, tonp and HF state dicts (global tensors).

    tonp_sd = megatron_to_tonp(mcore_sd, config)              # megatron-core GPTModel -> tonp
    mcore_sd = tonp_to_megatron(model.state_dict(), config)   # tonp -> megatron-core GPTModel
    hf_sd = megatron_to_hf(mcore_sd, config); mcore_sd = hf_to_megatron(hf_sd, config)
    spec_sd = tonp_to_spec(tonp_sd)       # a megatron GPTModel built with get_tonp_block_spec
(On a TP/EP rank, load global tensors with tonp_models.megatron.load_global_state_dict.)

Driven by `checkpoint.TABLE` (expanded by `hub_slots` on the config's unsharded model, built on
the meta device) plus `MEGATRON`: one megatron name and region per TABLE row (a missing row
fails at import). Values are copied, never recomputed: every round trip is bitwise. The
megatron layouts (qkv per query group, fc1 = [gate; up], TE fused norms, the three expert
layouts) are described in docs/megatron.md.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .checkpoint import TABLE, hub_slots
from .config import Qwen3MoeConfig

# HF name template (TABLE's first column) -> (megatron-core template, region kind)
MEGATRON: Dict[str, Optional[Tuple[str, Optional[str]]]] = {
    "model.embed_tokens.weight": ("embedding.word_embeddings.weight", None),
    "model.layers.{L}.input_layernorm.weight": ("decoder.layers.{L}.input_layernorm.weight", None),
    "model.layers.{L}.self_attn.q_proj.weight":
        ("decoder.layers.{L}.self_attention.linear_qkv.weight", "q"),
    "model.layers.{L}.self_attn.k_proj.weight":
        ("decoder.layers.{L}.self_attention.linear_qkv.weight", "k"),
    "model.layers.{L}.self_attn.v_proj.weight":
        ("decoder.layers.{L}.self_attention.linear_qkv.weight", "v"),
    "model.layers.{L}.self_attn.o_proj.weight":
        ("decoder.layers.{L}.self_attention.linear_proj.weight", None),
    "model.layers.{L}.self_attn.q_norm.weight":
        ("decoder.layers.{L}.self_attention.q_layernorm.weight", None),
    "model.layers.{L}.self_attn.k_norm.weight":
        ("decoder.layers.{L}.self_attention.k_layernorm.weight", None),
    "model.layers.{L}.post_attention_layernorm.weight":
        ("decoder.layers.{L}.pre_mlp_layernorm.weight", None),
    "model.layers.{L}.mlp.gate.weight": ("decoder.layers.{L}.mlp.router.weight", None),
    "model.layers.{L}.mlp.experts.{E}.gate_proj.weight":
        ("decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight", "gate"),
    "model.layers.{L}.mlp.experts.{E}.up_proj.weight":
        ("decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight", "up"),
    "model.layers.{L}.mlp.experts.{E}.down_proj.weight":
        ("decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc2.weight", None),
    "model.layers.{L}.mlp.gate_proj.weight": ("decoder.layers.{L}.mlp.linear_fc1.weight", "gate"),
    "model.layers.{L}.mlp.up_proj.weight": ("decoder.layers.{L}.mlp.linear_fc1.weight", "up"),
    "model.layers.{L}.mlp.down_proj.weight": ("decoder.layers.{L}.mlp.linear_fc2.weight", None),
    "model.norm.weight": ("decoder.final_layernorm.weight", None),
    "lm_head.weight": ("output_layer.weight", None),
    # tonp's megatron layers have no linear biases (add_qkv_bias / add_bias_linear are refused)
    **{f"model.layers.{{L}}.self_attn.{p}_proj.bias": None for p in "qkvo"},
}
_missing = [row[0] for row in TABLE if row[0] not in MEGATRON]
if _missing:  # pragma: no cover - a table edit must come with its megatron name
    raise ImportError(f"megatron_convert: TABLE rows without a megatron-core name: {_missing}")

EXPERT_LAYOUTS = ("sequential", "te_grouped", "legacy_grouped")
_EXTRA = "._extra_state"


def _pattern(template: str) -> "re.Pattern":
    return re.compile("^" + re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)")
                      .replace(r"\{E\}", r"(?P<E>\d+)") + "$")


_HF_PATTERNS = [(_pattern(hf), hf) for hf in MEGATRON]


def _meta_model(config: Qwen3MoeConfig):
    from .model import Qwen3MoeForCausalLM
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(config)


def _parse(hf_name: str):
    for pat, template in _HF_PATTERNS:
        m = pat.match(hf_name)
        if m:
            d = m.groupdict()
            return template, int(d["L"]) if "L" in d else None, int(d["E"]) if "E" in d else None
    raise KeyError(f"megatron_convert: {hf_name} matches no TABLE row")


# ---------------------------------------------------------------------------------------------
# HF <-> megatron-core
# ---------------------------------------------------------------------------------------------
Region = Callable[[torch.Tensor], torch.Tensor]   # megatron tensor -> the view an HF tensor fills


def _megatron_slots(config: Qwen3MoeConfig, fused_norms: bool, experts: str
                    ) -> List[Tuple[str, Tuple[int, ...], str, Tuple[int, ...], Region]]:
    """(hf name, hf shape, megatron name, megatron shape, region) for every HF tensor."""
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts={experts!r} must be one of {EXPERT_LAYOUTS}")
    c = config
    if c.attention_bias:
        raise ValueError("megatron_convert: attention_bias=True has no megatron counterpart in "
                         "tonp's layers (add_qkv_bias / add_bias_linear are refused)")
    d, H = c.head_dim, c.hidden_size
    ng, qpg = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads
    E, I, Id = c.num_experts, c.moe_intermediate_size, c.intermediate_size
    out = []
    for s in hub_slots(_meta_model(c)):
        template, L, e = _parse(s.hf)
        meg, kind = MEGATRON[template]
        meg = meg.format(L=L, E=e)
        shape = s.shape
        if kind in ("q", "k", "v"):
            shape = ((c.num_attention_heads + 2 * ng) * d, H)
            j = {"k": qpg, "v": qpg + 1}.get(kind)
            region = (lambda t: t.view(ng, qpg + 2, d, H)[:, :qpg]) if kind == "q" else \
                (lambda t, j=j: t.view(ng, qpg + 2, d, H)[:, j])
        elif kind in ("gate", "up"):
            n = I if e is not None else Id
            shape = (2 * n, H)
            rows = slice(0, n) if kind == "gate" else slice(n, 2 * n)
            region = lambda t, rows=rows: t[rows]
        else:
            region = lambda t: t
        if fused_norms and meg.endswith(".input_layernorm.weight"):
            meg = meg.replace("input_layernorm.weight",
                              "self_attention.linear_qkv.layer_norm_weight")
        if fused_norms and meg.endswith(".pre_mlp_layernorm.weight") and not c.is_sparse_layer(L):
            meg = meg.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        if e is not None and experts == "te_grouped":
            meg = re.sub(r"local_experts\.(\d+)\.(linear_fc\d)\.weight", r"\2.weight\1", meg)
        elif e is not None and experts == "legacy_grouped":
            fc1 = ".linear_fc1." in meg
            meg = re.sub(r"local_experts\.\d+\.linear_fc\d\.weight",
                         "weight1" if fc1 else "weight2", meg)
            if fc1:
                cols = slice(0, I) if kind == "gate" else slice(I, 2 * I)
                shape = (H, E * 2 * I)
                region = lambda t, e=e, cols=cols: t.view(E, H, 2 * I)[e, :, cols].t()
            else:
                shape = (E * I, H)
                region = lambda t, e=e: t.view(E, I, H)[e].t()
        out.append((s.hf, tuple(s.shape), meg, tuple(shape), region))
    return out


def _check_keys(what: str, given, expected, ignore=lambda k: False) -> None:
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(k for k in set(given) - set(expected) if not ignore(k))
    if missing or unexpected:
        lines = [f"{what}: the state dict does not match the config"]
        for tag, items in (("missing", missing), ("unexpected", unexpected)):
            if items:
                lines.append(f"  {tag} ({len(items)}): " + ", ".join(items[:12]) +
                             (" ..." if len(items) > 12 else ""))
        raise ValueError("\n".join(lines))


def _check_shape(name: str, t: torch.Tensor, shape) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"megatron_convert: {name} has shape {list(t.shape)}, the config "
                         f"expects {list(shape)}")


@torch.no_grad()
def hf_to_megatron(hf_sd: Dict[str, torch.Tensor], config: Qwen3MoeConfig, *,
                   fused_norms: bool = False, experts: str = "sequential"
                   ) -> Dict[str, torch.Tensor]:
    """HF hub-layout tensors -> a megatron-core GPTModel state dict (see the module doc)."""
    slots = _megatron_slots(config, fused_norms, experts)
    _check_keys("hf_to_megatron", hf_sd, [s[0] for s in slots],
                ignore=lambda k: k.endswith("rotary_emb.inv_freq"))
    out: Dict[str, torch.Tensor] = {}
    for hf, hf_shape, meg, meg_shape, region in slots:
        t = hf_sd[hf]
        _check_shape(hf, t, hf_shape)
        if meg not in out:
            out[meg] = t.new_empty(meg_shape)
        view = region(out[meg])
        view.copy_(t.reshape(view.shape))
    return out


@torch.no_grad()
def megatron_to_hf(mcore_sd: Dict[str, torch.Tensor], config: Qwen3MoeConfig, *,
                   fused_norms: bool = False, experts: str = "sequential"
                   ) -> Dict[str, torch.Tensor]:
    """A megatron-core GPTModel state dict -> HF hub-layout tensors (contiguous copies)."""
    slots = _megatron_slots(config, fused_norms, experts)
    _check_keys("megatron_to_hf", mcore_sd, {s[2] for s in slots},
                ignore=lambda k: k.endswith(_EXTRA))
    out = {}
    for hf, hf_shape, meg, meg_shape, region in slots:
        src = mcore_sd[meg]
        _check_shape(meg, src, meg_shape)
        out[hf] = region(src).reshape(hf_shape).clone(memory_format=torch.contiguous_format)
    return out


# ---------------------------------------------------------------------------------------------
# HF <-> tonp (the loader's slots, on state dicts instead of files)
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def hf_to_tonp(hf_sd: Dict[str, torch.Tensor], config: Qwen3MoeConfig) -> Dict[str, torch.Tensor]:
    """HF hub-layout tensors -> the parameters of Qwen3MoeForCausalLM(config) (its state dict)."""
    model = _meta_model(config)
    slots = hub_slots(model)
    _check_keys("hf_to_tonp", hf_sd, [s.hf for s in slots],
                ignore=lambda k: k.endswith("rotary_emb.inv_freq"))
    params = dict(model.named_parameters())
    out: Dict[str, torch.Tensor] = {}
    for s in slots:
        t = hf_sd[s.hf]
        _check_shape(s.hf, t, s.shape)
        if s.param not in out:
            out[s.param] = t.new_empty(params[s.param].shape)
        (out[s.param][s.index] if s.index else out[s.param]).copy_(t)
    return out


@torch.no_grad()
def tonp_to_hf(tonp_sd: Dict[str, torch.Tensor], config: Qwen3MoeConfig) -> Dict[str, torch.Tensor]:
    """Qwen3MoeForCausalLM parameters -> HF hub-layout tensors (contiguous copies)."""
    model = _meta_model(config)
    slots = hub_slots(model)
    params = dict(model.named_parameters())
    _check_keys("tonp_to_hf", tonp_sd, params)
    out = {}
    for s in slots:
        p = tonp_sd[s.param]
        _check_shape(s.param, p, params[s.param].shape)
        out[s.hf] = (p[s.index] if s.index else p).clone(memory_format=torch.contiguous_format)
    return out


def megatron_to_tonp(mcore_sd, config: Qwen3MoeConfig, **layout) -> Dict[str, torch.Tensor]:
    """megatron-core GPTModel state dict -> Qwen3MoeForCausalLM state dict (layout: fused_norms,
    experts, as in megatron_to_hf)."""
    return hf_to_tonp(megatron_to_hf(mcore_sd, config, **layout), config)


def tonp_to_megatron(tonp_sd, config: Qwen3MoeConfig, **layout) -> Dict[str, torch.Tensor]:
    """Qwen3MoeForCausalLM state dict -> megatron-core GPTModel state dict."""
    return hf_to_megatron(tonp_to_hf(tonp_sd, config), config, **layout)


# ---------------------------------------------------------------------------------------------
# tonp <-> a megatron model built with tonp's spec
# ---------------------------------------------------------------------------------------------
# The tonp-spec modules ARE tonp's layers, so only the module paths differ.
_SPEC_NAMES = [  # (tonp prefix, prefix in a megatron GPTModel built with get_tonp_block_spec)
    ("embed_tokens.", "embedding.word_embeddings."),
    ("layers.{L}.self_attn.", "decoder.layers.{L}.self_attention."),
    ("layers.{L}.input_layernorm.", "decoder.layers.{L}.input_layernorm."),
    ("layers.{L}.post_attention_layernorm.", "decoder.layers.{L}.pre_mlp_layernorm."),
    ("layers.{L}.mlp.", "decoder.layers.{L}.mlp."),
    ("norm.", "decoder.final_layernorm."),
    ("lm_head.", "output_layer."),
]


def _rename(sd, pairs, strip: str = "") -> Dict[str, torch.Tensor]:
    pats = [(re.compile("^" + re.escape(a).replace(r"\{L\}", r"(\d+)")), b) for a, b in pairs]
    out = {}
    for k, v in sd.items():
        if k.endswith(_EXTRA):
            continue
        for pat, repl in pats:
            m = pat.match(k)
            if m:
                new = repl.replace("{L}", m.group(1)) if m.groups() else repl
                out[(new + k[m.end():])[len(strip):]] = v
                break
        else:
            raise KeyError(f"megatron_convert: no rename rule for {k!r}")
    return out


def tonp_to_spec(tonp_sd, *, block_only: bool = False) -> Dict[str, torch.Tensor]:
    """tonp names -> a GPTModel built with the tonp spec (block_only: a bare TransformerBlock's
    names, `layers.N....` and `final_layernorm.weight`, without embedding and output layer)."""
    if block_only:
        sd = {k: v for k, v in tonp_sd.items() if not k.startswith(("embed_tokens.", "lm_head."))}
        return _rename(sd, _SPEC_NAMES, strip="decoder.")
    return _rename(tonp_sd, _SPEC_NAMES)


def spec_to_tonp(spec_sd, *, block_only: bool = False) -> Dict[str, torch.Tensor]:
    """The inverse of tonp_to_spec."""
    pairs = [(b[len("decoder."):] if block_only and b.startswith("decoder.") else b, a)
             for a, b in _SPEC_NAMES]
    return _rename(spec_sd, pairs)


__all__ = ["MEGATRON", "EXPERT_LAYOUTS", "hf_to_megatron", "megatron_to_hf",
           "hf_to_tonp", "tonp_to_hf", "megatron_to_tonp", "tonp_to_megatron", "tonp_to_spec",
           "spec_to_tonp"]
