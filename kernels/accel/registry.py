"""Which Triton kernel runs each tonp op: the op table's (tonp_kernels/table.py) `exact` and
`fast` modules of this package, each holding a function named after the op.

Every kernel here takes the op's schema arguments (`torch.ops.tonp.<op>`), in that order, and
returns what the C++ op returns, so the dispatcher can call either. Under
`tonp_kernels.use("invariant", numerics="fast")` an op with a fast kernel runs it; every other
op (and exact numerics) runs its exact kernel.
"""
from __future__ import annotations

import collections
import importlib
from typing import Callable, Dict

from .. import _mode
from ..table import OPS as _TABLE

# op -> the module (of this package) whose function of that name is the exact / fast kernel.
EXACT: Dict[str, str] = {o.name: o.exact for o in _TABLE if o.exact}
FAST: Dict[str, str] = {o.name: o.fast for o in _TABLE if o.fast}
OPS = tuple(EXACT)

# Kernel lookups per op since import: the seam that shows which ops ran on the Triton kernels.
CALLS: collections.Counter = collections.Counter()
_exact: Dict[str, Callable] = {}
_fast: Dict[str, Callable] = {}


def _load(op: str, module: str) -> Callable:
    return getattr(importlib.import_module(f"{__package__}.{module}"), op)


def exact(op: str) -> Callable:
    """The exact kernel of `op`."""
    fn = _exact.get(op)
    if fn is None:
        fn = _exact[op] = _load(op, EXACT[op])
    return fn


def fast(op: str) -> Callable | None:
    """The fast kernel of `op`, or None where it has none (it runs its exact kernel)."""
    fn = _fast.get(op)
    if fn is None and op in FAST:
        fn = _fast[op] = _load(op, FAST[op])
    return fn


def fast_kernels() -> Dict[str, Callable]:
    """{op: fast kernel} for every op with one."""
    return {op: fast(op) for op in FAST}


def kernel(op: str) -> Callable:
    """The kernel of `op` for the calling context's numerics (fast where one exists)."""
    CALLS[op] += 1
    if _mode.get_numerics() == "fast":
        fn = fast(op)
        if fn is not None:
            return fn
    return exact(op)
