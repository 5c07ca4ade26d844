"""Pieces the example scripts share: tokenizers, token data and samplers with a resumable
position, the SFT response loss, metrics (stdout, JSONL, TensorBoard, PNG).

The optimiser side (master weights, AdamW, schedule, DP averaging, clipping, process groups,
model construction) is `trainer.py`;
checkpoint files are `checkpointing.py`. Everything here works in one plain process; under
torchrun the caller passes a `tonp_parallel.ParallelGroups`.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# -- tokenizers -----------------------------------------------------------------------------------
class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; `bos_id` / `eos_id` are special ids above them (the tiny
    preset's vocabulary is 256 bytes + 64 specials: bos 256, eos 257)."""

    def __init__(self, bos_id: Optional[int] = 256, eos_id: Optional[int] = 257):
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's `tokenizer.json` through the `tokenizers` library (no special tokens added)."""

    def __init__(self, path: str, bos_id: Optional[int] = None, eos_id: Optional[int] = None):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(path)
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str) -> List[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids))


def _first(x):
    return x[0] if isinstance(x, (list, tuple)) else x


def load_tokenizer(checkpoint_dir: Optional[str], config):
    """The checkpoint's tokenizer.json when there is one, else bytes (which needs vocab >= 256)."""
    bos, eos = _first(config.bos_token_id), _first(config.eos_token_id)
    if checkpoint_dir and os.path.isfile(os.path.join(checkpoint_dir, "tokenizer.json")):
        return HFTokenizer(os.path.join(checkpoint_dir, "tokenizer.json"), bos, eos)
    if config.vocab_size < 256:
        raise ValueError(f"the byte tokenizer needs vocab_size >= 256, the model has "
                         f"{config.vocab_size} (and {checkpoint_dir} has no tokenizer.json)")
    return ByteTokenizer(bos, eos)


def parse_overrides(items: Sequence[str]) -> Dict[str, object]:
    """["num_hidden_layers=1", "rope_theta=1e4"] -> {"num_hidden_layers": 1, "rope_theta": 1e4}
    (values parsed as JSON when they are JSON, else kept as strings)."""
    out: Dict[str, object] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


# -- token data -----------------------------------------------------------------------------------
TOKEN_FILE_DTYPES = {".u16": np.uint16, ".uint16": np.uint16, ".u32": np.uint32,
                     ".uint32": np.uint32}


def load_tokens(path: str, tokenizer=None, token_dtype: Optional[str] = None) -> np.ndarray:
    """A 1-D array of token ids: a memory-mapped binary token file (raw uint16/uint32, little
    endian; the dtype from `token_dtype` or the suffix .u16/.u32/.bin=uint16), or a text file
    encoded with `tokenizer` (bytes by default)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path} (give --data a text file or a "
                                f"uint16/uint32 token file)")
    ext = os.path.splitext(path)[1].lower()
    if token_dtype or ext in TOKEN_FILE_DTYPES or ext == ".bin":
        dt = np.dtype(token_dtype or TOKEN_FILE_DTYPES.get(ext, np.uint16))
        if dt not in (np.uint16, np.uint32):
            raise ValueError(f"token files hold uint16 or uint32 ids, not {dt}")
        if os.path.getsize(path) % dt.itemsize:
            raise ValueError(f"{path}: size {os.path.getsize(path)} is not a multiple of "
                             f"{dt.itemsize} bytes ({dt})")
        return np.memmap(path, dtype=dt, mode="r")
    with open(path, "r", encoding="utf-8") as f:
        text = f.read()
    ids = (tokenizer or ByteTokenizer()).encode(text)
    return np.asarray(ids, dtype=np.uint32 if max(ids, default=0) >= 2**16 else np.uint16)


class IndexSampler:
    """Batches of item indices, without replacement within an epoch, with a resumable position.

    Each epoch visits the items 0..n-1 in a permutation drawn from (seed, epoch). A global batch
    is `batch_size * dp_size` items; data-parallel rank r takes items r::dp_size of it, so the
    global batch does not depend on the DP degree. (epoch, cursor) is the whole state: saving it
    resumes exactly.
    """

    def __init__(self, num_items: int, batch_size: int, seed: int = 0, dp_rank: int = 0,
                 dp_size: int = 1, what: str = "items"):
        if num_items < batch_size * dp_size:
            raise ValueError(f"the data holds {num_items} {what}, fewer than one global batch "
                             f"of {batch_size * dp_size}")
        self.num_items, self.batch_size = num_items, batch_size
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_items, generator=g)

    def next_indices(self) -> List[int]:
        """This rank's share of the next global batch (batch_size indices)."""
        n = self.batch_size * self.dp_size
        if self.cursor + n > self.num_items:
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._permutation()
        picks = self._order[self.cursor:self.cursor + n][self.dp_rank::self.dp_size]
        self.cursor += n
        return picks.tolist()

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "num_items": self.num_items}

    def load_state_dict(self, s: Dict[str, int]) -> None:
        if s["num_items"] != self.num_items or s["seed"] != self.seed:
            raise ValueError(f"the checkpoint's data position was saved for {s['num_items']} "
                             f"items and seed {s['seed']}, this run has {self.num_items} and "
                             f"seed {self.seed}: different data, --seq-len or --seed")
        self.epoch, self.cursor = s["epoch"], s["cursor"]
        self._order = self._permutation()


