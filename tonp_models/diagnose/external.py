"""Compare tonp's training-forward logprobs with per-token logprobs exported by another engine.

    rep = compare_external(model, load_jsonl("vllm.jsonl"), temperature=1.0, threshold=0.0)
    write_external_report(rep, "out/")          # external.txt, .json, _hist.png

Input: JSONL, one sequence a line: {"token_ids", "logprobs", "prompt_len"?}, examples/rollout.py's
output, a vLLM RequestOutput or an SGLang response (docs/diagnose.md gives each shape).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .inputs import check_vocab, int_list, read_jsonl, token_record
from .report import json_safe

DEFAULT_THRESHOLD = 1e-3


@dataclass
class ExternalSequence:
    """token_ids int64 [n]; logprobs fp64 [n]: logprobs[j] = log p(t_j | t_<j), NaN = absent;
    where: the record's origin ("file:line") for error messages."""
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    prompt_len: Optional[int] = None
    source: str = "tonp"
    where: str = ""


def _value(entry, token: int) -> float:
    """A logprob entry: a number, null, or a {token id: number | {"logprob": x}} dict."""
    if entry is None:
        return math.nan
    if isinstance(entry, (int, float)) and not isinstance(entry, bool):
        if math.isnan(entry):
            raise ValueError("the logprob is NaN")
        return float(entry)
    if isinstance(entry, (list, tuple)) and entry:  # SGLang's (logprob, token_id, text)
        return _value(entry[0], token)
    if isinstance(entry, dict):
        if "logprob" in entry:
            return _value(entry["logprob"], token)
        v = entry.get(str(token), entry.get(token))
        if v is None:
            raise ValueError(f"a top-logprobs dict lacks the sequence's token {token}")
        return _value(v, token)
    raise ValueError(f"cannot read a logprob from {entry!r}")


def _aligned(ids: List[int], lps, prompt_len: Optional[int], where: str,
             offset: Optional[int] = None) -> torch.Tensor:
    """fp64 [n]: the logprob entries placed on their tokens (offset None: inferred from the
    count, see the module doc); NaN where absent and at token 0."""
    n = len(ids)
    if not isinstance(lps, list):
        raise ValueError(f"{where}: 'logprobs' must be an array, got {type(lps).__name__}")
    if offset is None:
        if len(lps) == n:
            offset = 0
        elif len(lps) == n - 1:
            offset = 1
        elif prompt_len is not None and len(lps) == n - prompt_len:
            offset = prompt_len
        else:
            raise ValueError(f"{where}: {len(lps)} logprobs for {n} tokens; expected {n}, "
                             f"{n - 1} or n - prompt_len")
    elif len(lps) != n - offset:
        raise ValueError(f"{where}: {len(lps)} logprobs for {n - offset} completion tokens")
    out = [math.nan] * n
    for j, e in enumerate(lps):
        try:
            out[j + offset] = _value(e, ids[j + offset])
        except ValueError as err:
            raise ValueError(f"{where}: logprob of token {j + offset}: {err}") from None
    out[0] = math.nan  # the first token has no context: never compared
    return torch.tensor(out, dtype=torch.float64)


