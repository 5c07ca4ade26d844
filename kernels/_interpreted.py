"""CPU tensors on the Triton kernels, through Triton's interpreter: the route of
`use(..., backend="triton")` (or TONP_ACCEL_ON_CPU=1). `on_cpu(fn)` runs an invariant-backend
function inside a dispatch mode that sends every tonp op with a Triton forward kernel
(table.TRITON) to `accel.registry.kernel(op)`, interpreted; the other ops (the backward ones)
keep their C++ CPU kernels. TRITON_INTERPRET=1 is set before the kernels are first imported; a
process that imported them compiled cannot interpret them."""
from __future__ import annotations

import os
import sys

from torch.utils._python_dispatch import TorchDispatchMode

from .table import TRITON

_ROUTED = frozenset(TRITON)


class _TritonOnCPU(TorchDispatchMode):
    """Every tonp op of table.TRITON on the Triton kernels (interpreted); the rest as is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("tonp::") and name[6:] in _ROUTED:
            from .accel import registry
            return registry.kernel(name[6:])(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def require_interpreter() -> None:
    """Import the kernels interpreted (setting TRITON_INTERPRET=1 first), or explain why not."""
    if "tonp_kernels.accel._launch" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    from .accel import _launch
    if not _launch.INTERPRETED:
        raise RuntimeError("tonp_kernels: backend='triton' runs CPU tensors through Triton's "
                           "interpreter, but this process imported tonp's Triton kernels "
                           "compiled; set TRITON_INTERPRET=1 before the first tonp_kernels call")


def on_cpu(fn):
    """fn (an invariant-backend function) with its tonp ops on the interpreted Triton kernels."""
    require_interpreter()

    def run(*args):
        with _TritonOnCPU():
            return fn(*args)
    return run
