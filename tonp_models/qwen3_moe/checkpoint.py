"""HF checkpoints: ONE table from every HF weight name to a tonp parameter, used by the loader,
the saver and the tests.

Each row of `TABLE` says: HF name template, tonp parameter template, which part of the tonp
parameter it fills, the dim a tensor-parallel rank shards (of the HF tensor), and whether the
parameter's dim 0 is the expert dim (sharded by expert parallelism: a rank holds a contiguous
range of expert ids). `{L}` is a layer index, `{E}` an expert id. Which slice a rank holds is
its module's `Shard` (tonp_models.layers.linear; e.g. replicated KV heads at TP > KV heads):
the loader reads exactly that slice of each HF tensor (`safe_open(...).get_slice`, memory-
mapped), so a rank never reads other ranks' weights; the saver gathers the shards over the TP
and EP groups and global rank 0 alone writes the hub layout.

Two layouts load: the hub layout (per-expert `mlp.experts.{E}.{gate,up,down}_proj.weight`, what
transformers saves and the Qwen hub ships) and transformers' fused in-memory layout
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]); saving writes the
hub layout. Tensors are read with `safetensors.safe_open` (memory-mapped), slice by slice.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..layers.linear import Shard

# part: None = the whole parameter; "expert" = param[E]; "gate"/"up" = the first/second half
#       of the rows of param[E] (gate_up_proj [E, 2I, H], gate rows first, as transformers fuses).
# layers: "all" | "sparse" | "dense" | "untied" (lm_head only without tied embeddings).
# (hf name, tonp parameter, part, tp shard dim of the HF tensor, ep (param dim 0 = experts), layers)
TABLE: List[Tuple[str, str, Optional[str], Optional[int], bool, str]] = [
    ("model.embed_tokens.weight", "embed_tokens.weight", None, 0, False, "all"),
    ("model.layers.{L}.input_layernorm.weight", "layers.{L}.input_layernorm.weight",
     None, None, False, "all"),
    ("model.layers.{L}.self_attn.q_proj.weight", "layers.{L}.self_attn.q_proj.weight",
     None, 0, False, "all"),
    ("model.layers.{L}.self_attn.k_proj.weight", "layers.{L}.self_attn.k_proj.weight",
     None, 0, False, "all"),
    ("model.layers.{L}.self_attn.v_proj.weight", "layers.{L}.self_attn.v_proj.weight",
     None, 0, False, "all"),
    ("model.layers.{L}.self_attn.o_proj.weight", "layers.{L}.self_attn.o_proj.weight",
     None, 1, False, "all"),
    ("model.layers.{L}.self_attn.q_norm.weight", "layers.{L}.self_attn.q_norm.weight",
     None, None, False, "all"),
    ("model.layers.{L}.self_attn.k_norm.weight", "layers.{L}.self_attn.k_norm.weight",
     None, None, False, "all"),
    ("model.layers.{L}.post_attention_layernorm.weight",
     "layers.{L}.post_attention_layernorm.weight", None, None, False, "all"),
    ("model.layers.{L}.mlp.gate.weight", "layers.{L}.mlp.gate", None, None, False, "sparse"),
    ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "layers.{L}.mlp.gate_up_proj",
     "gate", None, True, "sparse"),
    ("model.layers.{L}.mlp.experts.{E}.up_proj.weight", "layers.{L}.mlp.gate_up_proj",
     "up", None, True, "sparse"),
    ("model.layers.{L}.mlp.experts.{E}.down_proj.weight", "layers.{L}.mlp.down_proj",
     "expert", None, True, "sparse"),
    ("model.layers.{L}.mlp.gate_proj.weight", "layers.{L}.mlp.gate_proj.weight",
     None, 0, False, "dense"),
    ("model.layers.{L}.mlp.up_proj.weight", "layers.{L}.mlp.up_proj.weight",
     None, 0, False, "dense"),
    ("model.layers.{L}.mlp.down_proj.weight", "layers.{L}.mlp.down_proj.weight",
     None, 1, False, "dense"),
    ("model.norm.weight", "norm.weight", None, None, False, "all"),
    ("lm_head.weight", "lm_head.weight", None, 0, False, "untied"),
]
# transformers' fused expert tensors: the whole 3-D parameter under one name.
FUSED = {"model.layers.{L}.mlp.experts.gate_up_proj": "layers.{L}.mlp.gate_up_proj",
         "model.layers.{L}.mlp.experts.down_proj": "layers.{L}.mlp.down_proj"}
# Names some checkpoints carry that hold nothing tonp needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Slot:
    """One HF tensor <-> a region of one tonp parameter (this rank's share).

    hf: HF name; param: tonp parameter name; index: the region of the local parameter
    (a tuple for `param[index]`); tp_dim: the dim of the HF tensor a TP rank narrows (None =
    replicated); shape: the full HF tensor's shape; shard: the slice of the HF tensor this
    rank holds (None = all of it)."""
    hf: str
    param: str
    index: tuple
    tp_dim: Optional[int]
    shape: Tuple[int, ...]
    shard: Optional[Shard] = None


def hub_slots(model, fused_layers=()) -> List[Slot]:
    """Every HF tensor of `model`'s config in the hub layout (layers in `fused_layers` in the
    fused-expert layout), restricted to the experts this rank owns."""
    c, params = model.config, dict(model.named_parameters())
    shards = model.parameter_shards()
    slots = []
    for hf, ours, part, tp_dim, ep, where in TABLE:
        if where == "untied" and c.tie_word_embeddings:
            continue
        layers = range(c.num_hidden_layers) if "{L}" in hf else [None]
        for L in layers:
            if L is not None and (where == "sparse") != c.is_sparse_layer(L) and where != "all":
                continue
            name = ours.format(L=L)
            p = params[name]
            if ep and L in fused_layers:
                continue
            if not ep:
                shard = shards.get(name)
                shape = shard.full_shape(p.shape) if shard else tuple(p.shape)
                slots.append(Slot(hf.format(L=L), name, (), tp_dim, tuple(shape), shard))
                continue
            moe = _module(model, name)
            I = moe.intermediate
            rows = {"gate": slice(0, I), "up": slice(I, 2 * I), "expert": slice(None)}[part]
            for e in range(moe.local_experts):
                index = (e, rows)
                slots.append(Slot(hf.format(L=L, E=moe.first_expert + e), name, index, None,
                                  tuple(p[index].shape)))
    for L in fused_layers:
        for hf, ours in FUSED.items():
            name = ours.format(L=L)
            moe, p = _module(model, name), params[name]
            shape = (moe.num_experts, *p.shape[1:])
            index = (slice(moe.first_expert, moe.first_expert + moe.local_experts),)
            # For fused tensors `index` selects from the HF tensor (the rank's expert range).
            slots.append(Slot(hf.format(L=L), name, index, None, shape))
    return slots


def _module(model, param_name):
    return model.get_submodule(param_name.rsplit(".", 1)[0])


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------
def _weight_files(path: str) -> Dict[str, str]:
    """HF name -> safetensors file, from model.safetensors.index.json or the .safetensors files."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"load_checkpoint: no *.safetensors (nor an index) in {path}")
    from safetensors import safe_open
    names = {}
    for fn in files:
        with safe_open(os.path.join(path, fn), framework="pt") as f:
            names.update({k: os.path.join(path, fn) for k in f.keys()})
    return names