def parse_record(rec: dict, where: str = "record") -> ExternalSequence:
    """One JSON object (any accepted shape, see the module doc) -> ExternalSequence."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "meta_info" in rec:                                               # SGLang
        meta = rec["meta_info"]
        prompt = int_list(rec.get("input_ids") or rec.get("prompt_token_ids") or [],
                          "input_ids", where)
        out_lp = meta.get("output_token_logprobs") or []
        out_ids = int_list(rec["output_ids"] if "output_ids" in rec else
                           [e[1] for e in out_lp], "output_ids", where)
        ids = prompt + out_ids
        in_lp = meta.get("input_token_logprobs")
        lps = (list(in_lp) if in_lp else [None] * len(prompt)) + list(out_lp)
        return _sequence(ids, _aligned(ids, lps, len(prompt), where), len(prompt), "sglang",
                         where)
    if "prompt_token_ids" in rec:                                        # vLLM
        prompt = int_list(rec["prompt_token_ids"], "prompt_token_ids", where)
        if "outputs" in rec:
            o = rec["outputs"][0]
            out_ids, out_lp = int_list(o["token_ids"], "token_ids", where), \
                list(o.get("logprobs") or [])
        else:
            field = "output_token_ids" if "output_token_ids" in rec else "token_ids"
            out_ids = int_list(rec.get(field, []), field, where)
            out_lp = list(rec.get("logprobs") or [])
        ids = prompt + out_ids
        plp = rec.get("prompt_logprobs")
        lps = (list(plp) if plp else [None] * len(prompt)) + out_lp
        return _sequence(ids, _aligned(ids, lps, len(prompt), where), len(prompt), "vllm",
                         where)
    if "logprobs" not in rec:
        raise ValueError(f"{where}: expected 'logprobs' with 'token_ids' (or 'input_ids', or "
                         f"rollout.py's 'prompt_ids' + 'completion_ids'), or a vLLM / SGLang "
                         f"record; got keys {sorted(rec)}")
    ids, pl = token_record(rec, where)
    if "prompt_ids" in rec or "completion_ids" in rec:                   # examples/rollout.py
        return _sequence(ids, _aligned(ids, rec["logprobs"], pl, where, offset=pl), pl,
                         "tonp-rollout", where)
    return _sequence(ids, _aligned(ids, rec["logprobs"], pl, where), pl, "tonp", where)


def _sequence(ids, lps, prompt_len, source, where) -> ExternalSequence:
    if not ids:
        raise ValueError(f"{where}: the sequence has no tokens")
    return ExternalSequence(torch.tensor(ids, dtype=torch.int64), lps, prompt_len, source, where)


def load_jsonl(path: str) -> List[ExternalSequence]:
    """Read every non-empty line of a JSONL file (see the module doc for the shapes); a bad line
    raises ValueError naming the file and line."""
    seqs = []
    for where, rec in read_jsonl(path):
        try:
            seqs.append(parse_record(rec, where))
        except (KeyError, TypeError, IndexError, AttributeError) as e:
            raise ValueError(f"{where}: unreadable record ({type(e).__name__}: {e})") from None
    return seqs


@dataclass
class ExternalReport:
    """Per-token |external - tonp| statistics. first_divergent[i]: the first token of sequence i
    with |diff| > threshold as {"index", "token_id", "external", "tonp", "diff"}, or None."""
    tokens_compared: int
    max_abs_diff: float
    mean_abs_diff: float
    tokens_not_bitwise_equal: int
    tokens_over_threshold: int
    threshold: float
    first_divergent: List[Optional[dict]]
    diffs: List[List[float]] = field(repr=False, default_factory=list)  # per sequence, NaN = absent


def compare_external(model, sequences: List[ExternalSequence], *, temperature: float = 1.0,
                     threshold: float = DEFAULT_THRESHOLD) -> ExternalReport:
    """Score the sequences with tonp's training forward (`model.token_logprobs`) and compare.
    temperature: the one the engine's logprobs were computed at (> 0); threshold >= 0."""
    for name, v, low in (("temperature", temperature, "> 0"), ("threshold", threshold, ">= 0")):
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or \
                (low == "> 0" and v == 0):
            raise ValueError(f"compare_external: {name} must be a finite number {low}, got {v!r}")
    for s in sequences:
        check_vocab(s.token_ids.tolist(), model.config.vocab_size, s.where or "a sequence")
    with torch.no_grad():
        ours = model.token_logprobs([s.token_ids for s in sequences], temperature=temperature)
    all_d, diffs, firsts = [], [], []
    for s, lp in zip(sequences, ours):
        d = torch.full((len(s.token_ids),), math.nan, dtype=torch.float64)
        ext, lp = s.logprobs[1:], lp.double()
        d[1:] = torch.where(ext == lp, 0.0, ext - lp)  # equal infinities differ by 0, not NaN
        diffs.append(d.tolist())
        ok = ~d.isnan()
        all_d.append(d[ok])
        over = (ok & (d.abs() > threshold)).nonzero()
        if over.numel():
            j = int(over[0])
            firsts.append(dict(index=j, token_id=int(s.token_ids[j]),
                               external=float(s.logprobs[j]), tonp=float(lp[j - 1]),
                               diff=float(d[j])))
        else:
            firsts.append(None)
    flat = torch.cat(all_d) if all_d else torch.zeros(0, dtype=torch.float64)
    a = flat.abs()
    return ExternalReport(int(a.numel()), float(a.max()) if a.numel() else 0.0,
                          float(a.mean()) if a.numel() else 0.0, int((a != 0).sum()),
                          int((a > threshold).sum()), threshold, firsts, diffs)


