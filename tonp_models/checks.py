"""Argument checks of the public entry points (`generate`, `Qwen3MoeForCausalLM.token_logprobs`):
integer-like values, real numbers, temperatures, token-id sequences (a request's own rules,
built on these, are tonp_models.engine.rules'), and `TPCheck`, which makes
the ranks of a tensor-parallel group prove they were given the same call.

Every check names the function, the argument, the value and the rule: TypeError for a wrong type
(a bool or a float where an integer belongs, a string), ValueError / IndexError for a wrong value.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

import tonp_kernels as tk
import tonp_parallel as tpar


def show(v) -> str:
    """A value, briefly, for an error message."""
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)} and dtype {v.dtype}"
    text = repr(v)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({type(v).__name__})"


def as_int(who: str, name: str, v, lo: int, hi: Optional[int] = None) -> int:
    """v as a Python int in [lo, hi): an int, a numpy integer or a 0-d integer tensor; never a
    bool or a float (TypeError), never out of range (ValueError)."""
    try:
        if isinstance(v, bool) or isinstance(v, torch.Tensor) and (v.dim() or v.is_complex()
                                                                   or v.dtype == torch.bool):
            raise TypeError
        i = operator.index(v)
    except TypeError:
        raise TypeError(f"{who}: {name} must be an integer, got {show(v)}") from None
    if i < lo or (hi is not None and i >= hi):
        rule = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        raise ValueError(f"{who}: {name} must be {rule}, got {i}")
    return i


def as_real(who: str, name: str, v) -> float:
    """v as a float: a Python or numpy real number or a 0-d real tensor; never a bool."""
    if isinstance(v, bool) or not (isinstance(v, numbers.Real) or isinstance(v, torch.Tensor)
                                   and v.dim() == 0 and v.dtype != torch.bool
                                   and not v.is_complex()):
        raise TypeError(f"{who}: {name} must be a real number, got {show(v)}")
    try:
        return float(v)
    except OverflowError:  # an int beyond the float range
        return math.copysign(math.inf, v)


def check_temperature(who: str, temperature, *, greedy_ok: bool) -> float:
    """temperature as a float: 0 (greedy, where greedy_ok) or a number the kernels can divide
    fp32 logits by (`tonp_kernels.check_temperature`: its fp32 value is a normal float)."""
    t = as_real(who, "temperature", temperature)
    try:
        return tk.check_temperature(t, op=who, allow_zero=greedy_ok)
    except ValueError as e:  # the kernels' rule, named by this entry point
        raise ValueError(str(e).removeprefix("tonp.")) from None


def sequence_list(who: str, name: str, x) -> list:
    """A list of token-id sequences from a list, a tuple, a 2-D tensor or another iterable."""
    if getattr(x, "ndim", None) == 1 or isinstance(x, (list, tuple)) and x and \
            all(isinstance(v, numbers.Integral) for v in x):
        raise TypeError(f"{who}: {name} must be a list of 1-D token-id sequences (got one "
                        f"sequence of ints: wrap it in a list)")
    try:
        if isinstance(x, (str, bytes, dict)) or getattr(x, "ndim", 2) != 2:
            raise TypeError
        return list(x)
    except TypeError:
        raise TypeError(f"{who}: {name} must be a list of 1-D token-id sequences, got "
                        f"{show(x)}") from None


def token_ids(who: str, name: str, x, vocab: Optional[int] = None) -> torch.Tensor:
    """A 1-D sequence of integer token ids in [0, vocab) (tensor, array or list) -> int64 [n].
    vocab None: the caller checks the range (a request's prompt: engine/rules.py)."""
    t = None
    if not isinstance(x, (str, bytes)) and not (isinstance(x, (list, tuple))
                                              and any(isinstance(v, bool) for v in x)):
        try:
            t = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            if isinstance(x, (list, tuple)) and all(isinstance(v, int) for v in x):
                raise IndexError(f"{who}: {name} holds token ids beyond int64, outside the "
                                 f"vocabulary") from None
    if t is None or t.dim() != 1 or (t.numel() and (t.is_floating_point() or t.is_complex()
                                                    or t.dtype == torch.bool)):
        raise TypeError(f"{who}: {name} must be a 1-D sequence of integer token ids, got "
                        f"{show(x)}")
    t = t.long()
    if vocab is not None:
        in_vocabulary(who, name, t, vocab)
    return t


def in_vocabulary(who: str, name: str, ids, vocab: int) -> None:
    """IndexError unless every token id of `ids` (an integer tensor or a list of ints) lies in
    [0, vocab): the one wording of the vocabulary rule (prompts, scored sequences, input_ids)."""
    if isinstance(ids, torch.Tensor):
        lo, hi = torch.aminmax(ids) if ids.numel() else (0, 0)   # one read of the values
        if int(lo) >= 0 and int(hi) < vocab:
            return
        bad = ids[(ids < 0) | (ids >= vocab)].unique()[:8].tolist()
    else:
        bad = sorted({t for t in ids if not 0 <= t < vocab})[:8]
        if not bad:
            return
    raise IndexError(f"{who}: {name} holds token ids {bad} outside the vocabulary [0, {vocab})")


def digest(*parts) -> int:
    """A 64-bit hash (the same in every process) of reprs and of int64 tensors' bytes."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(p.detach().cpu().numpy().tobytes() if isinstance(p, torch.Tensor)
                 else repr(p).encode())
        h.update(b"|")
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass
class TPCheck:
    """Every rank of the model's TP group must make the same call with the same token ids and
    settings: all-gather a 64-bit hash of them (16 bytes a rank) and raise on every rank when
    they differ, before a collective of the forward can pair mismatched messages. A no-op at
    TP 1; EP-only and data-parallel ranks may differ and are not checked."""
    who: str
    group: Optional[dist.ProcessGroup] = None
    device: torch.device = torch.device("cpu")

    @classmethod
    def of(cls, model, who: str) -> "TPCheck":
        groups = getattr(model, "groups", None) or tpar.ParallelGroups.single()  # a stand-in
        # The ranks of one replica: TP x CP x PP when the groups know it, else the TP group.
        group = groups.model_group or groups.tp_group
        if group is None or tpar.group_size(group) == 1:
            return cls(who)
        return cls(who, group, next(model.parameters()).device)

    def agreed(self, check: Callable, key: Callable):
        """check() (the argument checks) -> its value once every rank's key(value) agrees. A rank
        whose check raised re-raises its own error; its peers raise naming it (none hangs)."""
        try:
            value = check()
        except Exception:
            self.agree(None, "call")
            raise
        if self.group is not None:
            self.agree(digest(self.who, tk.get_mode(), *key(value)),
                       "call (token ids, settings or kernel mode)")
        return value

    def agree(self, h: Optional[int], what: str) -> None:
        """All-gather (ok, h) of a digest h; raise on every rank unless all ranks' h are equal.
        h None: this rank refused the call (it raises its own error)."""
        if self.group is None:
            return
        mine = torch.tensor([h is not None, h or 0], dtype=torch.int64, device=self.device)
        rows = tpar.all_gather_stacked(mine, self.group).tolist()                # (W, 2)
        if h is None:
            return                                           # this rank raises its own error
        ranks = dist.get_process_group_ranks(self.group)
        refused = [r for r, (ok, _) in enumerate(rows) if not ok]
        differ = [r for r, (_, d) in enumerate(rows) if d != rows[0][1]]
        if refused or differ:
            bad = refused or differ
            how = "refused their arguments (see the error on those ranks)" if refused else \
                f"got a different {what} than TP rank 0 (global rank {ranks[0]})"
            raise RuntimeError(f"{self.who}: TP rank(s) {bad} (global rank(s) "
                               f"{[ranks[r] for r in bad]}) {how}; every rank of a tensor-"
                               f"parallel group must make the same call with the same token "
                               f"ids and settings")
