"""Align two traces token by token and find the first op (in forward order) whose outputs differ.

Rows are matched by their keys (sequence, position, expert). A differing row whose inputs were
equal (`DEPS`, the model's dataflow) is an origin, classified as routing, collective order,
precision cast, weights differ or operator arithmetic; the rest are "input already differed".
docs/diagnose.md explains each class.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .capture import Trace

OPERATOR = "operator arithmetic"
ROUTING = "routing decision flipped"
COLLECTIVE = "collective order"
PRECISION = "precision cast"
PROPAGATED = "input already differed"
WEIGHTS = "weights differ"
CLASSES = (OPERATOR, ROUTING, COLLECTIVE, PRECISION, WEIGHTS, PROPAGATED)
MAX_POSITIONS = 64  # differing rows listed per op


@dataclass
class OpDiff:
    """How one op compares. positions: up to MAX_POSITIONS differing rows as
    [sequence, position, expert (-1 = a token row)]; max_abs_diff over differing elements."""
    layer: Optional[int]
    op: str
    kind: str
    rows_compared: int
    rows_differing: int
    max_abs_diff: float
    positions: List[List[int]]
    dtype_a: str
    dtype_b: str
    classification: Optional[str] = None     # None when rows_differing == 0
    detail: str = ""
    only_a: int = 0                          # rows (keys) present on one side only
    only_b: int = 0

    @property
    def where(self) -> str:
        return f"{'layer ' + str(self.layer) if self.layer is not None else 'model'} {self.op}"


@dataclass
class Diagnosis:
    """The comparison of two traces. first: the first differing op (None = no divergence);
    origins: every op with untainted differing rows (first included); ops: every compared op;
    one_sided: ops captured on one path only; logdiff: max |logprob diff| (None if absent)."""
    label_a: str
    label_b: str
    ops: List[OpDiff] = field(default_factory=list)
    first: Optional[OpDiff] = None
    origins: List[OpDiff] = field(default_factory=list)
    one_sided: Dict[str, List[str]] = field(default_factory=dict)
    logdiff: Optional[float] = None
    logprob_tokens_differing: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return self.first is not None


def _codes(keys: torch.Tensor) -> torch.Tensor:
    s, p, e = keys[:, 0], keys[:, 1], keys[:, 2] + 1
    if keys.numel() and (int(s.max()) >= 1 << 21 or int(p.max()) >= 1 << 22 or
                         int(e.max()) >= 1 << 20 or int(keys.min()) < -1):
        raise ValueError("diagnose: sequence/position/expert ids out of the supported range")
    return (s << 42) | (p << 20) | e


def _index(codes: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique codes and the row of each (the last occurrence wins)."""
    order = torch.argsort(codes, stable=True)
    sc = codes[order]
    last = torch.ones_like(sc, dtype=torch.bool)
    last[:-1] = sc[1:] != sc[:-1]
    return sc[last], order[last]


def align(keys_a: torch.Tensor, keys_b: torch.Tensor):
    """Rows of A and B with the same key -> (rows_a, rows_b, only_a, only_b)."""
    sa, ia = _index(_codes(keys_a))
    sb, ib = _index(_codes(keys_b))
    if sb.numel() == 0 or sa.numel() == 0:
        e = torch.zeros(0, dtype=torch.long)
        return e, e, int(sa.numel()), int(sb.numel())
    pos = torch.searchsorted(sb, sa).clamp(max=sb.numel() - 1)
    match = sb[pos] == sa
    n = int(match.sum())
    return ia[match], ib[pos[match]], int(sa.numel()) - n, int(sb.numel()) - n


