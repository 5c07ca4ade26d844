"""Capture a model's activations at every op boundary, without touching the model's code.

    with Capture(model, label="train") as cap:
        cap.begin_forward(seq_ids, positions)      # which (sequence, position) each packed row is
        model(ids, cu_seqlens)
    trace = cap.trace                              # Records in call order

Two mechanisms, both undone on exit:
* forward hooks on modules give the boundaries between modules: embedding, each layer's norms,
  q/k/v/o projections, q/k norms, RoPE (the shared rotary module, attributed to the calling
  layer), the residual (input of post_attention_layernorm), dense-MLP projections, the layer
  output, the final norm and the logits;
* the `tk` name each tonp_models module imported (`import tonp_kernels as tk`) is swapped for a
  proxy that records the points inside modules: the K/V rows attention reads (from the packed
  batch or from the cache pages), the attention output before o_proj, router logits, chosen
  expert ids and weights, each expert's gate_up / activation / down output (one row per
  (token, expert)), the combine, TP partials; `tonp_parallel.reduce_from_region` is wrapped
  the same way (a collective).

Under expert parallelism a rank's experts receive rows of other ranks' tokens, so which token a
row is cannot be known locally. The MoE layer probes its dispatch (kind "dispatch": the forward
row and expert of every (token, slot) row it sends, in send order); the expert records carry the
received row index instead of a key (`Record.recv_rows`), and `layout.merge_ranks` resolves them
from the senders' dispatch records (rows arrive by source rank, each in its sender's order).

Every record's rows carry keys (sequence, position, expert or -1), so two paths that computed
a token in different calls (a whole-sequence pass vs prefill + decode steps whose rows are
other tokens) can be aligned row by row. Code that is not a tonp_models layer can report its
own points with `probe(op, tensor, kind=...)` (a no-op when nothing is captured).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

import tonp_kernels as tk

from ..layers import probe as layer_probe

# Record kinds: "op" (a row-wise result), "route" (expert ids), "partial" (a TP rank's fp32
# share of a reduction, [R, ...] per rank), "collective" (the result of a reduce over ranks),
# "dispatch" (EP: the rows an MoE layer sends, value = their expert ids; keys[:, 2] too).
KINDS = ("op", "route", "partial", "collective", "dispatch")
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


_ACTIVE: List["Capture"] = []


def probe(op: str, value: torch.Tensor, *, kind: str = "op", shard_dim: Optional[int] = None,
          rows: Optional[torch.Tensor] = None) -> None:
    """Record `value` (rows = the current forward's tokens, or with `rows` (int64 [R]) row i is
    the forward's row rows[i]) under the innermost running module's name (e.g.
    "o_proj.partial"), when a Capture is active; otherwise do nothing."""
    if _ACTIVE:
        cap = _ACTIVE[-1]
        name, _ = cap._current()
        leaf = name.rsplit(".", 1)[-1] if name else ""
        keys = None
        if rows is not None:
            keys = cap._row_keys().index_select(0, rows.long())
            if kind == "dispatch":
                keys[:, 2] = value
                cap._share = torch.unique(rows)  # the tokens this rank combines (TP x EP)
        cap.record(f"{leaf}.{op}" if leaf and not leaf.isdigit() else op, value, kind=kind,
                   shard_dim=shard_dim, keys=keys)


def _layer_of(name: str) -> Optional[int]:
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1])
    return None


class _KernelProxy:
    """Stands in for `tonp_kernels` inside one model module: wrapped ops record, the rest pass."""

    def __init__(self, wrappers):
        self._wrappers = wrappers

    def __getattr__(self, name):
        return self._wrappers.get(name) or getattr(tk, name)


class Capture:
    """Context manager recording `model`'s activations (see the module doc).

    Args:
        model: a Qwen3MoeForCausalLM (any module tree with the same names works).
        label: a name for the trace (e.g. "train/invariant").
        rank: the TP rank stamped on the records (for merging layouts on rank 0).
    Before each forward call `begin_forward(seq_ids, positions)` (int [T] each) names the rows.
    """

    def __init__(self, model: nn.Module, label: str = "", rank: int = 0):
        self.model, self.rank = model, rank
        self.trace = Trace(label)
        self._keys: Optional[torch.Tensor] = None
        self._stack: List[Tuple[str, nn.Module]] = []
        self._handles: list = []
        self._patched: list = []
        self._moe: Optional[dict] = None
        self._share: Optional[torch.Tensor] = None

    # -- rows ----------------------------------------------------------------------------------
    def begin_forward(self, seq_ids, positions) -> None:
        """Name the packed rows of the next forward: row i is token positions[i] of seq_ids[i]."""
        s = torch.as_tensor(seq_ids, dtype=torch.int64).reshape(-1)
        p = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
        if s.shape != p.shape:
            raise ValueError(f"begin_forward: {s.numel()} sequence ids vs {p.numel()} positions")
        self._keys = torch.stack([s, p, torch.full_like(s, NO_EXPERT)], 1)
        self._stack.clear()
        self._share = None

    def _row_keys(self) -> torch.Tensor:
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
            keys = self._row_keys()
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

    # -- install / remove -------------------------------------------------------------------------
    def __enter__(self) -> "Capture":
        self._install_hooks()
        self._install_proxies()
        _ACTIVE.append(self)
        layer_probe.push_hook(probe)
        return self

    def __exit__(self, *exc) -> bool:
        layer_probe.pop_hook(probe)
        _ACTIVE.remove(self)
        for h in self._handles:
            h.remove()
        for obj, name, old in reversed(self._patched):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._handles.clear()
        self._patched.clear()
        return False

    def _patch(self, obj, name, new) -> None:
        self._patched.append((obj, name, obj.__dict__.get(name, _MISSING)
                              if isinstance(obj, nn.Module) else getattr(obj, name, _MISSING)))
        setattr(obj, name, new)

    def _install_hooks(self) -> None:
        for name, mod in self.model.named_modules():
            self._handles.append(mod.register_forward_pre_hook(self._push(name, mod)))
            self._handles.append(mod.register_forward_hook(
                self._on_output(_module_op(name), name, mod)))
            if name.endswith("post_attention_layernorm"):
                self._handles.append(mod.register_forward_pre_hook(self._on_residual))
            if hasattr(mod, "_run_local_experts"):
                # One call per expert, so gate_up / act / down are seen per (token, expert) row;
                # the fused op gives the same bits (tests/test_kernels_misc.py).
                self._patch(mod, "fused_experts", False)
                self._patch(mod, "_run_local_experts", self._experts_wrapper(mod))

    def _install_proxies(self) -> None:
        proxy = _KernelProxy(self._kernel_wrappers())
        for mname, module in list(sys.modules.items()):
            if mname.startswith("tonp_models.") and getattr(module, "tk", None) is tk \
                    and not mname.startswith("tonp_models.diagnose"):
                self._patch(module, "tk", proxy)
        par = sys.modules.get("tonp_parallel")
        if par is not None and hasattr(par, "reduce_from_region"):
            self._patch(par, "reduce_from_region", self._reduce_wrapper(par.reduce_from_region))

    # -- module hooks --------------------------------------------------------------------------
    def _push(self, name, mod):
        def hook(module, args):
            self._stack.append((name, mod))
        return hook

    def _on_output(self, op, name, mod):
        layer = _layer_of(name)

        def hook(module, args, out):
            if self._stack and self._stack[-1][1] is mod:
                self._stack.pop()
            if op is None:
                return
            parent_name, parent = self._current()
            if op == "rope":  # the shared rotary module: attributed to the calling layer
                shard = 1 if _attn_tp(parent) > 1 else None
                self.record("positions", args[2])
                self.record("q_rope", out[0], shard_dim=shard)
                self.record("k_rope", out[1], shard_dim=shard)
            else:
                self.record(op, out, layer=layer, shard_dim=_shard_dim(op, mod, parent),
                            module=name)
        return hook

    def _on_residual(self, module, args):
        self.record("residual", args[0])

    # -- kernel wrappers -----------------------------------------------------------------------
    def _kernel_wrappers(self) -> dict:
        cap = self

        def linear(x, weight, bias=None, **kw):
            y = tk.linear(x, weight, bias, **kw)
            _, mod = cap._current()
            if mod is not None and hasattr(mod, "_run_local_experts"):
                cap._on_moe_linear(mod, weight, y)
            return y

        def linear_partial(x, weight, **kw):
            y = tk.linear_partial(x, weight, **kw)
            probe("partial", y, kind="partial")
            return y

        def silu_mul(gate, up):
            y = tk.silu_mul(gate, up)
            _, mod = cap._current()
            if cap._moe is not None and mod is not None and hasattr(mod, "_run_local_experts"):
                cap._record_expert("expert.act", y)
            elif mod is not None:
                tp = getattr(getattr(mod, "gate_proj", None), "tp_size", 1)
                cap.record("mlp.act", y, shard_dim=-1 if tp > 1 else None)
            return y

        def attention_varlen(q, k, v, cu_seqlens, **kw):
            shard = 1 if _attn_tp(cap._current()[1]) > 1 else None
            cap.record("attn.k", k, shard_dim=shard)
            cap.record("attn.v", v, shard_dim=shard)
            o = tk.attention_varlen(q, k, v, cu_seqlens, **kw)
            cap.record("attention", o, shard_dim=shard)
            return o

        def attention_paged(q, k_cache, v_cache, page_table, q_seq, q_pos, **kw):
            # The K/V rows of these tokens as the kernel reads them from the pages.
            B = k_cache.shape[1]
            qp = q_pos.long()
            rows = page_table.long()[q_seq.long(), qp // B] * B + qp % B
            shard = 1 if _attn_tp(cap._current()[1]) > 1 else None
            cap.record("attn.k", k_cache.flatten(0, 1).index_select(0, rows), shard_dim=shard)
            cap.record("attn.v", v_cache.flatten(0, 1).index_select(0, rows), shard_dim=shard)
            o = tk.attention_paged(q, k_cache, v_cache, page_table, q_seq, q_pos, **kw)
            cap.record("attention", o, shard_dim=shard)
            return o

        def moe_route(router_logits, top_k, normalize):
            ids, w = tk.moe_route(router_logits, top_k, normalize)
            cap.record("route.ids", ids, kind="route")
            cap.record("route.weights", w)
            return ids, w

        def moe_combine(weights, expert_out):
            y = tk.moe_combine(weights, expert_out)
            _, mod = cap._current()
            if getattr(mod, "token_parts", 1) > 1 and cap._share is not None:
                # TP x EP: each TP rank combines its share of the tokens (rows split over ranks).
                cap.record("combine", y, keys=cap._row_keys().index_select(0, cap._share),
                           shard_dim=0)
            else:
                cap.record("combine", y)
            return y

        return dict(linear=linear, linear_partial=linear_partial, silu_mul=silu_mul,
                    attention_varlen=attention_varlen, attention_paged=attention_paged,
                    moe_route=moe_route, moe_combine=moe_combine)

    def _reduce_wrapper(self, reduce_from_region):
        def wrapped(partial, group, *a, **kw):
            y = reduce_from_region(partial, group, *a, **kw)
            probe("reduce", y, kind="collective")
            return y
        return wrapped

    # -- MoE experts: rows are (token, expert) pairs -------------------------------------------
    def _experts_wrapper(self, mod):
        original = type(mod)._run_local_experts.__get__(mod)

        def run(*args, **kw):
            if len(args) != 3 or kw:
                self.trace.meta["expert_rows"] = "not captured (unknown expert call)"
                return original(*args, **kw)
            x, token_of_row, counts = args
            starts, s = {}, 0
            for e in range(mod.local_experts):
                starts[mod.first_expert + e] = s
                s += counts[mod.first_expert + e]
            # Under EP, x holds the received rows: token_of_row indexes them, and the keys are
            # resolved on merge from the senders' dispatch records.
            ep = getattr(mod, "ep_size", 1) > 1
            if ep:
                self.trace.meta["experts_per_rank"] = mod.local_experts
            self._moe = dict(token_of_row=token_of_row, counts=counts, starts=starts, expert=None,
                             ep=ep)
            try:
                return original(x, token_of_row, counts)
            finally:
                self._moe = None
        return run

    def _on_moe_linear(self, mod, weight, y) -> None:
        if weight is mod.gate:
            self.record("router_logits", y)
            return
        if self._moe is None:
            return
        ptr = weight.data_ptr()
        for e in range(mod.local_experts):
            if ptr == mod.gate_up_proj[e].data_ptr():
                self._moe["expert"] = mod.first_expert + e
                self._record_expert("expert.gate_up", y)
                return
            if ptr == mod.down_proj[e].data_ptr():
                self._moe["expert"] = mod.first_expert + e
                self._record_expert("expert.down", y)
                return

    def _record_expert(self, op, y) -> None:
        m = self._moe
        e = m["expert"]
        start, n = m["starts"][e], m["counts"][e]
        rows = m["token_of_row"][start:start + n]
        if m["ep"]:
            keys = torch.full((n, 3), NO_EXPERT, dtype=torch.int64)
            keys[:, 2] = e
            self.record(op, y, keys=keys, recv_rows=rows)
            return
        keys = self._keys.index_select(0, rows).clone()
        keys[:, 2] = e
        self.record(op, y, keys=keys)


_MISSING = object()


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


__all__ = ["Capture", "Record", "Trace", "probe", "KINDS", "NO_EXPERT"]
