"""tonp_kernels: order-locked ops whose result for a row never depends on the batch.

    import tonp_kernels as tk
    y = tk.linear(x, w)                      # chunk-tree linear, same bits for any M
    with tk.use("torch"):                    # stock torch ops (this thread only), for comparison
        y_stock = tk.linear(x, w)
    y_gpu = tk.linear(x.cuda(), w.cuda())    # the Triton kernels: the same bits as y
    with tk.use("invariant", numerics="fast"):   # tensor-core kernels where they exist
        y_fast = tk.linear(x.cuda(), w.cuda())
    tk.isa()                                 # "avx512bf16", "avx2" or "portable": the table in use

docs/CONTRACT.md is the numerics contract, docs/kernels.md how the package meets it and how a
call is routed on each device (from the op table, `tonp_kernels.table`), docs/accelerators.md
the Triton kernels; `tonp_kernels.reference` holds the torch oracles.
"""
if __name__ == "kernels":
    # This folder is tonp_kernels' source. From a checkout's root (cwd on sys.path) it shadows the
    # installed package named `kernels` (Hugging Face's, which transformers >= 5.25 requires and
    # imports, and whose egg_info writer setuptools loads while building tonp): hand the name to
    # that package. Where none is installed, stay an empty module with no submodules (an older
    # transformers imports it to read a version, and must find none), whose attributes say why.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None:
        __path__ = []  # noqa: F811  (no submodules: kernels.x is not found)

        def __getattr__(name):
            raise AttributeError(f"module 'kernels' has no attribute {name!r}: no package named "
                                 "'kernels' is installed, and this checkout's kernels/ folder is "
                                 "the source of tonp_kernels (import tonp_kernels)")
    else:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module  # what `import kernels` returns once this body ends
        _spec.loader.exec_module(_module)
else:
    from ._arg_checks import MAX_TEMPERATURE, MIN_TEMPERATURE, check_temperature
    from ._library import FLOAT_DTYPES, MAX_CHUNKS, isa
    from ._mode import BACKENDS, MODES, NUMERICS, get_backend, get_mode, get_numerics, use
    from .ops import (DEFAULT_CHUNKS, attention_paged, attention_varlen, linear, linear_partial,
                      moe_combine, moe_experts, moe_route, on_huge_pages, pack_weight_groups,
                      rms_norm, rope, silu_mul, tree_sum)
    from .vocab import (argmax, log_softmax, logsumexp, lse_finish, lse_partial, max_with_index,
                        sample, target_logit, token_logprobs)
    from . import reference  # noqa: F401

__all__ = [
    "use", "get_mode", "get_numerics", "get_backend", "MODES", "NUMERICS", "BACKENDS", "isa", "MAX_CHUNKS", "FLOAT_DTYPES", "reference", "check_temperature", "MIN_TEMPERATURE",
    "MAX_TEMPERATURE", "DEFAULT_CHUNKS", "linear", "linear_partial", "tree_sum", "rms_norm",
    "silu_mul", "attention_varlen", "attention_paged", "rope", "logsumexp", "lse_partial",
    "lse_finish", "log_softmax", "token_logprobs", "target_logit", "argmax", "max_with_index",
    "sample", "moe_route", "moe_combine", "moe_experts", "pack_weight_groups", "on_huge_pages",
]
