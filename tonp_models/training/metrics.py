"""Metric logging: one JSON object a line in `<out>/metrics.jsonl`, a short stdout line,
TensorBoard scalars when tensorboard is installed, and a PNG of the curves.

    log = MetricLogger("out/run", enabled=groups.rank == 0, resume_step=None)
    log.log({"step": 1, "loss": 2.3, "lr": 1e-3})
    log.close(); plot_curves(log.path, "out/run/curves.png", ["loss", "lr"])
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence


class MetricLogger:
    """Writes metric rows (dicts) on rank 0 (`enabled`); the other ranks' calls do nothing.

    resume_step: continue an existing metrics.jsonl, keeping the rows up to that step (the steps
    an interrupted run took after its last checkpoint are redone, so they are logged again); the
    kept rows go to a temporary file that replaces the old one (a crash leaves one or the
    other, whole). Non-finite floats are written as null, so the file stays valid JSON.
    """

    def __init__(self, out_dir: str, enabled: bool = True, tensorboard: bool = True,
                 resume_step: Optional[int] = None):
        self.enabled, self.path = enabled, os.path.join(out_dir, "metrics.jsonl")
        self.tb = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        if resume_step is not None and os.path.exists(self.path):
            _rewrite(self.path, [r for r in read_jsonl(self.path, torn_tail="warn")
                                 if r.get("step", 0) <= resume_step])
            self.f = open(self.path, "a", encoding="utf-8")
        else:
            self.f = open(self.path, "w", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(out_dir, "tb"))
            except Exception:   # tensorboard is optional
                self.tb = None

    def log(self, row: Dict, echo: bool = True) -> None:
        """Append `row` (plus a "time" stamp); echo=True also prints it on stdout."""
        if not self.enabled:
            return
        row = {"time": round(time.time(), 3), **row}
        self.f.write(_dumps(row) + "\n")
        self.f.flush()
        if self.tb is not None and "step" in row:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self.tb.add_scalar(k, v, row["step"])
        if echo:
            from tqdm.auto import tqdm
            tqdm.write(" ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k != "time"),
                       file=sys.stdout)

    def close(self) -> None:
        if self.enabled:
            self.f.close()
            if self.tb is not None:
                self.tb.close()


def _rewrite(path: str, rows: List[Dict]) -> None:
    """Replace the JSONL file `path` by `rows`, atomically: a temporary file in the same
    directory, fsynced, then os.replace (a crash at any point leaves the old file or the new)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(_dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)                        # the rename itself reaches the disk
    finally:
        os.close(fd)


def _finite(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _dumps(row: Dict) -> str:
    return json.dumps({k: _finite(v) for k, v in row.items()}, allow_nan=False)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def read_jsonl(path: str, torn_tail: str = "error") -> List[Dict]:
    """The rows of a JSONL file. A last line that is not valid JSON (a write cut short by a
    crash) raises ValueError, or with torn_tail="warn" is dropped with a warning; a bad line
    before the last always raises, naming the file and line."""
    if torn_tail not in ("error", "warn"):
        raise ValueError(f"read_jsonl: torn_tail must be 'error' or 'warn', got {torn_tail!r}")
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    rows = []
    for i, (n, line) in enumerate(lines):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a JSON {type(row).__name__}, not an object")
        except ValueError as e:
            if i == len(lines) - 1 and torn_tail == "warn":
                warnings.warn(f"{path}:{n}: dropped a torn last line ({e}); it was cut short by "
                              f"an interrupted write", stacklevel=2)
                break
            raise ValueError(f"{path}:{n}: not a JSON object ({e})") from e
        rows.append(row)
    return rows


def plot_curves(jsonl_path: str, png_path: str, keys: Sequence[str], title: str = "") -> str:
    """A PNG with one panel per key (y against "step"), from the metrics JSONL."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = read_jsonl(jsonl_path, torn_tail="warn")
    keys = [k for k in keys if any(r.get(k) is not None for r in rows)]
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4.5 * max(1, len(keys)), 3.4),
                             squeeze=False)
    for ax, k in zip(axes[0], keys):
        pts = [(r["step"], r[k]) for r in rows if r.get(k) is not None and "step" in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
        ax.set_xlabel("step")
        ax.set_title(k)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
    return png_path
