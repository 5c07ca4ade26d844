"""What the `fast` kernels share: the launch (real bf16 tensors for the tensor cores, fp fusion
off, the compile check's recorder), the dot-operand rule, and the grid-filling target.

The fast kernels keep the contract's promises within one device model (docs/accelerators.md):
their tile configurations come from the weight's shape and dtype only, never from the rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from . import numerics as nm

# Interpreted kernels (TRITON_INTERPRET=1) replace tl.dot by `dot`'s fixed-order model: the
# interpreter's tl.dot multiplies bf16 operands' uint16 storage (Triton 3.9, create_dot) and its
# numpy matmul gives a row other bits at another row of the tile. Compiled kernels run tl.dot.
INTERP = _launch.INTERPRETED
# Programs a launch aims for (split-K only adds programs when the output tiles are fewer):
# two per SM of an H100 / H200 (132 SMs). A layout knob: it never changes a bit.
TARGET_PROGRAMS = 264


def dot_dtype(*dtypes: torch.dtype) -> str:
    """"bf16" when every operand is bf16 (bf16 tensor-core MMA), else "tf32" (fp32 operands,
    tf32 tensor-core MMA; bf16 operands are widened exactly)."""
    return "bf16" if all(d == torch.bfloat16 for d in dtypes) else "tf32"


def launch(kernel, grid, *args, num_warps: int, num_stages: int, **meta) -> None:
    """kernel[grid](*args) with fp fusion off (no a*b+c the kernel did not write as one), or
    recorded for compile_check while `_launch.recorder` is set."""
    meta = dict(meta, num_warps=num_warps, num_stages=num_stages)
    if _launch.recorder is not None:
        _launch.recorder.append((kernel, args, meta))
        return
    kernel[grid](*args, enable_fp_fusion=False, **meta)


@triton.jit
def dot(a, b, acc, DOT: tl.constexpr, INTERP: tl.constexpr):
    """acc + a [BM, BK] @ b [BK, BN] in fp32. Compiled: tl.dot on the tensor cores (bf16
    operands, or fp32 ones as tf32). Interpreted: fp32 products summed over k by a pairwise tree,
    the same operations for every row and column of the tile (a model of a fixed-order MMA; the
    hardware's own order inside one MMA is what only a GPU run can test)."""
    if INTERP:
        BM: tl.constexpr = a.shape[0]
        BK: tl.constexpr = a.shape[1]
        BN: tl.constexpr = b.shape[1]
        prod = a.to(tl.float32)[:, None, :] * tl.trans(b.to(tl.float32))[None, :, :]
        return acc + tl.reshape(nm._tree(tl.reshape(prod, [BM * BN, BK]), BM * BN, BK, 2),
                                [BM, BN])
    elif DOT == "tf32":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def to_out(v, out_ptr):
    """fp32 v as out_ptr's dtype stores it: bf16 rounded to nearest even in integer bits (the
    interpreter's own fp32 -> bf16 cast does not round to nearest even), fp32 as is."""
    if out_ptr.dtype.element_ty == tl.bfloat16:
        return nm.f32_to_bf16(v).to(tl.bfloat16, bitcast=True)
    else:
        return v


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
