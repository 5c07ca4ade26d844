"""Reading users' JSONL files: one JSON object a line; every error names the file and the line.

    for where, rec in read_jsonl(path): ...               # where = "path:line"
    seqs, prompt_lens = load_tokens(path)                 # token sequences for the paths

A token record is {"token_ids" | "input_ids": [...], "prompt_len": p (optional)}, or
examples/rollout.py's output line {"prompt_ids": [...], "completion_ids": [...], ...}
(prompt_len = len(prompt_ids)).
"""
from __future__ import annotations

import json
from typing import List, Optional, Tuple

import torch


def read_jsonl(path: str) -> List[Tuple[str, dict]]:
    """(where, object) for every non-blank line of `path`. ValueError when a line is not UTF-8,
    not JSON or not an object, or when the file holds no record; OSError when it cannot be read."""
    out = []
    with open(path, "rb") as fh:
        for i, raw in enumerate(fh, 1):
            where = f"{path}:{i}"
            try:
                line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                                 f"column {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") \
                    from None
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: expected one JSON object per line, got "
                                 f"{_json_type(rec)}")
            out.append((where, rec))
    if not out:
        raise ValueError(f"{path}: no records (the file is empty)")
    return out


def _json_type(x) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(x), type(x).__name__)


def int_list(value, field: str, where: str) -> List[int]:
    """`value` as a list of non-negative integers (token ids); ValueError naming the field."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: {field!r} must be an array of token ids, got "
                         f"{_json_type(value)}")
    for j, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"{where}: {field!r}[{j}] = {t!r} is not a token id (a "
                             f"non-negative integer)")
    return list(value)


def prompt_length(value, n: int, where: str, lowest: int = 0) -> Optional[int]:
    """An optional "prompt_len": None, or an integer in [lowest, n]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= n:
        raise ValueError(f"{where}: 'prompt_len' = {value!r} must be an integer in "
                         f"[{lowest}, {n}] (the sequence has {n} tokens)")
    return value


def token_record(rec: dict, where: str, lowest_prompt: int = 0
                 ) -> Tuple[List[int], Optional[int]]:
    """(token ids, prompt_len or None) of a token record (see the module doc)."""
    if "prompt_ids" in rec or "completion_ids" in rec:
        prompt = int_list(rec.get("prompt_ids"), "prompt_ids", where)
        ids = prompt + int_list(rec.get("completion_ids"), "completion_ids", where)
        pl = len(prompt)
        if pl < lowest_prompt:
            raise ValueError(f"{where}: 'prompt_ids' is empty")
    else:
        field = "token_ids" if "token_ids" in rec else "input_ids"
        if field not in rec:
            raise ValueError(f"{where}: expected 'token_ids' (or 'input_ids', or rollout.py's "
                             f"'prompt_ids' + 'completion_ids'); got keys {sorted(rec)}")
        ids = int_list(rec[field], field, where)
        pl = prompt_length(rec.get("prompt_len"), len(ids), where, lowest_prompt)
    if not ids:
        raise ValueError(f"{where}: the sequence has no tokens")
    return ids, pl


def check_vocab(ids: List[int], vocab: int, where: str) -> None:
    """ValueError when a token id is not below the model's vocabulary size."""
    bad = [t for t in ids if t >= vocab]
    if bad:
        raise ValueError(f"{where}: token ids {bad[:8]} are outside the model's vocabulary "
                         f"[0, {vocab})")


def load_tokens(path: str, vocab: Optional[int] = None
                ) -> Tuple[List[torch.Tensor], List[Optional[int]]]:
    """Token sequences (int64 [n] each) and their prompt lengths (None = not given) from a
    JSONL file of token records; ids are checked against `vocab` when given."""
    seqs, pls = [], []
    for where, rec in read_jsonl(path):
        ids, pl = token_record(rec, where, lowest_prompt=1)
        if vocab is not None:
            check_vocab(ids, vocab, where)
        seqs.append(torch.tensor(ids, dtype=torch.int64))
        pls.append(pl)
    return seqs, pls


__all__ = ["read_jsonl", "int_list", "prompt_length", "token_record", "check_vocab",
           "load_tokens"]
