"""A Diagnosis as readable text and as JSON (`write_report(diag, out_dir)` writes both)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Tuple

from .compare import Diagnosis, OpDiff

SHOWN_POSITIONS = 12   # rows listed per op in the text report
SHOWN_ORIGINS = 10
NO_DIVERGENCE = "no divergence"


def _positions(d: OpDiff) -> str:
    rows = [f"seq {s} pos {p}" + (f" expert {e}" if e >= 0 else "")
            for s, p, e in d.positions[:SHOWN_POSITIONS]]
    more = d.rows_differing - len(rows)
    return ", ".join(rows) + (f", ... (+{more} more)" if more > 0 else "")


def format_text(diag: Diagnosis) -> str:
    """The report a person reads: the verdict first, then the evidence."""
    lines = [f"tonp consistency diagnosis: A = {diag.label_a}  vs  B = {diag.label_b}",
             f"ops compared: {len(diag.ops)}"]
    if diag.logdiff is not None:
        lines.append(f"logdiff (max |logprob A - logprob B| over tokens): {diag.logdiff:.6g} "
                     f"({diag.logprob_tokens_differing} tokens differ)")
    for side, ops in diag.one_sided.items():
        if ops:
            lines.append(f"captured on path {side.upper()} only (not compared): "
                         + ", ".join(ops[:20]) + (" ..." if len(ops) > 20 else ""))
    for side in ("a", "b"):
        meta = diag.meta.get(side, {})
        if meta.get("rank_mismatch"):
            lines.append(f"WARNING: on path {side.upper()} the TP ranks hold different bits for "
                         f"replicated results: " + ", ".join(meta["rank_mismatch"][:10]))
        if meta.get("expert_rows"):
            lines.append(f"note: path {side.upper()} expert rows {meta['expert_rows']}")
    lines.append("")
    if not diag.diverged:
        lines.append(f"RESULT: {NO_DIVERGENCE}. Every captured op is bitwise equal for every "
                     f"token on both paths.")
        return "\n".join(lines) + "\n"
    f = diag.first
    lines += [f"RESULT: first divergence at {f.where}",
              f"  classification: {f.classification}",
              f"  why:            {f.detail}",
              f"  max |diff|:     {f.max_abs_diff:.6g}  (dtypes A {f.dtype_a}, B {f.dtype_b})",
              f"  rows differing: {f.rows_differing} of {f.rows_compared}",
              f"  positions:      {_positions(f)}", ""]
    if len(diag.origins) > 1:
        lines.append("Other ops where untainted rows diverge (independent causes):")
        for o in diag.origins[1:SHOWN_ORIGINS]:
            lines.append(f"  {o.where}: {o.classification}, {o.rows_differing} rows, "
                         f"max |diff| {o.max_abs_diff:.3g}")
        lines.append("")
    lines.append("Propagation (ops that differ, in forward order):")
    lines.append(f"  {'where':34s} {'rows':>9s} {'max |diff|':>11s}  note")
    for o in diag.ops:
        if o.rows_differing:
            note = o.classification if o in diag.origins else "input already differed"
            lines.append(f"  {o.where:34s} {o.rows_differing:>4d}/{o.rows_compared:<4d} "
                         f"{o.max_abs_diff:11.3g}  {note}")
    return "\n".join(lines) + "\n"


def to_json(diag: Diagnosis) -> dict:
    """A JSON-ready dict: verdict, first divergence, origins and every compared op."""
    return {
        "a": diag.label_a, "b": diag.label_b,
        "diverged": diag.diverged,
        "result": "divergence" if diag.diverged else NO_DIVERGENCE,
        "first": dataclasses.asdict(diag.first) if diag.first else None,
        "origins": [dataclasses.asdict(o) for o in diag.origins],
        "logdiff": diag.logdiff,
        "logprob_tokens_differing": diag.logprob_tokens_differing,
        "one_sided": diag.one_sided,
        "ops": [dataclasses.asdict(o) for o in diag.ops],
        "meta": diag.meta,
    }


def json_safe(x):
    """x with every non-finite float made JSON: NaN (absent) -> None, +-inf -> "inf" / "-inf"."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write_report(diag: Diagnosis, out_dir: str, stem: str = "diagnosis") -> Tuple[str, str]:
    """Write out_dir/<stem>.txt and out_dir/<stem>.json; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    txt, js = os.path.join(out_dir, stem + ".txt"), os.path.join(out_dir, stem + ".json")
    with open(txt, "w") as fh:
        fh.write(format_text(diag))
    with open(js, "w") as fh:
        json.dump(json_safe(to_json(diag)), fh, indent=1, default=str, allow_nan=False)
    return txt, js


__all__ = ["format_text", "to_json", "json_safe", "write_report", "NO_DIVERGENCE"]
