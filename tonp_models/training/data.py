"""Tokenizers, token data and samplers with a resumable position (bit-exact resume needs it).

    tokens = load_tokens("corpus.txt")                 # or a memory-mapped .u16 / .u32 file
    sampler = WindowSampler(tokens, seq_len=64, batch_size=8, seed=0, dp_rank=r, dp_size=d)
    batch = sampler.next_batch()                       # int64 [8, 65]
    state = sampler.state_dict(); sampler.load_state_dict(state)
"""
from __future__ import annotations

import os
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch


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


TOKEN_FILE_DTYPES = {".u16": np.uint16, ".uint16": np.uint16, ".u32": np.uint32,
                     ".uint32": np.uint32}


def load_tokens(path: str, tokenizer=None, token_dtype: Optional[str] = None) -> np.ndarray:
    """A 1-D array of token ids: a memory-mapped binary token file (raw uint16/uint32, little
    endian; the dtype from `token_dtype` or the suffix .u16/.u32/.bin=uint16), or a UTF-8 text
    file encoded with `tokenizer` (bytes by default)."""
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
        if os.path.getsize(path) == 0:
            raise ValueError(f"{path} is empty")
        return np.memmap(path, dtype=dt, mode="r")
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e}); a binary token file needs the "
                         f"suffix .u16/.u32/.bin or --token-dtype") from e
    ids = (tokenizer or ByteTokenizer()).encode(text)
    return np.asarray(ids, dtype=np.uint32 if max(ids, default=0) >= 2**16 else np.uint16)


def check_vocab(tokens: np.ndarray, vocab_size: int, path: str) -> None:
    """ValueError naming the largest id when `tokens` holds an id outside [0, vocab_size)."""
    top = int(tokens.max()) if len(tokens) else 0
    if top >= vocab_size:
        raise ValueError(f"{path} holds token id {top}, outside the model's vocabulary "
                         f"[0, {vocab_size})")


class IndexSampler:
    """Batches of item indices, without replacement within an epoch, with a resumable position.

    Each epoch visits the items 0..n-1 in a permutation drawn from (seed, epoch). A global batch
    is `batch_size * dp_size` items; data-parallel rank r takes items r::dp_size of it, so the
    global batch does not depend on the DP degree. (epoch, cursor) is the whole state.
    """

    def __init__(self, num_items: int, batch_size: int, seed: int = 0, dp_rank: int = 0,
                 dp_size: int = 1, what: str = "items"):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
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
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
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


class ItemSampler(IndexSampler):
    """IndexSampler over a list: `next_batch()` is this rank's items of the next global batch."""

    def __init__(self, items: Sequence, batch_size: int, seed: int = 0, dp_rank: int = 0,
                 dp_size: int = 1, what: str = "items"):
        self.items = items
        super().__init__(len(items), batch_size, seed, dp_rank, dp_size, what)

    def next_batch(self) -> List:
        return [self.items[i] for i in self.next_indices()]
