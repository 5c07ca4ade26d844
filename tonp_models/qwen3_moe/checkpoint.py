"""HF checkpoints through ONE table from every HF weight name to a region of a tonp parameter,
used by the loader, the saver, the megatron converters and the tests.

    load_checkpoint(model, path)     # this rank's shards, read slice by slice (memory-mapped)
    save_checkpoint(model, path)     # gathered over TP / EP / PP; global rank 0 writes, atomically
    slots = hub_slots(model)         # every HF tensor <-> (parameter, region) of this rank
    copy_parameters(src, dst)        # the same weights into a model of another layout

Which parameter is sharded, and which slice a rank holds, comes only from
`model.parameter_shards()`; the table says only how HF names map to tonp parameters. Layouts,
the refusals and the atomic save are explained in docs/checkpoints.md.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .checkpoint_files import (INDEX, TensorReader, nonfinite_problem, split_shards,
                               weight_files, write_directory)

# (HF name template, tonp parameter template, part, layers). {L}: layer, {E}: expert id.
# part: None = the whole parameter; "expert" = param[E]; "gate" / "up" = the first / second
#       half of the rows of param[E] (gate_up_proj [E, 2I, H], gate rows first).
# layers: "all" | "sparse" | "dense" | "untied" (no tied embeddings) | "bias" (attention_bias).
TABLE: List[Tuple[str, str, Optional[str], str]] = [
    ("model.embed_tokens.weight", "embed_tokens.weight", None, "all"),
    ("model.layers.{L}.input_layernorm.weight", "layers.{L}.input_layernorm.weight", None, "all"),
    ("model.layers.{L}.self_attn.q_proj.weight", "layers.{L}.self_attn.q_proj.weight", None,
     "all"),
    ("model.layers.{L}.self_attn.k_proj.weight", "layers.{L}.self_attn.k_proj.weight", None,
     "all"),
    ("model.layers.{L}.self_attn.v_proj.weight", "layers.{L}.self_attn.v_proj.weight", None,
     "all"),
    ("model.layers.{L}.self_attn.o_proj.weight", "layers.{L}.self_attn.o_proj.weight", None,
     "all"),
    ("model.layers.{L}.self_attn.q_proj.bias", "layers.{L}.self_attn.q_proj.bias", None, "bias"),
    ("model.layers.{L}.self_attn.k_proj.bias", "layers.{L}.self_attn.k_proj.bias", None, "bias"),
    ("model.layers.{L}.self_attn.v_proj.bias", "layers.{L}.self_attn.v_proj.bias", None, "bias"),
    ("model.layers.{L}.self_attn.o_proj.bias", "layers.{L}.self_attn.o_proj.bias", None, "bias"),
    ("model.layers.{L}.self_attn.q_norm.weight", "layers.{L}.self_attn.q_norm.weight", None,
     "all"),
    ("model.layers.{L}.self_attn.k_norm.weight", "layers.{L}.self_attn.k_norm.weight", None,
     "all"),
    ("model.layers.{L}.post_attention_layernorm.weight",
     "layers.{L}.post_attention_layernorm.weight", None, "all"),
    ("model.layers.{L}.mlp.gate.weight", "layers.{L}.mlp.gate", None, "sparse"),
    ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "layers.{L}.mlp.gate_up_proj", "gate",
     "sparse"),
    ("model.layers.{L}.mlp.experts.{E}.up_proj.weight", "layers.{L}.mlp.gate_up_proj", "up",
     "sparse"),
    ("model.layers.{L}.mlp.experts.{E}.down_proj.weight", "layers.{L}.mlp.down_proj", "expert",
     "sparse"),
    ("model.layers.{L}.mlp.gate_proj.weight", "layers.{L}.mlp.gate_proj.weight", None, "dense"),
    ("model.layers.{L}.mlp.up_proj.weight", "layers.{L}.mlp.up_proj.weight", None, "dense"),
    ("model.layers.{L}.mlp.down_proj.weight", "layers.{L}.mlp.down_proj.weight", None, "dense"),
    ("model.norm.weight", "norm.weight", None, "all"),
    ("lm_head.weight", "lm_head.weight", None, "untied"),
]
# transformers' fused expert tensors: the whole 3-D parameter under one name.
FUSED = {"model.layers.{L}.mlp.experts.gate_up_proj": "layers.{L}.mlp.gate_up_proj",
         "model.layers.{L}.mlp.experts.down_proj": "layers.{L}.mlp.down_proj"}
# Names some checkpoints carry that hold nothing tonp needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Slot:
    """One HF tensor <-> a region of one tonp parameter.

    hf: HF name; param: tonp parameter name; index: the region of the parameter it fills
    (`param[index]`, () = all of it); shape: the whole HF tensor's shape; read: the region of
    the HF tensor this rank reads (() = all of it: a TP slice or a fused tensor's expert range
    otherwise)."""
    hf: str
    param: str
    index: tuple
    shape: Tuple[int, ...]
    read: tuple = ()


def _applies(config, where: str, layer: Optional[int]) -> bool:
    if where == "sparse":
        return config.is_sparse_layer(layer)
    if where == "dense":
        return not config.is_sparse_layer(layer)
    return {"all": True, "untied": not config.tie_word_embeddings,
            "bias": config.attention_bias}[where]


def hub_slots(model, fused_layers=(), full: bool = False) -> List[Slot]:
    """Every HF tensor of `model`'s config in the hub layout (layers in `fused_layers` in the
    fused-expert layout). full=False: this rank's share (its pipeline stage's tensors, its TP
    slices, the experts it holds, regions of its local parameters); full=True: the unsharded,
    unpipelined model's (regions of the full parameters, e.g. after `gather_full_parameters`)."""
    if full and getattr(model, "pipelined", False):
        model = _whole(model)
    c, params = model.config, dict(model.named_parameters())
    shards = model.parameter_shards()
    layers = range(c.num_hidden_layers)
    slots = []
    for hf, ours, part, where in TABLE:
        for L in (layers if "{L}" in hf else [None]):
            if not _applies(c, where, L) or (part is not None and L in fused_layers):
                continue
            name = ours.format(L=L)
            if name not in params:  # another pipeline stage's
                continue
            shard = shards.get(name)
            shape = shard.full_shape(params[name].shape) if shard else tuple(params[name].shape)
            mine = None if full else shard
            if part is not None:
                slots += _expert_slots(hf, L, name, part, shape, mine)
                continue
            read = ()
            if mine is not None:
                read = tuple(slice(mine.start, mine.start + mine.length) if d == mine.dim
                             else slice(None) for d in range(len(shape)))
            slots.append(Slot(hf.format(L=L), name, (), shape, read))
    for L in fused_layers:
        for hf, ours in FUSED.items():
            name = ours.format(L=L)
            if name not in params:
                continue
            shard = None if full else shards.get(name)
            shape = (c.num_experts, *params[name].shape[1:])
            first, n = (shard.start, shard.length) if shard else (0, c.num_experts)
            slots.append(Slot(hf.format(L=L), name, (), shape, (slice(first, first + n),)))
    return slots