@torch.no_grad()
def load_checkpoint(model, path) -> None:
    """Fill `model`'s parameters (this rank's shards) from an HF safetensors checkpoint dir.

    Raises one ValueError listing every missing, unexpected and mis-shaped tensor."""
    from safetensors import safe_open
    path = os.fspath(path)
    files = _weight_files(path)
    c = model.config
    gate_up = next(iter(FUSED))
    fused = [L for L in range(c.num_hidden_layers)
             if c.is_sparse_layer(L) and gate_up.format(L=L) in files]
    fused_names = {hf.format(L=L) for L in fused for hf in FUSED}
    slots = hub_slots(model, fused_layers=fused)
    params = dict(model.named_parameters())
    expected = {s.hf for s in slots}
    ignored = {k for k in files if k.endswith(_IGNORED_SUFFIXES)
               or (c.tie_word_embeddings and k == "lm_head.weight")}
    # Under expert parallelism the other ranks' experts are in the files too: skip, not error.
    ignored |= {hf.format(L=L, E=e) for hf, _, _, _, ep, _ in TABLE if ep
                for L in range(c.num_hidden_layers) if c.is_sparse_layer(L)
                for e in range(c.num_experts)}
    missing = sorted(expected - set(files))
    unexpected = sorted(set(files) - expected - ignored)
    misshaped, handles = [], {}
    try:
        for s in slots:
            if s.hf not in files:
                continue
            fn = files[s.hf]
            if fn not in handles:
                handles[fn] = safe_open(fn, framework="pt")
            sl = handles[fn].get_slice(s.hf)
            shape = tuple(sl.get_shape())
            if shape != s.shape:
                misshaped.append(f"{s.hf}: checkpoint {list(shape)}, model {list(s.shape)}")
                continue
            if s.hf in fused_names:
                t, dst = sl[s.index], params[s.param]
            else:
                if s.shard is not None:  # read only this rank's slice from the file
                    idx = [slice(None)] * len(shape)
                    idx[s.shard.dim] = slice(s.shard.start, s.shard.start + s.shard.length)
                    t = sl[tuple(idx)]
                else:
                    t = sl[:]
                dst = params[s.param][s.index] if s.index else params[s.param]
            dst.copy_(t.to(dst.dtype))
    finally:
        handles.clear()
    if missing or unexpected or misshaped:
        lines = [f"checkpoint {path} does not match the model ({c.num_hidden_layers} layers, "
                 f"{c.num_experts} experts):"]
        for what, items in (("missing", missing), ("unexpected", unexpected),
                             ("mis-shaped", misshaped)):
            if items:
                lines.append(f"  {what} ({len(items)}): " + ", ".join(items[:20]) +
                             (" ..." if len(items) > 20 else ""))
        raise ValueError("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def state_dict_hub(model) -> Dict[str, torch.Tensor]:
    """The model's weights under HF hub names (contiguous CPU tensors in the model's dtype).

    A sharded model gathers its shards first (collective over its TP and EP groups: every
    rank must call it); the result is the whole model on every rank."""
    if model.parameter_shards():
        params = gather_full_parameters(model)
        with torch.device("meta"):  # the unsharded layout: the hub slots of the full model
            model = type(model)(model.config, dtype=model.dtype)
    else:
        params = dict(model.named_parameters())
    out = {}
    for s in hub_slots(model):
        t = params[s.param][s.index] if s.index else params[s.param]
        out[s.hf] = t.detach().contiguous().clone()
    return out


@torch.no_grad()
def gather_full_parameters(model) -> Dict[str, torch.Tensor]:
    """{name: the full (unsharded) parameter} from every rank's shard: an all_gather per sharded
    parameter over its TP or EP group (bytes only: exact in every dtype). Collective."""
    from tonp_parallel import all_gather_stacked
    shards, out = model.parameter_shards(), {}
    for name, p in model.named_parameters():
        s = shards.get(name)
        if s is None:
            out[name] = p.detach()
            continue
        group = getattr(model.groups, "tp_group" if s.group == "tp" else "ep_group")
        local = p.detach().contiguous()
        # bf16 -> fp32 -> bf16 is exact, and every backend gathers fp32.
        parts = all_gather_stacked(local.float(), group).to(local.dtype)         # (W, ...)
        starts = all_gather_stacked(torch.tensor([s.start]), group)[:, 0].tolist()
        full = local.new_empty(s.full_shape(local.shape))
        for start, part in zip(starts, parts):   # KV-head copies write the same slice twice
            full.narrow(s.dim, start, s.length).copy_(part)
        out[name] = full
    return out


def save_checkpoint(model, path, max_shard_size: int = 5 * 2**30) -> None:
    """Write config.json and the hub-layout safetensors (sharded + index above max_shard_size).
    A sharded model: every rank calls it, the shards are gathered, global rank 0 writes."""
    from safetensors.torch import save_file
    path = os.fspath(path)
    tensors = state_dict_hub(model)
    if model.parameter_shards():
        import torch.distributed as dist
        rank = dist.get_rank()
        if rank == 0:
            _write(model, path, tensors, max_shard_size, save_file)
        dist.barrier()  # nobody reads the checkpoint before rank 0 has written it
        return
    _write(model, path, tensors, max_shard_size, save_file)


def _write(model, path, tensors, max_shard_size, save_file) -> None:
    os.makedirs(path, exist_ok=True)
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    cfg = model.config.to_hf()
    cfg["dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[model.dtype]
    cfg["torch_dtype"] = cfg["dtype"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
