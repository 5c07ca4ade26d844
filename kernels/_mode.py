"""The kernel mode, per thread and per context: "invariant" (tonp's order-locked kernels) or
"torch" (stock ops, for comparison); and, for the invariant kernels, the numerics of the Triton
kernels ("exact": the CPU's bits; "fast": tensor cores, invariant within one device model) and
the backend of CPU tensors ("auto": the C++ kernels; "triton": the Triton kernels under Triton's
interpreter). A new thread starts in ("invariant", "exact", default backend), whatever its
creator uses; an asyncio task starts in a copy of its creator's context. See docs/kernels.md."""
from __future__ import annotations

import contextvars
import os

import torch

MODES = ("invariant", "torch")
NUMERICS = ("exact", "fast")
BACKENDS = ("auto", "triton")
# TONP_ACCEL_ON_CPU=1 (read once, at import) makes "triton" the default backend of CPU tensors.
DEFAULT_BACKEND = "triton" if os.environ.get("TONP_ACCEL_ON_CPU") == "1" else "auto"
_MODE = contextvars.ContextVar("tonp_kernels.mode", default="invariant")
_ACCEL = contextvars.ContextVar("tonp_kernels.accel", default=("exact", DEFAULT_BACKEND))


@torch.compiler.assume_constant_result  # dynamo cannot trace ContextVar.get: a compiled graph
def get_mode() -> str:                   # keeps the mode it was traced in
    """The kernel mode of the calling thread / context."""
    return _MODE.get()


@torch.compiler.assume_constant_result
def get_numerics() -> str:
    """The numerics of the Triton kernels in the calling context: "exact" or "fast"."""
    return _ACCEL.get()[0]


@torch.compiler.assume_constant_result
def get_backend() -> str:
    """Where CPU tensors run in invariant mode: "auto" (C++) or "triton" (interpreted)."""
    return _ACCEL.get()[1]


def _choice(value, allowed, name):
    if value not in allowed:
        raise ValueError(f"tonp_kernels.use: {name} must be one of {allowed}, got {value!r}")
    return value


class use:
    """Select the kernel mode of the current thread / context, at once or for a `with` block.

    `tonp_kernels.use("torch")` switches at once; `with tonp_kernels.use("torch"): ...` switches
    for the block and then restores exactly the settings it replaced. Other threads never see it.

    numerics: "exact" (each output performs the CPU kernel's operations: the CPU's bits on any
    device) or "fast" (the tensor-core kernels where they exist, exact elsewhere); it applies to
    the Triton kernels, the C++ kernels have one arithmetic. backend: "auto" (CPU tensors run
    the C++ kernels, CUDA / NPU tensors the Triton kernels) or "triton" (CPU tensors too run the
    Triton kernels, through Triton's interpreter: slow, for tests). None keeps the context's
    current value.
    """

    def __init__(self, mode: str, *, numerics: str | None = None, backend: str | None = None):
        _choice(mode, MODES, "mode")
        current = _ACCEL.get()
        accel = (current[0] if numerics is None else _choice(numerics, NUMERICS, "numerics"),
                 current[1] if backend is None else _choice(backend, BACKENDS, "backend"))
        self.mode, self.numerics, self.backend = mode, accel[0], accel[1]
        self._tokens = (_MODE.set(mode), _ACCEL.set(accel))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _ACCEL.reset(self._tokens[1])
        _MODE.reset(self._tokens[0])
        return False