def _whole(model):
    """The one-process model of `model`'s config and dtype, on the meta device (names and
    full shapes of every stage's parameters)."""
    with torch.device("meta"):
        return type(model)(model.config, dtype=model.dtype)


def _expert_slots(hf, L, name, part, shape, shard) -> List[Slot]:
    """One slot per expert held: dim 0 of an expert parameter is the expert id."""
    if shard is not None and shard.dim != 0:
        raise ValueError(f"hub_slots: {name} is split on dim {shard.dim}; experts are split by "
                         f"expert id only (dim 0)")
    first, n = (shard.start, shard.length) if shard else (0, shape[0])
    half = shape[1] // 2
    rows = {"gate": slice(0, half), "up": slice(half, 2 * half), "expert": slice(None)}[part]
    per_expert = (half, shape[2]) if part != "expert" else tuple(shape[1:])
    return [Slot(hf.format(L=L, E=first + e), name, (e, rows), per_expert) for e in range(n)]


def hub_layout(model) -> Tuple[Dict[str, Tuple[int, ...]], Dict[str, Slot]]:
    """({HF name: full shape} of the whole model, {HF name: this rank's Slot} of the names it
    holds): what a pushed full (unsharded) tensor is checked against and sharded by."""
    return ({s.hf: s.shape for s in hub_slots(model, full=True)},
            {s.hf: s for s in hub_slots(model)})


def slot_region(s: Slot, full: torch.Tensor) -> torch.Tensor:
    """This rank's region of the full HF tensor `full` of slot s."""
    return full[s.read] if s.read else full


def slot_target(params: Dict[str, torch.Tensor], s: Slot) -> torch.Tensor:
    """The view of a tonp parameter slot s fills."""
    return params[s.param][s.index] if s.index else params[s.param]


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------
def _fused_layers(config, files: Dict[str, str]) -> List[int]:
    """Sparse layers stored in the fused layout; a layer with both layouts is refused."""
    fused = []
    for L in range(config.num_hidden_layers):
        if not config.is_sparse_layer(L):
            continue
        mine = [hf.format(L=L) for hf in FUSED if hf.format(L=L) in files]
        if not mine:
            continue
        prefix = f"model.layers.{L}.mlp.experts."
        split = sorted(k for k in files if k.startswith(prefix) and k not in mine)
        if split:
            raise ValueError(f"load_checkpoint: layer {L} has both fused ({mine[0]} in "
                             f"{files[mine[0]]}) and per-expert expert tensors ({split[0]} in "
                             f"{files[split[0]]}, {len(split)} in all); which is meant is "
                             f"ambiguous")
        fused.append(L)
    return fused


