"""Record a model's activations at every op boundary, keyed by (sequence, position, expert).

    with Capture(model, label="train") as cap:
        cap.begin_forward(seq_ids, positions)      # which (sequence, position) each packed row is
        model(ids, cu_seqlens)
    trace = cap.trace                              # Records in call order

Two public mechanisms, both undone on exit: torch forward hooks on the model's modules (module
outputs, and the innermost running module that names a probe), and the layers' probe seam
(`tonp_models.layers.probe`, with detail on). docs/diagnose.md lists every recorded op.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ..layers import probe as seam

# Record kinds: the probe seam's kinds, plus "expert" (rows are (token, expert) pairs).
KINDS = ("op", "route", "partial", "collective", "dispatch", "expert")
NO_EXPERT = -1


@dataclass
class Record:
    """One captured tensor. keys int64 [R, 3] = (sequence, position, expert or -1) per row;
    value [R, ...] a detached copy; shard_dim: the dim of `value` split over TP ranks (None =
    replicated; 0 = rows split over the ranks); rank: the global rank that captured it;
    recv_rows: EP expert rows only, int64 [R], the index of each row among the rows this rank
    received in that forward (keys[:, :2] are then unknown until layout.merge_ranks)."""
    layer: Optional[int]
    op: str
    keys: torch.Tensor
    value: torch.Tensor
    kind: str = "op"
    shard_dim: Optional[int] = None
    rank: int = 0
    recv_rows: Optional[torch.Tensor] = None


@dataclass
class Trace:
    """The records of one path, in call order, plus a label and free-form metadata."""
    label: str
    records: List[Record] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def op_order(self) -> List[Tuple[Optional[int], str]]:
        """(layer, op) in order of first appearance: the forward order."""
        seen: Dict[Tuple[Optional[int], str], None] = {}
        for r in self.records:
            seen.setdefault((r.layer, r.op), None)
        return list(seen)

    def gather(self, layer: Optional[int], op: str
               ) -> Optional[Tuple[torch.Tensor, torch.Tensor, str]]:
        """(keys [R, 3], values [R, ...], kind) of every record of (layer, op), concatenated."""
        if getattr(self, "_index_size", None) != len(self.records):
            self._index: Dict[Tuple[Optional[int], str], List[Record]] = {}
            for r in self.records:
                self._index.setdefault((r.layer, r.op), []).append(r)
            self._index_size = len(self.records)
        recs = self._index.get((layer, op), [])
        if not recs:
            return None
        shapes = {tuple(r.value.shape[1:]) for r in recs}
        dtypes = {r.value.dtype for r in recs}
        if len(shapes) > 1 or len(dtypes) > 1:
            raise ValueError(f"{self.label}: records of layer {layer} op {op!r} disagree in "
                             f"shape/dtype: {shapes} {dtypes}")
        return (torch.cat([r.keys for r in recs]), torch.cat([r.value for r in recs]),
                recs[0].kind)


def _layer_of(name: str) -> Optional[int]:
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1])
    return None


class Capture:
    """Context manager recording `model`'s activations (see the module doc).

    Args:
        model: a Qwen3MoeForCausalLM (any module tree with the same names works).
        label: a name for the trace (e.g. "train/invariant").
        rank: the global rank stamped on the records (for merging layouts on rank 0).
        detail: ask the layers for their step-by-step paths (the MoE experts' gate_up / act /
            down per (token, expert) row, beside the fused op's output).
    Before each forward call `begin_forward(seq_ids, positions)` (int [T] each) names the rows.
    Only forwards run by the thread that entered the Capture are recorded.
    """

    def __init__(self, model: nn.Module, label: str = "", rank: int = 0, detail: bool = True):
        self.model, self.rank, self.detail = model, rank, detail
        self.trace = Trace(label)
        self._keys: Optional[torch.Tensor] = None
        self._stack: List[Tuple[str, nn.Module]] = []
        self._handles: list = []
        self._thread: Optional[int] = None

    # -- rows ----------------------------------------------------------------------------------
    def begin_forward(self, seq_ids, positions) -> None:
        """Name the packed rows of the next forward: row i is token positions[i] of seq_ids[i]."""
        s = torch.as_tensor(seq_ids, dtype=torch.int64).reshape(-1)
        p = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
        if s.shape != p.shape:
            raise ValueError(f"begin_forward: {s.numel()} sequence ids vs {p.numel()} positions")
        self._keys = torch.stack([s, p, torch.full_like(s, NO_EXPERT)], 1)
        self._stack.clear()

    def row_keys(self) -> torch.Tensor:
        """int64 [T, 3]: the keys of the current forward's rows (see begin_forward)."""
        if self._keys is None:
            raise RuntimeError("Capture: call begin_forward(seq_ids, positions) before the "
                               "forward so rows can be matched to tokens")
        return self._keys

    def record(self, op: str, value: torch.Tensor, *, keys: Optional[torch.Tensor] = None,
               layer="auto", kind: str = "op", shard_dim: Optional[int] = None,
               module: Optional[str] = None, recv_rows: Optional[torch.Tensor] = None) -> None:
        """Store a copy of `value` [R, ...]; keys default to the current forward's rows, layer
        ("auto") to the innermost running module's layer (None = outside the layers), module
        (the name of the module whose weights the op uses) to the innermost running module."""
        if kind not in KINDS:
            raise ValueError(f"Capture.record: kind must be one of {KINDS}, got {kind!r}")
        if keys is None:
            keys = self.row_keys()
        if value.shape[0] != keys.shape[0]:
            raise ValueError(f"Capture: {op!r} has {value.shape[0]} rows but the forward has "
                             f"{keys.shape[0]} named rows (logits_rows is not supported here)")
        if module is None:
            module = self._current()[0]
        if layer == "auto":
            layer = _layer_of(module)
        self.trace.meta.setdefault("modules", {}).setdefault((layer, op), module)
        self.trace.records.append(Record(layer, op, keys.clone(), value.detach().clone(), kind,
                                         shard_dim, self.rank,
                                         None if recv_rows is None else recv_rows.clone()))

    def _current(self) -> Tuple[str, Optional[nn.Module]]:
        return self._stack[-1] if self._stack else ("", None)

    # -- the probe seam ------------------------------------------------------------------------
    def _on_probe(self, op: str, value: torch.Tensor, *, kind: str = "op",
                  shard_dim: Optional[int] = None, rows: Optional[torch.Tensor] = None,
                  experts: Optional[torch.Tensor] = None, received: bool = False) -> None:
        """A layer's probe (meta as in layers/probe.py), named "<probing module>.<op>"."""
        name = self._current()[0]
        leaf = name.rsplit(".", 1)[-1]
        op = f"{leaf}.{op}" if leaf and not leaf.isdigit() else op
        recv_rows = None
        if received:  # rows of other ranks' tokens: named on merge (layout.merge_ranks)
            if rows is None:
                raise ValueError(f"probe {op!r}: received=True needs rows=")
            recv_rows = rows.long()
            keys = torch.full((rows.numel(), 3), NO_EXPERT, dtype=torch.int64)
        elif rows is not None:
            keys = self.row_keys().index_select(0, rows.long())
        else:
            keys = self.row_keys().clone()
        if experts is not None:
            keys[:, 2] = experts
            kind = "expert" if kind == "op" else kind
        self.record(op, value, keys=keys, kind=kind, shard_dim=shard_dim, recv_rows=recv_rows)

    # -- install / remove -------------------------------------------------------------------------
    def __enter__(self) -> "Capture":
        self._thread = threading.get_ident()
        for name, mod in self.model.named_modules():
            self._handles.append(mod.register_forward_pre_hook(self._push(name, mod)))
            self._handles.append(mod.register_forward_hook(
                self._on_output(_module_op(name), name, mod)))
            if name.endswith("post_attention_layernorm"):
                self._handles.append(mod.register_forward_pre_hook(self._on_residual))
        seam.push_hook(self._on_probe, detail=self.detail)
        return self

    def __exit__(self, *exc) -> bool:
        seam.pop_hook(self._on_probe)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    # -- module hooks --------------------------------------------------------------------------
    def _mine(self) -> bool:
        return threading.get_ident() == self._thread

    def _push(self, name, mod):
        def hook(module, args):
            if self._mine():
                self._stack.append((name, mod))
        return hook

    def _on_output(self, op, name, mod):
        layer = _layer_of(name)

        def hook(module, args, out):
            if not self._mine():
                return
            if self._stack and self._stack[-1][1] is mod:
                self._stack.pop()
            if op is None:
                return
            if op == "rope":  # the shared rotary module: attributed to the calling layer
                shard = 1 if _attn_tp(self._current()[1]) > 1 else None
                self.record("positions", args[2])
                self.record("q_rope", out[0], shard_dim=shard)
                self.record("k_rope", out[1], shard_dim=shard)
            else:
                shard = _shard_dim(op, mod, self._current()[1])
                self.record(op, out, layer=layer, shard_dim=shard, module=name)
        return hook

    def _on_residual(self, module, args):
        if self._mine():
            self.record("residual", args[0])


def _module_op(name: str) -> Optional[str]:
    """The op a module's output is recorded as (None: not recorded, e.g. containers)."""
    leaf = name.rsplit(".", 1)[-1]
    if name == "embed_tokens":
        return "embed"
    if name == "norm":
        return "final_norm"
    if name == "lm_head":
        return "logits"
    if name == "rotary":
        return "rope"
    layer = _layer_of(name)
    if layer is None:
        return None
    if name == f"layers.{layer}":
        return "layer_out"
    if leaf in ("input_layernorm", "post_attention_layernorm", "q_proj", "k_proj", "v_proj",
                "o_proj", "q_norm", "k_norm", "gate_proj", "up_proj", "down_proj"):
        return leaf
    return None


def _attn_tp(mod: Optional[nn.Module]) -> int:
    q = getattr(mod, "q_proj", None)
    return getattr(q, "tp_size", 1)


def _shard_dim(op: str, mod: nn.Module, parent: Optional[nn.Module]) -> Optional[int]:
    """Column-parallel outputs are split on the last dim, per-head q/k norms on the head dim."""
    if op in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        return -1 if getattr(mod, "tp_size", 1) > 1 else None
    if op in ("q_norm", "k_norm"):
        return 1 if _attn_tp(parent) > 1 else None
    return None


__all__ = ["Capture", "Record", "Trace", "KINDS", "NO_EXPERT"]
