"""Observation points for tools that inspect a forward (the diagnoser), without layers knowing them.

A layer calls `probe(op, tensor, **meta)` where a value has no module boundary of its own (for
example which token each expert-dispatched row belongs to). It does nothing unless a tool has
pushed a hook with `push_hook`; the tool lives above the layers and imports this module, never
the other way round.
"""
from __future__ import annotations

from typing import Callable, List

import torch

_HOOKS: List[Callable[..., None]] = []


def probe(op: str, value: torch.Tensor, **meta) -> None:
    """Hand `value` to the innermost installed hook, if any (a no-op otherwise)."""
    if _HOOKS:
        _HOOKS[-1](op, value, **meta)


def push_hook(fn: Callable[..., None]) -> None:
    _HOOKS.append(fn)


def pop_hook(fn: Callable[..., None]) -> None:
    _HOOKS.remove(fn)
