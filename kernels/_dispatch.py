"""`impl`: the one function that picks the implementation of a public op's call, from the kernel
mode of the calling context and the devices of the op's tensors; the op table (table.py) names
which ops have a stock version. The route of a call, device by device, is in docs/kernels.md."""
from __future__ import annotations

import torch

from . import _mode, invariant, stock
from .table import BY_NAME, DISPATCHED

_STOCK = {op: getattr(stock, op) for op in DISPATCHED if BY_NAME[op].stock}
_INVARIANT = {op: getattr(invariant, op) for op in DISPATCHED}
DEVICE_TYPES = ("cuda", "npu")  # ROCm tensors are "cuda" too; torch_npu's device is "npu"


def impl(op: str, *tensors):
    """The function that runs `op` on `tensors` (None entries are skipped).

    "torch" mode -> stock.<op> (stock torch ops, on any one device), where stock torch has one;
    tonp's own ops (seeded sampling, vocab-shard partials) have none and run their invariant
    versions in both modes. Invariant mode -> invariant.<op>, whose tonp ops run the C++ kernels
    on CPU tensors and the Triton kernels on CUDA / NPU tensors (the C++ dispatcher picks by
    device, _register.py); with backend "triton", CPU tensors run the Triton kernels too
    (interpreted, _interpreted.py). All tensors must be on one device.
    """
    stock_op = _STOCK.get(op) if _mode.get_mode() == "torch" else None
    try:
        for t in tensors:
            if t is not None and not t.is_cpu:
                break
        else:
            if stock_op is not None:
                return stock_op
            fn = _INVARIANT[op]
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
    if next(t for t in tensors if t is not None).device.type in DEVICE_TYPES:
        return _INVARIANT[op]
    why = ("the invariant kernels run on CPU, CUDA and NPU tensors (tonp_kernels.use('torch') "
           "runs stock ops on any one device)") if _mode.get_mode() == "invariant" else \
        "no stock torch version: its invariant kernel runs in both modes"
    raise NotImplementedError(f"tonp.{op}: {why}; got tensors on {devices[0]}")


def _on_cpu(fn):
    from . import _interpreted
    return _interpreted.on_cpu(fn)
