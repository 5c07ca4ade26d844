"""Which Triton kernel runs each tonp op: the exact launchers by name, and the `fast` ones found by
name in the `fast_*` modules of this package.

Every kernel here takes the op's schema arguments (library.cpp: `torch.ops.tonp.<op>`), in that
order, and returns what the C++ op returns, so the dispatcher can call either. A fast kernel
plugs in by name: a module `tonp_kernels/accel/fast_<anything>.py` that defines a function named
after an op in OPS (with that op's schema signature) serves the op under
`tonp_kernels.use("invariant", numerics="fast")`; an op without one runs its exact kernel.
"""
from __future__ import annotations

import collections
import importlib
import pkgutil
from typing import Callable, Dict

from .. import _mode

# op -> the module (of this package) whose function of that name is the exact kernel.
EXACT: Dict[str, str] = {
    "linear": "linear", "moe_route": "moe", "moe_experts": "moe", "rms_norm": "rowwise",
    "silu_mul": "rowwise", "rope": "rowwise", "moe_combine": "rowwise",
    "attention_varlen": "attention", "attention_paged": "attention", "lse_partial": "vocab",
    "lse_finish": "vocab", "token_logprobs": "vocab", "max_with_index": "vocab",
    "argmax": "vocab", "sample": "sample",
}
OPS = tuple(EXACT)

# Kernel lookups per op since import: the seam that shows which ops ran on the Triton kernels.
CALLS: collections.Counter = collections.Counter()
_exact: Dict[str, Callable] = {}
_fast: Dict[str, Callable] | None = None


def exact(op: str) -> Callable:
    """The exact kernel of `op`."""
    fn = _exact.get(op)
    if fn is None:
        module = importlib.import_module(f"{__package__}.{EXACT[op]}")
        fn = _exact[op] = getattr(module, op)
    return fn


def fast_kernels() -> Dict[str, Callable]:
    """{op: fast kernel} from every fast_* module of this package (imported once)."""
    global _fast
    if _fast is None:
        found = {}
        for info in sorted(pkgutil.iter_modules(_package_path()), key=lambda m: m.name):
            if not info.name.startswith("fast_"):
                continue
            module = importlib.import_module(f"{__package__}.{info.name}")
            for op in OPS:
                fn = getattr(module, op, None)
                if callable(fn) and getattr(fn, "__module__", None) == module.__name__:
                    if op in found:
                        raise RuntimeError(f"tonp_kernels.accel: two fast kernels for {op}: "
                                           f"{found[op].__module__} and {module.__name__}")
                    found[op] = fn
        _fast = found
    return _fast


def _package_path():
    return importlib.import_module(__package__).__path__


def kernel(op: str) -> Callable:
    """The kernel of `op` for the calling context's numerics (fast where one exists)."""
    CALLS[op] += 1
    if _mode.get_numerics() == "fast":
        fn = fast_kernels().get(op)
        if fn is not None:
            return fn
    return exact(op)
