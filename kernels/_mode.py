"""The kernel mode, per thread and per context: "invariant" (tonp's order-locked kernels) or
"torch" (stock ops, for comparison). A new thread starts in "invariant", whatever its creator
uses; an asyncio task starts in a copy of its creator's mode. See docs/kernels.md."""
from __future__ import annotations

import contextvars

import torch

MODES = ("invariant", "torch")
_MODE = contextvars.ContextVar("tonp_kernels.mode", default="invariant")


@torch.compiler.assume_constant_result  # dynamo cannot trace ContextVar.get: a compiled graph
def get_mode() -> str:                   # keeps the mode it was traced in
    """The kernel mode of the calling thread / context."""
    return _MODE.get()


class use:
    """Select the kernel mode of the current thread / context, at once or for a `with` block.

    `tonp_kernels.use("torch")` switches at once; `with tonp_kernels.use("torch"): ...` switches
    for the block and then restores exactly the mode it replaced. Other threads never see it.
    """

    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"tonp_kernels.use: mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._token = _MODE.set(mode)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _MODE.reset(self._token)
        return False
