"""The op table: one row per tonp op naming every implementation it has. It drives the dispatch
(_dispatch.py), the registrations (_register.py: fake kernels, CUDA / NPU kernels), the Triton
kernel lookup (accel/registry.py) and the table in docs/kernels.md (`python -m
tonp_kernels.table` prints it; tests/test_kernels_table.py holds the doc to it).

Columns (None / False / () where the op has none):
  wrapper   module of the public function `tonp_kernels.<op>` ("ops", "vocab"); None: an op only
            the autograd, a composite or a tool calls (torch.ops.tonp.<op>)
  stock     stock.<op> exists: the "torch" mode's stock-torch version; without one the op runs
            its invariant version in both modes
  schema    torch.ops.tonp.<op> is defined by the C++ extension (csrc/<cpp>), with its CPU kernel
            and a fake kernel (_fakes.<op>, for meta tensors and torch.compile)
  calls     the tonp ops the invariant version (invariant.<op>) runs, where that is not just
            torch.ops.tonp.<op> (composites in Python)
  exact     accel module of the exact Triton kernel <op> (the CPU's bits on CUDA / NPU)
  fast      accel module of the fast Triton kernel <op> (tensor cores; numerics="fast")
  device    CUDA / NPU kernel of an op without a Triton forward kernel: "device_grads" (torch
            math, device_grads.<op>), or an accel module whose <op> runs where Triton runs on
            the device, with device_grads.<op> as the fallback
  backward  the ops the C++ autograd (csrc/autograd.cpp) calls for the gradient
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class Op:
    name: str
    wrapper: Optional[str] = None
    stock: bool = False
    schema: bool = True
    cpp: Optional[str] = None
    calls: Tuple[str, ...] = ()
    exact: Optional[str] = None
    fast: Optional[str] = None
    device: Optional[str] = None
    backward: Tuple[str, ...] = ()


_G = "device_grads"
OPS: Tuple[Op, ...] = (
    # --- public ops on a kernel of their own ----------------------------------------------------
    Op("linear", "ops", True, cpp="ops.cpp", exact="linear", fast="fast_linear",
       backward=("linear_backward",)),
    Op("rms_norm", "ops", True, cpp="ops.cpp", exact="rowwise", backward=("rms_norm_backward",)),
    Op("silu_mul", "ops", True, cpp="ops.cpp", exact="rowwise", backward=("silu_mul_backward",)),
    Op("attention_varlen", "ops", True, cpp="ops.cpp", exact="attention",
       fast="fast_attention", backward=("attention_varlen_backward",)),
    Op("attention_paged", "ops", True, cpp="ops.cpp", exact="attention", fast="fast_attention"),
    Op("rope", "ops", True, cpp="ops.cpp", exact="rowwise", backward=("rope_backward",)),
    Op("moe_route", "ops", True, cpp="moe_ops.cpp", exact="moe",
       backward=("moe_route_backward",)),
    Op("moe_combine", "ops", True, cpp="moe_ops.cpp", exact="rowwise",
       backward=("moe_combine_backward",)),
    Op("moe_experts", "ops", True, cpp="moe_ops.cpp", exact="moe", fast="fast_moe",
       backward=("moe_experts_train", "moe_experts_grad")),
    Op("lse_partial", "vocab", cpp="vocab_ops.cpp", exact="vocab"),
    Op("lse_finish", "vocab", cpp="vocab_ops.cpp", exact="vocab"),
    Op("token_logprobs", "vocab", True, cpp="vocab_ops.cpp", exact="vocab",
       calls=("token_logprobs", "lse_partial", "lse_finish")),
    Op("argmax", "vocab", True, cpp="vocab_ops.cpp", exact="vocab"),
    Op("max_with_index", "vocab", cpp="vocab_ops.cpp", exact="vocab"),
    Op("sample", "vocab", cpp="vocab_ops.cpp", exact="sample"),
    # --- public ops composed in Python (no torch.ops.tonp op of their own) ----------------------
    Op("linear_partial", "ops", schema=False, calls=("linear",)),
    Op("tree_sum", "ops", schema=False),
    Op("logsumexp", "vocab", True, schema=False, calls=("lse_partial", "lse_finish")),
    Op("log_softmax", "vocab", True, schema=False, calls=("lse_partial", "lse_finish")),
    Op("target_logit", "vocab", True, schema=False),
    # --- the autograd's ops: gradients correct, not order-locked (CONTRACT.md) ------------------
    Op("linear_backward", cpp="grad_kernels.cpp", device=_G),
    Op("rms_norm_backward", cpp="grad_kernels.cpp", device=_G),
    Op("silu_mul_backward", cpp="grad_kernels.cpp", device=_G),
    Op("rope_backward", cpp="grad_kernels.cpp", device=_G),
    Op("moe_route_backward", cpp="grad_kernels.cpp", device=_G),
    Op("moe_combine_backward", cpp="grad_kernels.cpp", device=_G),
    Op("attention_varlen_backward", cpp="attention_grad.cpp", device=_G),
    Op("embedding_backward", cpp="grad_kernels.cpp", device=_G),
    Op("moe_experts_train", cpp="moe_backward.cpp", device="moe"),
    Op("moe_experts_grad", cpp="moe_backward.cpp", device="moe_grad"),
    Op("moe_experts_backward", cpp="moe_backward.cpp", device="moe_grad"),
    # --- tools: no numerics of their own, CPU only ---------------------------------------------
    Op("isa", cpp="library.cpp"),
    Op("linear_group_rows", cpp="library.cpp"),
    Op("backward_gemm", cpp="library.cpp"),
    Op("max_chunks", cpp="library.cpp"),
    Op("float_dtypes", cpp="library.cpp"),
    Op("bf16_pair_isas", cpp="bf16dot_ops.cpp"),
    Op("bf16_pair_step", cpp="bf16dot_ops.cpp"),
    Op("release_memory_pool", cpp="big_alloc.cpp"),
    Op("huge_pages_copy", cpp="big_alloc.cpp"),
    Op("pack_weight_groups", cpp="ops.cpp"),
    Op("amx_available", cpp="amx_ops.cpp"),
    Op("amx_tdpbf16ps", cpp="amx_ops.cpp"),
    Op("amx_pack_blocks", cpp="amx_ops.cpp"),
    Op("amx_linear_blocks", cpp="amx_ops.cpp"),
    Op("fma_linear_blocks", cpp="amx_ops.cpp"),
)
BY_NAME: Dict[str, Op] = {o.name: o for o in OPS}
# Tools return plain values (no tensors to fake, no device kernel).
TOOLS = frozenset(("isa", "linear_group_rows", "backward_gemm", "max_chunks", "float_dtypes", "bf16_pair_isas", "bf16_pair_step",
                   "release_memory_pool", "huge_pages_copy", "pack_weight_groups", "amx_available", "amx_tdpbf16ps", "amx_pack_blocks",
                   "amx_linear_blocks", "fma_linear_blocks"))
PUBLIC = tuple(o.name for o in OPS if o.wrapper)
# Ops the public functions reach through _dispatch.impl (tree_sum and linear_partial are plain
# Python over other ops).
DISPATCHED = tuple(n for n in PUBLIC if n not in ("tree_sum", "linear_partial"))
TRITON = tuple(o.name for o in OPS if o.exact)  # ops with a Triton forward kernel


def markdown() -> str:
    """The table as docs/kernels.md shows it (the tools left out)."""
    rows = ["| op | public | stock (`torch` mode) | C++ (CPU) | Triton exact | Triton fast | "
            "CUDA / NPU kernel, not Triton | backward ops |", "|" + "---|" * 8]
    for o in OPS:
        if o.name in TOOLS:
            continue
        if o.schema:
            cpp = f"`csrc/{o.cpp}`" + ("" if not o.calls else " (+ " + ", ".join(
                c for c in o.calls if c != o.name) + " under autograd)")
        else:
            cpp = "composite: " + (", ".join(o.calls) if o.calls else "torch ops")
        stock = "yes" if o.stock else "" if not o.wrapper else \
            "none: invariant in both modes" if o.name in DISPATCHED else "by the ops it calls"
        dev = "" if not o.device else "`device_grads.py`" if o.device == _G else \
            f"`accel/{o.device}.py` (`device_grads.py` without Triton)"
        rows.append("| " + " | ".join((
            f"`{o.name}`", f"`{o.wrapper}.py`" if o.wrapper else "", stock, cpp,
            f"`accel/{o.exact}.py`" if o.exact else "",
            f"`accel/{o.fast}.py`" if o.fast else ("exact" if o.exact else ""), dev,
            ", ".join(o.backward))) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