def format_external(rep: ExternalReport) -> str:
    lines = ["tonp vs external engine: per-token logprob differences (external - tonp)",
             f"tokens compared:        {rep.tokens_compared}",
             f"max |diff|:             {rep.max_abs_diff:.6g}",
             f"mean |diff|:            {rep.mean_abs_diff:.6g}",
             f"not bitwise equal:      {rep.tokens_not_bitwise_equal}",
             f"|diff| > {rep.threshold:g}:{'':{max(1, 13 - len(f'{rep.threshold:g}'))}}"
             f"{rep.tokens_over_threshold}", "", "first divergent token per sequence:"]
    for i, f in enumerate(rep.first_divergent):
        lines.append(f"  seq {i}: " + ("none" if f is None else
                     f"token index {f['index']} (id {f['token_id']}): external "
                     f"{f['external']:.6g}, tonp {f['tonp']:.6g}, diff {f['diff']:.3g}"))
    return "\n".join(lines) + "\n"


def histogram(rep: ExternalReport, path: str) -> str:
    """A PNG histogram of log10 |diff| over compared tokens (exact zeros counted in the title)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    d = torch.tensor([x for seq in rep.diffs for x in seq], dtype=torch.float64)
    d = d[~d.isnan()].abs()
    zeros, infinite = int((d == 0).sum()), int(d.isinf().sum())
    nz = d[(d > 0) & d.isfinite()].log10()
    fig, ax = plt.subplots(figsize=(6, 4))
    if nz.numel():
        ax.hist(nz.numpy(), bins=40)
    if rep.threshold > 0:  # threshold 0 (flag anything not bitwise) has no log10
        ax.axvline(math.log10(rep.threshold), color="red", linestyle="--",
                   label=f"threshold {rep.threshold:g}")
        ax.legend()
    ax.set_xlabel("log10 |logprob external - logprob tonp|")
    ax.set_ylabel("tokens")
    ax.set_title(f"{rep.tokens_compared} tokens, {zeros} bitwise equal"
                 + (f", {infinite} infinite" if infinite else "") + " (not shown)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_external_report(rep: ExternalReport, out_dir: str, stem: str = "external") -> dict:
    """Write <stem>.txt, <stem>.json and <stem>_hist.png into out_dir; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, stem + s) for k, s in
             (("text", ".txt"), ("json", ".json"), ("png", "_hist.png"))}
    with open(paths["text"], "w") as fh:
        fh.write(format_external(rep))
    with open(paths["json"], "w") as fh:
        json.dump(json_safe(dict(rep.__dict__)), fh, indent=1, allow_nan=False)
    histogram(rep, paths["png"])
    return paths


__all__ = ["ExternalSequence", "ExternalReport", "parse_record", "load_jsonl",
           "compare_external", "format_external", "histogram", "write_external_report",
           "DEFAULT_THRESHOLD"]
