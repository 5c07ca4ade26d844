"""The files of an HF safetensors checkpoint directory: which file holds each tensor (refusing
every ambiguity), reading a tensor under the dtype rule, and writing a directory atomically.

    files = weight_files(path)                     # {HF name: file}, or ValueError naming why
    with TensorReader() as r:
        sl, dtype = r.slice(files[name], name)        # then r.dtype_problem(...), sl[region]
    write_directory(path, lambda tmp: ...)         # the new files replace the old ones at once

See docs/checkpoints.md for the rules and why.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from typing import Callable, Dict, Optional, Tuple

import torch

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# The files a save writes (the names transformers writes too): a later save replaces them.
_SAVED = re.compile(r"^(config\.json|model\.safetensors|model\.safetensors\.index\.json|"
                    r"model-\d{5}-of-\d{5}\.safetensors)$")
# Weight files of any framework: never silently deleted, never left beside a new checkpoint.
_WEIGHTS = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.ckpt|\.h5|\.msgpack|\.gguf|"
                      r"\.index\.json)$")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16,
           "F16": torch.float16}
# (checkpoint dtype, model dtype) pairs that convert every value exactly.
_LOSSLESS = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}


# ---------------------------------------------------------------------------------------------
# Which file holds each tensor
# ---------------------------------------------------------------------------------------------
def _open(fn: str):
    from safetensors import safe_open
    try:
        return safe_open(fn, framework="pt")
    except Exception as e:  # SafetensorError (truncated, bad header), OSError
        raise ValueError(f"load_checkpoint: {fn} is not a readable safetensors file: {e}") from e


def _index_map(path: str) -> Dict[str, str]:
    fn = os.path.join(path, INDEX)
    try:
        with open(fn, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"load_checkpoint: {fn} is not a JSON object with a weight_map: "
                         f"{e}") from e
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ValueError(f"load_checkpoint: {fn}: weight_map must map tensor names to file "
                         f"names")
    out = {}
    for name, file in weight_map.items():
        # A plain relative path below the directory: no "..", no absolute or drive path.
        parts = re.split(r"[\\/]", file)
        if not file or os.path.isabs(file) or re.match(r"^[A-Za-z]:", file) or ".." in parts:
            raise ValueError(f"load_checkpoint: {fn} maps {name} to {file!r}, outside the "
                             f"checkpoint directory")
        out[name] = os.path.join(path, file)
    for file in sorted(set(out.values())):
        if not os.path.isfile(file):
            some = next(k for k, v in out.items() if v == file)
            raise FileNotFoundError(f"load_checkpoint: {fn} maps {some} to {file}, which does "
                                    f"not exist")
    return out


def weight_files(path: str) -> Dict[str, str]:
    """HF name -> safetensors file of the checkpoint dir `path`: from its index when it has
    one, else from every *.safetensors file. Refuses an index beside model.safetensors (the
    two libraries would read different files), index entries outside the directory, and a
    tensor that two files define."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_checkpoint: no checkpoint directory at {path}")
    if os.path.isfile(os.path.join(path, INDEX)):
        if os.path.isfile(os.path.join(path, SINGLE)):
            raise ValueError(f"load_checkpoint: {path} holds both {SINGLE} and {INDEX}: "
                             f"transformers reads the first, the index names other files; "
                             f"remove the stale one")
        return _index_map(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"load_checkpoint: no *.safetensors (nor an index) in {path}")
    names: Dict[str, str] = {}
    for fn in files:
        full = os.path.join(path, fn)
        with _open(full) as f:
            for k in f.keys():
                if k in names:
                    raise ValueError(f"load_checkpoint: {k} is defined in both {names[k]} and "
                                     f"{full}; which one is meant is ambiguous")
                names[k] = full
    return names


