"""`impl`: the one function that picks the implementation of an op call, from the kernel mode of
the calling context and the devices of the op's tensors. Backends are modules of functions named
after the public ops, taking the checked arguments (see docs/kernels.md)."""
from __future__ import annotations

import torch

from . import _mode, invariant, stock


def impl(op: str, *tensors):
    """The function that runs `op` on `tensors` (None entries are skipped).

    "torch" mode -> stock.<op> (stock torch ops, on any one device), where stock torch has one;
    tonp's own ops (seeded sampling, vocab-shard partials) have none and run their invariant
    kernels in both modes. Invariant mode -> invariant.<op>, whose tonp ops run the C++ kernels
    on CPU tensors and the Triton kernels on CUDA / NPU tensors (the dispatcher picks by
    device); with backend "triton", CPU tensors run the Triton kernels too (interpreted).
    All tensors must be on one device.
    """
    stock_op = getattr(stock, op, None) if _mode.get_mode() == "torch" else None
    try:
        for t in tensors:
            if t is not None and not t.is_cpu:
                break
        else:
            if stock_op is not None:
                return stock_op
            fn = getattr(invariant, op)
            return fn if _mode.get_backend() == "auto" else _on_cpu(fn)
    except AttributeError:  # not a tensor: stock's checks name the argument
        if stock_op is not None:
            return stock_op
        bad = next(t for t in tensors if t is not None and not isinstance(t, torch.Tensor))
        raise TypeError(f"tonp.{op}: expected tensors, got {type(bad).__name__}") from None
    devices = sorted({str(t.device) for t in tensors if t is not None})
    if len(devices) > 1:
        raise RuntimeError(f"tonp.{op}: tensors on several devices: {', '.join(devices)}; "
                           f"one call takes its tensors on one device (CPU, CUDA or NPU)")
    if stock_op is not None:
        return stock_op
    from . import _accel
    if next(t for t in tensors if t is not None).device.type in _accel.DEVICE_TYPES:
        return getattr(invariant, op)
    why = ("the invariant kernels run on CPU, CUDA and NPU tensors (tonp_kernels.use('torch') "
           "runs stock ops on any one device)") if _mode.get_mode() == "invariant" else \
        "no stock torch version: its invariant kernel runs in both modes"
    raise NotImplementedError(f"tonp.{op}: {why}; got tensors on {devices[0]}")


def _on_cpu(fn):
    from . import _accel
    return _accel.on_cpu(fn)
