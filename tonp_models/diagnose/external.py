"""Compare tonp's training-forward logprobs with per-token logprobs exported by another engine.

Input: JSONL, one sequence per line. The canonical form is

    {"token_ids": [t0, t1, ..., tn-1], "logprobs": [...], "prompt_len": p}   (prompt_len optional)

where "logprobs" holds log p(t_j | t_<j) either for every token (n entries; the first, having
no context, is null), for tokens 1..n-1 (n - 1 entries), or, with prompt_len, for the response
tokens p..n-1 only (n - p entries). Any entry may be null (not compared). An entry may also be a
{token id: logprob or {"logprob": x}} dict (top-logprobs), from which the actual token's value is
taken. Also accepted, as exported by the engines:

* vLLM (RequestOutput as JSON): {"prompt_token_ids": [...], "prompt_logprobs": [null, {...}, ...]
  (optional), "outputs": [{"token_ids": [...], "logprobs": [{id: {"logprob": x, ...}}, ...]}]},
  or flat {"prompt_token_ids", "output_token_ids" | "token_ids", "logprobs"};
* SGLang: {"input_ids" | "prompt_token_ids", "output_ids" (optional), "meta_info":
  {"output_token_logprobs": [[logprob, token_id, text], ...], "input_token_logprobs": [...]}};
* transformers: the canonical form, or "input_ids" for "token_ids" (e.g. the gathered
  log_softmax of a forward).

Output: per-token |diff| statistics, the first divergent token of each sequence and a PNG
histogram of log10 |diff|.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import List, Optional

import torch

DEFAULT_THRESHOLD = 1e-3


@dataclass
class ExternalSequence:
    """token_ids int64 [n]; logprobs fp64 [n]: logprobs[j] = log p(t_j | t_<j), NaN = absent."""
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    prompt_len: Optional[int] = None
    source: str = "tonp"


def _value(entry, token: int) -> float:
    """A logprob entry: a number, null, or a {token id: number | {"logprob": x}} dict."""
    if entry is None:
        return math.nan
    if isinstance(entry, (int, float)):
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


def _aligned(ids: List[int], lps: list, prompt_len: Optional[int], where: str) -> List[float]:
    n = len(ids)
    if len(lps) == n:
        offset = 0
    elif len(lps) == n - 1:
        offset = 1
    elif prompt_len is not None and len(lps) == n - prompt_len:
        offset = prompt_len
    else:
        raise ValueError(f"{where}: {len(lps)} logprobs for {n} tokens; expected {n}, {n - 1} "
                         f"or n - prompt_len")
    out = [math.nan] * n
    for j, e in enumerate(lps):
        out[j + offset] = _value(e, ids[j + offset])
    out[0] = math.nan  # the first token has no context: never compared
    return out


def parse_record(rec: dict, where: str = "record") -> ExternalSequence:
    """One JSON object (any accepted shape, see the module doc) -> ExternalSequence."""
    if "meta_info" in rec:                                               # SGLang
        meta = rec["meta_info"]
        prompt = list(rec.get("input_ids") or rec.get("prompt_token_ids") or [])
        out_lp = meta.get("output_token_logprobs") or []
        out_ids = list(rec.get("output_ids") or [e[1] for e in out_lp])
        ids = prompt + out_ids
        in_lp = meta.get("input_token_logprobs")
        lps = (list(in_lp) if in_lp else [None] * len(prompt)) + list(out_lp)
        return ExternalSequence(torch.tensor(ids), torch.tensor(
            _aligned(ids, lps, len(prompt), where), dtype=torch.float64), len(prompt), "sglang")
    if "prompt_token_ids" in rec:                                        # vLLM
        prompt = list(rec["prompt_token_ids"])
        if "outputs" in rec:
            o = rec["outputs"][0]
            out_ids, out_lp = list(o["token_ids"]), list(o.get("logprobs") or [])
        else:
            out_ids = list(rec.get("output_token_ids", rec.get("token_ids", [])))
            out_lp = list(rec.get("logprobs") or [])
        ids = prompt + out_ids
        plp = rec.get("prompt_logprobs")
        lps = (list(plp) if plp else [None] * len(prompt)) + out_lp
        return ExternalSequence(torch.tensor(ids), torch.tensor(
            _aligned(ids, lps, len(prompt), where), dtype=torch.float64), len(prompt), "vllm")
    ids = rec.get("token_ids", rec.get("input_ids"))
    if ids is None or "logprobs" not in rec:
        raise ValueError(f"{where}: expected 'token_ids' (or 'input_ids') and 'logprobs', or a "
                         f"vLLM / SGLang record; got keys {sorted(rec)}")
    ids = [int(t) for t in ids]
    pl = rec.get("prompt_len")
    return ExternalSequence(torch.tensor(ids), torch.tensor(
        _aligned(ids, list(rec["logprobs"]), pl, where), dtype=torch.float64), pl, "tonp")


def load_jsonl(path: str) -> List[ExternalSequence]:
    """Read every non-empty line of a JSONL file (see the module doc for the shapes)."""
    seqs = []
    with open(path) as fh:
        for i, line in enumerate(fh, 1):
            if line.strip():
                try:
                    seqs.append(parse_record(json.loads(line), f"{path}:{i}"))
                except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
                    raise ValueError(f"{path}:{i}: unreadable record ({e})") from e
    if not seqs:
        raise ValueError(f"{path}: no records")
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
    """Score the sequences with tonp's training forward (`model.token_logprobs`) and compare."""
    with torch.no_grad():
        ours = model.token_logprobs([s.token_ids for s in sequences], temperature=temperature)
    all_d, diffs, firsts = [], [], []
    for s, lp in zip(sequences, ours):
        d = torch.full((len(s.token_ids),), math.nan, dtype=torch.float64)
        d[1:] = s.logprobs[1:] - lp.double()
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
    zeros = int((d == 0).sum())
    nz = d[d > 0].log10()
    fig, ax = plt.subplots(figsize=(6, 4))
    if nz.numel():
        ax.hist(nz.numpy(), bins=40)
    ax.axvline(math.log10(rep.threshold), color="red", linestyle="--",
               label=f"threshold {rep.threshold:g}")
    ax.set_xlabel("log10 |logprob external - logprob tonp|")
    ax.set_ylabel("tokens")
    ax.set_title(f"{rep.tokens_compared} tokens, {zeros} bitwise equal (not shown)")
    ax.legend()
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
        body = {k: v for k, v in rep.__dict__.items() if k != "diffs"}
        body["diffs"] = [[None if math.isnan(x) else x for x in seq] for seq in rep.diffs]
        json.dump(body, fh, indent=1)
    histogram(rep, paths["png"])
    return paths


__all__ = ["ExternalSequence", "ExternalReport", "parse_record", "load_jsonl",
           "compare_external", "format_external", "histogram", "write_external_report",
           "DEFAULT_THRESHOLD"]