class CheckpointMismatch(ValueError):
    """A checkpoint refused by `check_checkpoint` (no weight changed). str(e) lists every
    tensor; `problems` is {kind: [lines]} (kinds: missing, unexpected, mis-shaped, wrong dtype)."""

    def __init__(self, message: str, problems: Dict[str, List[str]]):
        super().__init__(message)
        self.problems = problems


@dataclass
class LoadPlan:
    """What `copy_checkpoint` reads: every slot of this rank with the file that holds it."""
    path: str
    items: List[Tuple[Slot, str]]


def _problems_message(model, path: str, problems: Dict[str, List[str]]) -> str:
    c = model.config
    lines = [f"checkpoint {path} does not match the model ({c.num_hidden_layers} layers, "
             f"{c.num_experts} experts, {model.dtype}):"]
    for what, items in problems.items():
        if items:
            lines.append(f"  {what} ({len(items)}): " + ", ".join(items[:20]) +
                         (" ..." if len(items) > 20 else ""))
    return "\n".join(lines)


def check_checkpoint(model, path) -> LoadPlan:
    """Check an HF safetensors checkpoint dir against `model` without changing a weight: the
    files readable (headers), every tensor of this rank present once, none unexpected, every
    shape and dtype fit. Raises CheckpointMismatch (or ValueError / OSError for the files
    themselves); returns the plan `copy_checkpoint` reads."""
    path = os.fspath(path)
    files = weight_files(path)
    c = model.config
    fused = _fused_layers(c, files)
    slots = hub_slots(model, fused_layers=fused)
    expected = {s.hf for s in slots}
    # Under expert parallelism the other ranks' experts are in the files too: skip, not error.
    everyone = {s.hf for s in hub_slots(model, fused_layers=fused, full=True)}
    ignored = {k for k in files if k.endswith(_IGNORED_SUFFIXES)
               or (c.tie_word_embeddings and k == "lm_head.weight")} | everyone
    problems = {"missing": sorted(expected - set(files)),
                "unexpected": sorted(set(files) - expected - ignored),
                "mis-shaped": [], "wrong dtype": []}
    params = dict(model.named_parameters())
    items = []
    with TensorReader() as reader:
        for s in slots:
            if s.hf not in files:
                continue
            fn = files[s.hf]
            sl, dtype = reader.slice(fn, s.hf)
            shape = tuple(sl.get_shape())
            dst = slot_target(params, s)
            if shape != s.shape:
                problems["mis-shaped"].append(f"{s.hf}: checkpoint {list(shape)}, model "
                                              f"{list(s.shape)}")
            elif (why := reader.dtype_problem(fn, s.hf, dtype, dst.dtype)) is not None:
                problems["wrong dtype"].append(why)
            items.append((s, fn))
    if any(problems.values()):
        raise CheckpointMismatch(_problems_message(model, path, problems), problems)
    return LoadPlan(path, items)


@torch.no_grad()
def copy_checkpoint(model, plan: LoadPlan) -> None:
    """Copy a checked checkpoint into `model`. An error here (an I/O error, a file changed
    since the check, non-finite values: ValueError listing them) leaves the weights partly
    from the checkpoint: the caller must not use them."""
    params = dict(model.named_parameters())
    nonfinite = []
    with TensorReader() as reader:
        for s, fn in plan.items:
            sl, _ = reader.slice(fn, s.hf)
            if tuple(sl.get_shape()) != s.shape:
                raise ValueError(f"load_checkpoint: {fn} changed while it was loaded")
            dst = slot_target(params, s)
            dst.copy_(sl[s.read] if s.read else sl[:])
            if (why := nonfinite_problem(dst, s.hf, fn)) is not None:
                nonfinite.append(why)
    if nonfinite:
        raise ValueError(_problems_message(model, plan.path, {"non-finite": nonfinite}))


