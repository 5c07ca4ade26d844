"""What every launcher shares: dtype and device checks with the C++ ops' errors, bf16 tensors
passed as their int16 bits, and the launch itself with fp fusion off."""
from __future__ import annotations

import torch
import triton

from .._library import FLOAT_DTYPES as FLOATS

# The kernels of this package are interpreted when TRITON_INTERPRET=1 was set before import
# (triton.jit reads it when it decorates them), and then run on CPU tensors.
INTERPRETED = bool(triton.knobs.runtime.interpret)


def float_dtype(t: torch.Tensor | torch.dtype, op: str, what: str) -> bool:
    """True for bf16, False for fp32; TypeError (as the C++ op's) for anything else."""
    dtype = t if isinstance(t, torch.dtype) else t.dtype
    if dtype not in FLOATS:
        raise TypeError(f"tonp.{op}: {what} must be float32 or bfloat16, got {dtype}")
    return dtype == torch.bfloat16


def check_device(op: str, *tensors: torch.Tensor) -> None:
    """One device for all; CPU tensors only under the interpreter (the C++ kernels serve them)."""
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"tonp.{op}: all tensors must be on one device, got {dev} and "
                             f"{t.device}")
    if dev.type == "cpu" and not INTERPRETED and recorder is None:
        raise RuntimeError(f"tonp.{op}: the Triton kernels take CPU tensors only when "
                           "TRITON_INTERPRET=1 was set before tonp_kernels.accel was imported")


def bits(t):
    """A bf16 tensor as its int16 bits (the kernels widen and round bf16 in integer bits)."""
    return t.view(torch.int16) if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t


# While compile_check records the launches (a list), kernels are not run but appended to it.
recorder: list | None = None


def launch(kernel, grid, *args, **meta) -> None:
    """kernel[grid](*args, **meta) with fp fusion off: no a*b+c the kernel did not write as fma."""
    args = tuple(bits(a) for a in args)
    if recorder is not None:
        recorder.append((kernel, args, meta))
        return
    kernel[grid](*args, enable_fp_fusion=False, **meta)


_ROW_ISSUES = {1: "holds a NaN logit",
               2: "logits / temperature reach +inf (an infinite logit, or fp32 overflow at "
                  "temperature={T!r}); its softmax is undefined",
               3: "every logit is -inf; its softmax is undefined"}


def raise_row_issue(op: str, issues: torch.Tensor, temperature: float) -> None:
    """Refuse the lowest row whose issue code (int8 [M]: 1 NaN, 2 max +inf, 3 every logit -inf;
    vocab_ops.cpp RowIssue) is set, with the C++ check_rows message. One device sync."""
    if recorder is None and bool(issues.any()):
        r = int(issues.nonzero()[0])
        why = _ROW_ISSUES[int(issues[r])].format(T=temperature)
        raise ValueError(f"tonp.{op}: row {r}{' ' if why.startswith('holds') else ': '}{why}")


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
