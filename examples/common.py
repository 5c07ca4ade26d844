"""Pieces the example scripts share: tokenizers, token data, the optimizer and schedule, gradient
averaging and clipping over process groups, metrics (stdout, JSONL, TensorBoard, PNG).

Checkpointing lives in `checkpointing.py`. Everything here works in one plain process; under
torchrun the caller passes a `tonp_parallel.ParallelGroups` and only the functions that take one
talk to other ranks.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

import tonp_parallel as tpar
from tonp_models import Qwen3MoeForCausalLM

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
        dt = np.dtype(token_dtype) if token_dtype else TOKEN_FILE_DTYPES.get(ext, np.uint16)
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


class WindowSampler:
    """Random windows of seq_len + 1 tokens, without replacement within an epoch.

    The stream is cut into non-overlapping windows (start = i * seq_len); each epoch visits them
    in a permutation drawn from (seed, epoch). A global batch is `batch_size * dp_size` windows;
    data-parallel rank r takes rows r::dp_size, so the global batch does not depend on the DP
    degree. The position (epoch, cursor) is the whole state: saving it resumes exactly.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < batch_size * dp_size:
            raise ValueError(f"the data ({len(tokens)} tokens) holds {self.num_windows} windows "
                             f"of {seq_len + 1} tokens, fewer than one global batch of "
                             f"{batch_size * dp_size}; use a shorter --seq-len or more data")
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_windows, generator=g)

    def next_batch(self) -> torch.Tensor:
        """This rank's int64 [batch_size, seq_len + 1] windows of the next global batch."""
        n = self.batch_size * self.dp_size
        if self.cursor + n > self.num_windows:
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._permutation()
        picks = self._order[self.cursor:self.cursor + n][self.dp_rank::self.dp_size]
        self.cursor += n
        return window_rows(self.tokens, picks.tolist(), self.seq_len)

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "num_windows": self.num_windows}

    def load_state_dict(self, s: Dict[str, int]) -> None:
        if s["num_windows"] != self.num_windows or s["seed"] != self.seed:
            raise ValueError(f"the checkpoint's data position was saved for {s['num_windows']} "
                             f"windows and seed {s['seed']}, this run has {self.num_windows} and "
                             f"seed {self.seed}: different data, --seq-len or --seed")
        self.epoch, self.cursor = s["epoch"], s["cursor"]
        self._order = self._permutation()


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


# -- optimizer, schedule, master weights ----------------------------------------------------------
class MasterWeights:
    """The fp32 tensors the optimizer updates. For fp32 models they ARE the model parameters; for
    bf16 models they are fp32 copies (master weights), written back (rounded) after each step."""

    def __init__(self, model: torch.nn.Module):
        self.names, self.model_params = zip(*[(n, p) for n, p in model.named_parameters()
                                              if p.requires_grad])
        self.params = [p if p.dtype == torch.float32 else
                       p.detach().float().clone().requires_grad_(True) for p in self.model_params]

    @property
    def separate(self) -> bool:
        return any(m is not p for m, p in zip(self.params, self.model_params))

    def grads_to_master(self) -> None:
        for m, p in zip(self.params, self.model_params):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if m is not p:
                m.grad = g.float()
            elif p.grad is None:
                p.grad = g

    @torch.no_grad()
    def master_to_model(self) -> None:
        for m, p in zip(self.params, self.model_params):
            if m is not p:
                p.copy_(m)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {n: m.detach().clone() for n, m, p in zip(self.names, self.params,
                                                         self.model_params) if m is not p}

    @torch.no_grad()
    def load_state_dict(self, s: Dict[str, torch.Tensor]) -> None:
        for n, m, p in zip(self.names, self.params, self.model_params):
            if m is not p:
                if n not in s:
                    raise KeyError(f"the checkpoint has no fp32 master copy of {n}")
                m.copy_(s[n])


