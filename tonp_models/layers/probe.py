"""The one seam through which tools (the diagnoser) observe values inside a layer's forward.

    probe("partial", p, kind="partial")      # a layer reports a value; a no-op without a hook
    if probing(): probe("k", expensive())    # guard values that cost something to build
    if wants_detail(): ...                   # the hook asks for a step-by-step path (MoE experts)

A hook is `fn(op, value, **meta)`, installed for the current thread / async context with
`push_hook(fn, detail=...)` and removed with `pop_hook(fn)`; without one every call is a single
ContextVar read. Layers never know who listens; the tool names a value after the module that
probed it (e.g. "o_proj.partial"). Meta keywords (all optional):
  kind       "op" (a row-wise result), "route" (a discrete choice: expert ids), "partial" (this
             rank's fp32 share of a reduction over TP ranks), "collective" (a reduction's result
             over ranks), "dispatch" (EP: the rows sent to other ranks; value = their expert ids);
  shard_dim  the dim of `value` split over the TP ranks (0: rows split); None = replicated;
  rows       int64 [R]: value row i belongs to the forward's row rows[i] (default: row i);
  experts    int64 [R]: the expert each row went through (rows are (token, expert) pairs);
  received   True: `rows` index the rows this rank received from its EP peers, not its own.
Detail: the MoE block runs the fused expert op in production; under `wants_detail()` it also runs
its per-expert reference path (the same bits, tests/test_model_invariance.py) and probes each
step ("expert.gate_up", "expert.act", "expert.down"). docs/diagnose.md has the whole list.
"""
from __future__ import annotations

from contextvars import ContextVar
from typing import Callable, Tuple

import torch

Hook = Callable[..., None]
_HOOKS: ContextVar[Tuple[Tuple[Hook, bool], ...]] = ContextVar("tonp_probe_hooks", default=())


def probe(op: str, value: torch.Tensor, **meta) -> None:
    """Hand `value` to the innermost hook of this context, if any (see the module doc)."""
    hooks = _HOOKS.get()
    if hooks:
        hooks[-1][0](op, value, **meta)


def probing() -> bool:
    """Whether a hook listens in this context (guard probes whose value costs work)."""
    return bool(_HOOKS.get())


def wants_detail() -> bool:
    """Whether the innermost hook asked layers to run and probe their step-by-step paths."""
    hooks = _HOOKS.get()
    return bool(hooks) and hooks[-1][1]


def push_hook(fn: Hook, *, detail: bool = False) -> None:
    """Install `fn` as the innermost hook of this context."""
    _HOOKS.set(_HOOKS.get() + ((fn, detail),))


def pop_hook(fn: Hook) -> None:
    """Remove the innermost installation of `fn` from this context."""
    hooks = _HOOKS.get()
    for i in range(len(hooks) - 1, -1, -1):
        if hooks[i][0] == fn:
            _HOOKS.set(hooks[:i] + hooks[i + 1:])
            return
    raise ValueError(f"pop_hook: {fn!r} is not installed in this context")


__all__ = ["probe", "probing", "wants_detail", "push_hook", "pop_hook"]