def differing_rows(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(bool [R] rows not bitwise equal, float64 [R] max |a - b| per row). NaN == NaN here."""
    R = a.shape[0]
    if a.is_floating_point() or b.is_floating_point():
        x, y = a.reshape(R, -1).double(), b.reshape(R, -1).double()
        same = (x == y) | (x.isnan() & y.isnan())
        if a.dtype != b.dtype:
            same = torch.zeros_like(same)  # a different dtype is a different result
        diff = (x - y).abs().nan_to_num(nan=float("inf"))
    else:
        x, y = a.reshape(R, -1), b.reshape(R, -1)
        same = x == y
        diff = (x - y).abs().double()
    bad = ~same.all(1)
    return bad, (diff.amax(1) if diff.shape[1] else torch.zeros(R, dtype=torch.float64))


def _merge_order(oa, ob):
    out = list(oa)
    have = set(out)
    prev = None
    for k in ob:
        if k not in have:
            out.insert(out.index(prev) + 1 if prev is not None else 0, k)
            have.add(k)
        prev = k
    return out


def _rounded_to(x: torch.Tensor, low: torch.dtype) -> bool:
    return bool(torch.equal(x.to(low).to(x.dtype), x))


def _precision_detail(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """A description when a and b differ only by a rounding to a lower precision, else None."""
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} on path A vs {b.dtype} on path B"
    if a.dtype != torch.float32:
        return None
    for low in (torch.bfloat16, torch.float16):
        if torch.equal(a.to(low), b.to(low)):
            for side, x in (("A", a), ("B", b)):
                if _rounded_to(x, low):
                    return (f"values agree after rounding to {low}; path {side} holds "
                            f"{low}-rounded values")
    return None


def _classify(kind: str, a: torch.Tensor, b: torch.Tensor) -> Tuple[str, str]:
    """Classification of untainted differing rows a, b (inputs were equal)."""
    prec = _precision_detail(a, b)
    if kind == "route":
        return ROUTING, "router logits equal, chosen experts differ (a tie or a top-k order)"
    if prec is not None:
        return PRECISION, prec
    if kind == "collective":
        return COLLECTIVE, "every rank's local partial was equal; the reduced result differs"
    return OPERATOR, "the op's inputs were bitwise equal on both paths; its output differs"


# The model's dataflow: op -> its inputs as (op, layer offset, causal). "prev" is the previous
# layer's output (the embedding for layer 0); causal inputs reach a token from every earlier
# position of its sequence (attention), the rest from the same token only. Ops not listed (e.g.
# probes) are checked conservatively against every earlier op.
_PREV = ("prev", 0, False)
_NORM2 = ("post_attention_layernorm", 0, False)
DEPS = {
    "embed": [], "input_layernorm": [_PREV],
    "q_proj": [("input_layernorm", 0, False)], "k_proj": [("input_layernorm", 0, False)],
    "v_proj": [("input_layernorm", 0, False)],
    "q_norm": [("q_proj", 0, False)], "k_norm": [("k_proj", 0, False)], "positions": [],
    "q_rope": [("q_norm", 0, False), ("positions", 0, False)],
    "k_rope": [("k_norm", 0, False), ("positions", 0, False)],
    "self_attn.k": [("k_rope", 0, False)], "self_attn.v": [("v_proj", 0, False)],
    "self_attn.attention": [("q_rope", 0, False), ("self_attn.k", 0, True),
                            ("self_attn.v", 0, True)],
    "o_proj.partial": [("self_attn.attention", 0, False)],
    "o_proj.reduce": [("o_proj.partial", 0, False)],
    "o_proj": [("self_attn.attention", 0, False), ("o_proj.reduce", 0, False)],
    "residual": [_PREV, ("o_proj", 0, False)],
    "post_attention_layernorm": [("residual", 0, False)],
    "mlp.router_logits": [_NORM2],
    "mlp.route.ids": [("mlp.router_logits", 0, False)],
    "mlp.route.weights": [("mlp.router_logits", 0, False)],
    "mlp.expert.gate_up": [_NORM2, ("mlp.route.ids", 0, False)],
    "mlp.expert.act": [("mlp.expert.gate_up", 0, False)],
    "mlp.expert.down": [("mlp.expert.act", 0, False)],
    "mlp.experts": [_NORM2, ("mlp.route.ids", 0, False)],   # the fused op: not the path above
    "mlp.combine": [("mlp.route.ids", 0, False), ("mlp.route.weights", 0, False),
                    ("mlp.experts", 0, False)],
    "gate_proj": [_NORM2], "up_proj": [_NORM2],
    "mlp.act": [("gate_proj", 0, False), ("up_proj", 0, False)],
    "down_proj.partial": [("mlp.act", 0, False)],
    "down_proj.reduce": [("down_proj.partial", 0, False)],
    "down_proj": [("mlp.act", 0, False), ("down_proj.reduce", 0, False)],
    "layer_out": [("residual", 0, False), ("mlp.combine", 0, False), ("down_proj", 0, False)],
    "final_norm": [_PREV], "logits": [("final_norm", 0, False)],
    "logprobs": [("logits", 0, False)],
}


class _Taint:
    """Which tokens each op's output differed for, to tell origins from propagation."""

    def __init__(self):
        self.rows: Dict[tuple, set] = {}       # (layer, op) -> {(seq, pos)}
        self.first: Dict[tuple, Dict[int, int]] = {}  # (layer, op) -> seq -> first position
        self.last_layer_out: Optional[tuple] = None

    def add(self, key, seq_pos) -> None:
        rows = self.rows.setdefault(key, set())
        first = self.first.setdefault(key, {})
        for s, p in seq_pos:
            rows.add((s, p))
            first[s] = min(first.get(s, p), p)

    def inputs_differed(self, layer, op, s, p) -> bool:
        deps = DEPS.get(op)
        if deps is None:  # unknown op: any earlier difference at or before this position
            return any(f.get(s, 1 << 62) <= p for f in self.first.values())
        for name, _, causal in deps:
            key = self.prev(layer) if name == "prev" else (layer, name)
            if key is None:
                continue
            if causal and self.first.get(key, {}).get(s, 1 << 62) <= p:
                return True
            if not causal and (s, p) in self.rows.get(key, ()):
                return True
        return False

    def prev(self, layer):
        if layer is None or layer == 0:
            return self.last_layer_out if layer is None else (None, "embed")
        return (layer - 1, "layer_out")


def differing_parameters(model_a, model_b) -> List[str]:
    """Names of the parameters (and buffers) whose shape, dtype or bits differ between models."""
    if model_a is model_b:
        return []
    pa = dict(model_a.named_parameters())
    pa.update(model_a.named_buffers())
    pb = dict(model_b.named_parameters())
    pb.update(model_b.named_buffers())
    return sorted(n for n in set(pa) | set(pb)
                  if n not in pa or n not in pb or pa[n].shape != pb[n].shape or
                  pa[n].dtype != pb[n].dtype or not torch.equal(pa[n], pb[n]))


def compare_traces(a: Trace, b: Trace, changed_params: Sequence[str] = ()) -> Diagnosis:
    """Compare trace A with trace B op by op (see the module doc) -> Diagnosis.

    changed_params: parameter names that differ between the two paths' models (see
    `differing_parameters`), to tell "weights differ" from "operator arithmetic"."""
    diag = Diagnosis(a.label, b.label)
    diag.meta = {side: {k: v for k, v in t.meta.items() if k != "modules"}
                 for side, t in (("a", a), ("b", b))}
    modules = {**b.meta.get("modules", {}), **a.meta.get("modules", {})}
    order_a, order_b = a.op_order(), b.op_order()
    sa, sb = set(order_a), set(order_b)
    diag.one_sided = {"a": [_name(k) for k in order_a if k not in sb],
                      "b": [_name(k) for k in order_b if k not in sa]}
    taint = _Taint()
    for layer, op in _merge_order(order_a, order_b):
        if op == "layer_out" and (layer, op) in sa | sb:
            taint.last_layer_out = (layer, op)
        if (layer, op) not in sa or (layer, op) not in sb:
            continue
        ka, va, kind = a.gather(layer, op)
        kb, vb, _ = b.gather(layer, op)
        ra, rb, only_a, only_b = align(ka, kb)
        xa, xb = va.index_select(0, ra), vb.index_select(0, rb)
        keys = ka.index_select(0, ra)
        res = OpDiff(layer, op, kind, int(ra.numel()), 0, 0.0, [], str(va.dtype)[6:],
                     str(vb.dtype)[6:], only_a=only_a, only_b=only_b)
        diag.ops.append(res)
        if xa.shape[1:] != xb.shape[1:]:
            res.rows_differing, res.classification = res.rows_compared, OPERATOR
            res.detail = (f"shapes differ: {tuple(xa.shape[1:])} vs {tuple(xb.shape[1:])} (a TP "
                          f"shard not gathered?)")
            res.positions = keys[:MAX_POSITIONS].tolist()
            diag.origins.append(res)
            diag.first = diag.first or res
            taint.add((layer, op), keys[:, :2].tolist())
            continue
        bad, row_diff = differing_rows(xa, xb)
        if op == "logprobs" and layer is None:
            diag.logdiff = float(row_diff.max()) if row_diff.numel() else 0.0
            diag.logprob_tokens_differing = int(bad.sum())
        if not bool(bad.any()):
            continue
        bad_keys = keys[bad]
        res.rows_differing = int(bad.sum())
        res.max_abs_diff = float(row_diff[bad].max())
        res.positions = bad_keys[:MAX_POSITIONS].tolist()
        seq_pos = bad_keys[:, :2].tolist()
        tainted = torch.tensor([taint.inputs_differed(layer, op, s, p) for s, p in seq_pos],
                               dtype=torch.bool)
        fresh = bad.nonzero().squeeze(1)[~tainted]
        if fresh.numel():
            res.classification, res.detail = _classify(kind, xa[fresh], xb[fresh])
            mod = modules.get((layer, op))
            changed = [n for n in changed_params if mod and n.startswith(mod + ".")]
            if changed and res.classification == OPERATOR:
                res.classification = WEIGHTS
                res.detail = "the models' parameters differ here: " + ", ".join(changed[:8])
            if kind == "route":
                i = int(fresh[0])
                s_, p_, _ = keys[i].tolist()
                res.detail += (f"; e.g. seq {s_} pos {p_}: experts {xa[i].tolist()} on A vs "
                               f"{xb[i].tolist()} on B")
            if tainted.any():
                res.detail += f"; {int(tainted.sum())} other rows had inputs that already differed"
            diag.origins.append(res)
            diag.first = diag.first or res
        else:
            res.classification = PROPAGATED
            res.detail = "every differing row had an input that already differed"
        taint.add((layer, op), seq_pos)
    return diag


def _name(k) -> str:
    layer, op = k
    return f"{'model' if layer is None else 'layer ' + str(layer)} {op}"


__all__ = ["OpDiff", "Diagnosis", "compare_traces", "differing_parameters", "align",
           "differing_rows", "DEPS", "CLASSES", "OPERATOR", "ROUTING", "COLLECTIVE", "PRECISION",
           "WEIGHTS", "PROPAGATED"]
