"""Loads the C++ extension (`torch.ops.tonp.*`) and registers its fake (meta) implementations
and its autograd: forward = the invariant kernel, backward = autograd of `reference` (standard
torch math in fp32; gradients need to be correct, not invariant)."""
from __future__ import annotations

import torch

from . import reference

try:
    from . import _C as C  # noqa: F401  (TORCH_LIBRARY(tonp) registration happens on import)
    BUILD_ERROR = None
except ImportError as e:  # only without a build: "torch" mode still works
    C, BUILD_ERROR = None, e


def require_built() -> None:
    if C is None:
        raise ImportError("tonp_kernels._C is not built: run `make build` (or `pip install "
                          f"--no-build-isolation -e .`): {BUILD_ERROR}")


_lib = "tonp::"


if C is not None:  # registrations need the ops defined by the extension
    from . import _register  # noqa: F401
