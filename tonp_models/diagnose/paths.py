"""The paths a token can take through the model, each run under a Capture.

    trace = run_path(model, seqs, "train")                     # whole packed sequences
    trace = run_path(model, seqs, "padded")                    # a padded [B, L] batch
    trace = run_path(model, seqs, "decode", prompt_lens=[4])   # prefill, then one token per step
    trace = run_path(model, seqs, "train", mode="torch")       # stock torch kernels

Decode feeds the given tokens (teacher forcing), every unfinished sequence together per step.
Every path records its token logprobs ("logprobs", layer None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

import tonp_kernels as tk

from ..engine import PageAllocator, extend
from .capture import Capture, Trace

KINDS = ("train", "padded", "decode")


@dataclass
class PathSpec:
    """One side of a comparison: kind (train | padded | decode), kernel mode, TP/EP layout and
    an optional checkpoint. Parsed from "decode", "train,torch", "tp=2", "ckpt=/path", ..."""
    kind: str = "train"
    mode: str = "invariant"
    tp: int = 1
    ep: int = 1
    ckpt: Optional[str] = None

    @classmethod
    def parse(cls, text: str) -> "PathSpec":
        spec = cls()
        for tok in filter(None, (t.strip() for t in text.split(","))):
            key, _, val = tok.partition("=")
            if tok in KINDS:
                spec.kind = tok
            elif tok in tk.MODES:
                spec.mode = tok
            elif key in ("tp", "ep") and val.isdigit() and int(val) >= 1:
                setattr(spec, key, int(val))
            elif key == "ckpt":
                spec.ckpt = val or None
            else:
                raise ValueError(f"path spec {text!r}: unknown part {tok!r}; use a kind "
                                 f"{KINDS}, a kernel mode {tk.MODES}, tp=N, ep=N or ckpt[=PATH]")
        return spec

    @property
    def label(self) -> str:
        parts = [self.kind, self.mode]
        if self.tp > 1 or self.ep > 1:
            parts.append(f"tp={self.tp},ep={self.ep}")
        if self.ckpt:
            parts.append(f"ckpt={self.ckpt}")
        return "/".join(parts)


def run_path(model, sequences: Sequence[torch.Tensor], kind: str = "train", *,
             mode: str = "invariant", prompt_lens: Optional[Sequence[int]] = None,
             label: Optional[str] = None, rank: int = 0, detail: bool = True) -> Trace:
    """Run `sequences` (1-D int64 token ids each, len >= 1) through one path and capture it.

    prompt_lens (decode only): tokens prefilled per sequence (default: half, at least 1).
    detail: also record the layers' step-by-step paths (see Capture).
    Returns the Trace (label defaults to "kind/mode").
    """
    if kind not in KINDS:
        raise ValueError(f"run_path: kind must be one of {KINDS}, got {kind!r}")
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    if not seqs or min(len(s) for s in seqs) < 1:
        raise ValueError("run_path: need at least one sequence, each with at least one token")
    cap = Capture(model, label or f"{kind}/{mode}", rank, detail)
    with torch.no_grad(), tk.use(mode), cap:
        if kind == "train":
            _train(model, cap, seqs)
        elif kind == "padded":
            _padded(model, cap, seqs)
        else:
            _decode(model, cap, seqs, _prompt_lens(seqs, prompt_lens))
    cap.trace.meta.update(kind=kind, mode=mode, lengths=[len(s) for s in seqs])
    return cap.trace


def _prompt_lens(seqs, prompt_lens) -> List[int]:
    if prompt_lens is None:
        return [max(1, len(s) // 2) for s in seqs]
    pl = [int(p) for p in prompt_lens]
    if len(pl) == 1:
        pl = pl * len(seqs)
    if len(pl) != len(seqs) or any(not 1 <= p <= len(s) for p, s in zip(pl, seqs)):
        raise ValueError(f"run_path: prompt_lens {list(prompt_lens)} must give 1 <= p <= len "
                         f"for each of the {len(seqs)} sequences")
    return pl


def _record_logprobs(cap: Capture, logits, seq_ids, positions, seqs) -> None:
    """logprob of the next token for every row that has one (rows = this forward's tokens)."""
    rows = [i for i, (s, p) in enumerate(zip(seq_ids, positions)) if p + 1 < len(seqs[s])]
    if not rows:
        return
    targets = torch.tensor([int(seqs[seq_ids[i]][positions[i] + 1]) for i in rows])
    idx = torch.tensor(rows)
    lp = tk.token_logprobs(logits.index_select(0, idx), targets)
    cap.record("logprobs", lp, keys=cap.row_keys().index_select(0, idx), layer=None)


def _rows(seqs, starts, counts):
    seq_ids = [i for i, n in enumerate(counts) for _ in range(n)]
    positions = [starts[i] + j for i, n in enumerate(counts) for j in range(n)]
    return seq_ids, positions


def _train(model, cap, seqs) -> None:
    lens = [len(s) for s in seqs]
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    seq_ids, positions = _rows(seqs, [0] * len(seqs), lens)
    cap.begin_forward(seq_ids, positions)
    logits = model(torch.cat(seqs), cu)                                            # (T, V)
    _record_logprobs(cap, logits, seq_ids, positions, seqs)


def _padded(model, cap, seqs) -> None:
    lens = [len(s) for s in seqs]
    ids = torch.zeros(len(seqs), max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, True
    seq_ids, positions = _rows(seqs, [0] * len(seqs), lens)  # the model packs rows in mask order
    cap.begin_forward(seq_ids, positions)
    logits = model(ids, attention_mask=mask)[mask]                                 # (T, V)
    _record_logprobs(cap, logits, seq_ids, positions, seqs)


def _decode(model, cap, seqs, prompt_lens) -> None:
    pages = PageAllocator(model.new_cache(len(seqs), max(len(s) for s in seqs)))
    slots = [pages.add_sequence() for _ in seqs]
    done = [0] * len(seqs)
    counts = list(prompt_lens)                       # the first forward prefills every prompt
    while any(counts):
        active = [i for i, n in enumerate(counts) if n]
        seq_ids, positions = _rows(seqs, done, counts)
        cu = torch.zeros(len(active) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor([counts[i] for i in active]), 0)
        ids = torch.cat([seqs[i][done[i]:done[i] + counts[i]] for i in active])
        cap.begin_forward(seq_ids, positions)
        logits = extend(model, pages, ids, [slots[i] for i in active], cu)
        _record_logprobs(cap, logits, seq_ids, positions, seqs)
        for i in active:
            done[i] += counts[i]
        counts = [1 if done[i] < len(s) else 0 for i, s in enumerate(seqs)]


__all__ = ["PathSpec", "run_path", "KINDS"]
