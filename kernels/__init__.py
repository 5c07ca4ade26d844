"""tonp_kernels: order-locked ops whose result for a row never depends on the batch.

    import tonp_kernels as tk
    y = tk.linear(x, w)                      # chunk-tree linear, same bits for any M
    with tk.use("torch"):                    # stock torch ops, for comparison
        y_stock = tk.linear(x, w)

See CONTRACT.md for the numerics contract; `tonp_kernels.reference` holds the torch oracles.
"""
from ._mode import MODES, get_mode, use
from .ops import *  # noqa: F401,F403
from .ops import __all__ as _ops_all
from . import reference  # noqa: F401

__all__ = ["use", "get_mode", "MODES", "reference", *_ops_all]
