"""The kernel mode switch: "invariant" (tonp's order-locked kernels) or "torch" (stock ops)."""
from __future__ import annotations

MODES = ("invariant", "torch")
_mode = "invariant"


def get_mode() -> str:
    return _mode


class use:
    """Select the kernel mode, globally or for a `with` block.

    `tonp_kernels.use("torch")` switches at once; `with tonp_kernels.use("torch"): ...` switches
    for the block and restores the previous mode afterwards.
    """

    def __init__(self, mode: str):
        if mode not in MODES:
            raise ValueError(f"tonp_kernels.use: mode must be one of {MODES}, got {mode!r}")
        global _mode
        self.previous, _mode = _mode, mode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _mode
        _mode = self.previous
        return False
