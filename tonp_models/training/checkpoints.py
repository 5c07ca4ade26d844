"""Atomic training checkpoints with keep-last-N and exact resume.

    ckpt = CheckpointManager("out/pretrain/ckpt", keep_last=3, groups=groups)
    ckpt.save(step, {"model": ..., "optimizer": ..., ...}, meta={"config": ..., ...})
    state = ckpt.load(ckpt.latest(), expect={"config": ..., ...})

`<root>/step_00000100/` holds one `rankNNNNN.pt` per rank and `meta.json` (the run's identity,
each file's size and sha256), written last; the directory is renamed into place, so a crash
leaves the complete checkpoint or none of it (re-saving a step swaps the old one out, then
deletes it). Loading checks completeness, checksums and that `expect` matches; each failure is
a CheckpointError. Details: docs/training.md.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
from typing import Any, Dict, List, Optional

import numpy as np
import torch

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_OLD = ".old-"          # a checkpoint being replaced by a re-save of its step (complete)
RESERVED_META = ("step", "world_size", "files")   # meta.json keys the manager writes itself


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted, or belongs to a different run."""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes) -> None:
    """Write and fsync one file (the unit a crash test interrupts)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rng_state() -> Dict[str, Any]:
    """Every RNG a training step may draw from (torch CPU/CUDA, python, numpy), as tensors and
    plain values so `torch.load(weights_only=True)` reads it back."""
    np_state = np.random.get_state()
    s = {"torch": torch.get_rng_state(), "python": random.getstate(),
         "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:])}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: Dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in s["python"]))
    kind, keys, *rest = s["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


class CheckpointManager:
    """Saves and finds the checkpoints under `root` (see the module doc).

    Args: root directory; keep_last (N >= 1 complete checkpoints kept); groups (ParallelGroups or
    None: each rank writes its own file, rank 0 writes meta.json and renames).
    """

    def __init__(self, root: str, keep_last: int = 3, groups=None):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root, self.keep_last = root, keep_last
        self.rank = groups.rank if groups is not None else 0
        self.world = groups.world_size if groups is not None else 1

    # -- finding ----------------------------------------------------------------------------------
    def complete(self) -> List[str]:
        """Complete checkpoint directories (with meta.json), oldest first. A re-save of a step
        cut short between its two renames left the old checkpoint as `.old-step_N` and no
        `step_N`: that one counts (the next save renames it back)."""
        if not os.path.isdir(self.root):
            return []
        names = os.listdir(self.root)
        found = {}
        for name in names:
            step_name = name[len(_OLD):] if name.startswith(_OLD) else name
            m = _STEP_DIR.match(step_name)
            if m and os.path.isfile(os.path.join(self.root, name, "meta.json")) and \
                    (name == step_name or step_name not in names):
                found[int(m.group(1))] = name
        return [os.path.join(self.root, found[k]) for k in sorted(found)]

    def latest(self) -> Optional[str]:
        done = self.complete()
        return done[-1] if done else None

    # -- saving -----------------------------------------------------------------------------------
    def save(self, step: int, state: Dict[str, Any], meta: Dict[str, Any]) -> str:
        """Write this rank's `state` and (rank 0) `meta` as checkpoint `step`, atomically.
        Collective under torchrun. Returns the checkpoint directory. `meta` must not hold the
        keys the manager writes itself (RESERVED_META: ValueError)."""
        clash = sorted(k for k in meta if k in RESERVED_META)
        if clash:
            raise ValueError(f"CheckpointManager.save: meta keys {', '.join(map(repr, clash))} "
                             f"are reserved (the manager writes {', '.join(RESERVED_META)} "
                             f"itself); rename them")
        name = f"step_{step:08d}"
        final, tmp = os.path.join(self.root, name), os.path.join(self.root, f".tmp-{name}")
        old = os.path.join(self.root, _OLD + name)
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            self._clean()
            os.makedirs(tmp)
        self._barrier()
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
        fname = f"rank{self.rank:05d}.pt"
        _write_file(os.path.join(tmp, fname), data)
        files = self._gather({fname: {"bytes": len(data), "sha256": _sha256(data)}})
        if self.rank == 0:
            body = {"step": step, "world_size": self.world, "files": files, **meta}
            _write_file(os.path.join(tmp, "meta.json"),
                        json.dumps(body, indent=1, sort_keys=True).encode())
            _fsync_dir(tmp)
            if os.path.exists(final):                  # re-saving a step: replace it whole
                os.rename(final, old)                  # (a crash here: complete() finds `old`)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            shutil.rmtree(old, ignore_errors=True)     # the new one is in place and synced
            self._prune()
        self._barrier()
        return final

    def _clean(self) -> None:
        """What an interrupted save or prune left: torn `.tmp-` and `.trash-` directories go;
        an `.old-step_N` goes when `step_N` exists, else it is renamed back (it is complete)."""
        names = os.listdir(self.root)
        for stale in names:
            path = os.path.join(self.root, stale)
            if stale.startswith(_OLD) and stale[len(_OLD):] not in names \
                    and os.path.isfile(os.path.join(path, "meta.json")):
                os.rename(path, os.path.join(self.root, stale[len(_OLD):]))
            elif stale.startswith((".tmp-", ".trash-", _OLD)):
                shutil.rmtree(path, ignore_errors=True)
        _fsync_dir(self.root)

    def _prune(self) -> None:
        for path in self.complete()[:-self.keep_last]:
            trash = os.path.join(self.root, ".trash-" + os.path.basename(path))
            os.rename(path, trash)                     # gone from complete() at once
            shutil.rmtree(trash, ignore_errors=True)
        _fsync_dir(self.root)

    def _gather(self, files: Dict[str, Any]) -> Dict[str, Any]:
        if self.world == 1:
            return files
        import torch.distributed as dist
        every: List[Any] = [None] * self.world
        dist.all_gather_object(every, files)
        return {k: v for d in every for k, v in d.items()}

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist
            dist.barrier()

    # -- loading ----------------------------------------------------------------------------------
    def load(self, path: str, expect: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """This rank's state from checkpoint directory `path`, after checking it is complete,
        intact and from a run like this one (`expect`: meta keys that must match)."""
        meta = read_meta(path)
        if meta.get("world_size") != self.world:
            raise CheckpointError(f"checkpoint {path} was written by {meta.get('world_size')} "
                                  f"ranks, this run has {self.world}; resume with the same "
                                  f"torchrun layout")
        diffs = [k for k in (expect or {}) if meta.get(k) != expect[k]]
        if diffs:
            detail = "; ".join(_describe_diff(k, meta.get(k), expect[k]) for k in diffs)
            raise CheckpointError(f"checkpoint {path} does not match this run: {detail}")
        fname = f"rank{self.rank:05d}.pt"
        fpath = os.path.join(path, fname)
        info = meta["files"].get(fname)
        if info is None or not os.path.isfile(fpath):
            raise CheckpointError(f"checkpoint {path} is missing {fname}")
        with open(fpath, "rb") as f:
            data = f.read()
        if len(data) != info["bytes"] or _sha256(data) != info["sha256"]:
            raise CheckpointError(f"checkpoint file {fpath} is corrupted: {len(data)} bytes with "
                                  f"sha256 {_sha256(data)[:12]}..., meta.json recorded "
                                  f"{info['bytes']} bytes, {info['sha256'][:12]}...")
        try:
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # pragma: no cover - the checksum catches damage first
            raise CheckpointError(f"checkpoint file {fpath} cannot be read: {e}") from e
        state["meta"] = meta
        return state


def read_meta(path: str) -> Dict[str, Any]:
    """meta.json of a checkpoint directory, with clear errors for the ways it can be bad."""
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint directory at {path}")
    mpath = os.path.join(path, "meta.json")
    if not os.path.isfile(mpath):
        inside = CheckpointManager(path).complete()
        hint = (f"; it holds checkpoints ({os.path.basename(inside[-1])} is the newest): pass "
                f"one of them, or --resume alone for the latest") if inside else ""
        raise CheckpointError(f"{path} has no meta.json: it is not a checkpoint, or its save was "
                              f"interrupted{hint}")
    try:
        with open(mpath) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath} is corrupted (not valid JSON: {e})") from e


def _describe_diff(key: str, saved: Any, now: Any) -> str:
    if isinstance(saved, dict) and isinstance(now, dict):
        ks = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        return f"{key} differs in " + ", ".join(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}"
                                                 for k in ks[:8])
    return f"{key}: saved {saved!r}, now {now!r}"
