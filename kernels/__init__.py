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
from ._arg_checks import MAX_TEMPERATURE, MIN_TEMPERATURE, check_temperature
from ._library import FLOAT_DTYPES, MAX_CHUNKS, isa
from ._mode import BACKENDS, MODES, NUMERICS, get_backend, get_mode, get_numerics, use
from .ops import (DEFAULT_CHUNKS, attention_paged, attention_varlen, linear, linear_partial,
                  moe_combine, moe_experts, moe_route, rms_norm, rope, silu_mul, tree_sum)
from .vocab import (argmax, log_softmax, logsumexp, lse_finish, lse_partial, max_with_index,
                    sample, target_logit, token_logprobs)
from . import reference  # noqa: F401

__all__ = [
    "use", "get_mode", "get_numerics", "get_backend", "MODES", "NUMERICS", "BACKENDS", "isa", "MAX_CHUNKS", "FLOAT_DTYPES", "reference", "check_temperature", "MIN_TEMPERATURE",
    "MAX_TEMPERATURE", "DEFAULT_CHUNKS", "linear", "linear_partial", "tree_sum", "rms_norm",
    "silu_mul", "attention_varlen", "attention_paged", "rope", "logsumexp", "lse_partial",
    "lse_finish", "log_softmax", "token_logprobs", "target_logit", "argmax", "max_with_index",
    "sample", "moe_route", "moe_combine", "moe_experts",
]
