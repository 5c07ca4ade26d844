"""tonp_kernels.accel imported under Triton's interpreter, for the test_triton_* files.

triton.jit reads TRITON_INTERPRET when it decorates a kernel (and Triton's lazily imported parts
read it again at the first launch), so it is set before the first import and stays set for the
test process: the kernels run interpreted (IEEE fp32 in numpy, a true fused multiply-add) on
CPU tensors. Nothing else in tonp uses Triton; a subprocess that compiles the kernels for a GPU
target unsets it (test_triton_ptx.py).
"""
import os

import torch

os.environ["TRITON_INTERPRET"] = "1"
from tonp_kernels.accel import (  # noqa: E402,F401
    _launch, attention, linear, moe, numerics, rowwise, vocab)

if not _launch.INTERPRETED:
    raise ImportError("tonp_kernels.accel was imported before TRITON_INTERPRET=1 was set: its "
                      "kernels are compiled ones and cannot run on CPU tensors")


def bits(t):
    """fp32 as int32 bits (NaN payloads compared too; torch.equal calls NaN unequal)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)