class WindowSampler(IndexSampler):
    """Random windows of seq_len + 1 tokens of a token stream cut into non-overlapping windows
    (window i starts at i * seq_len); see IndexSampler for the order and the DP split."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1):
        self.tokens, self.seq_len = tokens, seq_len
        super().__init__((len(tokens) - 1) // seq_len, batch_size, seed, dp_rank, dp_size,
                         what=f"windows of {seq_len + 1} tokens (use a shorter --seq-len or "
                              f"more data)")

    def next_batch(self) -> torch.Tensor:
        """This rank's int64 [batch_size, seq_len + 1] windows of the next global batch."""
        return window_rows(self.tokens, self.next_indices(), self.seq_len)


def window_rows(tokens: np.ndarray, windows: Sequence[int], seq_len: int) -> torch.Tensor:
    """int64 [len(windows), seq_len + 1]: window i = tokens[i * seq_len : (i + 1) * seq_len + 1]."""
    rows = [np.asarray(tokens[i * seq_len:(i + 1) * seq_len + 1], dtype=np.int64) for i in windows]
    return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, seq_len + 1,
                                                                     dtype=torch.int64)


def check_vocab(tokens: np.ndarray, vocab_size: int, path: str) -> None:
    top = int(tokens.max()) if len(tokens) else 0
    if top >= vocab_size:
        raise ValueError(f"{path} holds token id {top}, outside the model's vocabulary "
                         f"[0, {vocab_size})")


# -- metrics --------------------------------------------------------------------------------------
class MetricLogger:
    """One JSON object per line in `<out>/metrics.jsonl`, a short line on stdout (through tqdm
    when a bar is active), TensorBoard scalars when tensorboard is installed. Only rank 0 writes.

    resume_step: continue an existing file, dropping rows logged after that step (the steps an
    interrupted run did after its last checkpoint are redone, so they are logged again)."""

    def __init__(self, out_dir: str, enabled: bool = True, tensorboard: bool = True,
                 resume_step: Optional[int] = None):
        self.enabled, self.path = enabled, os.path.join(out_dir, "metrics.jsonl")
        self.tb = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        kept = []
        if resume_step is not None and os.path.exists(self.path):
            kept = [r for r in read_jsonl(self.path) if r.get("step", 0) <= resume_step]
        self.f = open(self.path, "w")
        for r in kept:
            self.f.write(json.dumps(r) + "\n")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(out_dir, "tb"))
            except Exception:   # tensorboard is optional
                self.tb = None

    def log(self, row: Dict, echo: bool = True) -> None:
        if not self.enabled:
            return
        row = {"time": round(time.time(), 3), **row}
        self.f.write(json.dumps(row) + "\n")
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


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def read_jsonl(path: str) -> List[Dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(jsonl_path: str, png_path: str, keys: Sequence[str], title: str = "") -> str:
    """A PNG with one panel per key (y against "step"), from the metrics JSONL."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = read_jsonl(jsonl_path)
    keys = [k for k in keys if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4.5 * max(1, len(keys)), 3.4),
                             squeeze=False)
    for ax, k in zip(axes[0], keys):
        pts = [(r["step"], r[k]) for r in rows if k in r and "step" in r]
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


def response_loss(model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]
                  ) -> torch.Tensor:
    """SFT loss: mean -log p over the response tokens only (the prompt is context, not target).
    Each sequence is prompt + response; tonp's token logprobs score it in one packed forward."""
    seqs = [torch.tensor(list(p) + list(r), dtype=torch.int64) for p, r in zip(prompts, responses)]
    lps = model.token_logprobs(seqs)                      # lps[i][j] = log p(seq_i[j+1] | ...)
    resp = [lp[len(p) - 1:] for lp, p in zip(lps, prompts)]
    return -torch.cat(resp).mean()
