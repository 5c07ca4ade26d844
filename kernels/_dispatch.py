"""`impl`: the one function that picks the implementation of an op call, from the kernel mode of
the calling context and the devices of the op's tensors. Backends are modules of functions named
after the public ops, taking the checked arguments (see docs/kernels.md)."""
from __future__ import annotations

import torch

from . import _mode, cpu, stock


def impl(op: str, *tensors):
    """The function that runs `op` on `tensors` (None entries are skipped).

    "torch" mode -> stock.<op> (stock torch ops, on any one device), where stock torch has one;
    tonp's own ops (seeded sampling, vocab-shard partials) have none and run their invariant
    kernels in both modes. Invariant mode: CPU tensors -> cpu.<op> (the C++ kernels); other
    devices -> an error naming the op and the devices. (An accelerator backend slots in here:
    every tensor on one CUDA / NPU device -> its module's <op>.)
    """
    stock_op = getattr(stock, op, None) if _mode.get_mode() == "torch" else None
    try:
        for t in tensors:
            if t is not None and not t.is_cpu:
                break
        else:
            return stock_op or getattr(cpu, op)
    except AttributeError:  # not a tensor: stock's checks name the argument
        if stock_op is not None:
            return stock_op
        bad = next(t for t in tensors if t is not None and not isinstance(t, torch.Tensor))
        raise TypeError(f"tonp.{op}: expected tensors, got {type(bad).__name__}") from None
    devices = sorted({str(t.device) for t in tensors if t is not None})
    if stock_op is None:
        why = ("the invariant kernels run on CPU tensors (tonp_kernels.use('torch') runs stock "
               "ops on any one device)") if _mode.get_mode() == "invariant" else \
            "no stock torch version: its CPU kernel runs in both modes"
        raise NotImplementedError(f"tonp.{op}: {why}; got tensors on {', '.join(devices)}")
    if len(devices) > 1:
        raise RuntimeError(f"tonp.{op}: tensors on several devices: {', '.join(devices)}")
    return stock_op