# ---------------------------------------------------------------------------------------------
# Reading one tensor
# ---------------------------------------------------------------------------------------------
class TensorReader:
    """Reads tensors (memory-mapped, slice by slice) from open safetensors files."""

    def __init__(self):
        self._handles: Dict[str, object] = {}
        self.casts: Dict[Tuple[torch.dtype, torch.dtype], int] = {}

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()
        for (src, dst), n in sorted(self.casts.items(), key=str):
            how = "exact" if (src, dst) in _LOSSLESS else "rounded to the model's dtype"
            log.info("load_checkpoint: %d tensors converted %s -> %s (%s)", n, src, dst, how)

    def slice(self, fn: str, name: str):
        """(safetensors slice of `name` in file fn, its torch dtype)."""
        if fn not in self._handles:
            self._handles[fn] = _open(fn)
        try:
            sl = self._handles[fn].get_slice(name)
        except Exception as e:  # SafetensorError: the index names a tensor the file lacks
            raise ValueError(f"load_checkpoint: {fn} has no tensor {name}: {e}") from e
        code = sl.get_dtype()
        return sl, _DTYPES.get(code, code)

    def dtype_problem(self, fn: str, name: str, src, dst: torch.dtype) -> Optional[str]:
        """None when `src` may become `dst` (`cast_problem`'s rule). Else why not."""
        why = cast_problem(f"{name} in {fn}", src, dst)
        if why is None and src != dst:
            self.casts[(src, dst)] = self.casts.get((src, dst), 0) + 1
        return why


def cast_problem(what: str, src, dst: torch.dtype) -> Optional[str]:
    """None when a tensor of dtype `src` may become `dst`: the same dtype; an exact widening
    (bf16 / fp16 -> fp32); fp32 -> bf16 (a bf16 model rounds its weights to bf16). Else why
    not, naming `what`."""
    if src == dst or (src, dst) in _LOSSLESS or (src, dst) == (torch.float32, torch.bfloat16):
        return None
    hint = " (load with dtype=torch.float32: exact)" if src == torch.float16 else ""
    return f"{what} is {src}, the model is {dst}: the cast would change values{hint}"


def nonfinite_problem(t: torch.Tensor, name: str, fn: str) -> Optional[str]:
    """None when every value of t is finite; else a line naming the tensor and its file."""
    bad = int((~torch.isfinite(t)).sum())
    return f"{name} in {fn}: {bad} NaN / inf values" if bad else None


# ---------------------------------------------------------------------------------------------
# Writing a directory
# ---------------------------------------------------------------------------------------------
def write_directory(path, write: Callable[[str], None]) -> None:
    """Make `path` hold exactly what `write(tmp)` puts in the empty directory `tmp`.

    `tmp` sits beside `path` (same file system). When `path` exists, its checkpoint files are
    replaced as a whole: they move aside, the new directory takes the name, and the old files
    are deleted; other files (tokenizer, README, ...) are carried over. Weight files a save
    does not write (pytorch_model.bin, other *.safetensors, ...) are refused before anything
    is written. A failure leaves `path` as it was."""
    path = os.path.realpath(os.fspath(path))
    exists = os.path.exists(path)
    if exists and not os.path.isdir(path):
        raise NotADirectoryError(f"save_pretrained: {path} exists and is not a directory")
    old = sorted(os.listdir(path)) if exists else []
    foreign = [f for f in old if _WEIGHTS.search(f) and not _SAVED.match(f)]
    if foreign:
        raise ValueError(f"save_pretrained: {path} holds weight files a save does not write "
                         f"({', '.join(foreign)}); they would sit beside the new checkpoint. "
                         f"Remove them or save elsewhere")
    parent, base = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{base}.tonp-save-{uuid.uuid4().hex[:12]}")
    os.mkdir(tmp)
    try:
        if exists:
            shutil.copymode(path, tmp)
        write(tmp)
        if exists:
            _swap(tmp, path, [f for f in old if not _SAVED.match(f)])
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap(tmp: str, path: str, keep) -> None:
    """The finished `tmp` becomes `path`; `keep` (names in path) move over; the rest goes."""
    aside = tmp + ".old"
    os.rename(path, aside)
    moved = []
    try:
        for f in keep:
            os.rename(os.path.join(aside, f), os.path.join(tmp, f))
            moved.append(f)
        os.rename(tmp, path)
    except BaseException:  # put the old directory back as it was
        for f in moved:
            os.rename(os.path.join(tmp, f), os.path.join(aside, f))
        os.rename(aside, path)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def split_shards(tensors: Dict[str, torch.Tensor], max_bytes: int
                 ) -> Tuple[Dict[str, Dict[str, torch.Tensor]], Optional[dict]]:
    """{file name: tensors} in the hub layout (one file, or shards + the index dict)."""
    shards = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    if len(shards) == 1:
        return {SINGLE: shards[0]}, None
    files = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s
             for i, s in enumerate(shards)}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total},
             "weight_map": {k: fn for fn, s in files.items() for k in s}}
    return files, index


__all__ = ["INDEX", "SINGLE", "weight_files", "TensorReader", "cast_problem",
           "nonfinite_problem", "write_directory", "split_shards"]
