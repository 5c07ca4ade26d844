"""Loads the C++ extension, which defines `torch.ops.tonp.*` with its CPU kernels and C++
autograd (csrc/), then registers the ops' fake kernels and their CUDA / NPU kernels from the op
table (_register.py). Also the constants the C++ side owns, read from it once: MAX_CHUNKS (the
most reduction chunks a linear may use, kernels.h) and FLOAT_DTYPES (the float dtypes the
kernels take). Without a build only the "torch" mode works; every invariant op raises
ImportError saying how to build."""
from __future__ import annotations

import torch

try:
    from . import _C as C  # noqa: F401  (TORCH_LIBRARY(tonp) registration happens on import)
    BUILD_ERROR = None
except ImportError as e:
    C, BUILD_ERROR = None, e


def require_built() -> None:
    if C is None:
        raise ImportError("tonp_kernels._C is not built: run `make build` (or `pip install "
                          f"--no-build-isolation -e .`): {BUILD_ERROR}")


def op(name: str):
    """The torch.ops.tonp overload `name`, resolved once (or a stub that explains the build)."""
    if C is None:
        def missing(*args, **kwargs):
            require_built()
        return missing
    return getattr(torch.ops.tonp, name).default


def isa() -> str:
    """The kernel table this process uses: "avx512bf16" (AVX512-F/BW/VL/BF16, its instruction
    self-checked), "avx2" (AVX2 + FMA, or TONP_FORCE_AVX2=1) or "portable" (no AVX2, or
    TONP_FORCE_PORTABLE=1; both read at each call). All give the same bits."""
    require_built()
    return torch.ops.tonp.isa()


if C is not None:
    MAX_CHUNKS: int = torch.ops.tonp.max_chunks()
    FLOAT_DTYPES: tuple = tuple(getattr(torch, name) for name in torch.ops.tonp.float_dtypes())
    from . import _register  # noqa: F401,E402  (registrations need the ops the extension defines)
else:  # the stock ops' checks still need them; the build is what `require_built` asks for
    MAX_CHUNKS, FLOAT_DTYPES = 64, (torch.float32, torch.bfloat16)