def build_optimizer(master: MasterWeights, lr: float, weight_decay: float,
                    betas=(0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW on the fp32 master tensors; no weight decay on norms and biases (1-D tensors).
    foreach=False: one fixed per-tensor update order, the same in every run."""
    decay = [m for m in master.params if m.dim() >= 2]
    no_decay = [m for m in master.params if m.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps,
                             foreach=False)


def warmup_cosine(warmup: int, total: int, min_ratio: float = 0.1):
    """LR multiplier: linear from 1/warmup to 1 over `warmup` steps, then a cosine down to
    min_ratio at `total` (step counts from 0; LambdaLR calls it with the steps done so far)."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


# -- gradients over ranks -------------------------------------------------------------------------
def _expert_param(name: str) -> bool:
    return name.endswith("mlp.gate_up_proj") or name.endswith("mlp.down_proj")


def _sharded_names(model: Qwen3MoeForCausalLM) -> Dict[str, str]:
    """name -> "tp" | "ep" for parameters whose local shape differs from the one-rank model."""
    with torch.device("meta"):
        full = Qwen3MoeForCausalLM(model.config, dtype=model.dtype)
    shapes = {n: p.shape for n, p in full.named_parameters()}
    return {n: ("ep" if _expert_param(n) else "tp") for n, p in model.named_parameters()
            if p.shape != shapes[n]}


class GradSync:
    """Averages gradients over data-parallel replicas and clips by the global norm.

    Dense parameters are replicated over `groups.dp_group`; experts (under EP) over the
    expert-data-parallel group (ranks holding the same experts). Every sum is
    `tonp_parallel.tree_all_reduce` (fixed order: all replicas get the same bits) of one flat
    fp32 buffer; the average divides by the dense DP degree (the loss is a per-rank mean).
    """

    def __init__(self, model: Qwen3MoeForCausalLM, master: MasterWeights, groups,
                 expert_dp_group=None):
        self.master, self.groups = master, groups
        sharded = _sharded_names(model) if groups.world_size > 1 else {}
        self.kind = [sharded.get(n, "rep") for n in master.names]
        self.is_expert = [_expert_param(n) and groups.ep_size > 1 for n in master.names]
        self.expert_dp_group = expert_dp_group

    def average(self) -> None:
        g = self.groups
        if g.dp_size == 1:
            return
        for expert, group in ((False, g.dp_group), (True, self.expert_dp_group)):
            ps = [m for m, e in zip(self.master.params, self.is_expert) if e == expert]
            if not ps:
                continue
            flat = torch.cat([m.grad.reshape(-1) for m in ps])
            flat = tpar.tree_all_reduce(flat, group) / g.dp_size
            for m, part in zip(ps, flat.split([m.numel() for m in ps])):
                m.grad.copy_(part.view_as(m.grad))

    def clip(self, max_norm: float) -> float:
        """Scale grads so the norm over the whole (sharded) model is <= max_norm; returns it."""
        sq = {"rep": torch.zeros((), dtype=torch.float32), "tp": torch.zeros(()),
              "ep": torch.zeros(())}
        for m, kind in zip(self.master.params, self.kind):
            sq[kind] = sq[kind] + m.grad.float().pow(2).sum()
        g = self.groups
        total = sq["rep"]
        if g.tp_size > 1:
            total = total + tpar.tree_all_reduce(sq["tp"].reshape(1), g.tp_group)[0]
        else:
            total = total + sq["tp"]
        if g.ep_size > 1:
            total = total + tpar.tree_all_reduce(sq["ep"].reshape(1), g.ep_group)[0]
        else:
            total = total + sq["ep"]
        norm = float(total.sqrt())
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for m in self.master.params:
                m.grad.mul_(scale)
        return norm


def setup_parallel(tp: int, ep: int):
    """ParallelGroups for this process (torchrun or plain python), plus the expert-DP group."""
    groups = tpar.init_parallel(tp=tp, ep=ep)
    expert_dp = None
    if groups.world_size > 1 and ep > 1:
        import torch.distributed as dist
        layout = tpar.rank_layout(groups.world_size, tp, ep)
        for ranks in layout.expert_dp_groups:     # collective: every rank makes every group
            pg = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if groups.rank in ranks:
                expert_dp = pg
    return groups, expert_dp


def build_model(config, dtype: torch.dtype, groups, seed: int) -> Qwen3MoeForCausalLM:
    """The model, initialised from `seed` (the same weights on every rank for the same shard).
    A NotImplementedError from the model (TP/EP not wired yet) is re-raised with the flags."""
    torch.manual_seed(seed)
    try:
        return Qwen3MoeForCausalLM(config, dtype=dtype,
                                   groups=groups if groups.world_size > 1 else None)
    except NotImplementedError as e:
        raise NotImplementedError(f"this model does not support the requested parallel layout "
                                  f"({groups.describe()}): {e}. Data parallelism (--tp 1 "
                                  f"--ep 1 under torchrun) works.") from e


# -- metrics --------------------------------------------------------------------------------------
class MetricLogger:
    """One JSON object per line in `<out>/metrics.jsonl`, a short line on stdout (through tqdm
    when a bar is active), TensorBoard scalars when tensorboard is installed. Only rank 0 writes."""

    def __init__(self, out_dir: str, enabled: bool = True, tensorboard: bool = True,
                 resume: bool = False):
        self.enabled, self.path = enabled, os.path.join(out_dir, "metrics.jsonl")
        self.tb = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        self.f = open(self.path, "a" if resume else "w")
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