def load_checkpoint(model, path) -> None:
    """Fill `model`'s parameters (this rank's shards) from an HF safetensors checkpoint dir.

    Raises one ValueError listing every missing, unexpected, mis-shaped and wrongly typed
    tensor (with its file) before any weight changed (`check_checkpoint`); ambiguous
    directories are refused first; non-finite tensors are found while copying."""
    copy_checkpoint(model, check_checkpoint(model, path))


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def state_dict_hub(model) -> Dict[str, torch.Tensor]:
    """The model's weights under HF hub names (contiguous CPU tensors in the model's dtype).

    A sharded or pipelined model gathers its shards and stages first (collective over its TP,
    EP and PP groups: every rank must call it); the result is the whole model on every rank."""
    params = gather_full_parameters(model)
    out = {}
    for s in hub_slots(model, full=True):
        t = params[s.param][s.index] if s.index else params[s.param]
        out[s.hf] = t.detach().contiguous().clone()
    return out


@torch.no_grad()
def gather_full_parameters(model) -> Dict[str, torch.Tensor]:
    """{name: the full (unsharded) parameter} of every stage, from every rank's shard: an
    all_gather per sharded parameter over its TP or EP group, then (under PP) every stage's
    parameters over the PP group (bytes only: exact in every dtype). Collective."""
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
    if getattr(model, "pipelined", False):
        import torch.distributed as dist
        stages = [None] * model.groups.pp_size
        dist.all_gather_object(stages, {k: v.cpu() for k, v in out.items()},
                               group=model.groups.pp_group)
        out = {k: v for stage in stages for k, v in stage.items()}
    return out


@torch.no_grad()
def load_full_parameters(model, full: Dict[str, torch.Tensor]) -> None:
    """Copy this rank's part (its stage, its shards) of the full parameters `full` (as
    `gather_full_parameters` gives them, any layout's) into `model`. Exact: bytes only."""
    shards = model.parameter_shards()
    for name, p in model.named_parameters():
        if name not in full:
            raise ValueError(f"load_full_parameters: no full tensor for {name}")
        src = shards[name].take(full[name]) if name in shards else full[name]
        if src.shape != p.shape:
            raise ValueError(f"load_full_parameters: {name} is {tuple(src.shape)} in the source, "
                             f"{tuple(p.shape)} here")
        p.copy_(src)


def copy_parameters(src, dst) -> None:
    """The weights of model `src` into model `dst` of the same config on the same ranks, in
    any other TP / EP / PP / CP layout (e.g. a rollout model beside the trainer): every
    parameter is gathered whole on every rank, then each rank keeps its part. Collective
    over every rank of both layouts' groups; memory: the whole model once per rank."""
    if src.config != dst.config:
        raise ValueError("copy_parameters: the two models have different configs")
    load_full_parameters(dst, gather_full_parameters(src))


def save_checkpoint(model, path, max_shard_size: int = 5 * 2**30) -> None:
    """Make `path` hold exactly this model's config.json and hub-layout safetensors (sharded
    with an index above max_shard_size bytes), replacing any earlier checkpoint there at once.
    A sharded model: every rank calls it, the shards are gathered, global rank 0 writes, and
    an error on rank 0 is raised on every rank."""
    path = os.fspath(path)
    tensors = state_dict_hub(model)
    if not model.parameter_shards() and not getattr(model, "pipelined", False):
        write_directory(path, lambda tmp: _write(model, tmp, tensors, max_shard_size))
        return
    import torch.distributed as dist
    error, raised = [None], None
    if dist.get_rank() == 0:
        try:
            write_directory(path, lambda tmp: _write(model, tmp, tensors, max_shard_size))
        except Exception as e:  # noqa: BLE001 -- reported to every rank below
            error, raised = [f"{type(e).__name__}: {e}"], e
    dist.broadcast_object_list(error, src=0)  # nobody reads the checkpoint before it is written
    if raised is not None:
        raise raised
    if error[0] is not None:
        raise RuntimeError(f"save_checkpoint: global rank 0 failed to write {path}: {error[0]}")


def _write(model, path: str, tensors, max_shard_size: int) -> None:
    from safetensors.torch import save_file
    cfg = model.config.to_hf()
    cfg["dtype"] = cfg["torch_dtype"] = {torch.float32: "float32",
                                         torch.bfloat16: "bfloat16"}[model.dtype]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    files, index = split_shards(tensors, max_shard_size)
    for fn, shard in files.items():
        save_file(shard, os.path.join(path, fn), metadata={"format": "pt"})
    if index is not None:
        with open(os.path.join(path, INDEX), "w") as f:
            json.dump(index, f, indent=2)


__all__ = ["TABLE", "FUSED", "Slot", "hub_slots", "hub_layout", "slot_region", "slot_target",
           "load_checkpoint", "check_checkpoint",
           "copy_checkpoint", "CheckpointMismatch", "LoadPlan", "state_dict_hub",
           "gather_full_parameters", "load_full_parameters", "copy_parameters",
           "save_checkpoint"]
